"""Safe output folders and a streaming safetensors writer with Hugging Face shard names."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from attnkit import interrupts
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_NAME, SIDE_FILES, inside, safetensors_files
from attnkit.io.tempdirs import OLD_TAG, clean_stale, make_temp_dir, remove_tree, unmark

SINGLE_NAME = "model.safetensors"
#: torch dtype name -> safetensors dtype code.
TORCH_TO_SAFETENSORS = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}


def _disk_full(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def _fsync_path(path: Path) -> None:
    """Flush one file's data, or one folder's entries, to disk. Folders are skipped where the OS or the
    filesystem cannot open or fsync them (Windows, some network filesystems); file errors pass through."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then the folders themselves, deepest first."""
    for root, _subfolders, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync_path(Path(root, name))
        _fsync_path(Path(root))


def check_writable_parent(target: Path) -> None:
    """The folder that will hold `target` can hold it: its nearest existing ancestor is a folder this process may
    create entries in (checked before any work, so a read-only or misplaced target fails in one line at once)."""
    parent = Path(target).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise AttnkitError(f"{target}: cannot be created, {parent} is a file and not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise AttnkitError(f"{target}: cannot write into {parent} (permission denied)")


class OutputDir:
    """Write into a temp folder next to `target`; `commit()` renames it into place, anything else removes it.

    The temp folder is made when `path` is first used, so a command that works long before it writes
    leaves nothing behind until then. Leaving the `with` block without `commit()` (cleanly or by any
    exception, Ctrl-C and SIGTERM included) deletes it and leaves `target` untouched. Entering the block
    removes temp folders that killed runs left next to `target` (attnkit.io.tempdirs). `sources` (input
    folders or files) may not be the target, lie inside it, or hold it.
    """

    def __init__(self, target: Path, overwrite: bool = False, sources: Iterable[Path] = ()):
        self.target = Path(target).expanduser().absolute()
        self.overwrite = overwrite
        self._path: Path | None = None
        self._entered = False
        self.committed = False
        real = self.target.resolve()
        for source in sources:
            source = Path(source).expanduser().resolve()
            if real == source or real in source.parents:
                raise AttnkitError(f"{self.target}: output would replace the input {source}; choose another folder")
            if source in real.parents:
                raise AttnkitError(
                    f"{self.target}: output would be written inside the input {source}; choose a folder outside it"
                )
        self._check_target()

    def _check_target(self) -> None:
        if self.target.is_symlink() and not self.target.exists():
            raise AttnkitError(
                f"{self.target}: a symlink that leads nowhere ({os.readlink(self.target)}); remove it or choose "
                "another folder"
            )
        if self.target.exists() and not self.target.is_dir():
            raise AttnkitError(f"{self.target}: exists and is not a folder")
        if self.target.is_dir() and any(self.target.iterdir()) and not self.overwrite:
            raise AttnkitError(f"{self.target}: folder is not empty (pass --overwrite to replace it)")
        check_writable_parent(self.target)

    @property
    def path(self) -> Path:
        """The temp folder (created on first use)."""
        if not self._entered or self.committed:
            raise AttnkitError(f"{self.target}: the temp folder exists only inside an uncommitted `with` block")
        if self._path is None:
            self._path = make_temp_dir(self.target.parent, self.target.name)
        return self._path

    def __enter__(self) -> OutputDir:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(self.target.parent)
        self._entered = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.committed and self._path is not None:
            remove_tree(self._path)
        if _disk_full(exc):
            raise AttnkitError(f"disk full while writing {self.target}") from exc

    def commit(self, verifier: Callable[[Path], None] | None = None) -> Path:
        """Run `verifier(temp folder)` if given, then move the result to the target; returns the target."""
        if not self._entered or self.committed:
            raise AttnkitError(f"{self.target}: commit() needs an open, uncommitted OutputDir")
        path = self.path
        if verifier is not None:
            verifier(path)
        sync_tree(path)  # the data is on disk before the rename makes it visible
        self._check_target()  # the target may have changed while we worked
        interrupts.check()  # a signal whose exception a library swallowed still stops the rename
        unmark(path)
        if self.target.is_dir():
            # Unmarked until the new folder is in place: a run killed between the two renames leaves the
            # previous output in .<name>.attnkit-old-*, which no cleanup touches.
            old = make_temp_dir(self.target.parent, self.target.name, OLD_TAG, marked=False)
            self.target.rename(old / "previous")
            try:
                path.rename(self.target)
            except BaseException:
                (old / "previous").rename(self.target)
                remove_tree(old)
                raise
            self.committed = True
            remove_tree(old)
        else:
            path.rename(self.target)
            self.committed = True
        _fsync_path(self.target.parent)  # and the rename itself
        return self.target


class ShardedWriter:
    """Buffer tensors and write safetensors shards of at most `max_shard_bytes` (a bigger tensor gets its own).

    Peak memory is about one shard plus one tensor. Tensors must not be modified in place
    after `add` until `finish` returns. `folder` may be a function that returns the folder: it is
    called when the first shard is written (e.g. `lambda: out.path` of an OutputDir, so the temp
    folder appears only once there is something to write).
    """

    def __init__(self, folder: Path | Callable[[], Path], max_shard_bytes: int = 5 * 2**30):
        if max_shard_bytes <= 0:
            raise AttnkitError(f"max shard size must be positive, got {max_shard_bytes}")
        self._folder = folder
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_size = 0
        self.total_parameters = 0

    @property
    def tensors(self) -> int:
        """How many tensors were added."""
        return len(self._names)

    @property
    def folder(self) -> Path:
        if callable(self._folder):
            self._folder = self._folder()
        return Path(self._folder)

    def add(self, name: str, tensor, scanned: bool = False) -> None:
        """Queue `tensor` under `name`; writes a shard first when it would overflow the current one. A tensor
        holding NaN or Inf is refused (so what a writer wrote needs no second scan); `scanned`: the caller copies
        it unchanged from a source that was scanned when opened (attnkit.io.source.open_source), so it is not
        scanned again."""
        from attnkit.io.finite import is_finite

        interrupts.check()
        if name in self._names:
            raise AttnkitError(f"{self.folder}: tensor {name!r} added twice")
        tensor = tensor.detach().to("cpu").contiguous()
        if not scanned and not is_finite(tensor):
            raise AttnkitError(f"tensor {name!r} holds NaN or Inf; the output would not run")
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if storage.nbytes() != nbytes or any(
            t.untyped_storage().data_ptr() == storage.data_ptr() for t in self._buffer.values()
        ):
            tensor = tensor.clone()  # own storage: tied weights and views of larger tensors
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor
        self._buffer_bytes += nbytes
        self._names.add(name)
        self.total_size += nbytes
        self.total_parameters += tensor.numel()

    def _flush(self) -> None:
        path = self.folder / f".shard-{len(self._shards) + 1:05d}.safetensors.partial"
        write_safetensors(path, self._buffer, {"format": "pt"})
        self._shards.append((path, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> dict:
        """Write the last shard, give shards their HF names, write the index if sharded; returns the index."""
        if self._buffer:
            self._flush()
        if not self._shards:
            raise AttnkitError(f"{self.folder}: no tensors were written")
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self._shards, start=1):
            final = SINGLE_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {
            "metadata": {"total_parameters": self.total_parameters, "total_size": self.total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        if n > 1:
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return index


def write_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """Write contiguous CPU tensors as one safetensors file, streaming each tensor's bytes (OSErrors pass through)."""
    import torch

    # Widest dtypes first, so every tensor starts aligned to its element size.
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": torch_dtype_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for t in tensors.values():
            if t.numel():
                fh.write(t.reshape(-1).view(torch.uint8).numpy().data)


def torch_dtype_code(dtype) -> str:
    """The safetensors dtype string of a torch dtype."""
    code = TORCH_TO_SAFETENSORS.get(str(dtype).removeprefix("torch."))
    if code is None:
        raise AttnkitError(f"cannot store dtype {dtype} in safetensors")
    return code


def copy_side_files(src_root: Path, dst: Path) -> list[str]:
    """Copy tokenizer, generation and chat-template files (not weights, config.json or index); returns names."""
    patterns = [p for p in SIDE_FILES if p != "config.json"]
    copied = []
    for src in sorted(Path(src_root).iterdir()):
        if src.is_file() and any(fnmatch.fnmatch(src.name, p) for p in patterns):
            inside(Path(src_root), src.name, src)  # a link out of the checkpoint would copy that file into OUT
            shutil.copyfile(src, Path(dst) / src.name)  # follows hub-cache symlinks
            copied.append(src.name)
    return copied


def verify_output(folder: Path, expected: dict[str, tuple[int, ...]] | None = None, scan: bool = True) -> None:
    """Check names and shapes against `expected` (when given) and, with `scan`, that no tensor holds NaN/Inf
    (tensors a ShardedWriter wrote were scanned when added)."""
    from attnkit.io.finite import check_finite_files
    from attnkit.io.reader import LazyReader

    folder = Path(folder)
    files = safetensors_files(folder)
    if not files:
        raise AttnkitError(f"{folder}: no safetensors weights were written")
    if expected is not None:
        with LazyReader(files) as reader:
            _check_shapes(folder, reader, expected)
    if scan:
        check_finite_files(files, folder)


def _check_shapes(folder: Path, reader, expected: dict[str, tuple[int, ...]]) -> None:
    names = set(reader.names())
    missing = sorted(set(expected) - names)
    extra = sorted(names - set(expected))
    if missing:
        raise AttnkitError(f"{folder}: {len(missing)} expected tensor(s) missing, e.g. {missing[0]!r}")
    if extra:
        raise AttnkitError(f"{folder}: {len(extra)} unexpected tensor(s), e.g. {extra[0]!r}")
    for name, shape in expected.items():
        got = reader.info(name).shape
        if tuple(got) != tuple(shape):
            raise AttnkitError(f"{folder}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
