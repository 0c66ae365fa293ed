"""Converted attention tensors kept on disk between calibration and writing, so that a calibrated conversion holds
one layer at a time whatever the layer count (the plans of every layer, with their float64 o_proj refits, grew
with the model: 4 GB for an 8B geometry; `convert mla` wrote each layer into the shard writer's buffer, up to a
shard, 1 GiB, of converted tensors held beside the calibration).

The folder is a marked temp folder beside OUT (attnkit.io.tempdirs): removed when the conversion ends, and by a
later run if this one was killed.
"""

from __future__ import annotations

from pathlib import Path

from attnkit.io.tempdirs import make_temp_dir, remove_tree


class LayerSpill:
    """put(layer, tensors) during calibration, take(layer) while writing; use as a context manager."""

    def __init__(self, out: Path):
        out = Path(out).expanduser().absolute()
        self.folder = make_temp_dir(out.parent, f"{out.name}.layers")

    def _path(self, layer: int) -> Path:
        return self.folder / f"layer-{layer:05d}.safetensors"

    def put(self, layer: int, tensors: dict) -> None:
        """Write one layer's converted tensors {role: tensor} (CPU, their output dtype)."""
        from safetensors.torch import save_file

        save_file({role: t.detach().to("cpu").contiguous() for role, t in tensors.items()}, str(self._path(layer)))

    def take(self, layer: int) -> dict | None:
        """The tensors put for `layer`, or None when none were. safetensors memory-maps them from the file (page
        cache, not the process's own memory, however long a shard writer holds them); the file's name is removed
        at once, its data when the last of them is freed."""
        from safetensors.torch import load_file

        path = self._path(layer)
        if not path.is_file():
            return None
        tensors = load_file(str(path))
        path.unlink()
        return tensors

    def __enter__(self) -> LayerSpill:
        return self

    def __exit__(self, *exc) -> None:
        remove_tree(self.folder)
