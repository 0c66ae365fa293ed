"""The training line of attnkit's progress display: tokens, tokens/s, loss and ETA (a terminal only)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from attnkit.progress import phase


@contextlib.contextmanager
def training_bar(
    total: float, unit: str, done: float = 0.0, tokens: int = 0, enabled: bool = True
) -> Iterator[Callable[[dict], None] | None]:
    """Yield advance(step entry) for a phase over the budget in `unit` ('tokens' or 'seconds'), `done` of it
    spent and `tokens` trained before (a resumed run); None when disabled (processes other than the main one)."""
    if not enabled:
        yield None
        return

    began = time.perf_counter()
    with phase("training", total, unit, completed=done) as update:

        def advance(entry: dict) -> None:
            seconds = time.perf_counter() - began
            speed = (entry["tokens"] - tokens) / max(seconds, 1e-9)
            update(
                completed=entry["tokens"] if unit == "tokens" else done + seconds,
                note=f"{speed:,.0f} tok/s, loss {entry['loss']:.4f}",
            )

        yield advance
