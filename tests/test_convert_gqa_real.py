"""SmolLM2-135M (9 heads, 3 KV heads) to MQA: mean and calibrated merge on real prose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.cli import app
from attnkit.realmodels import smollm2_folder, smollm2_gguf

PROSE = Path(__file__).parent / "data" / "prose"
SHORT = ["--eval", str(PROSE / "heldout.txt"), "--eval-tokens", "1024", "--eval-seq-len", "256", "--no-check"]


def _convert(runner, *args: str) -> dict:
    result = runner.invoke(app, ["convert", *args, "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.real_model
def test_smollm2_mqa_merge_beats_mean(runner, tmp_path):
    from transformers import AutoConfig

    src = smollm2_folder()
    mean = _convert(runner, "mqa", str(src), str(tmp_path / "mean"), *SHORT)
    merge = _convert(
        runner,
        "mqa",
        str(src),
        str(tmp_path / "merge"),
        "--method",
        "merge",
        "--calib",
        str(PROSE / "calib.txt"),
        "--calib-tokens",
        "1024",
        *SHORT,
    )
    for out in ("mean", "merge"):
        assert AutoConfig.from_pretrained(str(tmp_path / out)).num_key_value_heads == 1
    assert (
        mean["kv_heads_before"] == 3
        and merge["kv_bytes_per_token"]["after"] * 3 == merge["kv_bytes_per_token"]["before"]
    )
    assert mean["eval"]["source_perplexity"] == pytest.approx(merge["eval"]["source_perplexity"], rel=1e-6)
    assert merge["eval"]["perplexity"] < mean["eval"]["perplexity"]
    assert merge["eval"]["kl_mean"] < mean["eval"]["kl_mean"]
    assert all(row["key_path"] == "merge" for row in merge["layers"])


@pytest.mark.real_model
def test_smollm2_gguf_source_dry_run(runner, tmp_path):
    report = _convert(runner, "gqa", str(smollm2_gguf()), str(tmp_path / "out"), "--kv-heads", "1", "--dry-run")
    assert (report["model_type"], report["num_heads"], report["kv_heads_before"], report["num_layers"]) == (
        "llama",
        9,
        3,
        30,
    )
    assert report["kv_bytes_per_token"]["before"] == 30 * 2 * 3 * 64 * 4  # fp32 materialization
    assert not (tmp_path / "out").exists()
