"""runtime.streaming: decoder layers read from the checkpoint only while they run, outputs equal a full load."""

from __future__ import annotations

import pytest
import torch

from attnkit.runtime import load_model
from attnkit.runtime.streaming import StreamingUnsupported, load_for_calibration, load_streaming
from tests.tiny import make_checkpoint

CAUSAL = ["llama_gqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "gpt2"]


def _logits(loaded, ids):
    with torch.no_grad():
        return loaded.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", CAUSAL)
def test_streamed_model_equals_full_load(tmp_path, family):
    folder = make_checkpoint(tmp_path / family, family, max_shard_size="100KB")  # sharded: layers span files
    ids = torch.randint(0, 100, (2, 24))
    streamed = load_streaming(str(folder), "cpu")
    layer_params = [p for n, p in streamed.model.named_parameters() if ".layers." in n or ".h." in n]
    assert layer_params and all(p.is_meta for p in layer_params)  # nothing of the layers is resident
    got, again = _logits(streamed, ids), _logits(streamed, ids)
    assert all(p.is_meta for n, p in streamed.model.named_parameters() if ".layers." in n or ".h." in n)
    want = _logits(load_model(str(folder), device="cpu", dtype="float32"), ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_renamed_tensor_is_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "m", "llama_gqa")
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.renamed"] = tensors.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StreamingUnsupported, match="model.layers.1.self_attn.k_proj.weight"):
        load_streaming(str(folder), "cpu")


def test_calibration_falls_back_to_a_full_load_when_names_differ(tmp_path):
    folder = make_checkpoint(tmp_path / "neox", "gpt_neox")  # transformers renames its head on load
    with pytest.raises(StreamingUnsupported, match="do not match"):
        load_streaming(str(folder), "cpu")
    loaded = load_for_calibration(str(folder), "cpu")
    assert not any(p.is_meta for p in loaded.model.parameters())
    ids = torch.randint(0, 100, (1, 16))
    want = _logits(load_model(str(folder), device="cpu", dtype="float32"), ids)
    torch.testing.assert_close(_logits(loaded, ids), want, rtol=0, atol=0)
