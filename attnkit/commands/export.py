"""`attnkit export`: a GGUF file as a Hugging Face safetensors folder that every other command (and
transformers) reads.

Flow: check the GGUF header, the dtype and OUT -> dequantize once into the cache (attnkit.io.gguf_load;
later runs and eval/probe reuse it) -> write its tensors in --dtype through attnkit.commands.write (config.json,
tokenizer and generation files, attnkit.json, checks, rename into place).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from attnkit.archs import get_arch
from attnkit.archs.spec import attention_spec
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.rewrite import WriteRequest, check_write
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.gguf_load import gguf_cache_folder
from attnkit.io.reader import LazyReader
from attnkit.io.resolve import resolve
from attnkit.io.source import open_source
from attnkit.progress import phase
from attnkit.runtime.loader import dtype_name


@dataclass(kw_only=True)
class ExportRequest(WriteRequest):
    """export: MODEL is a .gguf file (or a folder holding one); the dtype the tensors are written in."""

    dtype: str = "float32"


def check_request(req: ExportRequest):
    """The GGUF checkpoint, after the dtype (as torch names it), the header and OUT were checked (nothing
    dequantized yet)."""
    if req.dtype == "auto":
        raise UsageError("--dtype auto has no meaning for a GGUF file: choose float32, bfloat16 or float16")
    ckpt = resolve(req.model, need_weights=False)
    if ckpt.gguf_file is None:
        raise AttnkitError(f"{req.model}: not a GGUF file ({ckpt.kind}); export turns a .gguf file into a folder")
    get_arch(ckpt.model_type)
    attention_spec(ckpt.config)
    check_write(req)
    return ckpt


def _write(src, req: ExportRequest, writer) -> dict:
    """Every tensor of the cached folder in req.dtype (floating-point ones only)."""
    import torch

    dtype = getattr(torch, req.dtype)
    expected = {}
    with (
        LazyReader(src.ckpt.weight_files) as reader,
        phase(f"writing {req.out}", len(reader.names()), "tensors") as advance,
    ):
        for name in reader.names():
            tensor = reader.get(name)
            writer.add(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
            expected[name] = tuple(tensor.shape)
            advance(1)
    return expected


def export(req: ExportRequest) -> dict:
    """Run (or with dry_run, plan) the export; returns the report (see docs/checkpoints.md)."""
    started = time.perf_counter()
    req = replace(req, dtype=dtype_name(req.dtype))  # bf16 -> bfloat16, ...
    ckpt = check_request(req)
    report = {
        **report_head(req, ckpt.model_type),
        "dtype": req.dtype,
        "cache": str(gguf_cache_folder(ckpt.gguf_file)),
        "tensors": None,
        "bytes": None,
    }
    if req.dry_run:
        return timed(report, started)
    src = open_source(req.model, "export")
    config = src.raw_config()
    config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = req.dtype

    def weights(writer) -> dict:
        expected = _write(src, req, writer)
        report["tensors"] = len(expected)
        return expected

    out = write_checkpoint(
        req, src, "export", config=config, weights=weights, body=lambda: {"parameters": {"dtype": req.dtype}}
    )
    report["bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return timed(report, started)
