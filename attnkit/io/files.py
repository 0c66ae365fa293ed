"""Open an input file only when it is a regular file: a FIFO would block for ever, a device or socket never end,
a symlink loop never resolve. One place for the message every reader gives."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from attnkit.errors import AttnkitError

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


def special_kind(mode: int) -> str | None:
    """What a file of stat mode `mode` is when it is not a regular file ("a FIFO", "a character device", ...);
    None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path, what: str) -> BinaryIO:
    """`path` opened for binary reading, or an AttnkitError naming it and saying why it is not a `what` (the file
    is opened without blocking, so a FIFO is refused instead of waited on)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise AttnkitError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise AttnkitError(f"{path}: is a folder, not a {what}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise AttnkitError(f"{path}: a symlink loop, not a {what}") from None
        raise AttnkitError(f"{path}: cannot read ({exc.strerror or exc})") from None
    kind = special_kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise AttnkitError(f"{path}: is {kind}, not a {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
