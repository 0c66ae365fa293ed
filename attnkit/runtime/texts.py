"""Text input: read documents lazily, turn them into token windows that start as the tokenizer starts a text.

One rule for every command that runs a model on text (eval, probe, diff, calibration, heal, verify, greedy
samples): a window begins with the tokens the tokenizer puts in front of any text (its BOS where it adds
one, nothing where it adds none), followed by the text's tokens; documents are joined by EOS and that same
prefix. Text is read and tokenized piece by piece and only as far as the windows asked for need it, so
memory does not grow with the size of a file when a token budget is given.
"""

from __future__ import annotations

import io
import json
import stat
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError, UsageError
from attnkit.io.files import special_kind
from attnkit.units import MAX_TOKENS, check_bounds

#: Bytes read at a time when checking that a text file is UTF-8.
CHECK_CHUNK = 1 << 20
#: Characters of a text tokenized at a time: the first piece of a document FIRST_PIECE_CHARS, each next one twice
#: the last up to PIECE_CHARS (so a small token budget reads little), each cut after its last line break (else
#: space); a document shorter than the first piece is tokenized whole.
FIRST_PIECE_CHARS = 1 << 16
PIECE_CHARS = 1 << 20


#: What a pipe given as a text file is told (what `<(zcat x)` passes: it can be read once, and may never end).
PIPE = "a pipe (FIFO): give its text on stdin as '-' (e.g. `zcat x.gz | attnkit ... -`)"


def _text_file(p: str) -> Path:
    """The path of a text input that exists and is a regular file (an AttnkitError naming it otherwise, exit 1 like
    every problem with an input); a pipe or device is said to be one, never opened (it may never end)."""
    path = Path(p)
    if path.is_dir():
        raise AttnkitError(f"{p}: is a folder, not a text file")
    try:
        mode = path.stat().st_mode
    except OSError:
        raise AttnkitError(f"{p}: file not found") from None
    kind = special_kind(mode)
    if kind == "not a regular file":
        raise AttnkitError(f"{p}: not a regular text file")
    if kind is not None:
        raise AttnkitError(f"{p}: is {PIPE if stat.S_ISFIFO(mode) else kind}, not a text file")
    return path


def _undecodable(p: str, exc: UnicodeDecodeError, offset: int = 0) -> AttnkitError:
    return AttnkitError(f"{p}: not a UTF-8 text file (byte {offset + exc.start}); give .txt or .jsonl text")


def _binary(p: str) -> AttnkitError:
    return AttnkitError(f"{p}: a binary file (it holds NUL bytes), not text")


def check_text_files(paths: list[str]) -> None:
    """Check, streaming and without keeping the text, that every path (not "-") is a UTF-8 text file that holds
    more than whitespace, and that every line of a .jsonl file is a JSON object with a string field 'text' (no
    NUL in it)."""
    import codecs

    for p in paths:
        if p == "-":
            continue
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset, blank = 0, True
        try:
            with _text_file(p).open("rb") as fh:
                while chunk := fh.read(CHECK_CHUNK):
                    if b"\0" in chunk:
                        raise _binary(p)
                    decoder.decode(chunk)
                    offset += len(chunk)
                    blank = blank and not chunk.strip()
                decoder.decode(b"", final=True)
            if p.lower().endswith(".jsonl"):
                blank = True
                with open(p, encoding="utf-8") as fh:
                    for doc in _jsonl(p, fh):  # every line checked, none kept
                        blank = blank and not doc.strip()
        except UnicodeDecodeError as exc:
            raise _undecodable(p, exc, offset) from None
        except OSError as exc:
            raise AttnkitError(f"{p}: cannot read ({exc.strerror or exc})") from None
        if blank:
            raise AttnkitError(f"{p}: holds no text (it is empty or only whitespace)")


