"""MLA layouts (values narrower than queries and keys) run sdpa with zero-padded values on CPU: the same logits and
gradients as transformers' sdpa, a config that saves as before, and probes that still see every attention call."""

from __future__ import annotations

import json

import torch

from attnkit.runtime.hook import attention_hook
from attnkit.runtime.padded_attention import NAME, narrow_values, use_padded_sdpa
from tests.tiny import build_model, extra_model


def _logits_and_grad(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits  # [1, T, V]
    logits.float().pow(2).mean().backward()
    grad = model.model.layers[0].self_attn.kv_b_proj.weight.grad.clone()
    return logits.detach(), grad


def test_padded_values_give_sdpa_logits_and_gradients(tmp_path):
    model = extra_model("deepseek_v3").float()
    model.set_attn_implementation("sdpa")
    assert narrow_values(model.config)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    want, want_grad = _logits_and_grad(model, ids)
    use_padded_sdpa(model)
    assert model.config._attn_implementation == NAME
    got, got_grad = _logits_and_grad(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())


def test_probes_see_the_padded_model_and_give_it_back():
    model = extra_model("deepseek_v3").float()
    model.set_attn_implementation("sdpa")
    use_padded_sdpa(model)
    calls = []
    with attention_hook(model, lambda module, query, key, mask, kwargs: calls.append(query.shape)):
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert len(calls) == model.config.num_hidden_layers
    assert model.config._attn_implementation == NAME


def test_other_layouts_keep_sdpa():
    model = build_model("llama")
    model.set_attn_implementation("sdpa")
    use_padded_sdpa(model)
    assert not narrow_values(model.config)
    assert model.config._attn_implementation == "sdpa"
