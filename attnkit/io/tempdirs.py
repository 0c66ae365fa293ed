"""Temporary folders next to their targets that later runs can clean up, and atomic file writes.

A temp folder `.<target>.attnkit-tmp-<random>` holds a marker file with the owner's pid, host and
process start time. A process killed by SIGKILL (or the OOM killer, or a power cut) cannot remove
its folder; the next attnkit run that writes into the same parent folder (an output's parent, the
GGUF cache) removes every marked folder whose owner is gone from this host. Folders are deleted by
first renaming them to `.<target>.attnkit-del-<random>`, a name that means "garbage", so a deletion
cut short is finished by the next run too. Folders are created with the umask's permissions.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import threading
from pathlib import Path

from attnkit.errors import AttnkitError

MARKER = ".attnkit-owner"
TMP_TAG, OLD_TAG, DEL_TAG = ".attnkit-tmp-", ".attnkit-old-", ".attnkit-del-"


def make_temp_dir(parent: Path, name: str, tag: str = TMP_TAG, marked: bool = True) -> Path:
    """Create `parent/.<name><tag><random>` (mode 0o777 less the umask); `marked` records this process as owner."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f".{name}{tag}{secrets.token_hex(4)}"
        try:
            os.mkdir(path)  # unlike tempfile.mkdtemp (0o700), the umask decides who may read the output
        except FileExistsError:
            continue
        if marked:
            try:
                mark(path)
            except BaseException as exc:  # an unmarked folder would never be cleaned up by a later run
                shutil.rmtree(path, ignore_errors=True)
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    raise AttnkitError(f"disk full while writing in {parent}") from exc
                raise
        return path


def mark(folder: Path) -> None:
    """Record this process as the owner of `folder`."""
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
    (Path(folder) / MARKER).write_text(json.dumps(owner))


def unmark(folder: Path) -> None:
    """Remove the owner marker (just before a temp folder becomes the real output)."""
    (Path(folder) / MARKER).unlink(missing_ok=True)


def remove_tree(folder: Path) -> None:
    """Delete `folder`: renamed to a garbage name first, so an interrupted deletion is finished by a later run."""
    folder = Path(folder)
    with _signals_held():
        doomed = folder
        tag = next((t for t in (TMP_TAG, OLD_TAG) if t in folder.name), None)
        if tag is not None:
            trash = folder.with_name(folder.name.replace(tag, DEL_TAG, 1))
            with contextlib.suppress(OSError):
                folder.rename(trash)
                doomed = trash
        shutil.rmtree(doomed, ignore_errors=True)


def clean_stale(parent: Path) -> list[Path]:
    """Remove the temp folders in `parent` whose owner process is gone, and unfinished deletions; returns them."""
    try:
        entries = [e for e in Path(parent).iterdir() if e.name.startswith(".")]
    except OSError:
        return []
    removed = []
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        ours = TMP_TAG in entry.name or OLD_TAG in entry.name
        if DEL_TAG in entry.name or (ours and _owner_gone(entry)):
            remove_tree(entry)
            removed.append(entry)
    return removed


def follow_umask(folder: Path) -> None:
    """Give `folder` and everything in it the permissions the umask gives new files (libraries that write
    through private temp files leave 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    for root, dirs, files in os.walk(folder):
        for name in files:
            os.chmod(Path(root, name), 0o666 & ~mask)
        for name in dirs:
            os.chmod(Path(root, name), 0o777 & ~mask)
    os.chmod(folder, 0o777 & ~mask)


@contextlib.contextmanager
def atomic_file(path: Path):
    """Yield a temporary path to write; it replaces `path` only when the block succeeds (never half a file)."""
    path = Path(path).expanduser().absolute()
    if path.is_dir():
        raise AttnkitError(f"{path}: is a folder")
    clean_stale(path.parent)
    folder = make_temp_dir(path.parent, path.name)
    try:
        tmp = folder / path.name  # same name and suffix: writers that pick the format by suffix still do
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise AttnkitError(f"disk full while writing {path}") from exc
        raise
    finally:
        remove_tree(folder)


def _owner_gone(folder: Path) -> bool:
    """True when the folder's marker names a process of this host that no longer runs (pid reuse included)."""
    try:
        owner = json.loads((folder / MARKER).read_text()[:1000])
        pid, host, start = int(owner["pid"]), owner["host"], owner.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no readable marker: being created, or not ours to judge
    if os.name != "posix" or host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # exists, owned by another user
    current = _start_time(pid)
    return start is not None and current is not None and current != start


def _start_time(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux /proc), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT/SIGTERM/SIGHUP while a folder is deleted and deliver the first one after (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is not None:
            previous[sig] = signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending[0])
