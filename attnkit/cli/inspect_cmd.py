"""`attnkit inspect MODEL`: the attention layout from config and headers (no torch)."""

from __future__ import annotations

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors
from attnkit.cli.options import Format
from attnkit.cli.output import Column, render


def csv_row(report: dict) -> dict:
    """inspect's JSON as one CSV row: the spec's fields at the top level, MLA dims as mla_<name>."""
    spec = dict(report["spec"])
    mla = spec.pop("mla") or {}
    top = {k: v for k, v in report.items() if k not in ("spec", "summary")}
    return {**top, **spec, **{f"mla_{k}": v for k, v in mla.items()}}


def register(app: typer.Typer) -> None:
    @app.command(
        "inspect",
        epilog=examples(
            "attnkit inspect ./my-model",
            "attnkit inspect SmolLM2-135M-Instruct.Q4_1.gguf --format json",
            "attnkit inspect llama-3.1-8b --format csv",
        ),
    )
    @handle_errors
    def inspect(
        model: str = typer.Argument(..., help="Folder, .safetensors, .gguf, config.json, hub id[@rev] or preset name."),
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Attention layout from config and headers: heads, KV heads, head dim, variant, RoPE, windows, caps."""
        from attnkit.commands.analyse.inspect import inspect_model

        report = inspect_model(model)
        if fmt == OutputFormat.csv:  # data, one row: the JSON document flattened
            rows = [csv_row(report)]
        else:
            rows = [{"field": k, "value": v} for k, v in report["summary"].items()]
        render(
            rows,
            [Column("field", "field", justify="left"), Column("value", "value", justify="left")],
            fmt,
            title=f"attention layout: {model}",
            json_obj=report,
        )
