"""One opener (attnkit.io.source.open_source) for every way a model is run: a model run layer by layer is refused
exactly as a loaded one is, each reference is resolved once, and the weights are read for the NaN/Inf scan at
most once."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.cli import app
from attnkit.io.checkpoint import INDEX_NAME
from tests.helpers import FAST_CALIB, HELDOUT, char_tokenizer, one_line_error, tiny_source

TEXT = [HELDOUT, "--max-tokens", "128", "--seq-len", "64"]
BAD = "model.layers.1.mlp.down_proj.weight"


def _runs(runner, model, *more):
    """{(command, --layer-stream): result} of eval and probe of `model` loaded whole and layer by layer."""
    return {
        (command, mode): runner.invoke(app, [command, str(model), *more, *TEXT, "--layer-stream", mode])
        for command in ("eval", "probe")
        for mode in ("never", "always")
    }


def _assert_refused_alike(runs, words):
    """Every run exits 1 with one line holding `words`, and the streamed run's line is the loaded run's."""
    for (command, mode), result in runs.items():
        one_line_error(result, 1, words)
        assert result.output == runs[command, "never"].output, (mode, result.output)


def _sharded(tiny):
    model = char_tokenizer(tiny("llama_gqa", max_shard_size="100KB"))
    shards = sorted(set(json.loads((model / INDEX_NAME).read_text())["weight_map"].values()))
    assert len(shards) > 2
    return model, shards


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_layer_by_layer_as_when_loaded(runner, tmp_path, bad):
    """It was run: `eval --layer-stream always` printed perplexity nan and exit 0."""
    src = tiny_source(tmp_path, "llama_gqa")
    state = load_file(src / "model.safetensors")
    state[BAD] = state[BAD].index_fill(0, torch.tensor([3]), bad)
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    _assert_refused_alike(_runs(runner, src), f"{src}: tensor {BAD!r} holds NaN or Inf")
    # behind a model that is fine: refused as it is opened, after the first model's run, in both ways
    good = tiny_source(tmp_path / "good", "llama_gqa")
    lines = {}
    for mode in ("never", "always"):
        result = runner.invoke(app, ["probe", str(good), str(src), *TEXT, "--layer-stream", mode])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        lines[mode] = result.output.strip().splitlines()[-1]
    assert lines["always"] == lines["never"] == f"error: {src}: tensor {BAD!r} holds NaN or Inf"


def test_a_missing_shard_is_refused_layer_by_layer_as_when_loaded(runner, tiny):
    model, shards = _sharded(tiny)
    (model / shards[1]).unlink()
    _assert_refused_alike(_runs(runner, model), f"shard {shards[1]} is missing")


def test_an_index_that_leaves_out_a_shard_is_refused_layer_by_layer_as_when_loaded(runner, tiny):
    model, shards = _sharded(tiny)
    index = json.loads((model / INDEX_NAME).read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shards[-1]}
    (model / INDEX_NAME).write_text(json.dumps(index))
    _assert_refused_alike(_runs(runner, model), "incomplete checkpoint")


def test_a_missing_tensor_in_the_reference_is_refused_before_the_model_runs(runner, tmp_path, monkeypatch):
    """eval's reference is opened with the model, before either is loaded or streamed."""
    from attnkit.commands.analyse import eval as eval_command

    src = tiny_source(tmp_path, "llama_gqa")
    ref = tiny_source(tmp_path / "ref", "llama_gqa")
    state = load_file(ref / "model.safetensors")
    del state[BAD]
    save_file(state, ref / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(eval_command, "evaluate", lambda *a, **k: pytest.fail("scored before the checks"))
    for mode in ("never", "always"):
        result = runner.invoke(app, ["eval", str(src), *TEXT, "--reference", str(ref), "--layer-stream", mode])
        one_line_error(result, 1, f"tensor(s) that its config implies are missing, e.g. {BAD!r}")


@pytest.mark.parametrize("mode", ["always", "never", "auto"])
def test_eval_resolves_each_reference_once(runner, tmp_path, monkeypatch, mode):
    """It was five times for a layer-streamed eval (the checks, the size, the dtype, the build, ...)."""
    import attnkit.io.resolve as resolve_module

    src = tiny_source(tmp_path, "llama_gqa")
    ref = tiny_source(tmp_path / "ref", "llama_gqa", seed=1)
    calls = []
    resolve = resolve_module.resolve

    def counting(reference, **kwargs):
        calls.append(reference)
        return resolve(reference, **kwargs)

    monkeypatch.setattr(resolve_module, "resolve", counting)
    for command, more in (("eval", ["--reference", str(ref)]), ("probe", [str(ref)])):
        calls.clear()
        result = runner.invoke(app, [command, str(src), *more, *TEXT, "--layer-stream", mode, "--format", "json"])
        assert result.exit_code == 0, result.output
        assert sorted(calls) == sorted([str(src), str(ref)]), (command, calls)


def _count_scans(monkeypatch) -> list:
    """The weight files of every NaN/Inf scan of a source (attnkit.io.finite.check_finite_files) from now on."""
    import attnkit.io.source as source

    scans = []
    scan = source.check_finite_files

    def counting(files, where):
        scans.append(where)
        return scan(files, where)

    monkeypatch.setattr(source, "check_finite_files", counting)
    return scans


def test_the_weights_are_scanned_once_where_they_are_read_and_not_where_they_are_loaded(runner, tmp_path, monkeypatch):
    """A layer-streamed run scans the files once before it is built; a whole load checks the loaded parameters
    (no extra read); calibration streams the source that convert scanned when it opened it, without a second
    scan."""
    src = tiny_source(tmp_path, "llama_gqa")
    scans = _count_scans(monkeypatch)
    for mode, want in (("always", [str(src)]), ("never", [])):
        for command in ("eval", "probe"):
            scans.clear()
            result = runner.invoke(app, [command, str(src), *TEXT, "--layer-stream", mode])
            assert result.exit_code == 0, result.output
            assert scans == want, (command, mode)
    scans.clear()
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--method", "merge", *FAST_CALIB])
    assert result.exit_code == 0, result.output
    assert scans == [str(src)]
