"""Parse JSON from untrusted files: strict UTF-8, no duplicate keys, and only one exception type for bad input."""

from __future__ import annotations

import json


class JSONError(ValueError):
    """The bytes are not acceptable JSON; the message says why in a few words."""


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(f"duplicate key {key[:80]!r}")
        seen.add(key)
    return dict(pairs)


def _no_constant(name: str):
    raise JSONError(f"{name} is not a JSON number")


def loads_strict(raw: bytes | str, *, allow_nan: bool = True):
    """json.loads that refuses duplicate keys (and with allow_nan=False NaN/Infinity); raises JSONError only."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    except UnicodeDecodeError as exc:
        raise JSONError(f"not UTF-8 text (byte {exc.start})") from None
    kwargs = {} if allow_nan else {"parse_constant": _no_constant}
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, **kwargs)
    except json.JSONDecodeError as exc:
        raise JSONError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise JSONError("nested too deeply") from None
    except ValueError as exc:  # duplicate keys, integers longer than Python's digit limit
        raise JSONError(str(exc)) from None


#: Largest JSON file (config.json, model.safetensors.index.json) attnkit reads; real ones are far smaller.
MAX_JSON_FILE_BYTES = 64 * 2**20


def read_json_file(path, what: str):
    """The parsed JSON of the file `path` (a `what`, for messages); AttnkitError naming the file on any problem."""
    from pathlib import Path

    from attnkit.errors import AttnkitError
    from attnkit.io.files import open_regular

    path = Path(path)
    try:
        with open_regular(path, what) as fh:
            raw = fh.read(MAX_JSON_FILE_BYTES + 1)
    except OSError as exc:
        raise AttnkitError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_JSON_FILE_BYTES:
        raise AttnkitError(f"{path}: {what} is over the {MAX_JSON_FILE_BYTES // 2**20} MiB limit")
    try:
        return loads_strict(raw)
    except JSONError as exc:
        raise AttnkitError(f"{path}: invalid JSON ({exc})") from None
