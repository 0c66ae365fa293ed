"""One heal run as its helpers see it: the request, the checked pair, the data plan, the report being filled, the
log, the start time and the accelerator (devices and processes), in one record instead of a list of arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attnkit.commands.heal.pair import Pair
from attnkit.commands.heal.plan import DataPlan
from attnkit.commands.heal.request import HealRequest


@dataclass
class HealRun:
    """What a run's helpers share once the checks pass and the accelerator is made. `report` is filled as the run
    goes (docs/heal.md); `fingerprint` is what a --resume must match; `resumed` the checkpoint's run.json when
    resuming (None otherwise); `started` the time.perf_counter() of the command's start (--max-time counts from
    it)."""

    req: HealRequest
    pair: Pair
    plan: DataPlan
    report: dict
    fingerprint: dict
    resumed: dict | None
    started: float
    acc: object  # accelerate.Accelerator
    log: Callable[[str], None]

    @property
    def main(self) -> bool:
        """Whether this is the main process (the one that scores, prints and writes OUT)."""
        return self.acc.is_main_process
