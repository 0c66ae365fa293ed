"""Embedded presets: every file loads, and KV-cache sizes match hand-computed golden values."""

from __future__ import annotations

import json
import os

import pytest

from attnkit import kvcache, presets
from attnkit.archs.spec import attention_spec
from attnkit.commands.analyse.modelinfo import WEIGHT_DTYPE_BYTES
from attnkit.presets import all_presets, find_preset

BF16 = kvcache.cache_dtype("bf16")
REQUIRED = {
    "llama-2-7b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "mistral-7b-v0.1",
    "mistral-7b-v0.3",
    "mixtral-8x7b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "gemma-2-9b",
    "gemma-2-27b",
    "gemma-3-27b",
    "phi-3-mini-4k",
    "deepseek-v2-lite",
    "deepseek-v3",
    "gpt-oss-20b",
    "gpt-oss-120b",
    "olmo-2-7b",
    "smollm2-135m",
}


def spec_of(name: str):
    return attention_spec(all_presets()[name].config)


def test_required_presets_exist_with_attribution():
    presets = all_presets()
    assert REQUIRED <= set(presets)
    for name, p in presets.items():
        assert name == p.name == p.name.lower()
        assert p.url == f"https://huggingface.co/{p.source}/blob/main/config.json"
        assert p.parameters > 0 and p.weight_dtype in WEIGHT_DTYPE_BYTES
        assert p.notes, name


def test_a_preset_name_reads_its_file_alone():
    """Each preset is `<name>.json`, so find_preset reads one file for a name (a cold `attnkit kvmem`)."""
    presets._read.cache_clear()
    all_presets.cache_clear()
    assert find_preset(" Llama-3.1-8B ").name == "llama-3.1-8b"
    assert presets._read.cache_info().currsize == 1 and all_presets.cache_info().currsize == 0
    assert {f for f in os.listdir(presets.DATA) if f.endswith(".json")} == {f"{name}.json" for name in all_presets()}


