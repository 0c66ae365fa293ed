"""What every command that writes a checkpoint takes (WriteRequest: export, heal; RewriteRequest: convert and
retrofit, which also calibrate and score), and the checks those options get before anything is resolved or
loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.analyse.capability import CapabilitySpec, check_capability
from attnkit.errors import UsageError
from attnkit.io.writer import OutputDir
from attnkit.runtime.loader import resolve_device
from attnkit.runtime.texts import check_text_files, check_window_options, make_windows, read_texts
from attnkit.units import MAX_TOKENS, check_bounds

#: Prompt of the greedy sample when none is given: a fact a small model knows and a damaged one gets wrong.
DEFAULT_PROMPTS = ("The capital of the United States is",)


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
    """A rewrite of the source: calibration text, evaluation text and what the report scores on it."""

    calib: list[str] = field(default_factory=list)
    calib_tokens: int = 2048
    calib_seq_len: int = 512
    eval: list[str] = field(default_factory=list)
    eval_tokens: int | None = 4096
    eval_seq_len: int = 512
    sample_prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))  # greedy samples with --eval
    sample_tokens: int = 16
    capability: CapabilitySpec = field(default_factory=CapabilitySpec)  # tasks and pass keys of source and result

    @property
    def scored(self) -> bool:
        """Whether the report scores the result against its source (--eval text, tasks or pass keys)."""
        return bool(self.eval) or bool(self.capability)


def local_sources(ref: str) -> list[Path]:
    """The local files a model reference reads: a folder, or a weights file's folder; a GGUF file itself."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return [path]
    if path.is_file():
        return [path] if path.suffix.lower() == ".gguf" else [path.parent]
    return []


def check_write(req: WriteRequest, inputs: list[str] | None = None) -> None:
    """--device exists and OUT can be written: it is absent, an empty folder or (--overwrite) a folder, its parent
    can hold it, and it neither is, holds nor lies inside a local input (`inputs`: refs, default the model)."""
    resolve_device(req.device)
    if req.max_shard_bytes <= 0:
        raise UsageError(f"--max-shard-size must be positive, got {req.max_shard_bytes}")
    sources = [p for ref in (inputs or [req.model]) for p in local_sources(ref)]
    OutputDir(Path(req.out), overwrite=req.overwrite, sources=sources)  # checks only; creates nothing


def check_rewrite(req: RewriteRequest) -> None:
    """check_write, plus: text files are UTF-8 text, token budgets hold a window, and a window has room."""
    check_text_files([*req.calib, *req.eval])
    for kind, files, tokens, seq_len in (
        ("calib", req.calib, req.calib_tokens, req.calib_seq_len),
        ("eval", req.eval, req.eval_tokens, req.eval_seq_len),
    ):
        check_window_options(seq_len, tokens if files else None, (f"--{kind}-seq-len", f"--{kind}-tokens"))
        if tokens is not None:
            check_bounds(f"--{kind}-tokens", tokens, 1, MAX_TOKENS)
    check_bounds("the greedy samples' new tokens", req.sample_tokens, 1, MAX_TOKENS)
    check_write(req)
    check_capability(req.capability, [req.model])


def calib_windows(tokenizer, req: RewriteRequest):
    """The --calib text as windows [N, --calib-seq-len], at most --calib-tokens in all."""
    return make_windows(
        tokenizer,
        read_texts(req.calib),
        req.calib_seq_len,
        req.calib_tokens,
        flags=("--calib-seq-len", "--calib-tokens"),
    )


def calib_info(req: RewriteRequest, windows, **extra) -> dict:
    """The "calibration" entry of a report: the --calib files and the windows [N, T] made of them."""
    return {
        "files": list(req.calib),
        "tokens": int(windows.numel()),
        "windows": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        **extra,
    }


def eval_windows(tokenizer, req: RewriteRequest):
    """The --eval text as windows [N, --eval-seq-len], at most --eval-tokens in all."""
    return make_windows(
        tokenizer, read_texts(req.eval), req.eval_seq_len, req.eval_tokens, flags=("--eval-seq-len", "--eval-tokens")
    )
