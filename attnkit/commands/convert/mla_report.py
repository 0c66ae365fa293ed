"""What `convert mla`'s report says besides the layers: the KV cache per token before and after, the parameters
(also the manifest's) and the notes on what the result does differently from its source."""

from __future__ import annotations

from dataclasses import replace

from attnkit.commands.convert.mla_layer_budget import applies
from attnkit.commands.convert.mla_request import (
    MLARequest,
    MLASource,
    center_keys_choice,
    key_balance_choice,
    rope_pair_choice,
)
from attnkit.engines.targets import mla_serving
from attnkit.kvcache import apply_variant, bytes_per_token, cache_dtype
from attnkit.kvcache import kv_bytes as kv_cache_bytes


def result_spec(src: MLASource, rank: int):
    """The result's attention layout: R + P cached in each converted layer (a layer's own where --layer-shape
    gives it one), the source's K and V in the kept ones, the source's sliding windows where the target keeps
    them."""
    after = apply_variant(src.spec, f"mla:{rank}+{src.shape.rope_dim}")
    if src.target.keeps_windows:
        after = replace(after, layer_windows=src.spec.layer_windows)
    own = src.own_shapes()
    if src.plain_layers or own:
        shapes = tuple(tuple(own.get(str(i), ())) for i in range(src.spec.num_layers)) if own else ()
        after = replace(
            after,
            mla=replace(
                after.mla, plain_layers=src.plain_layers, plain_kv_heads=src.spec.num_kv_heads, layer_shapes=shapes
            ),
        )
    return after


def _dtype(src: MLASource):
    return cache_dtype(str(src.config.get("torch_dtype") or src.config.get("dtype") or "bfloat16"))


def kv_bytes(src: MLASource, rank: int) -> dict:
    """The report's kv_bytes_per_token: the source's and the result's KV cache per token in the source dtype (every
    layer, windows aside); elements per token and converted layer."""
    dtype = _dtype(src)
    after = result_spec(src, rank)
    return {
        "dtype": dtype.name,
        "before": bytes_per_token(src.spec, dtype),
        "after": bytes_per_token(after, dtype),
        "elements_before": 2 * src.spec.num_kv_heads * src.spec.head_dim,
        "elements_after": rank + src.shape.rope_dim,
        **(
            {"elements_after_by_layer": [after.kv_elements_per_token(i) for i in src.converted_layers]}
            if src.layer_shapes
            else {}
        ),
    }


def cache_at_context(src: MLASource, rank: int) -> list[dict]:
    """The report's kv_cache_at_context: the whole cache of one sequence (sliding layers holding their window),
    source and result, at 4,096 tokens and at the source's longest context."""
    dtype, after = _dtype(src), result_spec(src, rank)
    longest = src.arch.config_value(src.config, "max_positions") or 4096
    rows = []
    for context in sorted({min(4096, longest), longest}):
        before, result = kv_cache_bytes(src.spec, dtype, context, 1), kv_cache_bytes(after, dtype, context, 1)
        rows.append({"context": context, "before": before, "after": result, "ratio": result / before})
    return rows


def serving(src: MLASource) -> dict | None:
    """The report's `serving`: per engine, whether it serves the output as written (its cache holds the latent)
    or falls back, and the values it caches per token and layer then (attnkit.engines.targets.mla_serving); null
    for an output no engine serves (a target for transformers only, the bias route)."""
    if not src.target.engines or src.route.bias:
        return None
    return mla_serving(src.rank, src.shape.rope_dim, src.spec.num_heads, src.shape.head_dim)


