"""Files from probe results: per-head tables (parquet/csv via pandas) and a PNG of max logits and log Z."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError, UsageError
from attnkit.io.tempdirs import atomic_file

TABLE_SUFFIXES = (".parquet", ".csv")
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def check_output_path(path: str, option: str, suffixes: tuple[str, ...]) -> None:
    """An --out/--plot file name with a known suffix that is not a folder (checked before any model loads)."""
    if Path(path).suffix.lower() not in suffixes:
        raise UsageError(f"{option} {path}: use a {' or '.join(suffixes)} file name")
    if Path(path).is_dir():
        raise UsageError(f"{option} {path}: is a folder")


def write_table(results, path: str) -> None:
    """All models' per-head rows to .parquet or .csv, atomically (a failed write leaves no partial file)."""
    import pandas as pd

    check_output_path(path, "--out", TABLE_SUFFIXES)
    frame = pd.DataFrame([row for res in results for row in res.heads])
    with atomic_file(Path(path)) as tmp:
        if tmp.suffix.lower() == ".parquet":
            try:
                frame.to_parquet(tmp, index=False)
            except ImportError:
                raise AttnkitError("writing parquet needs pyarrow (pip install 'attnkit[parquet]')") from None
        else:
            frame.to_csv(tmp, index=False)


def _grid(rows: list[dict], key: str):
    """[layers, heads] array of `key` (NaN where missing)."""
    import numpy as np

    layers = sorted({r["layer"] for r in rows})
    heads = max(r["head"] for r in rows) + 1
    grid = np.full((len(layers), heads), np.nan)
    for r in rows:
        if r[key] is not None:
            grid[layers.index(r["layer"]), r["head"]] = r[key]
    return layers, grid


def plot(results, path: str, limit: float | None = None) -> None:
    """One row per model: layer x head heatmap of the max logit, on one colour scale for every model (so a
    clipped model is not shown as hot as its source), with `limit` (a --fail-if threshold on max_logit) marked
    on the colour bar; and per-layer log Z (mean and max over heads)."""
    check_output_path(path, "--plot", PLOT_SUFFIXES)
    try:
        import matplotlib
    except ImportError:
        raise AttnkitError("--plot needs matplotlib (pip install 'attnkit[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grids = [_grid(res.heads, "max_logit") for res in results]
    values = np.concatenate([grid[np.isfinite(grid)] for _, grid in grids] + [np.array([limit or np.nan])])
    values = values[np.isfinite(values)]
    vmin, vmax = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4 * len(results)), squeeze=False)
    for (heat, line), res, (layers, grid) in zip(axes, results, grids):
        image = heat.imshow(grid, aspect="auto", cmap="viridis", origin="lower", vmin=vmin, vmax=vmax)
        heat.set(title=f"{res.model}: max attention logit", xlabel="head", ylabel="layer")
        heat.set_yticks(range(len(layers)), layers if len(layers) <= 40 else None)
        bar = fig.colorbar(image, ax=heat)
        bar.set_label("max attention logit")
        if limit is not None:
            bar.ax.axhline(limit, color="red", linewidth=2)
        _, mean = _grid(res.heads, "logz_mean")
        _, high = _grid(res.heads, "logz_max")
        line.plot(layers, np.nanmean(mean, axis=1), marker="o", label="log Z mean")
        line.plot(layers, np.nanmax(high, axis=1), marker="^", label="log Z max")
        line.set(title=f"{res.model}: attention log Z per layer", xlabel="layer", ylabel="log Z")
        line.legend()
    notes = (["one colour scale for all models"] if len(results) > 1 else []) + (
        [f"red line: the --fail-if bound {limit:g}"] if limit is not None else []
    )
    if notes:
        fig.suptitle("; ".join(notes))
    fig.tight_layout()
    try:
        with atomic_file(Path(path)) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
