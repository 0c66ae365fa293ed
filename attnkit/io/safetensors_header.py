"""Read safetensors headers (names, dtypes, shapes, byte sizes) without torch, as strictly as the safetensors library.

A header is accepted only when the library would accept it: an 8-byte length, then a JSON object
(duplicate keys, which the library resolves silently, are refused), `__metadata__` a str -> str object, every
tensor with a known
dtype, a shape of non-negative integers and two integer offsets; the tensors' byte ranges tile the
data section from 0 to the end of the file without gaps or overlaps, and each range holds exactly
shape x dtype bytes. Anything else is an AttnkitError naming the file and what is wrong.
"""

from __future__ import annotations

import math
import reprlib
import struct
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.files import open_regular
from attnkit.io.jsonsafe import JSONError, loads_strict

#: Bits per element for every dtype the safetensors format defines.
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E4M3": 8,
    "F8_E5M2": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
#: Bytes per element (fractional for the sub-byte float formats).
DTYPE_BYTES = {name: bits / 8 if bits % 8 else bits // 8 for name, bits in DTYPE_BITS.items()}

#: The safetensors library's own limit on the JSON header.
MAX_HEADER_BYTES = 100_000_000
#: More dimensions than any real tensor has; bounds the work a crafted shape can cause.
MAX_DIMS = 64


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
        with open_regular(path, "safetensors file") as fh:
            size = fh.seek(0, 2)
            fh.seek(0)
            raw_len = fh.read(8)
            if len(raw_len) < 8:
                raise AttnkitError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > MAX_HEADER_BYTES:
                raise AttnkitError(
                    f"{path}: corrupt safetensors header (length {header_len} is over the "
                    f"{MAX_HEADER_BYTES:,}-byte limit)"
                )
            if 8 + header_len > size:
                raise AttnkitError(f"{path}: corrupt safetensors header (length {header_len} exceeds the file)")
            raw = fh.read(header_len)
    except OSError as exc:
        raise AttnkitError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return parse_header(raw, size - 8 - header_len, path)


def parse_header(raw: bytes, data_len: int, path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate the JSON header `raw` of a file whose data section has `data_len` bytes."""

    def bad(why: str) -> AttnkitError:
        return AttnkitError(f"{path}: corrupt safetensors header ({why})")

    try:
        header = loads_strict(raw, allow_nan=False)
    except JSONError as exc:
        raise bad(f"not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must be an object of strings")
    infos = {name: _entry(name, entry, data_len, path, bad) for name, entry in header.items()}
    _check_tiling(infos, data_len, bad)
    return infos, metadata


def _entry(name: str, entry, data_len: int, path: Path, bad) -> TensorInfo:
    """One tensor's info, its fields type-checked and its byte range matching shape x dtype."""
    if not isinstance(entry, dict):
        raise bad(f"entry for {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise AttnkitError(f"{path}: tensor {name!r} has unknown dtype {_short(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"shape of {name!r} must be a list of non-negative integers, got {_short(shape)}")
    if len(shape) > MAX_DIMS:
        raise bad(f"{name!r} has {len(shape)} dimensions, over the limit of {MAX_DIMS}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise bad(f"data_offsets of {name!r} must be two non-negative integers, got {_short(offsets)}")
    begin, end = offsets
    if end < begin or end > data_len:
        raise AttnkitError(f"{path}: tensor {name!r} does not fit the file (truncated or corrupt safetensors)")
    bits = _bits(shape, DTYPE_BITS[dtype], 8 * data_len)
    if bits is None or bits % 8 or bits // 8 != end - begin:
        raise AttnkitError(
            f"{path}: tensor {name!r} does not fit the file (its shape and dtype need a "
            f"different byte length than its offsets give)"
        )
    return TensorInfo(name, dtype, tuple(shape), (begin, end), path)


def _bits(shape: list[int], bits_per_element: int, limit: int) -> int | None:
    """shape x bits, or None once it passes `limit` (so a crafted shape costs no big-number arithmetic)."""
    if 0 in shape:
        return 0
    total = bits_per_element
    for dim in shape:
        total *= dim
        if total > limit:
            return None
    return total


def _check_tiling(infos: dict[str, TensorInfo], data_len: int, bad) -> None:
    """The byte ranges, in order, start at 0, touch without gaps or overlaps and end at the end of the file."""
    position = 0
    for info in sorted(infos.values(), key=lambda i: i.data_offsets):
        begin, end = info.data_offsets
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a gap at byte {position}"
            raise bad(f"{info.name!r} {what}")
        position = end
    if position != data_len:
        raise bad(f"the tensors end at byte {position} of a {data_len}-byte data section")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value) -> str:
    """A bounded repr for messages (a crafted value's full repr could be huge)."""
    return reprlib.repr(value)


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
