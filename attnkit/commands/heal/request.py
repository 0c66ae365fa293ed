"""What `attnkit heal` takes, and the checks of options and paths that need no model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.rewrite import WriteRequest
from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime.texts import check_text_files
from attnkit.scoring.options import EvalOptions, check_eval_options
from attnkit.scoring.selfcheck import CheckOptions
from attnkit.scoring.selfcheck import check_options as check_self_check
from attnkit.units import MAX_COUNT, MAX_TOKENS, check_bounds

TRAIN_CHOICES = ("rewritten", "all")
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Largest LoRA rank (wider than any hidden size attnkit reads).
MAX_LORA_RANK = 1 << 16
#: The token budget when neither --tokens nor --max-time is given (about 30 minutes for a 135M model on 2 CPU cores).
DEFAULT_TOKENS = 256 * 1024
TEACHER_LOGITS = ("live", "top-k")
#: --precision: auto is bf16 autocast on a CUDA GPU and fp32 elsewhere; bf16 asks for autocast on the CPU too.
PRECISIONS = ("auto", "fp32", "bf16")
MAX_TOP_K = 4096
#: Shortest training window the retrieval mix hides a task in.
MIN_RETRIEVAL_SEQ_LEN = 256
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$", re.IGNORECASE)


@dataclass(kw_only=True)
class HealRequest(WriteRequest):
    """The student (`model`), teacher and output; data; budget; what trains and how; checkpoints; what the report
    scores before and after training (`scoring`, as every rewrite's report does)."""

    teacher: str
    data: list[str] = field(default_factory=list)
    tokens: int | None = None
    max_time: float | None = None  # seconds for the whole command (loading, data, training, scoring)
    scoring: EvalOptions = field(default_factory=EvalOptions)  # --eval text, samples, tasks, pass keys
    check: CheckOptions = field(default_factory=CheckOptions)  # the self-check of OUT against the teacher
    eval_curve: bool = False  # also score --eval at every validation (reported only)
    train: str = "rewritten"
    lora_rank: int = 0
    lr: float | None = None  # None: trainable.default_lr of the student
    warmup_steps: int = 5
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_size: int = 4
    micro_batch_size: int = 4
    seq_len: int = 256
    attn_loss: float = 0.0
    precision: str = "auto"  # PRECISIONS; resolved against the device by heal.models.precision_for
    teacher_logits: str = "live"  # live: the teacher runs beside the student; top-k: its targets cached once
    top_k: int = 64
    val_tokens: int = 2048
    eval_every: int = 25
    patience: int = 4
    checkpoint_every: int = 50
    checkpoint_dir: Path | None = None
    resume: bool = False
    teacher_tokens: int | None = None  # teacher-written training tokens when no --data
    retrieval_mix: float | None = None  # share of training windows made synthetic retrieval tasks (heal.retrieval)
    sample_cache: Path | None = None
    gradient_checkpointing: bool = False
    fsdp: bool = False  # shard the student's weights, gradients and optimizer state over the processes (FSDP2)
    seed: int = 0

    @property
    def budget_tokens(self) -> int | None:
        """The token budget: --tokens, else the default when no --max-time is given."""
        if self.tokens is None and self.max_time is None:
            return DEFAULT_TOKENS
        return self.tokens

    @property
    def checkpoint_folder(self) -> Path:
        """--checkpoint-dir, else OUT with '.checkpoint' appended, next to it."""
        out = Path(self.out).expanduser().absolute()
        return (
            Path(self.checkpoint_dir).expanduser().absolute()
            if self.checkpoint_dir
            else out.with_name(out.name + ".checkpoint")
        )

    @property
    def samples_needed(self) -> int:
        """Teacher-written tokens to train on when no --data is given (--teacher-tokens, else the token budget)."""
        return self.teacher_tokens or self.budget_tokens or DEFAULT_TOKENS


def parse_duration(text: str) -> float:
    """'90', '90s' -> 90.0; '30m', '30min' -> 1800.0; '1.5h' -> 5400.0 (seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise UsageError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1.5h)")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}[(m.group(2) or "").lower()]
    if seconds <= 0:
        raise UsageError(f"--max-time must be positive, got {text!r}")
    return seconds


def processes() -> int:
    """Processes in this run, as torchrun and accelerate launch tell each one (WORLD_SIZE)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


#: Number options: flag -> (request field, lowest, highest); None: unbounded (still finite), POSITIVE: above 0.
#: A field that is None (not given) is not checked.
POSITIVE = "positive"
BOUNDS = {
    "--top-k": ("top_k", 1, MAX_TOP_K),
    "--batch-size": ("batch_size", POSITIVE, MAX_COUNT),
    "--micro-batch-size": ("micro_batch_size", POSITIVE, MAX_COUNT),
    "--val-tokens": ("val_tokens", POSITIVE, MAX_TOKENS),
    "--eval-every": ("eval_every", POSITIVE, MAX_COUNT),
    "--checkpoint-every": ("checkpoint_every", POSITIVE, MAX_COUNT),
    "--lr": ("lr", POSITIVE, None),
    "--tokens": ("tokens", POSITIVE, None),
    "--teacher-tokens": ("teacher_tokens", POSITIVE, None),
    "--max-time": ("max_time", POSITIVE, None),
    "--lora-rank": ("lora_rank", 0, MAX_LORA_RANK),
    "--warmup-steps": ("warmup_steps", 0, MAX_COUNT),
    "--patience": ("patience", 0, MAX_COUNT),
    "--weight-decay": ("weight_decay", 0, None),
    "--max-grad-norm": ("max_grad_norm", 0, None),
    "--attn-loss": ("attn_loss", 0, None),
    "--seed": ("seed", 0, MAX_COUNT),
    "--seq-len": ("seq_len", 2, MAX_TOKENS),
}
#: Options that take one of a few words: flag -> (request field, the words).
CHOICES = {
    "--train": ("train", TRAIN_CHOICES),
    "--teacher-logits": ("teacher_logits", TEACHER_LOGITS),
    "--precision": ("precision", PRECISIONS),
}


def check_options(req: HealRequest) -> None:
    """Every option's value and every input path, before anything is loaded; one-line UsageErrors."""
    if req.tokens is not None and req.max_time is not None:
        raise UsageError("give one budget: --tokens or --max-time, not both")
    for flag, (name, words) in CHOICES.items():
        if getattr(req, name) not in words:
            raise UsageError(f"{flag} must be one of {', '.join(words)}, got {getattr(req, name)!r}")
    for flag, (name, low, high) in BOUNDS.items():
        _check_number(flag, getattr(req, name), low, high)
    _check_combinations(req)
    check_eval_options(req.scoring)
    check_self_check(req.check)
    for path in req.data:
        check_data_path(Path(path))
    check_text_files([p for p in req.data if Path(p).suffix.lower() in (".txt", ".jsonl")])
    if req.sample_cache is not None:
        _check_sample_cache(Path(req.sample_cache).expanduser())
    if req.resume and not (req.checkpoint_folder / "run.json").is_file():
        raise UsageError(f"--resume: {req.checkpoint_folder} holds no heal checkpoint (run.json)")


def _check_sample_cache(folder: Path) -> None:
    """--sample-cache is a folder this process can write in, or can be made one."""
    from attnkit.io.writer import check_writable_parent

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--sample-cache {folder}: is a file, not a folder")
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"--sample-cache {folder}: cannot write into it (permission denied)")
        return
    try:
        check_writable_parent(folder)
    except AttnkitError as exc:
        raise UsageError(f"--sample-cache {exc}") from None


