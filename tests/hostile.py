"""Seeded mutators of checkpoint metadata (safetensors headers, index JSON, GGUF headers), shared by the fuzz
tests and tests/hostile_battery.py. Every mutator returns bytes; the readers must answer them with a
result or an AttnkitError, nothing else."""

from __future__ import annotations

import copy
import json
import random
import struct

#: Values a hostile header puts where numbers, strings, lists or objects belong.
NASTY = [
    -1,
    0,
    1,
    0.5,
    -0.0,
    1e308,
    2**31,
    2**63 - 1,
    2**64,
    2**80,
    "",
    "ab",
    "F32",
    None,
    True,
    False,
    [],
    [1],
    [-1, 2],
    [0.5],
    ["ab"],
    [2**64],
    [100000000, "ab"],
    [100000, 100000, 100000],
    {},
    {"a": 1},
    {"a": "b"},
    [[1, 2]],
    "../../../../etc/passwd",
    "/etc/passwd",
    "a\x00b",
]
#: JSON texts no JSON encoder writes but a file can hold.
RAW_JSON = [b"NaN", b"Infinity", b"-Infinity", b"1" * 5000, b"[" * 100000 + b"]" * 100000, b"1e999", b'"\\ud800"']


# ------------------------------------------------------------------ safetensors


def safetensors_header() -> dict:
    """A valid header: three tensors that tile a 96-byte data section, and metadata."""
    return {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]},
        "b": {"dtype": "BF16", "shape": [8], "data_offsets": [64, 80]},
        "c": {"dtype": "U8", "shape": [2, 8], "data_offsets": [80, 96]},
    }


def safetensors_bytes(header: dict | bytes, data_len: int = 96, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + b"\0" * data_len


def mutate_safetensors(rng: random.Random) -> bytes:
    """One hostile safetensors file: a structural edit of a valid header, a text-level edit, or a bad length."""
    header = safetensors_header()
    kind = rng.randrange(10)
    if kind < 5:
        for _ in range(rng.randint(1, 3)):
            _replace_somewhere(rng, header)
        return safetensors_bytes(header, data_len=rng.choice([96, 96, 95, 97, 0]))
    text = json.dumps(header).encode()
    if kind == 5:
        return safetensors_bytes(_flip_bytes(rng, text))
    if kind == 6:
        dup = b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        return safetensors_bytes(text[:1] + dup + text[1:])
    if kind == 7:
        return safetensors_bytes(
            rng.choice(RAW_JSON) if rng.random() < 0.5 else text.replace(b"64", rng.choice(RAW_JSON), 1)
        )
    if kind == 8:
        body = safetensors_bytes(header)
        return body[: rng.randrange(len(body))]
    length = rng.choice([0, 1, 7, len(text) - 3, 10**8 + 1, 2**40, 2**64 - 1])
    return safetensors_bytes(header, length=length)


def _nasty(rng: random.Random, extra: list | tuple = ()):
    """A fresh copy of a NASTY value (the pool's lists must not be edited in place by later mutations)."""
    return copy.deepcopy(rng.choice([*NASTY, *extra]))


def _replace_somewhere(rng: random.Random, header: dict) -> None:
    name = rng.choice(list(header))
    if name == "__metadata__":
        header[name] = _nasty(rng, [{"format": _nasty(rng)}])
        return
    entry = header[name]
    field = rng.choice(["dtype", "shape", "data_offsets", "entry", "drop", "offset0", "offset1", "dim"])
    if not (
        isinstance(entry, dict)
        and isinstance(entry.get("shape"), list)
        and entry["shape"]
        and isinstance(entry.get("data_offsets"), list)
        and len(entry["data_offsets"]) == 2
    ):
        field = "entry"  # an earlier edit already broke this entry
    if field == "entry":
        header[name] = _nasty(rng)
    elif field == "drop":
        entry.pop(rng.choice(list(entry)), None)
    elif field in ("offset0", "offset1"):
        entry["data_offsets"][int(field[-1])] = _nasty(rng, [32, 63, 65, 80, 96, 97])
    elif field == "dim":
        entry["shape"][rng.randrange(len(entry["shape"]))] = _nasty(rng, [0, 3, 5])
    else:
        entry[field] = _nasty(rng)


def _flip_bytes(rng: random.Random, raw: bytes) -> bytes:
    buf = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(3)
        i = rng.randrange(len(buf))
        if op == 0:
            buf[i] = rng.randrange(256)
        elif op == 1:
            del buf[i]
        else:
            buf.insert(i, rng.choice(b'{}[],:"\\0\xff\x80-.e'))
    return bytes(buf)


# ------------------------------------------------------------------ index JSON

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def index_doc() -> dict:
    return {"metadata": {"total_size": 96}, "weight_map": {"a": SHARDS[0], "b": SHARDS[0], "c": SHARDS[1]}}


def mutate_index(rng: random.Random) -> bytes:
    """One hostile model.safetensors.index.json."""
    doc = index_doc()
    kind = rng.randrange(6)
    if kind < 3:
        target = rng.choice(["weight_map", "value", "value", "doc", "key"])
        if target == "weight_map":
            doc["weight_map"] = _nasty(rng, [list(SHARDS)])
        elif target == "value":
            doc["weight_map"][rng.choice(list(doc["weight_map"]))] = _nasty(
                rng, ["../" * rng.randint(1, 6) + "etc/passwd", "sub/../../x.safetensors", "C:\\x.safetensors"]
            )
        elif target == "key":
            doc["weight_map"][rng.choice(["", "\ud800", "x" * 1000])] = SHARDS[0]
        else:
            doc = _nasty(rng)
        return json.dumps(doc).encode()
    text = json.dumps(doc).encode()
    if kind == 3:
        return _flip_bytes(rng, text)
    if kind == 4:
        return text.replace(b'"weight_map": {', b'"weight_map": {"a": "x.safetensors", ', 1)
    return rng.choice(RAW_JSON + [b"\xff\xfe" + text, text[: rng.randrange(len(text))]])


# ------------------------------------------------------------------ GGUF

U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(layers: int = 2) -> list[tuple[str, int, object]]:
    """(key, value type, value) of a small valid llama GGUF."""
    return [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, 32),
        ("llama.block_count", U32, layers),
        ("llama.embedding_length", U32, 64),
        ("llama.attention.head_count", U32, 8),
        ("llama.attention.head_count_kv", U32, 2),
        ("llama.context_length", U32, 512),
        ("llama.rope.freq_base", F32, 10000.0),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["a", "b", "c"])),
    ]


