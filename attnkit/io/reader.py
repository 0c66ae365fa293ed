"""Read tensors one at a time from safetensors shards, keeping at most one shard open."""

from __future__ import annotations

from pathlib import Path

from attnkit import interrupts
from attnkit.errors import AttnkitError
from attnkit.io.safetensors_header import TensorInfo, read_headers


class LazyReader:
    """Name -> tensor access over safetensors shards; tensors are read on demand, one shard open at a time."""

    def __init__(self, files: list[Path]):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise AttnkitError("no safetensors files to read")
        infos = read_headers(self.files)
        order = {f: i for i, f in enumerate(self.files)}
        # Shard order, then file order: iterating names() opens each shard once.
        self._infos = dict(sorted(infos.items(), key=lambda kv: (order[kv[1].file], kv[1].data_offsets[0])))
        self._open_file: Path | None = None
        self._handle = None
        self.opens = 0  # how many times a shard was opened (tests and diagnostics)

    def __enter__(self) -> LazyReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def names(self) -> list[str]:
        """All tensor names, grouped by shard."""
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and location of `name`, from the headers (no tensor data read)."""
        try:
            return self._infos[name]
        except KeyError:
            where = self.files[0].parent if len(self.files) > 1 else self.files[0]
            raise AttnkitError(f"{where}: no tensor named {name!r}") from None

    def get(self, name: str, dtype=None, device: str = "cpu"):
        """The tensor `name`, optionally cast to `dtype` (torch.dtype or name such as "bfloat16") and moved."""
        import torch

        interrupts.check()
        info = self.info(name)
        handle = self._shard(info.file)
        try:
            tensor = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises SafetensorError/OSError on damaged data
            raise AttnkitError(f"{info.file}: cannot read tensor {name!r} ({exc})") from None
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if dtype is not None or str(device) != "cpu":
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def close(self) -> None:
        """Close the open shard, if any."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None

    def _shard(self, file: Path):
        if self._open_file != file:
            from safetensors import safe_open

            self.close()
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:
                raise AttnkitError(f"{file}: cannot open safetensors file ({exc})") from None
            self._handle, self._open_file = handle.__enter__(), file
            self.opens += 1
        return self._handle
