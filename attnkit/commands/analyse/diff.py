"""diff: what a rewrite did to a model. Config keys and tensors that changed, the attention layout and KV
bytes per token of both, and with text the per-head attention statistics before (A) and after (B).

Tensors are compared by name: added, removed, reshaped or recast, and for tensors present in both with
one shape the relative change ||B - A|| / ||A|| (float64, one pair in memory at a time). Probe deltas
run both models on the same windows, tokenized with A's tokenizer (the vocabularies must agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attnkit.errors import AttnkitError
from attnkit.io.reader import LazyReader
from attnkit.io.safetensors_header import read_headers
from attnkit.io.source import open_source
from attnkit.kvcache import bytes_per_token, cache_dtype
from attnkit.progress import phase
from attnkit.runtime import load_model, make_windows, read_texts
from attnkit.runtime.loader import dtype_name, resolve_device
from attnkit.runtime.texts import check_text_files, check_window_options
from attnkit.scoring.attention_stats import probe

#: Per-head probe fields compared; a row holds each for A and B and their difference B - A.
PROBE_FIELDS = ("max_logit", "logz_mean", "entropy_mean")


@dataclass(kw_only=True)
class DiffRequest:
    a: str
    b: str
    texts: list[str] = field(default_factory=list)
    seq_len: int = 512
    max_tokens: int | None = None
    values: bool = True  # compare tensor values, not only names, shapes and dtypes
    device: str = "auto"
    dtype: str = "auto"


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested config keys as dotted names: {"rope_scaling": {"factor": 8}} -> {"rope_scaling.factor": 8}."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def config_changes(a: dict, b: dict) -> list[dict]:
    """Keys whose value differs (missing on one side: null there), in A's key order, then B's new keys."""
    fa, fb = flatten(a), flatten(b)
    keys = list(dict.fromkeys([*fa, *fb]))
    return [
        {
            "key": k,
            "a": fa.get(k),
            "b": fb.get(k),
            "change": "added" if k not in fa else "removed" if k not in fb else "changed",
        }
        for k in keys
        if fa.get(k, _MISSING) != fb.get(k, _MISSING)
    ]


_MISSING = object()


def tensor_changes(src_a, src_b, values: bool) -> tuple[list[dict], int]:
    """Rows for tensors added, removed, reshaped, recast or (with values) changed, and how many tensors are the
    same on both sides (name, shape and dtype; with values, also every value)."""

    ha, hb = read_headers(src_a.ckpt.weight_files), read_headers(src_b.ckpt.weight_files)
    rows = []
    for name in dict.fromkeys([*ha, *hb]):
        ia, ib = ha.get(name), hb.get(name)
        change = (
            "added"
            if ia is None
            else "removed"
            if ib is None
            else "reshaped"
            if ia.shape != ib.shape
            else "recast"
            if ia.dtype != ib.dtype
            else None
        )
        rows.append(
            {
                "name": name,
                "change": change,
                "shape_a": list(ia.shape) if ia else None,
                "shape_b": list(ib.shape) if ib else None,
                "dtype_a": ia.dtype if ia else None,
                "dtype_b": ib.dtype if ib else None,
                "rel_change": None,
            }
        )
    if values:
        _compare_values(src_a, src_b, [r for r in rows if r["change"] in (None, "recast")])
    changed = [r for r in rows if r["change"] is not None]
    return changed, len(rows) - len(changed)


def _compare_values(src_a, src_b, rows: list[dict]) -> None:
    """Fill rel_change (and change = "values" where they differ) for tensors of one shape on both sides."""
    import torch

    with (
        LazyReader(src_a.ckpt.weight_files) as ra,
        LazyReader(src_b.ckpt.weight_files) as rb,
        phase("comparing tensors", len(rows), "tensors") as advance,
    ):
        for row in rows:
            ta, tb = ra.get(row["name"]), rb.get(row["name"])
            if ta.is_floating_point() or tb.is_floating_point():
                da, db = ta.to(torch.float64), tb.to(torch.float64)
                diff = float(torch.linalg.vector_norm(db - da))
                base = float(torch.linalg.vector_norm(da))
                row["rel_change"] = diff / base if base > 0 else diff
                differs = diff > 0
            else:
                differs = not torch.equal(ta, tb)
                row["rel_change"] = 1.0 if differs else 0.0
            if differs and row["change"] is None:
                row["change"] = "values"
            advance(1)


def layout(src) -> dict:
    """Attention layout and KV bytes per token (bf16, the same basis for both sides)."""

    spec = src.spec
    return {
        "model_type": spec.model_type,
        "variant": spec.variant,
        "layers": spec.num_layers,
        "heads": spec.num_heads,
        "kv_heads": spec.num_kv_heads if spec.mla is None else None,
        "head_dim": spec.head_dim,
        "kv_bytes_per_token_bf16": bytes_per_token(spec, cache_dtype("bf16")),
    }


def probe_deltas(req: DiffRequest) -> dict:
    """Both models' per-head probe statistics on the same windows, joined on (layer, head)."""

    docs = read_texts(req.texts)
    a = load_model(req.a, device=req.device, dtype=req.dtype)
    windows = make_windows(a.tokenizer, docs, req.seq_len, req.max_tokens)
    pa = probe(a, windows, name="A")
    vocab = a.model.config.vocab_size
    del a
    b = load_model(req.b, device=req.device, dtype=req.dtype)
    if b.model.config.vocab_size != vocab:
        raise AttnkitError(f"probe deltas need one vocabulary: A has {vocab} tokens, B {b.model.config.vocab_size}")
    pb = probe(b, windows, name="B")
    heads_b = {(r["layer"], r["head"]): r for r in pb.heads}
    rows = []
    for ra in pa.heads:
        rb = heads_b.get((ra["layer"], ra["head"]))
        if rb is None:
            continue
        row = {"layer": ra["layer"], "head": ra["head"]}
        for key in PROBE_FIELDS:
            row[f"{key}_a"], row[f"{key}_b"] = ra[key], rb[key]
            row[f"{key}_delta"] = None if ra[key] is None or rb[key] is None else rb[key] - ra[key]
        rows.append(row)
    return {
        "tokens": int(windows.numel()),
        "windows": int(windows.shape[0]),
        "seq_len": req.seq_len,
        "heads": rows,
        "final": {
            k: {"a": pa.final.get(k), "b": pb.final.get(k)} for k in ("final_logit_max", "final_logz_mean", "z_loss")
        },
    }


