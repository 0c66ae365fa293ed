"""`attnkit export`: a GGUF file as a Hugging Face safetensors folder that every other command (and
transformers) reads.

Flow: check the GGUF header, the dtype and OUT -> dequantize once into the cache (attnkit.io.gguf_load;
later runs and eval/probe reuse it) -> stream its tensors into OUT's temp folder in --dtype, with
config.json, tokenizer and generation files and attnkit.json -> check names/shapes/finiteness -> rename
into place.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from attnkit import __version__
from attnkit.errors import AttnkitError


@dataclass(kw_only=True)
class ExportRequest:
    model: str  # a .gguf file (or a folder holding one)
    out: Path
    dtype: str = "float32"
    max_shard_bytes: int = 2**30
    overwrite: bool = False
    dry_run: bool = False
    command: str = ""


def check_request(req: ExportRequest):
    """The GGUF checkpoint, after the dtype, the header and OUT were checked (nothing dequantized yet)."""
    from attnkit.archs import get_arch
    from attnkit.archs.spec import attention_spec
    from attnkit.commands.rewrite import local_sources
    from attnkit.errors import UsageError
    from attnkit.io.resolve import resolve
    from attnkit.io.writer import OutputDir
    from attnkit.runtime.loader import dtype_name

    req.dtype = dtype_name(req.dtype)
    if req.dtype == "auto":
        raise UsageError("--dtype auto has no meaning for a GGUF file: choose float32, bfloat16 or float16")
    ckpt = resolve(req.model, need_weights=False)
    if ckpt.gguf_file is None:
        raise AttnkitError(f"{req.model}: not a GGUF file ({ckpt.kind}); export turns a .gguf file into a folder")
    get_arch(ckpt.model_type)
    attention_spec(ckpt.config)
    OutputDir(Path(req.out), overwrite=req.overwrite, sources=local_sources(req.model))  # checks only
    return ckpt


def _config(folder: Path, dtype: str) -> dict:
    """The cached folder's config.json with the dtype the weights are written in."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[key] = dtype
    return config


def _write(src, req: ExportRequest, folder: Path) -> dict:
    """Every tensor of the cached folder in req.dtype (floating-point ones only), shard by shard."""
    import torch

    from attnkit.io.reader import LazyReader
    from attnkit.io.writer import ShardedWriter
    from attnkit.progress import phase

    dtype = getattr(torch, req.dtype)
    expected = {}
    writer = ShardedWriter(folder, req.max_shard_bytes)
    with LazyReader(src.weight_files) as reader, phase(f"writing {req.out}", len(reader.names()), "tensors") as advance:
        for name in reader.names():
            tensor = reader.get(name)
            writer.add(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
            expected[name] = tuple(tensor.shape)
            advance(1)
        writer.finish()
    return expected


def export(req: ExportRequest) -> dict:
    """Run (or with dry_run, plan) the export; returns the report (see docs/checkpoints.md)."""
    from attnkit.io.gguf_load import dequantized, gguf_cache_folder
    from attnkit.io.writer import OutputDir, copy_side_files, verify_output

    started = time.perf_counter()
    ckpt = check_request(req)
    report = {"source": req.model, "output": str(req.out), "dry_run": req.dry_run, "model_type": ckpt.model_type,
              "dtype": req.dtype, "cache": str(gguf_cache_folder(ckpt.gguf_file)), "tensors": None,
              "bytes": None}
    if req.dry_run:
        report["seconds"] = time.perf_counter() - started
        return report
    src = dequantized(ckpt)
    with OutputDir(Path(req.out), overwrite=req.overwrite, sources=[Path(ckpt.gguf_file)]) as out:
        expected = _write(src, req, out.path)
        (out.path / "config.json").write_text(json.dumps(_config(Path(src.root), req.dtype), indent=2) + "\n")
        copy_side_files(Path(src.root), out.path)
        verify_output(out.path, expected)
        manifest = {"attnkit_version": __version__, "command": req.command, "export": "gguf",
                    "source": {"ref": req.model, "kind": "gguf", "repo_id": None, "revision": None,
                               "model_type": ckpt.model_type, "dequantized": str(src.root)},
                    "dtype": req.dtype}
        (out.path / "attnkit.json").write_text(json.dumps(manifest, indent=2) + "\n")
        report["tensors"] = len(expected)
        report["bytes"] = sum(f.stat().st_size for f in out.path.glob("*.safetensors"))
        out.commit()
    report["seconds"] = time.perf_counter() - started
    return report
