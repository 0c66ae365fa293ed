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
from attnkit.scoring.selfcheck import LIMITS, CheckOptions, CheckText, SelfCheck, check_options
from attnkit.units import MAX_TOKENS, check_bounds

#: The default calibration tokens and window of every rewrite (the request's and the CLI's defaults).
CALIB_TOKENS = 2048
CALIB_SEQ_LEN = 512
#: convert mla's default calibration tokens: at CALIB_TOKENS its results kept less pass-key retrieval
#: (docs/convert-mla.md, "## Long context").
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
    calib_tokens: int = CALIB_TOKENS
    calib_seq_len: int = CALIB_SEQ_LEN
    scoring: EvalOptions = field(default_factory=EvalOptions)
    check: CheckOptions = field(default_factory=CheckOptions)


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
    check_options(req.check)
    check_write(req)
    check_capability(req.scoring.capability, [req.model])


def check_texts(req: RewriteRequest, src, calibrates: bool) -> None:
    """Counted with the source's tokenizer, before any model loads: --calib-seq-len within the model's positions,
    the --calib text holds the --calib-tokens the rewrite calibrates on (when it does: `calibrates`), and the
    --eval text one window of --eval-seq-len tokens."""
    from attnkit.errors import AttnkitError
    from attnkit.runtime.loader import load_tokenizer

    calib = bool(req.calib) and calibrates
    limit = src.arch.config_value(src.config, "max_positions") if src.arch is not None else None
    if calib and limit is not None and req.calib_seq_len > int(limit):
        raise UsageError(
            f"--calib-seq-len {req.calib_seq_len:,} is past {req.model}'s {int(limit):,} positions "
            "(max_position_embeddings)"
        )
    if not calib and not req.scoring.files:
        return
    tokenizer = load_tokenizer(src.root)
    if tokenizer is None:
        raise AttnkitError(f"{req.model}: the checkpoint has no tokenizer to turn --calib or --eval text into tokens")
    if calib:
        try:
            windows = calib_windows(tokenizer, req)
        except AttnkitError as exc:
            raise UsageError(f"--calib: {exc}") from None
        need = req.calib_tokens // req.calib_seq_len
        if windows.shape[0] < need:
            held = windows.numel()
            raise UsageError(
                f"--calib holds {held:,} tokens in windows of {req.calib_seq_len}, fewer than the "
                f"{need * req.calib_seq_len:,} this rewrite calibrates on (--calib-tokens {req.calib_tokens}): give "
                f"more --calib text, or --calib-tokens {held} to calibrate on what there is (less text fits the model "
                "less well: docs/check.md)"
            )
    if req.scoring.files:
        seq_len = req.scoring.seq_len
        try:
            make_windows(tokenizer, read_texts(list(req.scoring.files)), seq_len, seq_len)
        except AttnkitError as exc:
            raise UsageError(f"--eval: {exc}") from None


class Rejected(Exception):
    """A candidate output failed its self-check (retrofit qknorm --method auto, convert mla's engine route of a
    biased source); write_checkpoint removes it and the next candidate is written."""

    def __init__(self, check: dict):
        super().__init__("rejected by the self-check")
        self.check = check


def self_check(req: RewriteRequest, operation: str, calibration: dict | None) -> SelfCheck | None:
    """What the rewrite's output is checked on (attnkit.scoring.selfcheck; None with --no-check): the --eval text,
    else the --calib text past the tokens the rewrite calibrated on (`calibration`: its report entry, None when it
    read none), held to the limit of `operation`."""
    if not req.check.enabled:
        return None
    if req.scoring.files:
        text = CheckText(tuple(req.scoring.files), 0, "--eval")
    elif req.calib:
        used = calibration["tokens"] if calibration else 0
        text = CheckText(tuple(req.calib), used, "held-out --calib text" if used else "--calib text")
    else:
        text = None  # attnkit's sample text (attnkit.scoring.selfcheck.windows)
    return SelfCheck(text, LIMITS[operation], req.check)


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
