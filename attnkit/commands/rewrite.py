"""What every command that writes a checkpoint takes (WriteRequest: export, heal; RewriteRequest: convert and
retrofit, which also calibrate and score: attnkit.scoring.options.EvalOptions), and the checks those options get
before anything is resolved or loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import UsageError
from attnkit.io.writer import OutputDir
from attnkit.runtime.loader import resolve_device
from attnkit.runtime.texts import check_text_files, check_window_options, make_windows, read_texts
from attnkit.scoring.capability import check_capability
from attnkit.scoring.options import EvalOptions, check_eval_options
from attnkit.units import MAX_TOKENS, check_bounds

#: convert mla's default calibration tokens: at 2048 (every other rewrite's default) its results kept less pass-key
#: retrieval (docs/convert-mla.md, "## Long context").
MLA_CALIB_TOKENS = 8192
#: The flags that set calib_seq_len and calib_tokens, for the messages.
CALIB_FLAGS = ("--calib-seq-len", "--calib-tokens")


@dataclass(kw_only=True)
class WriteRequest:
    """The source, the output folder and how to write it."""

    model: str
    out: Path
    overwrite: bool = False
    dry_run: bool = False
    device: str = "auto"
    max_shard_bytes: int = 2**30
    command: str = ""  # the command line, recorded in attnkit.json


@dataclass(kw_only=True)
class RewriteRequest(WriteRequest):
    """A rewrite of the source: calibration text, and what the report scores the result on against its source."""

    calib: list[str] = field(default_factory=list)
    calib_tokens: int = 2048
    calib_seq_len: int = 512
    scoring: EvalOptions = field(default_factory=EvalOptions)


def local_sources(ref: str) -> list[Path]:
    """The local files a model reference reads: a folder, or a weights file's folder; a GGUF file itself."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return [path]
    if path.is_file():
        return [path] if path.suffix.lower() == ".gguf" else [path.parent]
    return []


def check_write(req: WriteRequest, inputs: list[str] | None = None):
    """--device exists and OUT can be written: it is absent, an empty folder or (--overwrite) a folder, its parent
    can hold it, and it neither is, holds nor lies inside a local input (`inputs`: refs, default the model).
    Returns the device --device names (a torch.device)."""
    device = resolve_device(req.device)
    if req.max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be positive, got {req.max_shard_bytes}")
    sources = [p for ref in (inputs or [req.model]) for p in local_sources(ref)]
    OutputDir(Path(req.out), overwrite=req.overwrite, sources=sources)  # checks only; creates nothing
    return device


def check_rewrite(req: RewriteRequest) -> None:
    """check_write, plus: text files are UTF-8 text, token budgets hold a window, a window has room, and the
    scoring options (attnkit.scoring.options) hold."""
    check_text_files(req.calib)
    check_window_options(req.calib_seq_len, req.calib_tokens if req.calib else None, CALIB_FLAGS)
    check_bounds("--calib-tokens", req.calib_tokens, 1, MAX_TOKENS)
    check_eval_options(req.scoring)
    check_write(req)
    check_capability(req.scoring.capability, [req.model])


def calib_windows(tokenizer, req: RewriteRequest):
    """The --calib text as windows [N, --calib-seq-len], at most --calib-tokens in all."""
    return make_windows(tokenizer, read_texts(req.calib), req.calib_seq_len, req.calib_tokens, flags=CALIB_FLAGS)


def calib_info(req: RewriteRequest, windows, **extra) -> dict:
    """The "calibration" entry of a report: the --calib files and the windows [N, T] made of them."""
    return {
        "files": list(req.calib),
        "tokens": int(windows.numel()),
        "windows": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        **extra,
    }
