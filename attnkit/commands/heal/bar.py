"""The training progress bar: tokens/s, loss and ETA on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator


@contextlib.contextmanager
def training_bar(total: float, unit: str, done: float = 0.0, tokens: int = 0,
                 enabled: bool = True) -> Iterator[Callable[[dict], None] | None]:
    """Yield advance(step entry) for a bar over the budget in `unit` ('tokens' or 'seconds'), `done` of it spent
    and `tokens` trained before (a resumed run); None when disabled or stderr is not a terminal."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("heal"), BarColumn(), TextColumn("{task.fields[tokens]:,} tokens"),
               TextColumn("{task.fields[speed]:,.0f} tok/s"), TextColumn("loss {task.fields[loss]:.4f}"),
               TimeRemainingColumn())
    began = time.perf_counter()
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("heal", total=total, completed=done, tokens=tokens, speed=0.0, loss=float("nan"))

        def advance(entry: dict) -> None:
            seconds = time.perf_counter() - began
            bar.update(task, completed=entry["tokens"] if unit == "tokens" else done + seconds, tokens=entry["tokens"],
                       loss=entry["loss"], speed=(entry["tokens"] - tokens) / max(seconds, 1e-9))

        yield advance