def test_names_aliases_and_sources_are_unique_and_resolve():
    seen: dict[str, str] = {}
    for p in all_presets().values():
        for key in {p.name.lower(), p.source.lower(), *(a.lower() for a in p.aliases)}:
            assert key not in seen, f"{key} claimed by {seen.get(key)} and {p.name}"
            seen[key] = p.name
            assert find_preset(key.upper()).name == p.name
    assert find_preset("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3-8b"
    assert find_preset("no-such-model") is None


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_preset_spec_survives_a_transformers_round_trip(name):
    """The hub-style config and the same config as transformers 5 writes it give one spec."""
    import transformers

    config = all_presets()[name].config
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    saved = json.loads(transformers.AutoConfig.for_model(config["model_type"], **kwargs).to_json_string())
    assert attention_spec(saved) == attention_spec(config)


# ---------------------------------------------------------------- golden KV sizes (bf16, 2 bytes)


def test_llama_3_8b_gqa():
    spec = spec_of("llama-3-8b")
    # 32 layers x 2 (K, V) x 8 KV heads x 128 dims x 2 bytes
    assert kvcache.bytes_per_token(spec, BF16) == 32 * 2 * 8 * 128 * 2 == 131_072


def test_llama_2_7b_mha():
    spec = spec_of("llama-2-7b")
    assert spec.variant == "MHA"
    assert kvcache.bytes_per_token(spec, BF16) == 32 * 2 * 32 * 128 * 2 == 524_288


def test_deepseek_v3_mla_has_no_factor_two():
    spec = spec_of("deepseek-v3")
    # 61 layers x (kv_lora_rank 512 + rope key 64) x 2 bytes
    assert kvcache.bytes_per_token(spec, BF16) == 61 * (512 + 64) * 2 == 70_272
    assert (spec.num_heads, spec.head_dim, spec.v_head_dim) == (128, 128 + 64, 128)


def test_deepseek_v2_lite_mla():
    spec = spec_of("deepseek-v2-lite")
    assert spec.mla.q_lora_rank is None
    assert kvcache.bytes_per_token(spec, BF16) == 27 * (512 + 64) * 2 == 31_104


def test_mistral_7b_v01_window_caps_the_cache():
    spec = spec_of("mistral-7b-v0.1")
    per_token = 32 * 2 * 8 * 128 * 2  # 131,072
    assert spec.layer_windows == (4096,) * 32
    assert kvcache.kv_bytes(spec, BF16, context=32 * 1024, batch=1) == 4096 * per_token == 536_870_912
    assert kvcache.kv_bytes(spec, BF16, context=2048, batch=3) == 3 * 2048 * per_token
    v03 = spec_of("mistral-7b-v0.3")
    assert kvcache.kv_bytes(v03, BF16, context=32 * 1024, batch=1) == 32 * 1024 * per_token


def test_gemma_2_9b_half_the_layers_slide():
    spec = spec_of("gemma-2-9b")
    assert spec.layer_windows[:4] == (4096, None, 4096, None)
    per_layer = 2 * 8 * 256 * 2  # 8,192 bytes per token per layer
    assert kvcache.bytes_per_token(spec, BF16) == 42 * per_layer == 344_064
    # 21 global layers keep 32k tokens, 21 sliding layers keep 4096
    assert kvcache.kv_bytes(spec, BF16, context=32768, batch=1) == (21 * 32768 + 21 * 4096) * per_layer == 6_341_787_648
    assert (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)


def test_gemma_3_27b_five_local_per_global():
    spec = spec_of("gemma-3-27b")
    per_layer = 2 * 16 * 128 * 2  # 8,192
    globals_ = [i for i, w in enumerate(spec.layer_windows) if w is None]
    assert globals_ == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert (
        kvcache.kv_bytes(spec, BF16, context=131072, batch=1) == (10 * 131072 + 52 * 1024) * per_layer == 11_173_625_856
    )


def test_gpt_oss_120b_mixed_layers():
    spec = spec_of("gpt-oss-120b")
    per_layer = 2 * 8 * 64 * 2  # 2,048
    assert kvcache.bytes_per_token(spec, BF16) == 36 * per_layer == 73_728
    # 18 full layers keep 128k tokens, 18 sliding layers keep 128
    assert (
        kvcache.kv_bytes(spec, BF16, context=131072, batch=1) == (18 * 131072 + 18 * 128) * per_layer == 4_836_556_800
    )


def test_tensor_parallel_replicates_kv_heads_beyond_hkv():
    spec = spec_of("llama-3-8b")  # 8 KV heads
    assert kvcache.kv_heads_per_gpu(spec, 4) == 2
    assert kvcache.bytes_per_token(spec, BF16, tp=4) == 32 * 2 * 2 * 128 * 2 == 32_768
    assert kvcache.kv_heads_per_gpu(spec, 16) == 1  # 16 GPUs, 8 heads: each GPU holds (a copy of) one
    assert kvcache.bytes_per_token(spec, BF16, tp=16) == 32 * 2 * 1 * 128 * 2 == 16_384
    assert kvcache.bytes_per_token(spec, BF16, tp=8) == 16_384


def test_mla_latent_is_replicated_on_every_gpu():
    spec = spec_of("deepseek-v3")
    assert kvcache.bytes_per_token(spec, BF16, tp=8) == kvcache.bytes_per_token(spec, BF16) == 70_272


def test_kvmem_cli_json_on_a_preset(runner):
    from attnkit.cli import app

    result = runner.invoke(
        app, ["kvmem", "deepseek-v3", "--context", "4k,32k", "--gpu-mem", "141GiB", "--tp", "8", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "preset" and "deepseek-ai/DeepSeek-V3" in doc["source"]
    assert doc["parameters"] == all_presets()["deepseek-v3"].parameters
    rows = {r["context"]: r for r in doc["rows"]}
    assert rows[4096]["bytes_per_token"] == 70_272
    assert rows[32768]["kv_bytes"] == 32768 * 70_272 == 2_302_672_896
    assert rows[32768]["kv_per_gpu"] == 32768 * 70_272  # the latent is not split by tensor parallelism
    assert rows[32768]["weights_per_gpu"] == doc["parameters"] * 1 / 8  # fp8 weights split over 8 GPUs


def test_kvmem_cli_json_sliding_preset(runner):
    from attnkit.cli import app

    args = ["kvmem", "mistralai/Mistral-7B-v0.1", "--context", "4k,32k", "--format", "json"]
    result = runner.invoke(app, [*args, "--paging", "exact"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["kv_bytes"] for r in rows] == [4096 * 131_072, 4096 * 131_072]
    # vLLM: a sliding layer holds min(window - 1 + 16k in flight, context) tokens in blocks of 16, plus one block
    rows = json.loads(runner.invoke(app, args).stdout)["rows"]
    assert [r["kv_bytes"] for r in rows] == [(256 + 1) * 16 * 131_072, (1280 + 1) * 16 * 131_072]
