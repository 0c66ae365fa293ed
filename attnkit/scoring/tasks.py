"""Task accuracy through lm-evaluation-harness: the tasks users already run (hellaswag, arc, piqa, ... or local
YAML task folders), on a model as attnkit loads it, and a result beside its source with the paired difference on
the same items.

lm-eval is an optional dependency (`pip install 'attnkit[tasks]'`); everything here is checked before any
model loads: lm-eval is installed, the task folder holds YAML tasks, every task name is one lm-eval knows
(closest names suggested), and the numbers are in range.
"""

from __future__ import annotations

import difflib
import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError, UsageError
from attnkit.units import MAX_COUNT, check_bounds

#: z of a two-sided 95% interval (normal approximation of the paired mean difference).
Z95 = 1.959963984540054
#: Keys of an lm-eval result entry that are not metrics.
NOT_METRICS = ("name", "alias", "sample_len", "samples")


@dataclass(frozen=True)
class TaskSpec:
    """What to run: lm-eval task names, a folder of local YAML tasks, few-shot examples, items per task."""

    tasks: tuple[str, ...]
    tasks_dir: str | None = None
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 1


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise AttnkitError("task evaluation needs lm-eval: pip install 'attnkit[tasks]'") from None
    return lm_eval


def check_tasks(spec: TaskSpec):
    """The checks before any model loads; returns lm-eval's TaskManager (it indexes the tasks once)."""
    if not spec.tasks:
        raise UsageError("give at least one task name")
    if any(not t.strip() for t in spec.tasks):
        raise UsageError("empty task name in the task list")
    if spec.limit is not None:
        check_bounds("--limit", spec.limit, 1, MAX_COUNT)
    if spec.num_fewshot is not None:
        check_bounds("--num-fewshot", spec.num_fewshot, 0, 1024)
    check_bounds("--batch-size", spec.batch_size, 1, MAX_COUNT)
    if spec.tasks_dir is not None:
        folder = Path(spec.tasks_dir)
        if not folder.is_dir():
            raise UsageError(f"--tasks-dir {folder}: not a folder")
        if not any(folder.rglob("*.yaml")) and not any(folder.rglob("*.yml")):
            raise UsageError(f"--tasks-dir {folder}: holds no YAML task files")
    manager = _task_manager(spec.tasks_dir)
    known = set(manager.all_tasks)
    for task in spec.tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=3, cutoff=0.6)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise UsageError(f"unknown task {task!r}{hint} (lm-eval knows {len(known):,} tasks)")
    return manager


@functools.lru_cache(maxsize=4)
def _task_manager(tasks_dir: str | None):
    """lm-eval's TaskManager over its own tasks and those of `tasks_dir` (indexing them takes seconds: once)."""
    _lm_eval()
    from lm_eval.tasks import TaskManager

    from attnkit.runtime.lm_eval_model import quiet

    with quiet():
        return TaskManager(include_path=tasks_dir)


def run_tasks(loaded, spec: TaskSpec, manager) -> dict:
    """Score one loaded model: {"rows": [{task, metric, filter, value, stderr, n}], "items": {row key: {doc_id:
    value}}} with per-item values for the metrics lm-eval averages (the ones a paired difference applies to)."""
    lm_eval = _lm_eval()

    from attnkit.runtime.lm_eval_model import harness_model, quiet

    with quiet():
        out = lm_eval.simple_evaluate(
            model=harness_model(loaded, batch_size=spec.batch_size),
            tasks=list(spec.tasks),
            num_fewshot=spec.num_fewshot,
            limit=spec.limit,
            task_manager=manager,
            log_samples=True,
        )
    rows, items = [], {}
    for task, entry in out["results"].items():
        means = _mean_metrics(out.get("configs", {}).get(task, {}))
        samples = out.get("samples", {}).get(task, [])
        for key, value in entry.items():
            if key in NOT_METRICS or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            stderr = entry.get(f"{metric}_stderr,{filt}")
            row = {
                "task": task,
                "metric": metric,
                "filter": filt or None,
                "value": float(value),
                "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                "n": len(samples) or None,
            }
            rows.append(row)
            if metric in means:
                items[_key(row)] = {
                    s["doc_id"]: float(s[metric])
                    for s in samples
                    if s.get("filter", "none") == (filt or "none") and metric in s
                }
    return {"rows": rows, "items": items, "num_fewshot": spec.num_fewshot, "limit": spec.limit}


def _mean_metrics(config: dict) -> set[str]:
    """Metrics of a task config that lm-eval aggregates by a mean of per-item values."""
    return {
        m["metric"]
        for m in config.get("metric_list", [])
        if isinstance(m, dict) and m.get("aggregation", "mean") == "mean" and isinstance(m.get("metric"), str)
    }


def _key(row: dict) -> str:
    return f"{row['task']}|{row['metric']}|{row['filter'] or ''}"


def compare_tasks(source: dict, result: dict) -> list[dict]:
    """Rows of both models side by side: value of each, result - source, and for averaged metrics the paired
    difference's 95% interval over the items both scored (normal approximation; null for a single item)."""
    theirs = {_key(r): r for r in source["rows"]}
    rows = []
    for row in result["rows"]:
        src = theirs.get(_key(row))
        if src is None:
            continue
        low = high = None
        a, b = source["items"].get(_key(row)), result["items"].get(_key(row))
        if a and b:
            shared = sorted(set(a) & set(b))
            diffs = [b[i] - a[i] for i in shared]
            if len(diffs) > 1:
                half = Z95 * statistics.stdev(diffs) / math.sqrt(len(diffs))
                mean = statistics.fmean(diffs)
                low, high = mean - half, mean + half
        rows.append(
            {
                "task": row["task"],
                "metric": row["metric"],
                "filter": row["filter"],
                "source": src["value"],
                "result": row["value"],
                "difference": row["value"] - src["value"],
                "ci95_low": low,
                "ci95_high": high,
                "source_stderr": src["stderr"],
                "stderr": row["stderr"],
                "n": row["n"],
            }
        )
    return rows


def public(scores: dict) -> dict:
    """The part of run_tasks' scores that reports carry (the per-item values stay out)."""
    return {k: v for k, v in scores.items() if k != "items"}
