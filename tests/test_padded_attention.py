"""attnkit_sdpa: MLA's narrower values padded so that the CPU's SDPA takes its fused kernel, with the same output."""

from __future__ import annotations

import torch

from attnkit.runtime import load_model
from attnkit.runtime.hook import attention_hook
from tests.helpers import char_tokenizer
from tests.tiny import build_model, extra_model, save_model


def _mla(tmp_path):
    model = extra_model("deepseek_v3")  # qk 12 wide (8 + 4 RoPE), values 8
    assert model.config.v_head_dim < model.config.qk_head_dim
    return load_model(str(char_tokenizer(save_model(model, tmp_path / "mla"))), device="cpu", dtype="float32").model


def _run(model, ids) -> tuple[torch.Tensor, dict, list]:
    """Logits [1, T, V], the trained weights' gradients and the shapes of the saved [.., T, T] tensors."""
    model.zero_grad(set_to_none=True)
    squares = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == t.shape[-2] == ids.shape[1]:
            squares.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, squares


def test_the_loader_pads_mla_values_on_the_cpu_with_the_same_outputs_and_gradients_and_no_probabilities_kept(
    tmp_path,
):
    model = _mla(tmp_path)
    assert model.config._attn_implementation == "attnkit_sdpa"
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (1, 48))
    padded, padded_grads, padded_squares = _run(model, ids)
    model.set_attn_implementation("sdpa")
    plain, plain_grads, plain_squares = _run(model, ids)
    assert padded_squares == [] and plain_squares  # the fused kernel keeps no probabilities; the math path does
    assert torch.allclose(padded, plain, rtol=1e-5, atol=1e-5 * plain.abs().max().item())
    assert padded_grads.keys() == plain_grads.keys() and padded_grads
    for name, grad in plain_grads.items():
        assert torch.allclose(padded_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item()), name


def test_equal_widths_keep_sdpa_and_a_padded_model_can_be_probed(tmp_path):
    llama = save_model(build_model("llama_gqa"), tmp_path / "llama")
    assert load_model(str(char_tokenizer(llama)), device="cpu").model.config._attn_implementation == "sdpa"
    model = _mla(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    calls = []
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with attention_hook(model, lambda module, q, k, mask, kw: calls.append(tuple(q.shape))):
            probed = model(input_ids=ids).logits
    assert model.config._attn_implementation == "attnkit_sdpa"  # restored after the probe
    assert len(calls) == model.config.num_hidden_layers and torch.equal(probed, plain)
    model.save_pretrained(tmp_path / "saved")  # what heal writes: the runtime's choice stays out of the checkpoint
    assert "attnkit_sdpa" not in (tmp_path / "saved" / "config.json").read_text()
