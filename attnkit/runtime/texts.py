"""Text input: read documents, cut them into fixed token windows, batch them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator

from attnkit.errors import AttnkitError, UsageError


def _jsonl(path: str, lines) -> list[str]:
    texts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise AttnkitError(f"{path}:{n}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise AttnkitError(f"{path}:{n}: no string field 'text'")
        texts.append(record["text"])
    return texts


def read_texts(paths: list[str], text: str | None = None) -> list[str]:
    """Documents from .txt files (one document each), .jsonl files (field `text`), "-" (stdin) and `text`."""
    texts: list[str] = []
    for p in paths:
        if p == "-":
            texts.append(sys.stdin.read())
            continue
        path = Path(p)
        if not path.is_file():
            raise AttnkitError(f"{p}: file not found")
        if path.suffix.lower() == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                texts.extend(_jsonl(p, fh))
        else:
            texts.append(path.read_text(encoding="utf-8"))
    if text is not None:
        texts.append(text)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UsageError("no text given: pass text files, '-' for stdin, or --text")
    return texts


def make_windows(tokenizer, texts: list[str], seq_len: int, max_tokens: int | None = None):
    """LongTensor [N, seq_len]: documents joined with EOS between them, cut into full windows, <= max_tokens in all."""
    import torch

    if seq_len < 2:
        raise UsageError("--seq-len must be at least 2")
    if max_tokens is not None and max_tokens < seq_len:
        raise UsageError(f"--max-tokens {max_tokens} is shorter than one window (--seq-len {seq_len})")
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
                           "give more text or a smaller --seq-len")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)  # [N, seq_len]


def batches(windows, batch_size: int) -> Iterator:
    """Consecutive slices of `windows` [N, T] with at most `batch_size` rows."""
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start:start + batch_size]
