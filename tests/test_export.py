"""`attnkit export`: a GGUF file as a safetensors folder (the dequantization itself is transformers'; here a
tiny folder stands in for the cached result, the real one is in the real-model test)."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import app
from tests.helpers import char_tokenizer, write_gguf


@pytest.fixture
def gguf_and_cache(tiny, tmp_path, monkeypatch):
    """A GGUF file with a valid header, whose 'dequantized' cache folder is a tiny llama_gqa checkpoint."""
    from attnkit.io import gguf_load
    from attnkit.io.resolve import resolve

    gguf = write_gguf(tmp_path / "m.gguf", "llama", layers=2, hidden=64, heads=8, kv_heads=2)
    cached = char_tokenizer(tiny("llama_gqa"))

    def fake(ckpt):
        folder = resolve(str(cached))
        folder.ref, folder.dequantized_from = ckpt.ref, ckpt.gguf_file
        return folder

    monkeypatch.setattr(gguf_load, "dequantized", fake)
    return gguf, cached


def test_export_writes_a_folder_in_the_asked_dtype(runner, gguf_and_cache, tmp_path):
    import torch
    from safetensors.torch import load_file

    gguf, cached = gguf_and_cache
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(gguf), str(out), "--dtype", "bf16", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    source, written = load_file(str(cached / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(written) == set(source) and report["tensors"] == len(source)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, source[n].to(torch.bfloat16)) for n, t in written.items())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").read_bytes() == (cached / "tokenizer.json").read_bytes()
    manifest = json.loads((out / "attnkit.json").read_text())
    assert manifest["source"]["kind"] == "gguf" and manifest["source"]["ref"] == str(gguf)
    assert manifest["operation"] == "export" and manifest["parameters"]["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["--dtype", "auto"], 2, "--dtype auto has no meaning"),
        (["--dtype", "int4"], 2, "unknown --dtype 'int4'"),
        (["--max-shard-size", "1000"], 2, "has no unit"),
    ],
)
def test_export_bad_options(runner, gguf_and_cache, tmp_path, args, code, needle):
    gguf, _ = gguf_and_cache
    result = runner.invoke(app, ["export", str(gguf), str(tmp_path / "out"), *args])
    assert result.exit_code == code and needle in result.stderr
    assert not (tmp_path / "out").exists()


def test_export_refuses_what_is_not_gguf_and_a_full_target(runner, gguf_and_cache, tiny, tmp_path):
    gguf, cached = gguf_and_cache
    result = runner.invoke(app, ["export", str(cached), str(tmp_path / "out")])
    assert result.exit_code == 1 and "not a GGUF file" in result.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    result = runner.invoke(app, ["export", str(gguf), str(full)])
    assert result.exit_code != 0 and (full / "x").exists() and not (full / "config.json").exists()


@pytest.mark.real_model
def test_export_smollm2_loads_in_transformers(runner, tmp_path):
    from transformers import AutoModelForCausalLM

    from attnkit.realmodels import smollm2_gguf

    out = tmp_path / "smollm2"
    result = runner.invoke(app, ["export", str(smollm2_gguf()), str(out), "--format", "json"])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.num_key_value_heads == 3 and model.config.num_hidden_layers == 30
    assert json.loads((out / "attnkit.json").read_text())["source"]["kind"] == "gguf"


def test_export_leaves_the_request_as_given(gguf_and_cache, tmp_path):
    """The dtype is read as torch names it (bf16 -> bfloat16) into a derived request; the caller's is unchanged."""
    from attnkit.commands.export import ExportRequest, export

    gguf, _ = gguf_and_cache
    req = ExportRequest(model=str(gguf), out=tmp_path / "out", dtype="bf16")
    assert export(req)["dtype"] == "bfloat16" and req.dtype == "bf16"
