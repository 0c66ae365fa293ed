"""Signals that must not be lost: the CLI's handler records the request here as well as raising it.

An exception raised by a Python signal handler appears wherever the main thread happens to be, and C
code that calls back into Python (PyO3, torch) may swallow it. The long loops therefore call
`check()` (every tensor read and written, and before an output is renamed into place), which raises
the recorded request again, so a SIGTERM is never silently ignored.
"""

from __future__ import annotations

_pending: BaseException | None = None


def request(exc: BaseException) -> None:
    """Record a termination request (KeyboardInterrupt, or attnkit.errors.Terminated)."""
    global _pending
    _pending = exc


def check() -> None:
    """Raise the recorded termination request, if any."""
    if _pending is not None:
        raise _pending
