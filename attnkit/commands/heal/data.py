"""Training text from files: .txt, .jsonl, .parquet or a local `datasets` folder, as token windows split into
training and validation parts, and a digest that identifies the data of a run."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.runtime.texts import Texts

#: Bytes read at a time when hashing data files.
HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class DataFiles:
    """The --data paths as text for attnkit.runtime.texts.make_windows: .txt (one document), .jsonl ('text'
    field), .parquet and folders (a `text` column, through the `datasets` library), read lazily piece by piece.
    A path without text is an error once it is reached."""

    paths: tuple[str, ...]

    def pieces(self) -> Iterator[tuple[str, bool]]:

        for p in self.paths:
            path = Path(p)
            found = False
            if path.is_dir() or path.suffix.lower() == ".parquet":
                pieces = ((text, True) for text in _dataset_texts(path) if text.strip())
            else:
                pieces = Texts((p,)).pieces()
            for piece in pieces:
                found = True
                yield piece
            if not found:
                raise AttnkitError(f"{p}: no text in this data file")


def _dataset_texts(path: Path) -> Iterator[str]:
    """The `text` column of a parquet file, a folder saved by `save_to_disk`, or a folder of data files, row by
    row (the `datasets` library memory-maps the data)."""
    try:
        import datasets
    except ImportError:
        raise AttnkitError(
            f"{path}: reading parquet files and dataset folders needs the `datasets` package "
            "(pip install 'attnkit[heal]')"
        ) from None
    datasets.disable_progress_bars()
    try:
        if path.is_file():
            ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        elif (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(path), split="train")
    except (ValueError, FileNotFoundError, OSError) as exc:
        raise AttnkitError(f"{path}: cannot read as a dataset ({str(exc).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise AttnkitError(f"{path}: dataset has no 'train' split (has {', '.join(ds)})")
        ds = ds["train"]
    if "text" not in ds.column_names:
        raise AttnkitError(f"{path}: no 'text' column (columns: {', '.join(ds.column_names)})")
    for batch in ds.select_columns(["text"]).iter(batch_size=256):
        yield from (t for t in batch["text"] if isinstance(t, str))


def split_windows(windows, val_tokens: int):
    """(train [N - n, T], validation [n, T]): the validation part is the last val_tokens of the stream."""
    n_val = max(1, val_tokens // windows.shape[1])
    if windows.shape[0] < n_val + 1:
        raise AttnkitError(
            f"the training text gives {windows.shape[0]} window(s) of {windows.shape[1]} tokens: "
            f"too few for {n_val} validation window(s) plus training; give more text or a smaller "
            "--val-tokens"
        )
    return windows[:-n_val], windows[-n_val:]


def files_digest(paths: list[str]) -> str:
    """sha256 over the names and contents of data files (folders: every file inside, sorted)."""
    h = hashlib.sha256()
    for p in paths:
        path = Path(p)
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
            with f.open("rb") as fh:
                while chunk := fh.read(HASH_CHUNK):
                    h.update(chunk)
    return h.hexdigest()
