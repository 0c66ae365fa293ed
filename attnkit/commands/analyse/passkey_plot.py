"""`attnkit eval --plot`: a heat map of pass-key accuracy by context length and depth of the key, one panel per
model."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError, UsageError
from attnkit.io.tempdirs import atomic_file
from attnkit.scoring.capability import CapabilitySpec

PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_plot(path: str | None, spec: CapabilitySpec) -> None:
    """--plot: a heat map of pass-key accuracy, so it needs --passkey and a .png/.pdf/.svg name."""
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
