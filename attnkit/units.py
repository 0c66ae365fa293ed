"""Parse and print sizes: token counts (4k = 4096) and byte sizes (80GiB, 80GB; a unit is required)."""

from __future__ import annotations

import re

from attnkit.errors import UsageError

_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "M": 1024**2,
    "G": 1024**3,
    "T": 1024**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
#: Largest token count (2**40, a trillion tokens), batch size and memory size (1 PiB) the tables accept.
MAX_TOKENS = 1 << 40
MAX_COUNT = 1 << 32
MAX_BYTES = 1 << 50


def _shown(text: str) -> str:
    """`text` quoted for a message, cut to 40 characters."""
    return repr(text if len(text) <= 40 else text[:37] + "...")


def parse_tokens(text: str) -> int:
    """'4k' -> 4096, '128k' -> 131072, '1m' -> 1048576, '1000' -> 1000 (binary k, as context sizes are)."""
    m = _TOKENS.match(text)
    if not m:
        raise UsageError(f"not a token count: {_shown(text)} (use e.g. 4096, 4k, 128k)")
    scale = {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]
    value = float(m.group(1)) * scale
    if value > MAX_TOKENS:
        raise UsageError(f"token count {_shown(text)} is over the limit of {MAX_TOKENS:,} (1024G tokens)")
    if value < 1 or value != int(value):
        raise UsageError(f"not a positive whole token count: {_shown(text)}")
    return int(value)


def parse_bytes(text: str, option: str | None = None) -> int:
    """'80GiB' or '80G' -> 80*2**30, '80GB' -> 80*10**9, '1024B' -> 1024 bytes. A number without a unit is
    refused: '--gpu-mem 80' means 80 GiB to a person and 80 bytes to a parser."""
    m = _BYTES.match(text)
    where = f"{option} " if option else ""
    if not m:
        raise UsageError(f"{where}not a memory size: {_shown(text)} (use e.g. 80GiB, 24GB, 512MiB)")
    if not m.group(2):
        number = m.group(1)
        raise UsageError(
            f"{where}{_shown(text)} has no unit: write {number}GiB (binary), {number}GB (decimal) or {number}B (bytes)"
        )
    unit = m.group(2).upper().replace("IB", "").replace("I", "")
    if unit not in _BYTE_UNITS:
        raise UsageError(f"unknown memory unit in {_shown(text)}")
    value = float(m.group(1)) * _BYTE_UNITS[unit]
    if value > MAX_BYTES:
        raise UsageError(f"memory size {_shown(text)} is over the limit of 1 PiB")
    if value <= 0:
        raise UsageError(f"memory size must be positive: {_shown(text)}")
    return int(value)


def parse_list(text: str, parse) -> list:
    """Comma-separated items, each parsed; an empty list or an empty item ('4k,,8k', '4k,') is refused."""
    items = [s.strip() for s in text.split(",")]
    if not any(items):
        raise UsageError(f"empty list: {_shown(text)}")
    if not all(items):
        raise UsageError(f"empty item in the list {_shown(text)}")
    return [parse(t) for t in items]


def check_bounds(flag: str, value, low=None, high=None) -> None:
    """A number option is finite and within [low, high] (either end may be None); a one-line UsageError naming
    the flag otherwise. Every command bounds its numbers this way, so none runs for ever or overflows."""
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise UsageError(f"{flag} must be at least {low:,}, got {value:,}")
    if high is not None and value > high:
        raise UsageError(f"{flag} {value:,} is over the limit of {high:,}")


def parse_positive_int(text: str) -> int:
    if text.strip().isdigit() and len(text.strip()) > 12:  # int() of thousands of digits is slow, then refused
        raise UsageError(f"{_shown(text)} is over the limit of {MAX_COUNT:,}")
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"not a whole number: {_shown(text)}") from None
    if value < 1:
        raise UsageError(f"must be at least 1: {_shown(text)}")
    if value > MAX_COUNT:
        raise UsageError(f"{_shown(text)} is over the limit of {MAX_COUNT:,}")
    return value


def human_bytes(n: float) -> str:
    """Binary units, three significant digits and never an exponent: 131072 -> '128 KiB', 1069547520 ->
    '1020 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} PiB"


def human_tokens(n: int) -> str:
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return str(n)