def _check_number(flag: str, value, low, high) -> None:
    """One BOUNDS row: finite and within its bounds (check_bounds), or above 0 for POSITIVE."""
    if value is None:
        return
    check_bounds(flag, value, None if low == POSITIVE else low, high)
    if low == POSITIVE and not value > 0:
        raise UsageError(f"{flag} must be positive, got {value}")


def _check_combinations(req: HealRequest) -> None:
    """Options that are each valid but not together."""
    if req.teacher_logits == "top-k" and req.attn_loss > 0:
        raise UsageError("--attn-loss compares attention with the teacher's, which --teacher-logits top-k does not run")
    if req.fsdp and processes() < 2:
        raise UsageError(
            "--fsdp shards the student over processes and this run has 1; launch it with "
            "torchrun --nproc-per-node N or accelerate launch --num_processes N"
        )
    if not 0 <= req.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {req.min_lr_ratio}")
    if req.batch_size % req.micro_batch_size:
        raise UsageError(
            f"--batch-size {req.batch_size} is not a multiple of --micro-batch-size {req.micro_batch_size}"
        )
    if req.val_tokens < req.seq_len:
        raise UsageError(f"--val-tokens {req.val_tokens} is shorter than one window (--seq-len {req.seq_len})")
    if req.eval_curve and not req.scoring.files:
        raise UsageError("--eval-curve needs --eval text")
    if req.retrieval_mix is not None:
        check_bounds("--retrieval-mix", req.retrieval_mix)
        if not 0 < req.retrieval_mix <= 1:
            raise UsageError(
                f"--retrieval-mix is the share of training windows made retrieval tasks: give a value "
                f"above 0 and at most 1, got {req.retrieval_mix}"
            )
        if req.seq_len < MIN_RETRIEVAL_SEQ_LEN:
            raise UsageError(
                f"--retrieval-mix needs windows of at least {MIN_RETRIEVAL_SEQ_LEN} tokens to hide a "
                f"task in, got --seq-len {req.seq_len}"
            )


def check_positions(req: HealRequest, max_positions: int | None) -> None:
    """--seq-len within the models' positions (max_position_embeddings), from their configs before any loads."""
    if max_positions is not None and req.seq_len > max_positions:
        raise UsageError(
            f"--seq-len {req.seq_len:,} is past the model's {max_positions:,} positions (max_position_embeddings)"
        )


def check_data_path(path: Path) -> None:
    """A --data path is a .txt/.jsonl/.parquet file or a folder, and is not empty."""
    if path.is_dir():
        if not any(path.iterdir()):
            raise AttnkitError(f"{path}: empty data folder")
        return
    if not path.is_file():
        raise AttnkitError(f"{path}: file not found")
    if path.suffix.lower() not in DATA_SUFFIXES:
        raise AttnkitError(f"{path}: data must be {', '.join(DATA_SUFFIXES)} files or a datasets folder")
    if path.stat().st_size == 0:
        raise AttnkitError(f"{path}: empty data file")
