"""KV-cache arithmetic against hand-computed values."""

from __future__ import annotations

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
    assert kvcache.cached_tokens(windowed, 100) == 16 + 100 + 16 + 100
    assert kvcache.cached_tokens(windowed, 8) == 4 * 8


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