def parameters(req: MLARequest, src: MLASource) -> dict:
    """The report's and the manifest's parameters: the shape chosen and every option."""
    o = req.options
    pairs = rope_pair_choice(o, src.target)
    return {
        "kv_lora_rank": src.rank,
        "latent_rank": src.shape.latent_rank,
        "rope_dim": src.shape.rope_dim,
        "layer_shapes": src.own_shapes(),
        "layer_budget": req.layer_budget,
        "rope_pairs": src.shape.pairs if pairs == "fastest" else None,
        "rope_pair_choice": pairs,
        "kv_budget": req.kv_budget,
        "calib": list(req.calib),
        "calib_tokens": req.calib_tokens,
        "calib_seq_len": req.calib_seq_len,
        "sequential": req.sequential,
        "key_weight": o.key_weight,
        "value_weight": o.value_weight,
        "residual": o.residual,
        "fade_window": o.window,
        "key_balance": key_balance_choice(o, src.target),
        "center_keys": center_keys_choice(o, src.target),
        "ridge": o.ridge,
        "o_refit": o.o_refit,
        "whiten": o.whiten,
        "shrink": o.shrink,
        "latent_norm": src.route.latent_norm,
        "engine": src.route.engine,
        "route_why": src.route.why,
        "target": req.target,
        "sliding_layers": req.sliding_layers,
        "q_lora_rank": (src.spec.hidden_size + int(src.route.bias)) if src.q_lora else None,
        "max_shard_bytes": req.max_shard_bytes,
    }


def notes(req: MLARequest, src: MLASource) -> list[str]:
    """What the result does differently from the source, one sentence each."""
    notes = [src.route.why] if src.route.why else []
    if src.route.bias:
        if src.q_lora:
            notes.append(
                "q bias carried through the q_lora path (q_lora_rank = hidden + 1, RMSNorm made linear "
                "by a constant channel); all-zero q biases use a plain q_proj"
            )
    else:
        if src.q_lora:
            notes.append(
                f"query through q_a_proj = identity (q_lora_rank = hidden = {src.spec.hidden_size}): "
                f"llama.cpp's deepseek2 reads q_lora unless a model has 26 or 27 layers"
            )
        if src.augmented:
            notes.append(
                "q and RoPE-key biases ride on the anchor a.x ~ 1 (engines have no bias slot); the "
                "latent's own constants come out exact"
            )
    if src.target.note:
        notes.append(src.target.note)
    if src.plain_layers:
        spent = (
            "--kv-budget is spent on the global layers, counted on the whole cache at the longest context"
            if req.kv_budget is not None
            else "only the global layers are converted"
        )
        notes.append(
            f"sliding-window layers {_ranges(src.plain_layers)} kept as the source's attention (their cache holds at "
            f"most the window); {spent} (kv_cache_at_context; --sliding-layers convert converts every layer)"
        )
    chosen = src.layer_budget or {}
    if chosen.get("chosen") == "traded":
        trades = "; ".join(
            f"layer {t['taker']} takes layer {t['giver']}'s share, its keys exact (cost measured alone "
            f"{t['cost_even']:.3g} -> {t['cost']:.3g})"
            for t in chosen["trades"]
            if t["stands"]
        )
        notes.append(f"--layer-budget auto: {trades} (layer_budget)")
    elif applies(req, src) and req.dry_run:
        notes.append("--layer-budget auto measures each converted layer when converting; the plan shows the even share")
    served = serving(src) or {}
    source = 2 * src.spec.num_kv_heads * src.spec.head_dim
    for engine, row in served.items():
        if not row["as_written"]:
            saving = "no saving there" if row["values"] >= source else "a smaller saving there"
            notes.append(
                f"{engine} serves {src.rank} + {src.shape.rope_dim} with a fallback ({row['why']}): it caches "
                f"{row['values']:,} values per token and layer against the source's {source:,}, {saving}"
            )
    if not src.target.keeps_windows and any(w is not None for w in src.spec.layer_windows):
        notes.append(
            "the source's sliding window is dropped: DeepseekV3 attends to the full context "
            "(identical up to the window length)"
        )
    if src.spec.qk_norm == "per_head" and not src.target.exact_qk_norm:
        notes.append(
            "per-head QK-norm approximated: each head's 1/rms(q) and 1/rms(k) per token replaced by constants "
            "fitted on the calibration text (least attention KL; qk_norm_fold_kl per layer), the norm gains "
            "folded into the projections (docs/convert-mla.md)"
        )
    if src.arch.family == "gemma":
        notes.append(
            "Gemma: norm weights stored as 1 + w, embeddings pre-multiplied by sqrt(hidden) and untied from lm_head"
        )
    return notes


def _ranges(layers: tuple[int, ...]) -> str:
    """0,1,2,4 -> '0-2, 4'."""
    spans: list[list[int]] = []
    for i in layers:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
