"""What a model can do, beside what another one can: task accuracy (attnkit.scoring.tasks, lm-eval) and
long-context retrieval (attnkit.scoring.passkey). One spec, checked before any model loads, scored the same way
by `attnkit eval` (a model beside its reference) and by every writing command's report (convert, retrofit: the
result beside its source; heal: the student before and after training beside the teacher)."""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.archs import get_arch
from attnkit.io.resolve import resolve
from attnkit.scoring import passkey as passkeys
from attnkit.scoring import tasks as task_scores
from attnkit.scoring.passkey import PasskeySpec
from attnkit.scoring.tasks import TaskSpec


@dataclass(frozen=True)
class CapabilitySpec:
    """Tasks and pass keys to score; either may be None."""

    tasks: TaskSpec | None = None
    passkey: PasskeySpec | None = None

    def __bool__(self) -> bool:
        return self.tasks is not None or self.passkey is not None


def max_positions(ref: str) -> int | None:
    """A model's position limit (max_position_embeddings) from its config, without loading it."""
    ckpt = resolve(ref, need_weights=False)
    value = get_arch(ckpt.model_type).config_value(ckpt.config, "max_positions")
    return int(value) if value is not None else None


def check_capability(spec: CapabilitySpec, refs: list[str]):
    """Everything checkable before a model loads, for every model in `refs`; returns lm-eval's TaskManager for
    run_capability (None without tasks)."""
    if spec.passkey is not None:
        for ref in refs:
            passkeys.check_passkey(spec.passkey, max_positions(ref), ref)
    return task_scores.check_tasks(spec.tasks) if spec.tasks is not None else None


def run_capability(loaded, spec: CapabilitySpec, manager, name: str = "model") -> dict:
    """{"tasks": run_tasks scores or None, "passkey": run_passkey scores or None} of one loaded model."""
    return {
        "tasks": task_scores.run_tasks(loaded, spec.tasks, manager) if spec.tasks is not None else None,
        "passkey": passkeys.run_passkey(loaded, spec.passkey, name) if spec.passkey is not None else None,
    }


def side_by_side(first: dict, second: dict | None, names: tuple[str, str]) -> dict:
    """The report of one model's scores (`first`) and, when given, another's beside them: per kind
    {names[0]: ..., names[1]: ..., "comparison": rows of names[1] against names[0]}; `second` is the one the
    comparison measures (a result against its source, a model against its reference)."""
    out = {}
    for kind, public, compare in (
        ("tasks", task_scores.public, task_scores.compare_tasks),
        ("passkey", lambda s: s, passkeys.compare_passkey),
    ):
        a, b = first.get(kind), (second or {}).get(kind)
        if a is None:
            out[kind] = None
            continue
        out[kind] = {
            names[0]: public(a),
            names[1]: public(b) if b is not None else None,
            "comparison": compare(a, b) if b is not None else None,
        }
    return out
