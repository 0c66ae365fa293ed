"""`attnkit inspect MODEL`: the attention layout from config and headers (no torch)."""

from __future__ import annotations

import typer

from attnkit.cli.common import FORMAT_OPTION, OutputFormat, handle_errors
from attnkit.cli.output import Column, render


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    @handle_errors
    def inspect(
        model: str = typer.Argument(..., help="Folder, .safetensors, .gguf, config.json, hub id[@rev] or preset name."),
        fmt: OutputFormat = FORMAT_OPTION,
    ) -> None:
        """Attention layout from config and headers: heads, KV heads, head dim, variant, RoPE, windows, caps."""
        from attnkit.commands.analyse.inspect import inspect_model

        report = inspect_model(model)
        rows = [{"field": k, "value": v} for k, v in report["summary"].items()]
        render(rows, [Column("field", "field", justify="left"), Column("value", "value", justify="left")],
               fmt, title=f"attention layout: {model}", json_obj=report)
