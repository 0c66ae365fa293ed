"""What the report of every writing command (convert, retrofit, export, heal) starts and ends with: its head (the
operation, the models read, OUT, --dry-run, the model type) in one order, and the seconds it took, last. The JSON
reports are a stable schema (docs/cli.md): the keys and their order come from here, not from each command."""

from __future__ import annotations

import time

from attnkit.commands.rewrite import WriteRequest


def report_head(
    req: WriteRequest, model_type: str | None = None, *, lead: dict | None = None, inputs: dict | None = None
) -> dict:
    """The first keys of a report: `lead` (what names the operation, e.g. {"retrofit": "qknorm"}), `inputs` (the
    models read; default {"source": MODEL}, heal's {"student": ..., "teacher": ...}), "output" (OUT as given),
    "dry_run" and, when given, "model_type". The command adds its own keys after these."""
    head = {
        **(lead or {}),
        **(inputs if inputs is not None else {"source": req.model}),
        "output": str(req.out),
        "dry_run": req.dry_run,
    }
    if model_type is not None:
        head["model_type"] = model_type
    return head


def timed(report: dict, started: float) -> dict:
    """`report` with "seconds" since `started` (a time.perf_counter() reading) added as its last key."""
    report["seconds"] = time.perf_counter() - started
    return report
