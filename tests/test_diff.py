"""`attnkit diff A B`: config keys, tensors, layout and per-head probe deltas between two checkpoints."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import app
from tests.helpers import char_tokenizer

PROSE = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 20


@pytest.fixture
def pair(runner, tiny, tmp_path):
    """A tiny GQA model (2 KV heads) and its MQA conversion (mean pooling: q and o unchanged)."""
    src = char_tokenizer(tiny("llama_gqa", vocab_size=128))
    out = tmp_path / "mqa"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out)])
    assert result.exit_code == 0, result.output
    return src, out


def _diff(runner, *args):
    result = runner.invoke(app, ["diff", *map(str, args), "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_diff_names_config_keys_tensors_and_kv_bytes(runner, pair):
    src, out = pair
    doc = _diff(runner, src, out)
    assert {"key": "num_key_value_heads", "a": 2, "b": 1, "change": "changed"} in doc["config"]
    changes = {r["name"]: r for r in doc["tensors"]}
    k0 = changes["model.layers.0.self_attn.k_proj.weight"]
    assert k0["change"] == "reshaped" and k0["shape_a"] == [16, 64] and k0["shape_b"] == [8, 64]
    assert not any("q_proj" in n or "o_proj" in n or "mlp" in n for n in changes)
    assert doc["tensors_unchanged"] == 3 + 2 * 7  # embeddings, final norm, lm_head; per layer q, o, MLP, norms
    a, b = doc["layout"]["a"], doc["layout"]["b"]
    assert (a["variant"], b["variant"]) == ("GQA-2", "MQA")
    assert a["kv_bytes_per_token_bf16"] == 2 * b["kv_bytes_per_token_bf16"]
    assert doc["probe"] is None


def test_diff_of_a_model_with_itself_is_empty(runner, pair):
    src, _ = pair
    doc = _diff(runner, src, src)
    assert doc["config"] == [] and doc["tensors"] == [] and doc["tensors_unchanged"] > 0


def test_diff_finds_changed_values_and_skips_them_on_request(runner, tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    a = tiny("llama_gqa")
    b = tmp_path / "b"
    b.mkdir()
    tensors = load_file(str(a / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(b / "model.safetensors"), metadata={"format": "pt"})
    (b / "config.json").write_bytes((a / "config.json").read_bytes())
    (row,) = _diff(runner, a, b)["tensors"]
    assert row["name"] == name and row["change"] == "values" and row["rel_change"] == pytest.approx(1.0)
    assert _diff(runner, a, b, "--no-values")["tensors"] == []


def test_diff_with_text_gives_per_head_probe_deltas(runner, pair, tmp_path):
    src, out = pair
    text = tmp_path / "t.txt"
    text.write_text(PROSE)
    doc = _diff(runner, src, out, text, "--seq-len", "32", "--max-tokens", "64")
    heads = doc["probe"]["heads"]
    assert len(heads) == 2 * 8 and doc["probe"]["tokens"] == 64
    for row in heads:
        assert row["max_logit_delta"] == pytest.approx(row["max_logit_b"] - row["max_logit_a"])


def test_diff_checks_both_models_and_the_text_before_reading_tensors(runner, pair, tmp_path, monkeypatch):
    import attnkit.commands.analyse.diff as diff

    src, _ = pair
    monkeypatch.setattr(diff, "tensor_changes", lambda *a: pytest.fail("tensors read before the checks"))
    result = runner.invoke(app, ["diff", str(src), str(tmp_path / "missing"), str(tmp_path / "t.txt")])
    assert result.exit_code == 1 and "t.txt: file not found" in result.stderr
    (tmp_path / "t.txt").write_text(PROSE)
    result = runner.invoke(app, ["diff", str(src), str(tmp_path / "missing"), str(tmp_path / "t.txt")])
    assert result.exit_code == 1 and "missing" in result.stderr


def test_diff_table_output(runner, pair):
    src, out = pair
    result = runner.invoke(app, ["diff", str(src), str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "num_key_value_heads" in result.stdout and "k_proj" in result.stdout and "reshaped" in result.stdout


def test_diff_leaves_the_request_as_given(pair, tmp_path):
    from attnkit.commands.analyse.diff import DiffRequest, diff_models

    src, out = pair
    text = tmp_path / "t.txt"
    text.write_text(PROSE)
    req = DiffRequest(a=str(src), b=str(out), texts=[str(text)], seq_len=32, max_tokens=64, device="cpu", dtype="fp32")
    assert diff_models(req)["probe"]["tokens"] == 64 and req.dtype == "fp32"