def gguf_tensors(layers: int = 2) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, dims, ggml type) of F32 tensors: the embedding, and per block a norm and the attention (GGUF dims
    [in, out]; hidden 64, 8 heads and 2 KV heads of 8)."""
    block = [
        ("attn_norm", (64,)),
        ("attn_q", (64, 64)),
        ("attn_k", (64, 16)),
        ("attn_v", (64, 16)),
        ("attn_output", (64, 64)),
    ]
    return [("token_embd.weight", (64, 3), 0)] + [
        (f"blk.{i}.{role}.weight", dims, 0) for i in range(layers) for role, dims in block
    ]


def gguf_bytes(fields, tensors, *, n_kv: int | None = None, n_tensors: int | None = None, version: int = 3) -> bytes:
    """A GGUF file: header, key/values, tensor infos, padding to 32 and the (zero) tensor data."""
    out = bytearray(
        b"GGUF"
        + struct.pack(
            "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(fields) if n_kv is None else n_kv
        )
    )
    for key, vtype, value in fields:
        out += _gguf_string(key) + struct.pack("<I", vtype) + _gguf_value(vtype, value)
    offset = 0
    for name, dims, ggml_type in tensors:
        out += _gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ggml_type, offset)
        offset += 4 * _prod(dims) + (-4 * _prod(dims)) % 32
    out += b"\0" * (-len(out) % 32)
    return bytes(out) + b"\0" * offset


def mutate_gguf(rng: random.Random) -> bytes:
    """One hostile GGUF: a field retyped or revalued, a count inflated, bytes flipped or the file cut."""
    layers = rng.choice([1, 2])
    fields, tensors = gguf_fields(layers), gguf_tensors(layers)
    kind = rng.randrange(8)
    if kind < 4:
        i = rng.randrange(len(fields))
        key, _, _ = fields[i]
        fields[i] = (key, *rng.choice(_GGUF_NASTY))
        return gguf_bytes(fields, tensors)
    if kind == 4:
        big = rng.choice([2**20 + 1, 2**32, 2**62, 2**64 - 1])
        return gguf_bytes(fields, tensors, **{rng.choice(["n_kv", "n_tensors"]): big})
    if kind == 5:
        fields.append((rng.choice([f[0] for f in fields]), U32, 3))  # a duplicate key
        return gguf_bytes(fields, tensors)
    raw = gguf_bytes(fields, tensors)
    if kind == 6:
        return _flip_bytes(rng, raw[:400]) + raw[400:]
    return raw[: rng.randrange(24, len(raw))]


#: (value type, value) replacements, including arrays and strings where counts belong.
_GGUF_NASTY = [
    (U32, 0),
    (U32, 3),
    (U32, 2**32 - 1),
    (I32, -2),
    (F32, 0.5),
    (F32, 9.5),
    (F32, float("nan")),
    (BOOL, True),
    (U64, 2**62),
    (U64, 2**64 - 1),
    (STRING, "abc"),
    (STRING, ""),
    (ARRAY, (U32, [8, 8])),
    (ARRAY, (U32, [8, 4])),
    (ARRAY, (U32, [])),
    (ARRAY, (STRING, ["x"])),
    (ARRAY, (F32, [0.5])),
    (ARRAY, (ARRAY, [])),
    (ARRAY, (U32, list(range(5000)))),
    (77, None),
]


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _gguf_value(vtype: int, value) -> bytes:
    if vtype == STRING:
        return _gguf_string(value)
    if vtype == ARRAY:
        etype, items = value
        body = b"".join(_gguf_value(etype, v) for v in items) if etype != ARRAY else b""
        return struct.pack("<IQ", etype, len(items)) + body
    if vtype in _FMT:
        return struct.pack("<" + _FMT[vtype], value)
    return b""  # an unknown type: the reader must stop at the type code


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
