"""The `attnkit` command line: one module per command, registered here."""

from __future__ import annotations

import typer

from attnkit import __version__
from attnkit.cli import inspect_cmd, kvmem_cmd, presets_cmd
from attnkit.cli import eval_cmd
from attnkit.cli import probe_cmd
from attnkit.cli import convert_cmd
from attnkit.cli import retrofit_cmd
from attnkit.cli import verify_cmd
from attnkit.cli.common import handle_signals
from attnkit.cli import heal_cmd

app = typer.Typer(
    name="attnkit",
    help="Analyse and rewrite the attention layers of transformer checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Analyse and rewrite the attention layers of transformer checkpoints."""


inspect_cmd.register(app)
kvmem_cmd.register(app)
eval_cmd.register(app)
probe_cmd.register(app)
presets_cmd.register(app)
convert_cmd.register(app)
verify_cmd.register(app)
app.add_typer(retrofit_cmd.app)
heal_cmd.register(app)


def main() -> None:
    handle_signals()
    app()