def check_request(req: DiffRequest):
    """Texts, device, dtype and both models checked before any tensor is read."""

    if req.texts:
        check_text_files(req.texts)
        check_window_options(req.seq_len, req.max_tokens)
        resolve_device(req.device)
        dtype_name(req.dtype)  # refuses an unknown --dtype; load_model reads the short names too
    return open_source(req.a, "compare", causal=False), open_source(req.b, "compare", causal=False)


def diff_models(req: DiffRequest) -> dict:
    """The report of `attnkit diff` (see docs/diff.md)."""
    src_a, src_b = check_request(req)
    tensors, identical = tensor_changes(src_a, src_b, req.values)
    report = {
        "a": req.a,
        "b": req.b,
        "layout": {"a": layout(src_a), "b": layout(src_b)},
        "config": config_changes(src_a.raw_config(), src_b.raw_config()),
        "tensors": tensors,
        "tensors_unchanged": identical,
        "values_compared": req.values,
        "probe": None,
    }
    if req.texts:
        report["probe"] = probe_deltas(req)
    return report


def largest_first(rows: list[dict], key: str, top: int) -> list[dict]:
    """Rows by |row[key]| descending (missing values last), the first `top` (0: all)."""
    ordered = sorted(rows, key=lambda r: -abs(r[key]) if r[key] is not None and math.isfinite(r[key]) else math.inf)
    return ordered[:top] if top else ordered
