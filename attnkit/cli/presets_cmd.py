"""`attnkit presets`: the embedded model presets that kvmem and inspect accept by name."""

from __future__ import annotations

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors
from attnkit.cli.options import Format
from attnkit.cli.output import Column, render


def register(app: typer.Typer) -> None:
    @app.command("presets", epilog=examples("attnkit presets", "attnkit presets --format json"))
    @handle_errors
    def presets(fmt: Format = OutputFormat.table) -> None:
        """List embedded model presets (published configs, usable offline) with their sources."""
        from attnkit.archs.spec import attention_spec
        from attnkit.presets import all_presets

        rows = []
        for p in all_presets().values():
            spec = attention_spec(p.config)
            rows.append(
                {
                    "name": p.name,
                    "model_type": spec.model_type,
                    "variant": spec.variant,
                    "layers": spec.num_layers,
                    "parameters": p.parameters,
                    "source": p.source,
                    "url": p.url,
                    "aliases": list(p.aliases),
                }
            )
        columns = [
            Column("name", "name", justify="left"),
            Column("model_type", "model_type", justify="left"),
            Column("variant", "variant", justify="left"),
            Column("layers", "layers"),
            Column("parameters", "parameters", lambda v: f"{v / 1e9:.2f}B"),
            Column("source", "source", justify="left"),
        ]
        render(rows, columns, fmt, title="model presets", json_obj=rows)
