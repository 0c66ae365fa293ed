"""Read safetensors headers (names, dtypes, shapes, byte sizes) without torch."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError

#: Bytes per element for every dtype the safetensors format defines.
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
    "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    file: Path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor infos and the `__metadata__` of one safetensors file; errors name the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise AttnkitError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise AttnkitError(f"{path}: corrupt safetensors header (length {header_len} exceeds the file)")
            raw = fh.read(header_len)
    except FileNotFoundError:
        raise AttnkitError(f"{path}: file not found") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AttnkitError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise AttnkitError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_len = size - 8 - header_len
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, offsets = entry["dtype"], tuple(entry["shape"]), tuple(entry["data_offsets"])
        except (KeyError, TypeError):
            raise AttnkitError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise AttnkitError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        info = TensorInfo(name, dtype, shape, (int(offsets[0]), int(offsets[1])), path)
        if info.nbytes != math.ceil(info.numel * DTYPE_BYTES[dtype]) or info.data_offsets[1] > data_len:
            raise AttnkitError(
                f"{path}: tensor {name!r} does not fit the file (truncated or corrupt safetensors)"
            )
        infos[name] = info
    return infos, metadata


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Merge the headers of several shards into one name -> TensorInfo map."""
    merged: dict[str, TensorInfo] = {}
    for file in files:
        infos, _ = read_header(file)
        for name, info in infos.items():
            if name in merged:
                raise AttnkitError(f"{file}: tensor {name!r} is also in {merged[name].file.name} (duplicate shards?)")
            merged[name] = info
    return merged
