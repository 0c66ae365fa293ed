"""runtime.streaming: decoder layers read from the checkpoint only while they run, outputs equal a full load."""

from __future__ import annotations

import re

import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.runtime import load_model
from attnkit.runtime.streaming import StreamingUnsupported, load_for_calibration, load_streaming
from tests.tiny import build_model, make_checkpoint, save_model

CAUSAL = ["llama_gqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "gpt2"]


def _logits(loaded, ids):
    with torch.no_grad():
        return loaded.model(input_ids=ids, use_cache=False).logits


def _final_hidden(loaded, ids):
    """The final hidden states (what a streamed model is compared on: its head is an identity, calibration
    reads hidden states only)."""
    with torch.no_grad():
        return loaded.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("family", CAUSAL)
def test_streamed_model_equals_full_load(tmp_path, family):
    """Bit for bit; the output head, tied or not, is not loaded (calibration reads hidden states only)."""
    folder = make_checkpoint(tmp_path / family, family, max_shard_size="100KB")  # sharded: layers span files
    ids = torch.randint(0, 100, (2, 24))
    streamed = load_streaming(str(folder), "cpu")
    layer_params = [p for n, p in streamed.model.named_parameters() if ".layers." in n or ".h." in n]
    assert layer_params and all(p.is_meta for p in layer_params)  # nothing of the layers is resident
    got, again = _final_hidden(streamed, ids), _final_hidden(streamed, ids)
    assert all(p.is_meta for n, p in streamed.model.named_parameters() if ".layers." in n or ".h." in n)
    full = load_model(str(folder), device="cpu", dtype="float32")
    assert isinstance(streamed.model.get_output_embeddings(), torch.nn.Identity)
    want = _final_hidden(full, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


@pytest.mark.parametrize("family,tied", [("llama_gqa", False), ("llama_gqa", True), ("qwen2", False)])
def test_a_bf16_checkpoint_streams_as_stored_and_gives_the_float32_hidden_states(tmp_path, monkeypatch, family, tied):
    """Widening bf16 to float32 is exact, so the embedding table and the layers' linear weights (and biases)
    stay in their stored dtype, widened as used (the layers' a slice of rows at a time); the hidden states equal
    a float32 full load's to float32 rounding (a product split by output rows may sum in another order; measured
    here: at most 5.4e-7 on values of order 1); a tied head (a bf16 table) is not run."""
    import attnkit.runtime.sliced_linear as sliced_linear

    model = build_model(family, tie_word_embeddings=tied).to(torch.bfloat16)
    folder = save_model(model, tmp_path / "bf16")
    streamed = load_streaming(str(folder), "cpu")
    assert streamed.model.get_input_embeddings().weight.dtype == torch.bfloat16
    seen = []
    for name, module in streamed.model.named_modules():
        if name.endswith(("q_proj", "down_proj")):
            module.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, m.bias)))
    monkeypatch.setattr(sliced_linear, "SLICE_ELEMENTS", 5 * 64)  # slices of 5 rows (hidden 64), a short last one
    ids = torch.randint(0, 100, (2, 24))
    full = load_model(str(folder), device="cpu", dtype="float32")
    assert (full.model.get_output_embeddings().weight is full.model.get_input_embeddings().weight) == tied
    torch.testing.assert_close(_final_hidden(streamed, ids), _final_hidden(full, ids), rtol=1e-5, atol=1e-5)
    assert seen and {dtype for dtype, _ in seen} == {torch.bfloat16}
    assert (family == "qwen2") == any(bias is not None for _, bias in seen)  # qwen2's q_proj has a bias


def test_renamed_tensor_is_refused(tmp_path):
    """Refused as every command refuses it (attnkit.io.source: the completeness check), not as a layout that
    cannot stream, which would send calibration to a whole load."""
    folder = make_checkpoint(tmp_path / "m", "llama_gqa")
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.renamed"] = tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    words = "incomplete checkpoint: 1 tensor(s) that its config implies are missing, e.g. "
    with pytest.raises(AttnkitError, match=re.escape(words + "'model.layers.1.self_attn.k_proj.weight'")) as refused:
        load_streaming(str(folder), "cpu")
    assert not isinstance(refused.value, StreamingUnsupported)


def test_a_head_renamed_on_load_does_not_stop_streaming(tmp_path):
    """GPT-NeoX's head is renamed by transformers on load; calibration does not load the head, so it streams."""
    folder = make_checkpoint(tmp_path / "neox", "gpt_neox")
    streamed = load_streaming(str(folder), "cpu")
    ids = torch.randint(0, 100, (1, 16))
    full = load_model(str(folder), device="cpu", dtype="float32")
    torch.testing.assert_close(_final_hidden(streamed, ids), _final_hidden(full, ids), rtol=0, atol=0)


def test_calibration_falls_back_to_a_full_load_when_streaming_is_unsupported(tmp_path, monkeypatch):
    import attnkit.runtime.streaming as streaming

    def unsupported(*args, **kwargs):
        raise StreamingUnsupported("fused experts")

    monkeypatch.setattr(streaming, "build_streamed", unsupported)
    folder = make_checkpoint(tmp_path / "m", "llama_gqa")
    loaded = load_for_calibration(str(folder), "cpu")
    assert not any(p.is_meta for p in loaded.model.parameters())
    ids = torch.randint(0, 100, (1, 16))
    want = _logits(load_model(str(folder), device="cpu", dtype="float32"), ids)
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=0, atol=0)
