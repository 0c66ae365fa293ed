"""`convert gqa|mqa` bad input and interrupted writes: one-line errors, input untouched, no partial output."""

from __future__ import annotations

import errno
import json

import pytest

from attnkit.cli import app
from tests.helpers import char_tokenizer, digest, leftovers, one_line_error


@pytest.fixture
def src(tiny):
    return char_tokenizer(tiny("llama_gqa"))  # 8 query heads, 2 KV heads


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["gqa", "--kv-heads", "3"], 2, "--kv-heads 3 is more than the model's 2 KV heads"),
        (["gqa", "--kv-heads", "4"], 2, "valid: 1"),
        (["gqa", "--kv-heads", "2"], 2, "the model already has 2 KV heads: --kv-heads 2 would write an unchanged copy"),
        (["gqa", "--kv-heads", "0"], 2, "--kv-heads must be at least 1"),
        (["mqa", "--method", "merge"], 2, "--method merge needs calibration text"),
        (["mqa", "--method", "median"], 2, "unknown --method 'median'"),
        (["mqa", "--eval-long-seq-len", "100"], 2, "--eval-long-seq-len 100: long windows are scored by distance"),
        (
            ["mqa", "--method", "merge", "--calib", "/nonexistent/calib.txt"],
            1,
            "/nonexistent/calib.txt: file not found",
        ),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(runner, src, tmp_path, args, code, needle):
    cmd, *rest = args
    result = runner.invoke(app, ["convert", cmd, str(src), str(tmp_path / "out"), *rest])
    one_line_error(result, code, needle)
    assert not (tmp_path / "out").exists()


def test_kv_heads_not_dividing(runner, tiny, tmp_path):
    src = char_tokenizer(tiny("qwen2"))  # 4 KV heads
    result = runner.invoke(app, ["convert", "gqa", str(src), str(tmp_path / "out"), "--kv-heads", "3"])
    one_line_error(result, 2, "--kv-heads 3 does not divide the model's 4 KV heads; valid: 1, 2")


@pytest.mark.parametrize(
    "family,needle",
    [
        ("gpt2", "gpt2 (GPT2LMHeadModel) cannot be converted"),
        ("gpt_neox", "gpt_neox (GPTNeoXForCausalLM) cannot be converted"),
        ("bert", "bert is not a causal language model"),
    ],
)
def test_unsupported_families_are_refused(runner, tiny, tmp_path, family, needle):
    result = runner.invoke(app, ["convert", "mqa", str(tiny(family)), str(tmp_path / "out")])
    one_line_error(result, 1, needle)
    assert family == "bert" or "num_key_value_heads" in result.output


def test_non_empty_output_needs_overwrite(runner, src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out)])
    one_line_error(result, 1, "folder is not empty (pass --overwrite to replace it)")
    assert (out / "keep.txt").read_text() == "precious"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()


def test_output_replacing_input_is_refused(runner, src):
    before = digest(src)
    result = runner.invoke(app, ["convert", "mqa", str(src), str(src), "--overwrite"])
    one_line_error(result, 1, "output would replace the input")
    assert digest(src) == before


def test_dry_run_writes_nothing_and_reports_the_plan(runner, src, tmp_path):
    before = digest(src)
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out"), "--dry-run", "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and report["layers"] == [] and report["kv_heads_after"] == 1
    assert report["kv_bytes_per_token"]["after"] * 2 == report["kv_bytes_per_token"]["before"]
    assert list(report) == [
        "source",
        "output",
        "dry_run",
        "model_type",
        "method",
        "num_heads",
        "kv_heads_before",
        "kv_heads_after",
        "num_layers",
        "kv_bytes_per_token",
        "parameters",
        "error_basis",
        "calibration",
        "layers",
        "eval",
        "check",
        "seconds",
    ]
    assert not (tmp_path / "out").exists() and digest(src) == before


@pytest.mark.parametrize(
    "failure,code,needle",
    [
        (KeyboardInterrupt(), 130, "interrupted"),
        (OSError(errno.ENOSPC, "No space left on device"), 1, "disk full"),
    ],
)
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
    before = digest(src)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--max-shard-size", "20KiB"])
    one_line_error(result, code, needle, progress_lines=1)
    assert calls["n"] == 2
    assert leftovers(tmp_path, "out") == [] and digest(src) == before


def test_table_and_markdown_output(runner, src, tmp_path):
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out"), "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert "| layer | keys | values | K rel. error | V rel. error |" in result.stdout
    assert "2 -> 1 KV heads" in result.stdout


def test_merge_knobs_reach_the_report_and_manifest(runner, src, tmp_path):
    calib = tmp_path / "calib.txt"
    calib.write_text("The river ran quietly past the mill, and the miller counted sacks of grain. " * 20)
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "convert",
            "mqa",
            str(src),
            str(out),
            "--method",
            "merge",
            "--calib",
            str(calib),
            "--calib-tokens",
            "256",
            "--calib-seq-len",
            "64",
            "--o-refit",
            "0",
            "--key-weight",
            "uniform",
            "--value-weight",
            "none",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {row["value_path"] for row in report["layers"]} == {"merge"}  # refit off
    assert report["calibration"] == {
        "tokens": 256,
        "windows": 4,
        "seq_len": 64,
        "sequential": False,
        "files": [str(calib)],
    }
    params = json.loads((out / "attnkit.json").read_text())["parameters"]
    assert (params["o_refit"], params["key_weight"], params["value_weight"]) == (None, "uniform", "none")
    bad = runner.invoke(
        app,
        [
            "convert",
            "mqa",
            str(src),
            str(tmp_path / "x"),
            "--method",
            "merge",
            "--calib",
            str(calib),
            "--key-weight",
            "loud",
        ],
    )
    one_line_error(bad, 2, "--key-weight must be query, uniform or attention")


@pytest.mark.parametrize("fail", [False, True])
def test_calibrated_layers_wait_on_disk_and_leave_nothing_behind(runner, src, tmp_path, monkeypatch, fail):
    """A calibrated conversion keeps each layer's converted tensors in a temp folder beside OUT until they are
    written (attnkit.commands.convert.layer_spill), not in memory: every layer goes through it, and the folder
    is gone afterwards, also when the write fails."""
    import attnkit.commands.convert.layer_spill as spill
    import attnkit.io.writer as writer
    from tests.helpers import HELDOUT

    taken, take = [], spill.LayerSpill.take

    def counted(self, layer):
        found = take(self, layer)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(spill.LayerSpill, "take", counted)
    if fail:
        monkeypatch.setattr(writer, "write_safetensors", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "io")))
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--method", "merge", "--calib", HELDOUT])
    assert (result.exit_code != 0) == fail, result.output
    if not fail:
        assert taken and all(taken)
    assert leftovers(tmp_path, "out") == ([] if fail else ["out"])
