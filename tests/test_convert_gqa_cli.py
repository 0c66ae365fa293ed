"""`convert gqa|mqa` bad input and interrupted writes: one-line errors, input untouched, no partial output."""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path

import pytest

from attnkit.cli import app
from tests.test_runtime import char_tokenizer


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _one_line_error(result, code: int, needle: str, progress_lines: int = 0) -> None:
    """Exit code, no traceback, and the error as the one last line (after `progress_lines` phase logs)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 + progress_lines and "Traceback" not in result.output, result.output
    assert lines[-1].startswith("error: ") and needle in lines[-1], result.output


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "attnkit-tmp" in p.name or p.name == "out"]


@pytest.fixture
def src(tiny):
    return char_tokenizer(tiny("llama_gqa"))  # 8 query heads, 2 KV heads


@pytest.mark.parametrize("args,code,needle", [
    (["gqa", "--kv-heads", "3"], 2, "--kv-heads 3 is more than the model's 2 KV heads"),
    (["gqa", "--kv-heads", "4"], 2, "valid: 1"),
    (["gqa", "--kv-heads", "2"], 2, "the model already has 2 KV heads: --kv-heads 2 would write an unchanged copy"),
    (["gqa", "--kv-heads", "0"], 2, "--kv-heads must be at least 1"),
    (["mqa", "--method", "merge"], 2, "--method merge needs calibration text"),
    (["mqa", "--method", "median"], 2, "unknown --method 'median'"),
    (["mqa", "--method", "merge", "--calib", "/nonexistent/calib.txt"], 2, "/nonexistent/calib.txt: file not found"),
])
def test_bad_arguments_are_one_line_usage_errors(runner, src, tmp_path, args, code, needle):
    cmd, *rest = args
    result = runner.invoke(app, ["convert", cmd, str(src), str(tmp_path / "out"), *rest])
    _one_line_error(result, code, needle)
    assert not (tmp_path / "out").exists()


def test_kv_heads_not_dividing(runner, tiny, tmp_path):
    src = char_tokenizer(tiny("qwen2"))  # 4 KV heads
    result = runner.invoke(app, ["convert", "gqa", str(src), str(tmp_path / "out"), "--kv-heads", "3"])
    _one_line_error(result, 2, "--kv-heads 3 does not divide the model's 4 KV heads; valid: 1, 2")


@pytest.mark.parametrize("family,needle", [
    ("gpt2", "gpt2 (GPT2LMHeadModel) cannot be converted"),
    ("gpt_neox", "gpt_neox (GPTNeoXForCausalLM) cannot be converted"),
    ("bert", "bert is not a causal language model"),
])
def test_unsupported_families_are_refused(runner, tiny, tmp_path, family, needle):
    result = runner.invoke(app, ["convert", "mqa", str(tiny(family)), str(tmp_path / "out")])
    _one_line_error(result, 1, needle)
    assert family == "bert" or "num_key_value_heads" in result.output


def test_non_empty_output_needs_overwrite(runner, src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out)])
    _one_line_error(result, 1, "folder is not empty (pass --overwrite to replace it)")
    assert (out / "keep.txt").read_text() == "precious"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_output_replacing_input_is_refused(runner, src):
    before = _digest(src)
    result = runner.invoke(app, ["convert", "mqa", str(src), str(src), "--overwrite"])
    _one_line_error(result, 1, "output would replace the input")
    assert _digest(src) == before


def test_dry_run_writes_nothing_and_reports_the_plan(runner, src, tmp_path):
    before = _digest(src)
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out"), "--dry-run", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and report["layers"] == [] and report["kv_heads_after"] == 1
    assert report["kv_bytes_per_token"]["after"] * 2 == report["kv_bytes_per_token"]["before"]
    assert list(report) == ["source", "output", "dry_run", "model_type", "method", "num_heads", "kv_heads_before",
                            "kv_heads_after", "num_layers", "kv_bytes_per_token", "parameters", "error_basis",
                            "calibration", "layers", "eval", "seconds"]
    assert not (tmp_path / "out").exists() and _digest(src) == before


@pytest.mark.parametrize("failure,code,needle", [
    (KeyboardInterrupt(), 130, "interrupted"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "disk full"),
])
def test_interrupted_write_leaves_no_output(runner, src, tmp_path, monkeypatch, failure, code, needle):
    import attnkit.io.writer as writer

    calls = {"n": 0}
    real = writer.write_safetensors

    def failing(path, tensors, metadata):
        calls["n"] += 1
        if calls["n"] == 2:
            raise failure
        return real(path, tensors, metadata)

    monkeypatch.setattr(writer, "write_safetensors", failing)
    before = _digest(src)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--max-shard-size", "20KiB"])
    _one_line_error(result, code, needle, progress_lines=1)
    assert calls["n"] == 2
    assert _leftovers(tmp_path) == [] and _digest(src) == before


def test_table_and_markdown_output(runner, src, tmp_path):
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out"), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert "| layer | keys | values | K rel. error | V rel. error |" in result.stdout
    assert "2 -> 1 KV heads" in result.stdout


def test_merge_knobs_reach_the_report_and_manifest(runner, src, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("The river ran quietly past the mill, and the miller counted sacks of grain. " * 20)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--method", "merge", "--calib", str(calib),
                                 "--calib-tokens", "256", "--calib-seq-len", "64", "--o-refit", "0",
                                 "--key-weight", "uniform", "--value-weight", "none", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {row["value_path"] for row in report["layers"]} == {"merge"}  # refit off
    assert report["calibration"] == {"tokens": 256, "windows": 4, "seq_len": 64, "sequential": False,
                                     "files": [str(calib)]}
    params = json.loads((out / "attnkit.json").read_text())["parameters"]
    assert (params["o_refit"], params["key_weight"], params["value_weight"]) == (None, "uniform", "none")
    bad = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "x"), "--method", "merge", "--calib",
                              str(calib), "--key-weight", "loud"])
    _one_line_error(bad, 2, "--key-weight must be query, uniform or attention")
