"""What a rewrite saves where it is served, as `attnkit verify` measures it: each engine's own KV cache held
against `attnkit kvmem`'s prediction, and with --source / --decode-depths, each engine's cache and decode speed
beside the source's.

llama.cpp: the KV cache it allocates at `-c CTX` for the output and for the source (each held against `attnkit
kvmem --paging llama.cpp`), and decode tokens/s at each depth (llama-bench: tokens generated after DEPTH tokens in
the cache). vLLM: the tokens its pool holds in the same memory for both (its own "KV cache size", held against
kvmem's per-request bytes), and decode tokens/s after a prompt of DEPTH tokens (the engine core's timestamps).
The two models side by side: one run each a round, the order reversed every other round, the median kept.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from attnkit.engines import llamacpp
from attnkit.errors import UsageError

#: Tokens generated per llama-bench run (what its tokens/s is the mean of), and the room a depth leaves for them.
DECODE_TOKENS = 32


def check_options(req) -> None:
    """The VerifyRequest's decode rounds (one to nine) and llama-bench -fa value; before any engine starts."""
    if req.decode_flash_attn not in llamacpp.FLASH_ATTN:
        raise UsageError(f"--flash-attn must be one of {', '.join(llamacpp.FLASH_ATTN)}, got {req.decode_flash_attn!r}")
    if not 1 <= req.decode_rounds <= 9:
        raise UsageError(f"--decode-rounds must be 1 to 9, got {req.decode_rounds}")


def check_depths(depths: list[int], max_positions: int | None, model: str) -> None:
    """Decode depths of at least 1 whose cache plus the generated tokens fit `model`'s positions."""
    for depth in depths:
        if depth < 1:
            raise UsageError(f"--decode-depths must be at least 1, got {depth}")
        if max_positions is not None and depth + DECODE_TOKENS > max_positions:
            raise UsageError(
                f"--decode-depths {depth:,} (+{DECODE_TOKENS} generated) is past {model}'s {max_positions:,} "
                "positions (max_position_embeddings)"
            )


def llamacpp_cache(tools, gguf: Path, config: dict, n_ctx: int, timeout: float) -> dict:
    """What llama.cpp allocates for `gguf` at -c n_ctx (f16 cache, its default) beside `kvmem --paging llama.cpp`'s
    prediction for `config`: equal to the 0.01 MiB llama.cpp prints each cache to."""
    from attnkit.archs.spec import attention_spec
    from attnkit.kvcache import LlamaCppPaging, cache_dtype, kv_bytes

    allocated = llamacpp.kv_allocation(tools, gguf, n_ctx, timeout=timeout)
    predicted = kv_bytes(attention_spec(config), cache_dtype("f16"), n_ctx, 1, paging=LlamaCppPaging()) / (1 << 20)
    return {
        "n_ctx": n_ctx,
        "mib": allocated["mib"],
        "kvmem_mib": predicted,
        "equal": abs(predicted - allocated["mib"]) <= 0.005 * len(allocated["caches"]) + 1e-9,
        "caches": allocated["caches"],
    }


def beside_source(tools, gguf: Path, cache: dict, source, req, workdir: Path) -> dict:
    """The output (`gguf`, its `cache`) beside the source (an opened Source, or None): the source's cache and its
    ratio, and decode tokens/s of both at each of the VerifyRequest's depths (the output's alone without a
    source)."""
    models = {"output": gguf}
    report: dict = {"source_cache": None, "cache_ratio": None, "kvmem_ratio": None}
    if source is not None:
        models["source"] = workdir / "source-f32.gguf"
        llamacpp.convert(tools, Path(source.root), models["source"], req.timeout)
        report["source_cache"] = llamacpp_cache(tools, models["source"], dict(source.config), req.ctx, req.timeout)
        report["cache_ratio"] = cache["mib"] / report["source_cache"]["mib"]
        report["kvmem_ratio"] = cache["kvmem_mib"] / report["source_cache"]["kvmem_mib"]
    report["decode"] = (
        decode(tools, models, req.decode_depths, req.decode_rounds, req.threads, req.decode_flash_attn)
        if req.decode_depths
        else None
    )
    return report


def decode(
    tools, models: dict[str, Path], depths: list[int], rounds: int, threads: int = 2, flash_attn: str = "auto"
) -> dict:
    """Decode tokens/s of each GGUF in `models` (name -> path; "output" and "source" for verify) at each depth in
    llama-bench, side by side (`side_by_side`)."""

    def measure(name: str) -> dict[int, float]:
        return llamacpp.decode_speed(tools, models[name], depths, DECODE_TOKENS, 1, threads, flash_attn)

    return {**side_by_side(measure, list(models), depths, rounds), "flash_attn": flash_attn}


