"""Options declared once: request fields that are options (attnkit.option_fields) and the CLI built from
them (heal), and the typed aliases every command shares (attnkit.cli.options)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from attnkit.cli import app
from attnkit.commands.heal.request import LOOP, RESUME, SETTINGS, HealRequest
from attnkit.errors import UsageError
from attnkit.option_fields import POSITIVE, check_fields, flags, option, tagged


@dataclasses.dataclass
class _Request:
    rate: float | None = option(None, "--rate", "A rate.", low=POSITIVE, tags=("a",))
    count: int = option(3, "--count", "A count.", low=0, high=10, tags=("a", "b"))
    mode: str = option("x", "--mode", "A mode.", choices=("x", "y"))
    name: str = "not an option"


def test_fields_are_checked_by_their_declared_bounds_and_choices():
    check_fields(_Request())  # None is "not given": not checked
    for bad, message in (
        (dict(rate=0.0), "--rate must be positive, got 0.0"),
        (dict(rate=float("nan")), "--rate must be a finite number"),
        (dict(count=11), "--count 11 is over the limit of 10"),
        (dict(count=-1), "--count must be at least 0"),
        (dict(mode="z"), "--mode must be one of x, y, got 'z'"),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            check_fields(_Request(**bad))


def test_tags_give_each_list_of_fields():
    req = _Request(rate=2.0)
    assert tagged(req, "a") == {"rate": 2.0, "count": 3}
    assert tagged(req, "b") == {"count": 3}
    assert [f.name for f, _ in flags(_Request)] == ["rate", "count", "mode"]


def test_heal_options_are_its_request_fields(runner):
    """Every option field of HealRequest is an option of `attnkit heal` with its help, and nothing else declares
    them; the resume fingerprint and the report's settings are lists of those fields."""
    result = runner.invoke(app, ["heal", "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    assert result.exit_code == 0
    shown = " ".join(result.output.split())
    fields = list(flags(HealRequest))
    assert len(fields) > 25
    for _, flag in fields:
        assert flag.flag in shown, flag.flag
        assert " ".join(flag.help.split())[:40] in shown, flag.flag
    names = {f.name for f, _ in fields}
    req = HealRequest(model="s", out="o", teacher="t")
    for tag in (RESUME, SETTINGS, LOOP):
        assert set(tagged(req, tag)) <= names and tagged(req, tag)
    assert "seq_len" in tagged(req, RESUME) and "eval_every" not in tagged(req, RESUME)


def test_heal_option_text_is_parsed_and_checked_before_any_model(runner, tmp_path):
    """--tokens reads "2k", and a bad value gets the request's one-line message (exit 2) before anything loads:
    the models named here do not exist."""
    data = tmp_path / "d.txt"
    data.write_text("text\n")
    base = ["heal", str(tmp_path / "student"), str(tmp_path / "out"), "--teacher", str(tmp_path / "t")]
    base += ["--data", str(data)]
    for extra, message in (
        (["--top-k", "0"], "--top-k must be at least 1"),
        (["--precision", "fp8"], "--precision must be one of auto, fp32, bf16"),
        (["--tokens", "2k", "--max-time", "1m"], "give one budget"),
        (["--min-lr-ratio", "2"], "--min-lr-ratio 2.0 is over the limit of 1"),
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert message in " ".join(result.output.split()), (extra, result.output)


@pytest.mark.parametrize(
    "command", [["eval", "m"], ["probe", "m", "t.txt"], ["diff", "a", "b", "t.txt"]], ids=["eval", "probe", "diff"]
)
def test_the_text_options_are_one_declaration(runner, command):
    """--seq-len, --max-tokens and --format read the same in every command that takes them (one help text)."""
    result = runner.invoke(app, [*command[:1], "--help"], env={"COLUMNS": "300", "TERMINAL_WIDTH": "300"})
    shown = " ".join(result.output.split())
    assert "--seq-len INTEGER Tokens per window." in shown
    assert "--max-tokens INTEGER At most this many tokens in all (whole windows)." in shown
    assert "Output format: table, json, csv or markdown." in shown
