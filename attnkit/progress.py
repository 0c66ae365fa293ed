"""One progress display per command: a rich Progress on stderr while a command runs in a terminal.

The CLI opens `display()` around every command; the work inside reports its phases with `phase()`
(layers calibrated, tensors written, windows scored), each a line of the same display with a bar,
a count, the elapsed time and an ETA. Without a display (stderr piped or a file, the Python API)
`phase()` hands back a no-op, and rich is never imported.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

_display: "_Display | None" = None


def _noop(_n: int = 1) -> None:
    return None


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


class _Display:
    """A rich Progress made and started at the first phase (commands without phases never import rich)."""

    def __init__(self, console: Callable[[], object]):
        self.console, self.progress = console, None

    def add(self, description: str, total: int, unit: str):
        if self.progress is None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=self.console(), transient=False)
            self.progress.start()
        return self.progress.add_task(description, total=total, unit=unit)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@contextlib.contextmanager
def display(console: Callable[[], object] | None = None, force: bool = False) -> Iterator[None]:
    """Show phases for the block on the rich console that `console()` returns (default: a new stderr console),
    when stderr is a terminal (or `force`); nested calls share the outer display."""
    global _display
    if _display is not None or not (force or sys.stderr.isatty()):
        yield
        return
    _display = _Display(console or _stderr_console)
    try:
        yield
    finally:
        shown, _display = _display, None
        shown.stop()


@contextlib.contextmanager
def phase(description: str, total: int, unit: str = "") -> Iterator[Callable[[int], None]]:
    """A line of the active display with `total` steps of `unit`; yields advance(n=1)."""
    if _display is None or total <= 0:
        yield _noop
        return
    shown = _display
    task = shown.add(description, int(total), unit)
    yield lambda n=1: shown.progress.advance(task, n)
