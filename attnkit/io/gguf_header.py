"""Parse a GGUF header (key/values and tensor infos) without reading tensor data or long arrays."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.files import open_regular

#: GGUF value type -> struct format (8 = string and 9 = array are handled apart).
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
#: Numeric arrays up to this length are read into lists; longer ones (and string arrays) keep only their length.
MAX_ARRAY_VALUES = 4096
DEFAULT_ALIGNMENT = 32
#: Longest key or tensor name (the GGUF spec allows 65535 bytes) and longest string value kept (chat templates
#: are kilobytes); longer ones are refused rather than copied.
MAX_NAME_BYTES = 65535
MAX_STRING_BYTES = 16 * 2**20
#: Most key/values and tensors a header may declare; each also needs at least this many bytes of the file.
MAX_ENTRIES = 1 << 20
KV_MIN_BYTES, TENSOR_MIN_BYTES = 13, 24


class _Truncated(Exception):
    pass


@dataclass
class GGUFHeader:
    version: int
    fields: dict = field(default_factory=dict)  # key -> scalar, str, or list (short numeric arrays)
    array_lengths: dict = field(default_factory=dict)  # key -> length, for every array
    tensors: list = field(default_factory=list)  # (name, dims, ggml type, offset) in file order
    data_start: int = 0


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def string(self, limit: int = MAX_STRING_BYTES) -> str:
        n = self.one("Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        if n > limit:
            raise ValueError(f"a {n:,}-byte string at offset {self.pos - 8}, over the {limit:,}-byte limit")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        if count * 8 > len(self.buf) - self.pos:  # each string needs at least its 8-byte length
            raise _Truncated
        for _ in range(count):
            n = self.one("Q")  # read before adding: `pos += one()` would use the old pos
            self.pos += n
            if self.pos > len(self.buf):
                raise _Truncated

    def value(self, vtype: int, key: str, header: GGUFHeader):
        if vtype == STRING:
            return self.string()
        if vtype in SCALAR_FORMATS:
            return self.one(SCALAR_FORMATS[vtype])
        if vtype != ARRAY:
            raise ValueError(f"unknown value type {vtype} for {key!r}")
        etype, count = self.one("I"), self.one("Q")
        header.array_lengths[key] = count
        if etype == STRING:
            self.skip_strings(count)
            return None
        if etype not in SCALAR_FORMATS:
            raise ValueError(f"unsupported array type {etype} for {key!r}")
        fmt = SCALAR_FORMATS[etype]
        if count > MAX_ARRAY_VALUES:
            self.pos += count * struct.calcsize("<" + fmt)
            if self.pos > len(self.buf):
                raise _Truncated
            return None
        return list(self.take(f"{count}{fmt}")) if count else []


def parse_gguf_header(path: Path) -> GGUFHeader:
    """Key/values and tensor infos of a GGUF file; one-line AttnkitError naming the file when it is damaged."""
    try:
        with open_regular(path, "GGUF file") as fh:
            if fh.seek(0, 2) < 24:
                raise AttnkitError(f"{path}: not a GGUF file (too short)")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf)
    except OSError as exc:
        raise AttnkitError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except _Truncated:
        raise AttnkitError(f"{path}: truncated GGUF file (header runs past the end)") from None
    except (ValueError, OverflowError) as exc:
        raise AttnkitError(f"{path}: corrupt GGUF header ({exc})") from None


def _parse(path: Path, buf) -> GGUFHeader:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise AttnkitError(f"{path}: not a GGUF file (bad magic)")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("IQQ")
    if version not in (2, 3):
        raise AttnkitError(f"{path}: unsupported GGUF version {version}")
    _check_count(path, "key/values", n_kv, KV_MIN_BYTES, len(buf))
    _check_count(path, "tensors", n_tensors, TENSOR_MIN_BYTES, len(buf))
    header = GGUFHeader(version)
    names = set()
    for _ in range(n_kv):
        key = cur.string(MAX_NAME_BYTES)
        if key in header.fields:
            raise ValueError(f"key {key!r} appears twice")
        header.fields[key] = cur.value(cur.one("I"), key, header)
    for _ in range(n_tensors):
        name = cur.string(MAX_NAME_BYTES)
        n_dims = cur.one("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = cur.take(f"{n_dims}Q")
        ggml_type, offset = cur.take("IQ")
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        header.tensors.append((name, dims, ggml_type, offset))
    alignment = header.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment must be a positive power of two, got {alignment!r}")
    misaligned = next((name for name, _, _, offset in header.tensors if offset % alignment), None)
    if misaligned is not None:
        raise ValueError(
            f"tensor {misaligned!r} starts at an offset that is not a multiple of the alignment {alignment}"
        )
    header.data_start = math.ceil(cur.pos / alignment) * alignment
    return header


def _check_count(path: Path, what: str, count: int, min_bytes: int, size: int) -> None:
    """A declared count must fit the file (each entry takes at least `min_bytes`) and the MAX_ENTRIES limit."""
    if count > MAX_ENTRIES:
        raise AttnkitError(f"{path}: corrupt GGUF header ({count:,} {what}, over the limit of {MAX_ENTRIES:,})")
    if count * min_bytes > size:
        raise AttnkitError(f"{path}: corrupt GGUF header ({count:,} {what} cannot fit in {size:,} bytes)")
