"""heal's "eval" report: the student before training and the healed student after it, each against the teacher
through the comparison every rewrite's report uses (attnkit.scoring.comparison), so both have its keys. The
block itself is the healed student's (as a convert or retrofit report's is its result's), `before` is the
student's as loaded, and `change` is what training changed in tasks and pass keys (after against before, paired
on the same items). heal's keys of earlier releases are written beside them for one more release."""

from __future__ import annotations

from attnkit.commands.heal.models import as_loaded
from attnkit.runtime.loader import LoadedModel
from attnkit.scoring.capability import side_by_side
from attnkit.scoring.comparison import Comparison

#: The --eval scores heal's report held under "before" and "after" until this release.
TEXT_SCORES = ("perplexity", "kl_mean", "kl_max", "top1_agreement")


def comparison_for(run) -> Comparison | None:
    """The Comparison of a HealRun's scoring options, in the main process (None elsewhere, or when nothing is
    scored)."""
    if not run.main or not run.req.scoring:
        return None
    return Comparison(run.req.scoring, run.plan.eval)


def score(comparison: Comparison, run, teacher, student) -> dict:
    """The "eval" block of `student` (an nn.Module heal holds, or the LoadedModel of the written folder) against
    `teacher` (an nn.Module)."""
    if not isinstance(student, LoadedModel):
        student = as_loaded(student, run)
    return comparison(as_loaded(teacher, run), student)


def eval_report(comparison: Comparison, before: dict, after: dict) -> dict:
    """The report's "eval": the healed student's block, its `before` and the capability `change`, plus the
    deprecated keys of earlier releases."""
    change = {"tasks": None, "passkey": None}
    if comparison.options.capability:
        first, last = comparison.result_capability[0], comparison.result_capability[-1]
        change = side_by_side(first, last, ("before", "after"))
    report = {**after, "before": before, "change": change}
    _add_deprecated(report)
    return report


def _add_deprecated(report: dict) -> None:
    """heal's "eval" keys of the last release, still written for one more (docs/heal.md, CHANGELOG):
    `teacher_perplexity` (now `source_perplexity`), `after` (the healed student's TEXT_SCORES, now the block's own;
    `before` is now the student's whole block, which holds them too) and, per capability kind, `teacher`, `before`,
    `after` and `against_teacher` (now `source`, `change.<kind>.before`, `result` and `comparison`)."""
    text = report["perplexity"] is not None
    report["teacher_perplexity"] = report["source_perplexity"]
    report["after"] = {k: report[k] for k in TEXT_SCORES} if text else None
    for kind in ("tasks", "passkey"):
        scores = report[kind]
        if scores is not None:
            report[kind] = {
                **scores,
                "teacher": scores["source"],
                "before": report["change"][kind]["before"],
                "after": scores["result"],
                "against_teacher": scores["comparison"],
            }
