"""eval and probe layer by layer (attnkit.runtime.layerwise): the same numbers as the whole model, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnkit.cli import app
from attnkit.runtime.streaming import read_layer
from tests.helpers import FAST_CALIB, HELDOUT, tiny_source

TEXT = [HELDOUT, "--max-tokens", "192", "--seq-len", "64", "--batch-size", "2"]


def _json(runner, args: list[str]) -> dict:
    result = runner.invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("family", ["llama_gqa", "qwen2", "gemma3", "mistral"])
def test_layer_streamed_eval_and_probe_equal_the_whole_model(runner, tmp_path, family):
    """Sliding windows (Gemma 3, Mistral: 16 tokens in windows of 64), per-type RoPE, biases: every figure equal."""
    src = tiny_source(tmp_path, family)
    ref = tiny_source(tmp_path / "ref", family, seed=1)
    runs = {}
    for mode in ("never", "always"):
        ev = _json(runner, ["eval", str(src), *TEXT, "--reference", str(ref), "--layer-stream", mode])
        pr = _json(runner, ["probe", str(src), *TEXT, "--layer-stream", mode])
        runs[mode] = (ev, pr["models"][0])
    (ev_whole, pr_whole), (ev_layers, pr_layers) = runs["never"], runs["always"]
    assert ev_layers.pop("layer_streamed") is True and ev_whole.pop("layer_streamed") is False
    assert ev_layers == ev_whole
    assert pr_layers["heads"] == pr_whole["heads"] and pr_layers["final"] == pr_whole["final"]


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_checkpoint_streams_as_stored(runner, tmp_path, monkeypatch, tied):
    """The embedding table, the output head and the layers' linear weights of a bf16 checkpoint are kept as
    stored (widened as they are used: the table per lookup, the linear weights a slice of rows at a time), which
    is what bounds a layer-streamed 8B or 70B model's memory. The figures equal the whole float32 model's to
    float32 rounding: a matrix product split by output rows may sum its dot products in another order."""
    import torch

    import attnkit.runtime.sliced_linear as sliced_linear
    from attnkit.runtime.layerwise import load_layerwise
    from tests.helpers import assert_numbers_close, char_tokenizer
    from tests.tiny import build_model, save_model

    src = char_tokenizer(save_model(build_model("llama_gqa", tie_word_embeddings=tied).bfloat16(), tmp_path / "m"))
    streamed = load_layerwise(str(src), "cpu", torch.float32)
    model = streamed.model
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    prefix, layer = streamed.layers[0]
    read_layer(layer, streamed.files, prefix, "cpu", torch.float32)
    assert layer.self_attn.q_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert layer.input_layernorm.weight.dtype == torch.float32
    monkeypatch.setattr(sliced_linear, "SLICE_ELEMENTS", 7 * 64)  # slices of 7 rows (hidden 64), a short last one
    for command in ("eval", "probe"):
        whole, layers = (_json(runner, [command, str(src), *TEXT, "--layer-stream", m]) for m in ("never", "always"))
        if command == "eval":
            assert layers.pop("layer_streamed") and not whole.pop("layer_streamed")
            assert_numbers_close(layers, whole, rel=1e-5)
        else:
            assert_numbers_close(layers["models"][0]["heads"], whole["models"][0]["heads"], rel=1e-5)
            assert_numbers_close(layers["models"][0]["final"], whole["models"][0]["final"], rel=1e-5)


def test_auto_streams_when_the_weights_do_not_fit(runner, tmp_path, monkeypatch):
    import attnkit.runtime.loader as loader

    src = tiny_source(tmp_path, "llama")
    assert not _json(runner, ["eval", str(src), *TEXT])["layer_streamed"]
    monkeypatch.setattr(loader, "free_memory", lambda device: 1024)
    streamed = _json(runner, ["eval", str(src), *TEXT])
    assert streamed["layer_streamed"]
    monkeypatch.undo()
    assert streamed["perplexity"] == _json(runner, ["eval", str(src), *TEXT])["perplexity"]


def test_device_map_auto_places_the_whole_model(runner, tmp_path):
    src = tiny_source(tmp_path, "llama")
    placed = _json(runner, ["eval", str(src), *TEXT, "--device-map", "auto"])
    assert placed["perplexity"] == _json(runner, ["eval", str(src), *TEXT])["perplexity"]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--layer-stream", "sometimes"], "--layer-stream must be one of auto, always, never"),
        (["--device-map", "balanced"], "--device-map takes auto"),
        (["--device-map", "auto", "--layer-stream", "always"], "cannot be combined with --layer-stream always"),
    ],
)
def test_bad_run_options_are_usage_errors(runner, tmp_path, args, words):
    src = tiny_source(tmp_path, "llama")
    for command in ("eval", "probe"):
        result = runner.invoke(app, [command, str(src), *TEXT, *args])
        assert result.exit_code == 2 and words in result.output and len(result.output.strip().splitlines()) == 1


def test_a_gguf_cannot_be_streamed_and_says_so(runner, tmp_path):
    from tests.helpers import write_gguf

    gguf = write_gguf(tmp_path / "m.gguf", "llama")
    result = runner.invoke(app, ["probe", str(gguf), *TEXT, "--layer-stream", "always"])
    assert result.exit_code != 0 and "--layer-stream always" in result.output


@pytest.mark.real_model
def test_smollm2_layer_streamed_probe_equals_the_whole_model(runner):
    from attnkit.realmodels import smollm2_folder

    args = ["probe", str(smollm2_folder()), HELDOUT, "--max-tokens", "1024", "--seq-len", "256", "--batch-size", "2"]
    whole = _json(runner, [*args, "--layer-stream", "never"])["models"][0]
    layers = _json(runner, [*args, "--layer-stream", "always"])["models"][0]
    assert layers["heads"] == whole["heads"] and layers["final"] == whole["final"]


@pytest.mark.parametrize(
    "family, args",
    [
        ("llama_gqa", ["convert", "mqa", "--method", "mean"]),
        ("llama_gqa", ["convert", "mla", "--kv-budget", "0.5", *FAST_CALIB]),
        ("gemma3", ["convert", "mla", "--target", "gemma3-mla", "--kv-budget", "0.5", *FAST_CALIB]),
        (
            "gemma3",
            [
                "convert",
                "mla",
                "--target",
                "gemma3-mla",
                "--kv-budget",
                "0.5",
                "--sliding-layers",
                "convert",
                *FAST_CALIB,
            ],
        ),
        ("llama_gqa", ["retrofit", "qknorm", "--method", "pad", *FAST_CALIB]),
        ("qwen2", ["retrofit", "qknorm", "--method", "bias", *FAST_CALIB]),
        ("llama_gqa", ["retrofit", "softcap", "--attn-cap", "30"]),
    ],
)
def test_every_layout_attnkit_writes_evaluates_the_same_layer_by_layer(runner, tmp_path, family, args):
    """The layer-streamed and the loaded builders run attnkit's own layouts (Gemma 3 MLA, DeepseekV3 with padded
    values, Qwen3 with q/k/v biases, soft-capped attention) alike: every eval figure equal."""
    mixed = {"layer_types": ["sliding_attention", "full_attention"]} if family == "gemma3" else {}
    src = tiny_source(tmp_path, family, **mixed)  # Gemma 3: a sliding and a global layer (kept and converted)
    out = tmp_path / "out"
    command, rest = args[:2], args[2:]
    result = runner.invoke(app, [*command, str(src), str(out), *rest, "--no-check"])
    assert result.exit_code == 0, result.output
    whole = _json(runner, ["eval", str(out), *TEXT, "--reference", str(src), "--layer-stream", "never"])
    streamed = subprocess.run(  # a fresh interpreter: nothing the conversion imported registers the layout
        [sys.executable, "-m", "attnkit", "eval", str(out), *TEXT, "--reference", str(src), "--layer-stream", "always"]
        + ["--format", "json"],
        capture_output=True,
        text=True,
    )
    assert streamed.returncode == 0, streamed.stderr
    layers = json.loads(streamed.stdout)
    assert layers.pop("layer_streamed") is True and whole.pop("layer_streamed") is False
    assert layers == whole
