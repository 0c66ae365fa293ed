"""Soft-cap math, the histogram-based cap choice, and attnkit's soft-capped attention path."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.ops.logit_cap import AbsHistogram, affect_ratio, affect_threshold, cap_for_fraction, softcap
from attnkit.runtime.capped_attention import apply_softcaps, native_support, use_attnkit_attention
from tests.tiny import build_model


@pytest.mark.parametrize("z, want", [(100, 29.92), (50, 27.93), (10, 9.645), (0, 0.0), (-10, -9.645), (-100, -29.92)])
def test_background_worked_numbers(z, want):
    got = float(softcap(torch.tensor(float(z), dtype=torch.float64), 30.0))
    assert got == pytest.approx(want, abs=5e-3)


def test_affect_ratio_is_the_exact_boundary():
    u = affect_ratio(0.01)
    assert 1 - math.tanh(u) / u == pytest.approx(0.01, abs=1e-12)
    cap = 20.0
    t = affect_threshold(cap)
    for z, affected in [(t * 0.999, False), (t * 1.001, True)]:
        change = abs(z - cap * math.tanh(z / cap))
        assert (change > 0.01 * z) == affected


def test_cap_for_fraction_matches_a_brute_force_count():
    torch.manual_seed(0)
    z = torch.randn(200_000, dtype=torch.float64) * 5
    hist = AbsHistogram()
    hist.add(z[:100_000])
    hist.add(z[100_000:])
    for target in (1e-2, 1e-3, 1e-4):
        cap, frac = cap_for_fraction(hist, target)
        brute = float(((z - softcap(z, cap)).abs() > 0.01 * z.abs()).double().mean())
        assert frac <= target
        assert brute == pytest.approx(frac, abs=2 / z.numel())
        # one bin lower would affect more than the target: the cap is the smallest allowed
        assert (
            float(
                (z.abs() >= hist.edge(round(math.log10(cap * affect_ratio() / hist.lo) * hist.per_decade) - 1))
                .double()
                .mean()
            )
            > target
        )


def test_bad_fraction_and_empty_histogram():
    with pytest.raises(ValueError):
        cap_for_fraction(AbsHistogram(), 0.0)
    with pytest.raises(ValueError):
        cap_for_fraction(AbsHistogram(), 1e-3)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_native_table_matches_installed_transformers():
    """Families claimed non-native really ignore the config keys; gemma2 really honours them."""
    ids = torch.randint(3, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for family, model_type in [("llama", "llama"), ("qwen2", "qwen2"), ("gemma2", "gemma2"), ("gemma3", "gemma3_text")]:
        plain = build_model(family, attn_logit_softcapping=None, final_logit_softcapping=None)
        capped = build_model(family, attn_logit_softcapping=0.5, final_logit_softcapping=None)
        final = build_model(family, attn_logit_softcapping=None, final_logit_softcapping=0.5)
        native_attn, native_final = native_support(model_type)
        assert (not torch.equal(_logits(plain, ids), _logits(capped, ids))) == native_attn, family
        assert (not torch.equal(_logits(plain, ids), _logits(final, ids))) == native_final, family


def test_attnkit_attention_equals_stock_eager_gemma2():
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    model = build_model("gemma2", attn_logit_softcapping=2.0, attn_implementation="eager")
    stock = _logits(model, ids)
    use_attnkit_attention(model)
    mine = _logits(model, ids)
    assert (mine - stock).abs().max() < 1e-5


def test_huge_cap_is_the_identity():
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    reference = _logits(build_model("llama_gqa"), ids)
    capped = build_model("llama_gqa", attn_logit_softcapping=1e9, final_logit_softcapping=1e9)
    state = apply_softcaps(capped)
    assert (state.attn_path, state.final_path) == ("attnkit", "attnkit")
    assert (_logits(capped, ids) - reference).abs().max() < 1e-6


def test_attnkit_caps_llama_like_a_manual_reference():
    """Llama with caps through attnkit == the same weights with every attention score capped by hand."""
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    model = build_model("llama_gqa", attn_logit_softcapping=1.5, final_logit_softcapping=3.0)
    apply_softcaps(model)
    got = _logits(model, ids)
    ref_model = build_model("llama_gqa", attn_implementation="eager")
    import transformers.models.llama.modeling_llama as ml

    original = ml.eager_attention_forward

    def capped_eager(module, q, k, v, mask, scaling, dropout=0.0, **kw):
        q = q * scaling
        s = torch.matmul(q, ml.repeat_kv(k, module.num_key_value_groups).transpose(2, 3))  # [B, H, T, T]
        s = 1.5 * torch.tanh(s / 1.5) + mask
        p = torch.softmax(s, -1)
        return torch.matmul(p, ml.repeat_kv(v, module.num_key_value_groups)).transpose(1, 2).contiguous(), p

    ml.eager_attention_forward = capped_eager
    try:
        want = 3.0 * torch.tanh(_logits(ref_model, ids) / 3.0)
    finally:
        ml.eager_attention_forward = original
    assert (got - want).abs().max() < 1e-5
