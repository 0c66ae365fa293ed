"""CLI plumbing: version, help, exit codes, output formats, and no heavy imports on the fast paths."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnkit import __version__
from attnkit.cli import app
from tests.helpers import modules_after


def test_version(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"attnkit {__version__}"


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "attnkit", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"attnkit {__version__}"


def test_help_lists_commands(runner):
    from attnkit.cli import COMMANDS

    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    rows = [line for line in result.output.splitlines() if line.startswith("│ ") and line[2] != " "]
    listed = {row.split()[1] for row in rows if row.split()[1] not in ("--version", "--help")}
    assert listed == set(COMMANDS), result.output


@pytest.mark.parametrize("args", [["--help"], ["kvmem", "llama-3.1-8b", "--format", "json"]])
def test_fast_paths_import_no_torch(args):
    assert modules_after(args) == set()


def test_inspect_imports_no_torch(tiny):
    folder = tiny("llama_gqa")
    assert modules_after(["inspect", str(folder), "--format", "json"]) == set()


def test_missing_file_is_one_line_error(runner, tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "nope.safetensors")])
    assert result.exit_code == 1
    assert "file not found" in result.output
    assert "Traceback" not in result.output


def test_usage_error_exit_code(runner):
    result = runner.invoke(app, ["kvmem", "llama-3.1-8b", "--context", "abc"])
    assert result.exit_code == 2
    assert "not a token count" in result.output


def test_unknown_option_is_usage_error(runner):
    assert runner.invoke(app, ["kvmem", "llama-3.1-8b", "--no-such-flag"]).exit_code == 2


def test_debug_env_shows_traceback(tmp_path):
    code = f"from attnkit.cli import app; app(['inspect', {str(tmp_path / 'missing.gguf')!r}])"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    debug = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "ATTNKIT_DEBUG": "1"},
    )
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    assert "Traceback" in debug.stderr


@pytest.mark.parametrize("fmt", ["table", "json", "csv", "markdown"])
def test_kvmem_formats(runner, fmt):
    result = runner.invoke(app, ["kvmem", "llama-3.1-8b", "--context", "4k", "--format", fmt])
    assert result.exit_code == 0, result.output
    if fmt == "json":
        doc = json.loads(result.stdout)
        assert doc["rows"][0]["bytes_per_token"] == 131072
    elif fmt == "csv":
        header, row = result.stdout.strip().splitlines()
        assert header.split(",")[:4] == ["variant", "attention", "sliding", "dtype"]
        assert "131072" in row
    elif fmt == "markdown":
        assert result.stdout.startswith("**KV cache") and "| 131,072 |" in result.stdout
    else:
        assert "131,072" in result.stdout


# ------------------------------------------------------------------ paths are printed as they are


def test_a_bracketed_output_path_is_printed_whole_in_the_log(runner, tiny, tmp_path):
    """rich reads "[test]" as a style tag: every command's log (attnkit.cli.common.log_sink) and table print with
    markup off, so runs[test] does not come out as runs."""
    from tests.helpers import HELDOUT, char_tokenizer

    teacher = char_tokenizer(tiny("llama_gqa"))
    student = tmp_path / "student"
    made = runner.invoke(app, ["convert", "mqa", str(teacher), str(student), "--method", "mean"])
    assert made.exit_code == 0, made.output
    out = tmp_path / "runs[test]"
    fast = ["--tokens", "256", "--seq-len", "32", "--batch-size", "2", "--micro-batch-size", "2"]
    fast += ["--val-tokens", "64", "--eval-every", "2", "--device", "cpu"]
    result = runner.invoke(app, ["heal", str(student), str(out), "--teacher", str(teacher), "--data", HELDOUT, *fast])
    assert result.exit_code == 0, result.output
    assert f"writing {out}" in result.stderr  # heal's log
    assert f"{out}" in "".join(result.stdout.split())  # the table's caption: wrote .../runs[test]


def test_a_bracketed_path_is_printed_whole_in_a_table(runner, tiny, tmp_path):
    src, out = tiny("llama_gqa"), tmp_path / "mqa[a]"
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), "--method", "mean"])
    assert result.exit_code == 0, result.output
    assert f"{out}" in "".join(result.stdout.split())  # the caption: wrote .../mqa[a]


# ------------------------------------------------------------------ one report head (attnkit.commands.report_head)


@pytest.mark.parametrize(
    "args, lead",
    [
        (["convert", "mqa"], []),
        (["convert", "mla", "--kv-budget", "0.5"], []),
        (["retrofit", "softcap", "--attn-cap", "20"], ["retrofit"]),
        (["retrofit", "qknorm", "--method", "pad"], ["retrofit"]),
        (["retrofit", "qkclip"], ["retrofit"]),
    ],
)
def test_writing_reports_start_with_one_head_and_end_with_seconds(runner, tiny, tmp_path, args, lead):
    from tests.helpers import CALIB, char_tokenizer

    src, out = char_tokenizer(tiny("llama_gqa")), tmp_path / "out"
    command, options = args[:2], args[2:]
    result = runner.invoke(
        app, [*command, str(src), str(out), *options, "--calib", CALIB, "--dry-run", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    keys = list(report)
    assert keys[: len(lead) + 4] == [*lead, "source", "output", "dry_run", "model_type"] and keys[-1] == "seconds"
    assert (report["source"], report["output"], report["dry_run"]) == (str(src), str(out), True)
    assert report["model_type"] == "llama" and report["seconds"] >= 0