def side_by_side(measure, names: list[str], depths: list[int], rounds: int) -> dict:
    """`measure(name)` ({depth: tokens/s}) of each model a round, the order reversed every other round; the
    medians: {"depths", "rounds", "tokens_per_second": {name: {depth: median}}, "ratio": {depth: output / source}
    or None}."""
    seen: dict[str, dict[int, list[float]]] = {name: {d: [] for d in depths} for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            speeds = measure(name)
            for depth in depths:
                seen[name][depth].append(speeds[depth])
    medians = {name: {d: statistics.median(v) for d, v in by.items()} for name, by in seen.items()}
    both = "output" in medians and "source" in medians
    ratio = {d: medians["output"][d] / medians["source"][d] for d in depths} if both else None
    return {"depths": depths, "rounds": rounds, "tokens_per_second": medians, "ratio": ratio}


def vllm_served(config: dict, max_model_len: int, paging=None) -> tuple[int, int]:
    """kvmem's prediction of vLLM's fp32 cache for `config`: (bytes per token, bytes one request of max_model_len
    reserves under `paging`, a VllmPaging). An MLA output vLLM runs as plain attention is predicted by its
    expanded keys and values (attnkit.engines.targets.mla_serving), as kvmem's `serving` note says."""
    from attnkit.archs.spec import attention_spec
    from attnkit.engines.targets import mla_serving
    from attnkit.kvcache import VllmPaging, bytes_per_token, cache_dtype, vllm_request_bytes

    spec = attention_spec(config)
    fp32 = cache_dtype("fp32")
    per_token = bytes_per_token(spec, fp32)
    request = vllm_request_bytes(spec, fp32, max_model_len, paging or VllmPaging())
    if spec.mla is not None:
        served = mla_serving(
            spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, spec.num_heads, spec.mla.qk_nope_head_dim
        )
        scale = served["vllm"]["values"] / spec.kv_elements_per_token() if not served["vllm"]["as_written"] else 1
        per_token, request = per_token * scale, request * scale
    return int(per_token), int(request)


def vllm_pool_gib(configs: list[dict], max_model_len: int) -> int:
    """One KV pool for the output and its source (VLLM_CPU_KVCACHE_SPACE, whole GiB, so that their capacities
    compare): room for two requests of max_model_len of the larger predicted cache, at least 1 GiB."""
    largest = max(vllm_served(config, max_model_len)[1] for config in configs)
    return max(1, -(-2 * largest // (1 << 30)))


def vllm_cache(pool: dict, engine_bytes: int, config: dict) -> dict:
    """vLLM's pool beside `attnkit kvmem`'s prediction for the checkpoint's `config` (fp32 cache, the pool's
    block size and tokens in flight): bytes per token, what one request of max_model_len reserves, and the tokens
    the pool holds (its "KV cache size": requests of max_model_len that fit, times max_model_len), all equal when
    kvmem counts what vLLM allocates (the capacity to one block)."""
    from attnkit.kvcache import VllmPaging

    paging = VllmPaging(block_size=pool["block_size"], in_flight_tokens=pool["max_in_flight_tokens"])
    per_token, request = vllm_served(config, pool["max_model_len"], paging)
    capacity = int(pool["pool_bytes"] * pool["max_model_len"] / request) if request else 0
    return {
        **pool,
        "engine_bytes_per_token": engine_bytes,
        "kvmem_bytes_per_token": per_token,
        "kvmem_request_bytes": request,
        "kvmem_capacity_tokens": capacity,
        "equal": engine_bytes == per_token
        and pool["request_bytes"] == request
        and abs(pool["capacity_tokens"] - capacity) <= pool["block_size"],
    }


def capacity_ratio(output: dict, source: dict) -> dict:
    """The output's cache over the source's in vLLM's own accounting (the source's capacity over the output's,
    the same pool) beside kvmem's (the output's request bytes over the source's), and whether they agree to one
    block of each capacity."""
    engine = source["capacity_tokens"] / output["capacity_tokens"]
    kvmem = output["kvmem_request_bytes"] / source["kvmem_request_bytes"]
    rounding = engine * sum(pool["block_size"] / pool["capacity_tokens"] for pool in (output, source))
    return {"cache_ratio": engine, "kvmem_ratio": kvmem, "ratio_equal": abs(engine - kvmem) <= rounding}
