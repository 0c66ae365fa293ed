"""Resolve a model reference (folder, .safetensors, .gguf, config.json or hub id) to local files."""

from __future__ import annotations

import re
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import Checkpoint, safetensors_files
from attnkit.io.config import read_config

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(@[\w.\-/]+)?$")


def looks_like_hub_id(ref: str) -> bool:
    return bool(HUB_ID.match(ref)) and not ref.startswith((".", "/", "~"))


def resolve(ref: str, *, need_weights: bool = True) -> Checkpoint:
    """Find config and weights for `ref`; hub ids download only what is needed."""
    if not ref.strip():
        raise AttnkitError("empty model path: give a folder, a .safetensors or .gguf file, or a hub id")
    path = Path(ref).expanduser()
    if path.is_dir():
        return _from_folder(ref, path, need_weights)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".gguf":
            from attnkit.io.gguf_meta import read_gguf

            config, _ = read_gguf(path)
            return Checkpoint(ref, "gguf", config, root=path.parent, gguf_file=path)
        if suffix == ".safetensors":
            config = read_config(path.parent / "config.json")
            return Checkpoint(ref, "safetensors", config, root=path.parent, weight_files=[path])
        if suffix == ".json":
            return Checkpoint(ref, "config", read_config(path), root=path.parent)
        raise AttnkitError(f"{path}: not a model file (expected a folder, .safetensors, .gguf or config.json)")
    if path.suffix.lower() in (".gguf", ".safetensors", ".json"):
        raise AttnkitError(f"{path}: file not found")
    if ref.startswith((".", "/", "~")) or "/" in ref and path.parent.exists():
        raise AttnkitError(f"{path}: no such file or folder")
    if looks_like_hub_id(ref):
        from attnkit.io.hub import resolve_hub

        return resolve_hub(ref, need_weights=need_weights)
    raise AttnkitError(f"{ref}: no such file or folder, and not a valid hub id")


def resolve_weights(ref: str, purpose: str) -> Checkpoint:
    """`ref` resolved for a command that reads its weights: a bare config file is refused ("a config file has no
    weights to <purpose>"), a hub id gets its weight files; a GGUF file stays undequantized (gguf_load.dequantized)."""
    ckpt = resolve(ref)
    if ckpt.kind == "config":
        raise AttnkitError(f"{ref}: a config file has no weights to {purpose}")
    if ckpt.gguf_file is None and not ckpt.weight_files:
        raise AttnkitError(f"{ref}: no safetensors weights found")
    return ckpt


def _from_folder(ref: str, folder: Path, need_weights: bool) -> Checkpoint:
    ggufs = sorted(folder.glob("*.gguf"))
    config_path = folder / "config.json"
    if not config_path.is_file() and len(ggufs) == 1:
        return resolve(str(ggufs[0]), need_weights=need_weights)
    config = read_config(config_path)
    files = safetensors_files(folder)
    if need_weights and not files:
        raise AttnkitError(f"{folder}: no *.safetensors weights found")
    return Checkpoint(ref, "folder", config, root=folder, weight_files=files)
