"""The check every command runs on a checkpoint's weights before any work: side files inside the folder, strict
headers, and every tensor its config implies present with the attention shapes it implies."""

from __future__ import annotations

from attnkit.io.checkpoint import Checkpoint, side_files
from attnkit.io.safetensors_header import TensorInfo, read_headers


def checked_weights(ckpt: Checkpoint, arch, spec) -> tuple[dict[str, TensorInfo], str]:
    """(name -> TensorInfo of every shard, tensor-name prefix) of a checkpoint with safetensors weights.
    The tokenizer and other side files that rewrites copy must not link out of the folder either. Completeness
    needs the architecture: with `arch` None (a family outside the registry) only the files and headers are
    checked, and the prefix is empty."""
    from attnkit.archs.tensors import check_tensors

    if ckpt.root is not None:
        side_files(ckpt.root)
    infos = read_headers(ckpt.weight_files)
    if arch is None:
        return infos, ""
    where = ckpt.root if ckpt.kind in ("folder", "hub") else ckpt.ref
    prefix = check_tensors(
        arch,
        spec,
        ckpt.config,
        {name: info.shape for name, info in infos.items()},
        where,
        {name: info.dtype for name, info in infos.items()},
    )
    return infos, prefix
