"""kvmem: KV-cache memory tables over context x batch x cache dtype x attention variant."""

from __future__ import annotations

from dataclasses import dataclass

from attnkit import kvcache
from attnkit.archs import get_arch
from attnkit.commands.analyse.modelinfo import ModelInfo


@dataclass(frozen=True)
class GpuBudget:
    mem_bytes: int
    tp: int = 1
    reserve_bytes: int = 0  # activations, CUDA context, fragmentation


def kvmem_rows(
    info: ModelInfo,
    variants: list[str],
    dtypes: list[str],
    contexts: list[int],
    batches: list[int],
    gpu: GpuBudget | None,
    weight_dtype: str | None,
    paging: kvcache.Paging | None = None,
) -> list[dict]:
    """One row per (variant, dtype, context, batch); a variant is the model `convert` would write.

    paging None: the tokens each layer keeps; else the bytes the engine reserves (vLLM: whole blocks, its window
    bound; llama.cpp: cells padded to 256, a sliding layer its window + a micro-batch).
    """
    rows = []
    weights = info.weights_bytes_as(weight_dtype)
    max_positions = _max_positions(info)
    for variant in variants:
        spec = kvcache.apply_variant(info.spec, variant)
        for dtype_name in dtypes:
            dtype = kvcache.cache_dtype(dtype_name)
            per_token = kvcache.bytes_per_token(spec, dtype)
            for context in contexts:
                for batch in batches:
                    kv = kvcache.kv_bytes(spec, dtype, context, batch, paging=paging)
                    native = kvcache.kv_bytes(info.spec, dtype, context, batch, paging=paging)
                    row = {
                        "variant": variant,
                        "attention": spec.variant,
                        "sliding": spec.sliding_summary(),
                        "dtype": dtype.name,
                        "context": context,
                        "batch": batch,
                        "bytes_per_token": per_token,
                        "kv_bytes": kv,
                        "vs_native": kv / native,
                        "exceeds_max_positions": bool(max_positions and context > max_positions),
                    }
                    if gpu is not None:
                        row.update(_fit(spec, dtype, context, batch, gpu, weights, max_positions, paging))
                    rows.append(row)
    return rows


def _fit(
    spec, dtype, context: int, batch: int, gpu: GpuBudget, weights: float, max_positions: int | None, paging
) -> dict:
    """What fits one GPU; the longest context is capped by the model's own position limit when it has one."""
    weights_per_gpu = weights / gpu.tp
    kv_per_gpu = kvcache.kv_bytes(spec, dtype, context, batch, gpu.tp, paging)
    budget = gpu.mem_bytes - gpu.reserve_bytes - weights_per_gpu
    limit = max_positions or kvcache.MAX_CONTEXT
    longest = kvcache.max_context(spec, dtype, batch, budget, gpu.tp, limit=limit, paging=paging)
    return {
        "weights_per_gpu": weights_per_gpu,
        "kv_per_gpu": kv_per_gpu,
        "total_per_gpu": weights_per_gpu + kv_per_gpu,
        "fits": weights_per_gpu + kv_per_gpu <= gpu.mem_bytes - gpu.reserve_bytes,
        "max_context": None if longest >= kvcache.MAX_CONTEXT else longest,  # None: windows cap the cache
        "max_context_capped": bool(max_positions) and longest >= max_positions,
        "max_batch": kvcache.max_batch(spec, dtype, context, budget, gpu.tp, paging),
    }


def larger_than_native(rows: list[dict]) -> list[str]:
    """The variants whose cache exceeds the model's own in some row (MLA drops sliding windows)."""
    return sorted({r["variant"] for r in rows if r["vs_native"] > 1 + 1e-12})


def variant_serving(spec, variants: list[str]) -> dict[str, dict]:
    """Per MLA what-if variant (and a native MLA model), how each serving engine would serve it
    (attnkit.engines.targets.mla_serving: as written, or a fallback and the values it caches then); none for a
    native layout no engine loads (attnkit.engines.targets.TRANSFORMERS_ONLY)."""
    served = {}
    for variant in variants:
        after = kvcache.apply_variant(spec, variant)
        if after.mla is not None:
            from attnkit.engines.targets import (
                TRANSFORMERS_ONLY,
                mla_serving,
            )  # MLA rows only: a cold kvmem stays small

            if variant == "native" and spec.model_type in TRANSFORMERS_ONLY:
                continue

            mla = after.mla
            nope = spec.head_dim if spec.mla is None else spec.mla.qk_nope_head_dim  # convert mla keeps D
            served[variant] = mla_serving(mla.kv_lora_rank, mla.qk_rope_head_dim, after.num_heads, nope)
    return served


def _max_positions(info: ModelInfo) -> int | None:
    value = get_arch(info.spec.model_type).config_value(info.config, "max_positions")
    return int(value) if value else None
