"""The `attnkit` command line: one module per command, registered here.

`main()` registers only the command it is asked to run (plus the root options), so a fast command
such as `attnkit kvmem` never imports the modules, nor builds the typer commands, of the others;
`attnkit --help`, a mistyped command and `attnkit.cli.app` get every command.
"""

from __future__ import annotations

import importlib
import sys

import typer

from attnkit import __version__

#: command name -> the attnkit.cli module whose register(app) adds it.
COMMANDS = {
    "inspect": "inspect_cmd",
    "kvmem": "kvmem_cmd",
    "eval": "eval_cmd",
    "probe": "probe_cmd",
    "presets": "presets_cmd",
    "diff": "diff_cmd",
    "export": "export_cmd",
    "convert": "convert_cmd",
    "retrofit": "retrofit_cmd",
    "verify": "verify_cmd",
    "heal": "heal_cmd",
}
HELP = "Analyse and rewrite the attention layers of transformer checkpoints."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnkit {__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Analyse and rewrite the attention layers of transformer checkpoints."""


def build_app(names: list[str] | None = None) -> typer.Typer:
    """The typer app with the commands in `names` (None: all of them)."""
    app = typer.Typer(
        name="attnkit", help=HELP, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False
    )
    app.callback()(_root)
    for name in COMMANDS if names is None else names:
        importlib.import_module(f"attnkit.cli.{COMMANDS[name]}").register(app)
    return app


def invoked(args: list[str]) -> list[str] | None:
    """The commands a run needs: the one `args` starts with, none for --version, and None (all of them) for
    --help, no arguments or a mistyped command, which list or suggest them."""
    if args[:1] == ["--version"]:
        return []
    return [args[0]] if args and args[0] in COMMANDS else None


def __getattr__(name: str):
    if name == "app":  # the full app, built on first use (tests, `from attnkit.cli import app`)
        app = globals()["app"] = build_app()
        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    from attnkit.cli.common import handle_signals, quiet_libraries

    handle_signals()
    quiet_libraries()
    build_app(invoked(sys.argv[1:]))()
