"""Shared CLI plumbing: error handling, output formats, stderr console."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from enum import Enum
from typing import Callable, TypeVar

import typer

from attnkit.errors import EXIT_RUNTIME, AttnkitError, Terminated

F = TypeVar("F", bound=Callable)


@functools.cache
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


def log_sink(message: str) -> None:
    """Where every command's `log(message)` goes: one dim line on stderr, never wrapped, printed as it is (never
    read as markup or emoji codes: a path like runs/[test] stays whole)."""
    from rich.text import Text

    stderr.print(Text(message, style="dim"), soft_wrap=True)


def print_notes(notes: list[str] = (), warnings: list[str] = ()) -> None:
    """A report's notes and warnings on stderr, one line each, printed as they are (never read as markup)."""
    from rich.text import Text

    for label, style, lines in (("note", "yellow", notes), ("warning", "bold yellow", warnings)):
        for line in lines:
            stderr.print(Text.assemble((f"{label}: ", style), line), soft_wrap=True)


def examples(*lines: str) -> str:
    """The epilog of a command's --help: its example command lines."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in lines)


def debug_enabled() -> bool:
    return os.environ.get("ATTNKIT_DEBUG", "") not in ("", "0")


def fail(message: str, code: int = EXIT_RUNTIME) -> None:
    """Print one line to stderr and exit with `code` (the message is shown as is, never read as markup)."""
    from rich.text import Text

    try:
        stderr.print(Text.assemble(("error:", "bold red"), f" {message}"), soft_wrap=True)
    except Exception:  # noqa: BLE001 - a console that cannot print must not hide the exit code
        with contextlib.suppress(Exception):
            sys.stderr.write(f"error: {message.encode('ascii', 'backslashreplace').decode()}\n")
    raise typer.Exit(code)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _describe(exc: BaseException) -> str:
    """str(exc) on one line; exceptions whose str() itself fails are named by their type."""
    try:
        return _one_line(exc)
    except Exception:  # noqa: BLE001
        return type(exc).__name__


def _os_message(exc: OSError) -> str:
    """One line for an OSError that no command turned into its own message: what failed and where."""
    import errno

    filename = getattr(exc, "filename", None)
    where = f" {os.fsdecode(filename)}" if isinstance(filename, (str, bytes)) else ""
    if exc.errno == errno.ENOSPC:
        return _one_line(f"disk full{' while writing' + where if where else ''}")
    what = {
        errno.EACCES: "permission denied",
        errno.EROFS: "read-only file system",
        errno.ELOOP: "symlink loop",
        errno.ENOTDIR: "not a folder",
        errno.EISDIR: "is a folder",
        errno.ENOENT: "no such file or folder",
    }
    return _one_line(f"cannot use{where or ' a file'}: {what.get(exc.errno) or exc.strerror or _describe(exc)}")


def _library_message(exc: BaseException) -> str | None:
    """attnkit's words for what the numeric libraries raise on inputs they cannot handle, or None."""
    name = type(exc).__name__
    first = _describe(exc).split(". ")[0]
    if name == "LinAlgError":
        return (
            f"a matrix factorization failed ({first}); the calibration text may be too short or too "
            "repetitive: give more varied --calib text"
        )
    if name == "OutOfMemoryError":
        return f"out of GPU memory ({first}); try fewer tokens, a smaller --batch-size or --device cpu"
    return None


def _on_signal(signum, _frame) -> None:
    import signal

    from attnkit import interrupts

    exc = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum, signal.Signals(signum).name)
    interrupts.request(exc)  # raised again at the next tensor read or write if a library swallows it here
    raise exc


def handle_signals() -> None:
    """Make SIGTERM and SIGHUP unwind like Ctrl-C (temp folders removed, exit 143 / 129), and make none of the
    three lost when a library swallows the exception (attnkit.interrupts); main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _on_signal)


def quiet_libraries() -> None:
    """What the libraries print on their own is off in CLI runs, which show one progress display of their
    own (attnkit.progress): transformers logs errors only, FutureWarning and DeprecationWarning are hidden,
    as are the UserWarnings of torch, transformers, accelerate and huggingface_hub, and when stderr is not a
    terminal every tqdm bar (transformers' loading, GGUF and shard-writing bars) is off. Set before those
    libraries are imported; ATTNKIT_DEBUG=1 leaves everything on."""
    import warnings

    if debug_enabled():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not is_terminal():
        os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|accelerate|huggingface_hub)\b")


def handle_errors(fn: F) -> F:
    """Turn exceptions into one-line messages and exit codes (traceback with ATTNKIT_DEBUG=1); the command runs
    inside one progress display (attnkit.progress, shown in a terminal only)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from attnkit.progress import display

        try:
            with display(_stderr_console):
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except AttnkitError as exc:
            if debug_enabled():
                raise
            fail(_describe(exc), exc.exit_code)
        except Terminated as exc:
            if debug_enabled():
                raise
            fail(f"terminated ({exc.name})", exc.exit_code)
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            fail("interrupted", 130)
        except OSError as exc:
            if debug_enabled():
                raise
            fail(_os_message(exc))
        except MemoryError:
            if debug_enabled():
                raise
            fail("out of memory: try fewer tokens, a smaller --batch-size or another --device")
        except Exception as exc:  # noqa: BLE001 - last-resort one-line report
            if debug_enabled():
                raise
            fail(
                _library_message(exc)
                or f"{type(exc).__name__}: {_describe(exc)} (set ATTNKIT_DEBUG=1 for the traceback)"
            )

    return wrapper  # type: ignore[return-value]


def is_terminal() -> bool:
    """True when stderr is an interactive terminal (progress bars are shown only then)."""
    return sys.stderr.isatty()
