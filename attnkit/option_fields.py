"""Request fields that are command-line options, each declared once: its flag, help, bounds or choices, how its
text is read, and the lists it belongs to (what a resumed run must share, the report's settings, ...).

A request dataclass declares `lr: float | None = option(None, "--lr", "Peak learning rate.", low=POSITIVE,
tags=("fingerprint",))`; the CLI builds its typer options from these (attnkit.cli.options.options_from), the
request checks its values with `check_fields`, and reports read their lists with `tagged`. Nothing here imports
typer: requests are used without the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from attnkit.errors import UsageError
from attnkit.units import check_bounds

#: A lower bound that means "above 0" (a strict bound check_bounds has no word for).
POSITIVE = "positive"


@dataclass(frozen=True)
class Flag:
    """How one request field is given on the command line and checked."""

    flag: str  # --name
    help: str
    short: str | None = None  # -x
    low: Any = None  # lowest value, POSITIVE (above 0) or None
    high: Any = None  # highest value or None
    choices: tuple[str, ...] | None = None  # the words it takes
    parse: Callable[[str], Any] | None = None  # the CLI takes text and this reads it (e.g. "256k" -> 262144)
    negative: str | None = None  # a boolean's off flag (--no-name)
    hidden_default: bool = False  # the help shows no default (the default is resolved later)
    tags: tuple[str, ...] = ()


def option(default=dataclasses.MISSING, flag: str = "", help: str = "", *, default_factory=dataclasses.MISSING, **kw):
    """A dataclass field that is also the command-line option `flag` (Flag's keywords: bounds, choices, tags...)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={"option": Flag(flag, help, **kw)}
    )


def flags(cls) -> Iterator[tuple[dataclasses.Field, Flag]]:
    """The request class's option fields, in declaration order, with their Flag."""
    for f in dataclasses.fields(cls):
        if "option" in f.metadata:
            yield f, f.metadata["option"]


def tagged(req, tag: str) -> dict:
    """{field name: value} of the request's option fields that carry `tag`."""
    return {f.name: getattr(req, f.name) for f, flag in flags(type(req)) if tag in flag.tags}


def check_fields(req) -> None:
    """Every option field's value within its choices and bounds (None: not given, not checked); one-line
    UsageErrors naming the flag."""
    for f, flag in flags(type(req)):
        value = getattr(req, f.name)
        if value is None:
            continue
        if flag.choices is not None and value not in flag.choices:
            raise UsageError(f"{flag.flag} must be one of {', '.join(flag.choices)}, got {value!r}")
        if flag.low is None and flag.high is None:
            continue
        check_bounds(flag.flag, value, None if flag.low == POSITIVE else flag.low, flag.high)
        if flag.low == POSITIVE and not value > 0:
            raise UsageError(f"{flag.flag} must be positive, got {value}")
