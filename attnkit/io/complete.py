"""The check every command runs on a checkpoint's weights before any work: strict headers, and every tensor
its config implies present with the attention shapes it implies."""

from __future__ import annotations

from attnkit.io.checkpoint import Checkpoint
from attnkit.io.safetensors_header import TensorInfo, read_headers


def checked_weights(ckpt: Checkpoint, arch, spec) -> tuple[dict[str, TensorInfo], str]:
    """(name -> TensorInfo of every shard, tensor-name prefix) of a checkpoint with safetensors weights."""
    from attnkit.archs.tensors import check_tensors

    infos = read_headers(ckpt.weight_files)
    where = ckpt.root if ckpt.kind in ("folder", "hub") else ckpt.ref
    prefix = check_tensors(arch, spec, ckpt.config, {name: info.shape for name, info in infos.items()}, where)
    return infos, prefix
