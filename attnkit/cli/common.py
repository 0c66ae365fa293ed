"""Shared CLI plumbing: error handling, output formats, stderr console."""

from __future__ import annotations

import functools
import os
import sys
from enum import Enum
from typing import Callable, TypeVar

import typer

from attnkit.errors import AttnkitError, EXIT_RUNTIME

F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=None)
def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


class _LazyConsole:
    """The stderr console for logs, progress and warnings (data goes to stdout); rich loads on first use."""

    def __getattr__(self, name):
        return getattr(_stderr_console(), name)


stderr = _LazyConsole()


class OutputFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"
    markdown = "markdown"


FORMAT_OPTION = typer.Option(
    OutputFormat.table, "--format", "-f", help="Output format: table, json, csv or markdown."
)
#: --device and --dtype of the commands that run a model (eval, probe).
DEVICE_OPTION = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps.")
DTYPE_OPTION = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")


def debug_enabled() -> bool:
    return os.environ.get("ATTNKIT_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = EXIT_RUNTIME) -> None:
    """Print one line to stderr and exit with `code`."""
    stderr.print(f"[bold red]error:[/] {message}", soft_wrap=True, markup=True)
    raise typer.Exit(code)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def handle_errors(fn: F) -> F:
    """Turn exceptions into one-line messages and exit codes (traceback with ATTNKIT_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except AttnkitError as exc:
            if debug_enabled():
                raise
            fail(_one_line(str(exc)), exc.exit_code)
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            fail("interrupted", 130)
        except OSError as exc:
            if debug_enabled():
                raise
            where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
            fail(_one_line(f"{exc.strerror or exc}{where}"))
        except Exception as exc:  # noqa: BLE001 - last-resort one-line report
            if debug_enabled():
                raise
            fail(_one_line(f"{type(exc).__name__}: {exc} (set ATTNKIT_DEBUG=1 for the traceback)"))

    return wrapper  # type: ignore[return-value]


def is_terminal() -> bool:
    """True when stderr is an interactive terminal (progress bars are shown only then)."""
    return sys.stderr.isatty()
