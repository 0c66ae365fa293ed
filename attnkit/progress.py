"""One progress display per command: a rich Progress on stderr while a command runs in a terminal.

The CLI opens `display()` around every command; the work inside reports its phases with `phase()`
(layers calibrated, tensors written, windows scored), each a line of the same display with a bar,
a count, the elapsed time and an ETA. Without a display (stderr piped or a file, the Python API)
`phase()` hands back a no-op, and rich is never imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

_display: _Display | None = None


def _noop(_n: float = 1, **_fields) -> None:
    return None


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


class _Display:
    """A rich Progress on the console, live while a phase runs: started by the first phase, stopped when no phase
    is left (finished lines stay on screen), so data printed after the work never shares the screen with a live
    display. stdout is never redirected: data stays on stdout (`> out.json` gets it)."""

    def __init__(self, console: Callable[[], object]):
        self.console, self.progress, self.running = console, None, 0

    def add(self, description: str, total: float, unit: str, completed: float):
        if self.progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("{task.description}", markup=False),  # descriptions echo paths
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[unit]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[note]}", markup=False),
                console=self.console(),
                transient=False,
                redirect_stdout=False,
            )
            self.progress.start()
        self.running += 1
        return self.progress.add_task(description, total=total, completed=completed, unit=unit, note="")

    def advance(self, task, n: float = 1, completed: float | None = None, note: str | None = None) -> None:
        fields = {} if note is None else {"note": note}
        if completed is None:
            self.progress.update(task, advance=n, **fields)
        else:
            self.progress.update(task, completed=completed, **fields)

    def done(self) -> None:
        self.running -= 1
        if not self.running:
            self.stop()

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


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
def phase(description: str, total: float, unit: str = "", completed: float = 0) -> Iterator[Callable[..., None]]:
    """A line of the active display with `total` steps of `unit`, `completed` of them done before (a resumed
    run); yields advance(n=1, completed=None, note=None): n more steps, or `completed` in all, and a note
    shown after the ETA (e.g. a loss)."""
    if _display is None or total <= 0:
        yield _noop
        return
    shown = _display
    task = shown.add(description, total, unit, completed)
    try:
        yield lambda n=1, completed=None, note=None: shown.advance(task, n, completed, note)
    finally:
        shown.done()
