"""What a model can do, beside what another one can: task accuracy (attnkit.commands.analyse.tasks, lm-eval) and
long-context retrieval (attnkit.commands.analyse.passkey). One spec, checked before any model loads, scored the
same way by `attnkit eval`, by every rewrite's report (convert, retrofit: source beside result) and by heal
(teacher, student before and after)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnkit.archs import get_arch
from attnkit.commands.analyse import passkey as passkeys
from attnkit.commands.analyse import tasks as task_scores
from attnkit.commands.analyse.passkey import PasskeySpec
from attnkit.commands.analyse.tasks import TaskSpec
from attnkit.errors import AttnkitError
from attnkit.io.resolve import resolve
from attnkit.io.tempdirs import atomic_file

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


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


def before_after(abilities: dict, after: dict) -> dict:
    """heal's capability report: per kind the teacher's, the student's before and after scores, what healing
    changed (after against before) and what is left (after against the teacher); null when not asked for."""
    out = {}
    for kind in ("tasks", "passkey"):
        if abilities.get("teacher", {}).get(kind) is None:
            out[kind] = None
            continue
        teacher, before, healed = (scores[kind] for scores in (abilities["teacher"], abilities["before"], after))
        gained = side_by_side({kind: before}, {kind: healed}, ("before", "after"))[kind]
        left = side_by_side({kind: teacher}, {kind: healed}, ("teacher", "after"))[kind]
        out[kind] = {"teacher": left["teacher"], **gained, "against_teacher": left["comparison"]}
    return out


def check_plot(path: str | None, spec: CapabilitySpec) -> None:
    """--plot: a heat map of pass-key accuracy, so it needs --passkey and a .png/.pdf/.svg name."""
    from attnkit.errors import UsageError

    if path is None:
        return
    if spec.passkey is None:
        raise UsageError("--plot draws the pass-key accuracy: give --passkey")
    if Path(path).suffix.lower() not in PLOT_SUFFIXES or Path(path).is_dir():
        raise UsageError(f"--plot {path}: use a {' or '.join(PLOT_SUFFIXES)} file name")


def plot_passkey(results: dict[str, dict], path: str) -> None:
    """One heat map per model: pass-key accuracy by context length (rows) and depth of the key (columns)."""
    try:
        import matplotlib
    except ImportError:
        raise AttnkitError("--plot needs matplotlib (pip install 'attnkit[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results) + 1, 4), squeeze=False)
    for ax, (name, scores) in zip(axes[0], results.items()):
        lengths = [r["length"] for r in scores["by_length"]]
        depths = scores["depths"]
        grid = np.full((len(lengths), len(depths)), np.nan)
        for cell in scores["cells"]:
            grid[lengths.index(cell["length"]), depths.index(cell["depth"])] = cell["accuracy"]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower", vmin=0, vmax=1)
        ax.set(title=f"{name}: pass key ({scores['variant']})", xlabel="depth of the key", ylabel="context tokens")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_yticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        for i in range(len(lengths)):
            for j in range(len(depths)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(image, ax=ax).set_label("accuracy")
    fig.tight_layout()
    try:
        with atomic_file(Path(path)) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
