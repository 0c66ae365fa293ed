"""`attnkit eval --plot`: one figure of what eval measured that has a shape: a heat map of pass-key accuracy by
context length and depth of the key (one panel per model), and the scores by distance of the predicted token in
its window (perplexity of the model and, with a reference, the reference's and the KL between them)."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError, UsageError
from attnkit.io.tempdirs import atomic_file
from attnkit.scoring.capability import CapabilitySpec

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot(path: str | None, spec: CapabilitySpec, by_distance: bool) -> None:
    """--plot draws pass keys (--passkey) and/or scores by distance (text in windows longer than the first
    distance bucket), into a .png/.pdf/.svg file."""
    if path is None:
        return
    if spec.passkey is None and not by_distance:
        raise UsageError(
            "--plot draws pass-key accuracy or scores by distance: give --passkey, or text with a --seq-len longer "
            "than the first distance bucket"
        )
    if Path(path).suffix.lower() not in PLOT_SUFFIXES or Path(path).is_dir():
        raise UsageError(f"--plot {path}: use a {' or '.join(PLOT_SUFFIXES)} file name")


def plot_eval(path: str, passkeys: dict[str, dict] | None, distance: tuple[str, list[dict]] | None) -> None:
    """Pass-key heat maps ({model name: run_passkey scores}) and the by-distance panel ((model name, the
    evaluate rows)), side by side in one figure written atomically to `path`."""
    try:
        import matplotlib
    except ImportError:
        raise AttnkitError("--plot needs matplotlib (pip install 'attnkit[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(passkeys or {}) + int(distance is not None)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
    for ax, (name, scores) in zip(axes[0], (passkeys or {}).items()):
        _passkey_panel(fig, ax, name, scores)
    if distance is not None:
        _distance_panel(axes[0][-1], *distance)
    fig.tight_layout()
    try:
        with atomic_file(Path(path)) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


def _passkey_panel(fig, ax, name: str, scores: dict) -> None:
    """Pass-key accuracy by context length (rows) and depth of the key (columns)."""
    import numpy as np

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


def _distance_panel(ax, name: str, rows: list[dict]) -> None:
    """Perplexity per distance bucket (log scale), the reference's beside it and the KL on a second axis."""
    x = range(len(rows))
    ax.plot(x, [r["perplexity"] for r in rows], "o-", label=f"{name} perplexity")
    if rows[0]["reference_perplexity"] is not None:
        ax.plot(x, [r["reference_perplexity"] for r in rows], "s--", label="reference perplexity")
        kl = ax.twinx()
        kl.plot(x, [r["kl_mean"] for r in rows], "^:", color="tab:red", label="KL(reference || model)")
        kl.set_ylabel("KL per token (nats)", color="tab:red")
        kl.set_ylim(bottom=0)
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{r['start']:,}-{r['end']:,}" for r in rows], rotation=30, fontsize=8)
    ax.set(title="by distance", xlabel="position of the predicted token", ylabel="perplexity")
    ax.legend(loc="upper right", fontsize=8)