def _pieces(fh) -> Iterator[str]:
    """A text stream in pieces of FIRST_PIECE_CHARS growing to PIECE_CHARS characters, each cut after its last
    line break or space."""
    carry, size = "", min(FIRST_PIECE_CHARS, PIECE_CHARS)
    while block := fh.read(size):
        full = len(block) == size
        block = carry + block
        size = min(2 * size, PIECE_CHARS)
        cut = block.rfind("\n")
        if cut < 0:
            cut = block.rfind(" ")
        if cut < 0 or not full:  # no boundary to cut at, or the end of the stream
            carry = ""
            yield block
            continue
        carry = block[cut + 1 :]
        yield block[: cut + 1]
    if carry:
        yield carry


def _jsonl(path: str, lines) -> Iterator[str]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, over-long integers, deep nesting
            raise AttnkitError(f"{path}:{n}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise AttnkitError(f"{path}:{n}: no string field 'text'")
        if "\0" in record["text"]:
            raise AttnkitError(f"{path}:{n}: the text holds a NUL character (\\u0000): binary data, not text")
        yield record["text"]


@dataclass(frozen=True)
class Texts:
    """Documents from .txt files (one document each), .jsonl files (field `text`), stdin and a literal text,
    read lazily and re-iterable. Iterating gives whole documents; `pieces()` gives (piece, starts a document)
    in bounded pieces. Stdin ("-") is read when the Texts is made, so that it can be iterated again."""

    paths: tuple[str, ...]
    text: str | None = None
    stdin: str | None = None

    def pieces(self) -> Iterator[tuple[str, bool]]:
        for p in self.paths:
            if p == "-":
                yield from _document("stdin", iter([self.stdin or ""]))
            else:
                yield from _file_pieces(p)
        if self.text is not None:
            yield from _document("--text", iter([self.text]))

    def __iter__(self) -> Iterator[str]:
        doc: list[str] = []
        for piece, starts in self.pieces():
            if starts and doc:
                yield "".join(doc)
                doc = []
            doc.append(piece)
        if doc:
            yield "".join(doc)


def _file_pieces(p: str) -> Iterator[tuple[str, bool]]:
    """The (piece, starts a document) of one text file; undecodable bytes are an AttnkitError naming it."""
    try:
        path = _text_file(p)
        with path.open(encoding="utf-8") as fh:
            if path.suffix.lower() == ".jsonl":
                for doc in _jsonl(p, fh):  # each document tokenized in bounded pieces, as a .txt file is
                    yield from _document(p, _pieces(io.StringIO(doc)))
            else:
                yield from _document(p, _pieces(fh))
    except UnicodeDecodeError as exc:
        raise _undecodable(p, exc) from None
    except OSError as exc:
        raise AttnkitError(f"{p}: cannot read ({exc.strerror or exc})") from None


def _document(name: str, pieces: Iterator[str]) -> Iterator[tuple[str, bool]]:
    """The pieces of one document, the first marked as its start; a blank document gives none."""
    pending: list[str] = []  # leading blank pieces, kept until the document turns out not to be blank
    started = False
    for piece in pieces:
        if "\0" in piece:
            raise _binary(name)
        if started:
            yield piece, False
        elif piece.strip():
            started = True
            yield "".join(pending) + piece, True
        else:
            pending.append(piece)


def read_texts(paths: list[str], text: str | None = None) -> Texts:
    """The text inputs, checked to exist (nothing read yet but stdin); a UsageError when none is given."""
    if not paths and text is None:
        raise UsageError("no text given: pass text files, '-' for stdin, or --text")
    for p in paths:
        if p != "-":
            _text_file(p)
    stdin = None
    if "-" in paths:
        try:
            stdin = sys.stdin.read()
        except UnicodeDecodeError as exc:
            raise _undecodable("stdin", exc) from None
        if "\0" in stdin:
            raise _binary("stdin")
    return Texts(tuple(paths), text, stdin)


def text_prefix(tokenizer) -> list[int]:
    """The token ids the tokenizer puts in front of any text (e.g. [BOS] for Gemma or Llama 3, [] for GPT-2)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def encode(tokenizer, text: str) -> list[int]:
    """The token ids of `text` alone, without special tokens."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the model sees it at the start of a text: the tokenizer's prefix, then its tokens."""
    return text_prefix(tokenizer) + encode(tokenizer, prompt)


def token_windows(
    pieces: Iterable[tuple[list[int], bool]],
    prefix: list[int],
    eos: int | None,
    seq_len: int,
    max_windows: int | None = None,
    skip: int = 0,
):
    """LongTensor [N, seq_len] from tokenized pieces (ids, starts a document): each window is `prefix` and then
    seq_len - len(prefix) tokens of the stream of documents joined by EOS + `prefix`, past its first `skip` tokens
    (what another set of windows of the same text used); at most `max_windows` full windows, reading no further
    than they need. Returns (windows, tokens of the stream read after the skipped ones)."""
    import torch

    body = seq_len - len(prefix)
    separator = ([eos] if eos is not None else []) + prefix
    stream: list[int] = []
    need = None if max_windows is None else skip + max_windows * body
    for ids, starts in pieces:
        if starts and stream:
            stream.extend(separator)
        stream.extend(ids)
        if need is not None and len(stream) >= need:
            break
    del stream[:skip]
    n = len(stream) // body
    if max_windows is not None:
        n = min(n, max_windows)
    rows = [prefix + stream[w * body : (w + 1) * body] for w in range(n)]
    return torch.tensor(rows, dtype=torch.long).view(n, seq_len), len(stream)


def _tokenized(tokenizer, texts) -> Iterator[tuple[list[int], bool]]:
    """(token ids, starts a document) of `texts` (anything with a Texts-like `pieces()`, or a list of document
    strings), piece by piece."""
    pieces = texts.pieces() if hasattr(texts, "pieces") else ((doc, True) for doc in texts if doc.strip())
    for piece, starts in pieces:
        yield encode(tokenizer, piece), starts


def check_window_options(
    seq_len: int, max_tokens: int | None, flags: tuple[str, str] = ("--seq-len", "--max-tokens")
) -> None:
    """A window length of at least 2 tokens, and a token budget (when given) that holds one window; both bounded
    (attnkit.units). `flags` name the options, for the messages."""
    seq_flag, tokens_flag = flags
    check_bounds(seq_flag, seq_len, 2, MAX_TOKENS)
    if max_tokens is not None:
        check_bounds(tokens_flag, max_tokens, 1, MAX_TOKENS)
        if max_tokens < seq_len:
            raise UsageError(f"{tokens_flag} {max_tokens} is shorter than one window ({seq_flag} {seq_len})")


def make_windows(
    tokenizer,
    texts,
    seq_len: int,
    max_tokens: int | None = None,
    *,
    flags: tuple[str, str] = ("--seq-len", "--max-tokens"),
    skip: int = 0,
):
    """LongTensor [N, seq_len] of `texts` (Texts or document strings), <= max_tokens in all: every window starts
    as the tokenizer starts a text (see text_prefix) and holds seq_len tokens in all; the first `skip` tokens of
    the text's stream are passed over (token_windows). `flags` name the options that set seq_len and max_tokens,
    for the messages."""
    seq_flag, _ = flags
    check_window_options(seq_len, max_tokens, flags)
    if tokenizer is None:
        raise AttnkitError("the checkpoint has no tokenizer; cannot turn text into tokens")
    prefix = text_prefix(tokenizer)
    if seq_len <= len(prefix) + 1:
        raise UsageError(
            f"{seq_flag} {seq_len} leaves no room for text after the tokenizer's {len(prefix)} start token(s)"
        )
    windows, read = token_windows(
        _tokenized(tokenizer, texts),
        prefix,
        tokenizer.eos_token_id,
        seq_len,
        None if max_tokens is None else max_tokens // seq_len,
        skip,
    )
    if windows.shape[0] == 0:
        after = f" after the tokenizer's {len(prefix)} start token(s)" if prefix else ""
        past = f" past the {skip:,} tokens used before" if skip else ""
        raise AttnkitError(
            f"the text has {read} tokens{past}, shorter than one window of {seq_len}{after}; "
            f"give more text or a smaller {seq_flag}"
        )
    return windows


def batches(windows, batch_size: int) -> Iterator:
    """Consecutive slices of `windows` [N, T] with at most `batch_size` rows."""
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    for start in range(0, windows.shape[0], batch_size):
        yield windows[start : start + batch_size]
