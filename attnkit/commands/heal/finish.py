"""The end of a heal run: OUT written through the one write path (attnkit.commands.write) in the student's layout,
the written folder loaded and scored against the teacher before it is renamed into place ("eval", beside the
student's scores before training), attnkit.json, and the checkpoint folder removed."""

from __future__ import annotations

import shutil
from pathlib import Path

from attnkit.commands.heal.models import as_loaded
from attnkit.commands.heal.output import healed_tensors
from attnkit.commands.heal.scores import eval_report, score
from attnkit.commands.write import write_checkpoint
from attnkit.runtime import load_model
from attnkit.scoring.comparison import Comparison
from attnkit.scoring.selfcheck import LIMITS, CheckText, run_check

#: The report's entries that attnkit.json carries besides parameters, warnings and eval.
MANIFEST_KEYS = ("data", "budget", "seed", "trainable", "training", "validation")


def write_healed(run, model, teacher, comparison: Comparison | None, before: dict | None) -> None:
    """Write OUT from the healed `model`; the written folder is self-checked against `teacher` (report["check"],
    unless --no-check) and, with a comparison (`before`: the student's block), scored into report["eval"]."""
    req, pair, report = run.req, run.pair, run.report
    report["eval"] = report["check"] = None

    def scored(folder: Path) -> dict:
        healed = load_model(str(folder), device=str(run.acc.device), dtype="float32")
        if comparison is not None:
            report["eval"] = eval_report(comparison, before, score(comparison, run, teacher, healed))
        if req.check.enabled:
            text = CheckText(tuple(req.scoring.files), 0, "--eval") if req.scoring.files else None
            report["check"] = run_check(as_loaded(teacher, run), healed, text, LIMITS["heal"], req.check)
        return {"eval": report["eval"], "check": report["check"]}

    write_checkpoint(
        req,
        pair.student,
        "heal",
        config=pair.student.root / "config.json",
        weights=lambda writer: healed_tensors(model, pair.student.ckpt, writer),
        body=lambda: _manifest(run),
        score=scored if comparison is not None or req.check.enabled else None,
        inputs=[pair.teacher.root],
    )
    _remove_checkpoint(req.checkpoint_folder)


def _manifest(run) -> dict:
    """attnkit.json entries of the healed folder (its source is the student): the teacher, the rewrite it heals,
    data, budget, settings (its parameters), training and validation."""
    report = run.report
    doc = {
        "parameters": report.get("settings"),
        "warnings": report.get("warnings", []),
        "teacher": run.pair.teacher.record(),
        "rewrite": run.pair.manifest,
        **{k: report.get(k) for k in MANIFEST_KEYS},
    }
    doc["trainable"] = {k: v for k, v in (doc["trainable"] or {}).items() if k != "names"}
    return doc


def _remove_checkpoint(folder: Path) -> None:
    """The run finished and OUT is written: its checkpoint is no longer needed."""
    if (folder / "run.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
