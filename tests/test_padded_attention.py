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


def test_a_streamed_mla_model_runs_padded_and_matches_a_full_load(tmp_path):
    """Layer streaming (eval/probe --layer-stream, calibration) builds its own model: it gets the kernel too."""
    import transformers as tf

    from attnkit.runtime import load_model
    from attnkit.runtime.streaming import load_streaming
    from tests.tiny import MLA, SMALL, save_model

    config = tf.DeepseekV3Config(**SMALL, **MLA, q_lora_rank=24, n_group=1, topk_group=1, first_k_dense_replace=2)
    torch.manual_seed(0)
    folder = save_model(tf.DeepseekV3ForCausalLM(config).eval(), tmp_path / "mla")  # dense layers only: streamable
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    streamed = load_streaming(str(folder), "cpu")
    full = load_model(str(folder), device="cpu", dtype="float32")
    assert streamed.model.config._attn_implementation == NAME == full.model.config._attn_implementation
    with torch.no_grad():
        got = streamed.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        want = full.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
