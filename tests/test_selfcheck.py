"""The self-check every rewrite runs on its output (attnkit.scoring.selfcheck): its verdict, the text it picks, its
place in the report, the manifest and the last stderr line, --max-loss and --no-check, and the refusals before any
model loads."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import app
from attnkit.scoring import selfcheck
from attnkit.scoring.selfcheck import CheckOptions, Limit, lost_keys, verdict
from tests.helpers import PROSE, one_line_error, tiny_source


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(PROSE * 12)  # ~1,900 characters: calibration and a held-out window of the tiny model's 512
    return str(path)


@pytest.fixture
def src(tmp_path):
    return tiny_source(tmp_path, "llama_gqa")


def _convert(runner, src, out, *args):
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out), *map(str, args), "-f", "json"])
    return result, (json.loads(result.stdout) if result.exit_code in (0, 3) and result.stdout.strip() else None)


def _block(short: float, rows: list[tuple[int, int, float]], keys: tuple[int, int] | None = None) -> dict:
    """A check block with a short-window ratio, distance rows (start, end, ratio) and pass keys (source, result)."""
    block = {
        "short": {"seq_len": 512, "ratio": short},
        "long": {"by_distance": [{"start": a, "end": b, "ratio": r} for a, b, r in rows]},
        "passkey": None,
    }
    block["long"]["growth"] = selfcheck.growth(block["long"]["by_distance"])
    if keys:
        block["passkey"] = {"length": 4096, "keys": 3, "source": keys[0], "result": keys[1]}
        block["passkey"]["lost"] = lost_keys(*keys)
    return block


LONG = [(0, 128, 1.1), (128, 256, 1.2), (256, 512, 1.2), (512, 1024, 1.25), (1024, 2048, 1.3), (2048, 4096, 1.45)]


def test_verdict_names_the_worst_bucket_the_growth_and_lost_keys():
    ok = verdict(_block(1.1, LONG), Limit(1.5, 1.25, "lossy"), CheckOptions())
    assert ok["verdict"] == "ok" and ok["worst"] == {"where": "2,048-4,096 tokens of context", "ratio": 1.45}
    grows = verdict(_block(1.1, LONG), Limit(1.5, 1.15, "lossy"), CheckOptions())
    assert grows["verdict"] == "worse than its limit" and "grows x1.21" in grows["problems"][0]
    high = verdict(_block(1.6, LONG), Limit(1.5, 1.25, "lossy"), CheckOptions(max_loss=1.55))
    assert high["worst"]["where"] == "512-token windows" and "x1.6" in high["problems"][0] and high["over_max_loss"]
    keys = verdict(_block(1.1, LONG, (3, 1)), Limit(1.5, 1.25, "lossy"), CheckOptions())
    assert keys["verdict"] == "worse than its limit" and "finds 1 of 3 pass keys" in keys["problems"][0]
    assert not verdict(_block(1.1, LONG, (2, 1)), Limit(1.5, 1.25, "lossy"), CheckOptions())["problems"]


def test_lost_keys_is_fewer_than_half_of_the_sources():
    assert [lost_keys(s, r) for s, r in ((3, 1), (3, 2), (2, 0), (2, 1), (1, 0), (0, 0))] == [
        True,
        False,
        True,
        False,
        True,
        False,
    ]


def test_growth_needs_a_long_window():
    assert selfcheck.growth([{"start": 0, "end": 128, "ratio": 1.0}, {"start": 128, "end": 256, "ratio": 2.0}]) is None
    short = [(0, 128, 1.0), (128, 256, 1.0), (256, 512, 2.0)]
    assert selfcheck.growth([{"start": a, "end": b, "ratio": r} for a, b, r in short]) is None


def test_every_rewrite_checks_itself_on_the_held_out_calibration_text(runner, src, text, tmp_path):
    out = tmp_path / "out"
    calib = ("--method", "merge", "--calib", text, "--calib-tokens", "512", "--calib-seq-len", "64")
    result, doc = _convert(runner, src, out, *calib)
    assert result.exit_code == 0, result.output
    check = doc["check"]
    assert check["text"]["origin"] == "held-out --calib text" and check["text"]["skipped_tokens"] == 512
    assert check["short"]["windows"] >= 1 and check["long"]["seq_len"] == 512  # the tiny model's positions
    assert check["limit"] == {"ratio": 1.5, "growth": 1.15, "meant": "lossy"} and check["verdict"] in (
        "ok",
        "worse than its limit",
    )
    assert json.loads((out / "attnkit.json").read_text())["check"] == check
    last = result.stderr.strip().splitlines()[-1]
    assert "self-check (held-out --calib text): perplexity x" in last and "convert mqa" in last


def test_without_any_text_the_check_scores_attnkits_sample_text(runner, src, tmp_path):
    result, doc = _convert(runner, src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert doc["check"]["text"]["origin"] == "attnkit's sample text" and doc["check"]["short"]["windows"] == 4


def test_a_rewrite_worse_than_its_limit_warns(runner, src, tmp_path, monkeypatch):
    monkeypatch.setitem(selfcheck.LIMITS, "convert gqa", Limit(1.0, 1.0, "exact"))
    result, doc = _convert(runner, src, tmp_path / "out")
    assert result.exit_code == 0 and doc["check"]["verdict"] == "worse than its limit", result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("warning: self-check") and "WORSE than convert mqa's limit" in last


def test_max_loss_fails_a_ci_job_with_exit_3(runner, src, tmp_path):
    out = tmp_path / "out"
    result, doc = _convert(runner, src, out, "--max-loss", "1.0")
    assert result.exit_code == 3 and doc["check"]["over_max_loss"], result.output
    assert "above --max-loss 1" in result.stderr.strip().splitlines()[-1]
    assert (out / "attnkit.json").is_file()  # written: the limit is the user's, the output is there to inspect


def test_no_check_skips_it(runner, src, tmp_path):
    result, doc = _convert(runner, src, tmp_path / "out", "--no-check")
    assert result.exit_code == 0 and doc["check"] is None and "self-check" not in result.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max-loss", "0.5"], "--max-loss is a perplexity ratio to the source, at least 1"),
        (["--max-loss", "nan"], "--max-loss is a perplexity ratio to the source, at least 1"),
        (["--max-loss", "1.2", "--no-check"], "cannot go with --no-check"),
    ],
)
def test_bad_check_options_are_refused_before_any_model_loads(runner, src, tmp_path, args, needle):
    out = tmp_path / "out"
    result, _ = _convert(runner, src, out, *args)
    one_line_error(result, 2, needle)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_max_loss_not_a_number_is_a_usage_error(runner, src, tmp_path):
    result, _ = _convert(runner, src, tmp_path / "out", "--max-loss", "abc")
    assert result.exit_code == 2 and "abc" in result.output


def test_an_eval_text_shorter_than_one_window_is_refused_before_any_model_loads(runner, src, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.")
    out = tmp_path / "out"
    result, _ = _convert(runner, src, out, "--eval", short)
    one_line_error(result, 2, "--eval: the text has")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_source_without_a_tokenizer_is_not_checked_and_says_so(runner, tiny, tmp_path):
    result, doc = _convert(runner, tiny("llama_gqa", vocab_size=128), tmp_path / "out")
    assert result.exit_code == 0 and doc["check"]["verdict"] == "not checked", result.output
    assert "is NOT checked: the source has no tokenizer" in result.stderr.strip().splitlines()[-1]


def test_the_sample_text_is_the_held_out_prose():
    from pathlib import Path

    sample = Path(selfcheck.sample_text().files[0]).read_text()
    assert sample == (Path(__file__).parent / "data" / "prose" / "heldout.txt").read_text()
