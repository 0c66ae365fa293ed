"""Text input: read documents, cut them into fixed token windows, batch them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

from attnkit.errors import AttnkitError, UsageError


#: Bytes read at a time when checking that a text file is UTF-8.
CHECK_CHUNK = 1 << 20


def _jsonl(path: str, lines) -> list[str]:
    texts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, over-long integers, deep nesting
            raise AttnkitError(f"{path}:{n}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise AttnkitError(f"{path}:{n}: no string field 'text'")
        texts.append(record["text"])
    return texts


def _text_file(p: str) -> Path:
    """The path of a text input that exists and is a file (UsageError otherwise)."""
    path = Path(p)
    if path.is_dir():
        raise UsageError(f"{p}: is a folder, not a text file")
    if not path.is_file():
        raise UsageError(f"{p}: file not found")
    return path


def _undecodable(p: str, exc: UnicodeDecodeError, offset: int = 0) -> AttnkitError:
    return AttnkitError(f"{p}: not a UTF-8 text file (byte {offset + exc.start}); give .txt or .jsonl text")


def _binary(p: str) -> AttnkitError:
    return AttnkitError(f"{p}: a binary file (it holds NUL bytes), not text")


def check_text_files(paths: list[str]) -> None:
    """Check, streaming and without keeping the text, that every path (not "-") is a UTF-8 text file."""
    import codecs

    for p in paths:
        if p == "-":
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        try:
            with _text_file(p).open("rb") as fh:
                while chunk := fh.read(CHECK_CHUNK):
                    if b"\0" in chunk:
                        raise _binary(p)
                    decoder.decode(chunk)
                    offset += len(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise _undecodable(p, exc, offset) from None
        except OSError as exc:
            raise AttnkitError(f"{p}: cannot read ({exc.strerror or exc})") from None


def read_texts(paths: list[str], text: str | None = None) -> list[str]:
    """Documents from .txt files (one document each), .jsonl files (field `text`), "-" (stdin) and `text`."""
    texts: list[str] = []
    for p in paths:
        docs = _read_one(p)
        if any("\0" in doc for doc in docs):
            raise _binary(p)
        texts.extend(docs)
    if text is not None:
        texts.append(text)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UsageError("no text given: pass text files, '-' for stdin, or --text")
    return texts


def _read_one(p: str) -> list[str]:
    """The documents of one text input; undecodable bytes are an AttnkitError naming it."""
    try:
        if p == "-":
            return [sys.stdin.read()]
        path = _text_file(p)
        if path.suffix.lower() == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                return _jsonl(p, fh)
        return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError as exc:
        raise _undecodable("stdin" if p == "-" else p, exc) from None
    except OSError as exc:
        raise AttnkitError(f"{p}: cannot read ({exc.strerror or exc})") from None


def make_windows(tokenizer, texts: list[str], seq_len: int, max_tokens: int | None = None, *,
                 flags: tuple[str, str] = ("--seq-len", "--max-tokens")):
    """LongTensor [N, seq_len]: documents joined with EOS between them, cut into full windows, <= max_tokens in all.
    `flags` name the options that set seq_len and max_tokens, for the messages."""
    import torch

    seq_flag, tokens_flag = flags
    if seq_len < 2:
        raise UsageError(f"{seq_flag} must be at least 2")
    if max_tokens is not None and max_tokens < seq_len:
        raise UsageError(f"{tokens_flag} {max_tokens} is shorter than one window ({seq_flag} {seq_len})")
    if tokenizer is None:
        raise AttnkitError("the checkpoint has no tokenizer; cannot turn text into tokens")
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for i, doc in enumerate(texts):
        if i and eos is not None:
            ids.append(eos)
        ids.extend(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    n = len(ids) // seq_len
    if max_tokens is not None:
        n = min(n, max_tokens // seq_len)
    if n == 0:
        raise AttnkitError(f"the text has {len(ids)} tokens, shorter than one window of {seq_len}; "
                           f"give more text or a smaller {seq_flag}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)  # [N, seq_len]


def batches(windows, batch_size: int) -> Iterator:
    """Consecutive slices of `windows` [N, T] with at most `batch_size` rows."""
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start:start + batch_size]
