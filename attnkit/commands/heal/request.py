"""What `attnkit heal` takes, and the checks of options and paths that need no model."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.analyse.capability import CapabilitySpec
from attnkit.commands.rewrite import WriteRequest
from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime.texts import check_text_files
from attnkit.units import MAX_COUNT, MAX_TOKENS, check_bounds

TRAIN_CHOICES = ("rewritten", "all")
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: Largest LoRA rank (wider than any hidden size attnkit reads).
MAX_LORA_RANK = 1 << 16
#: The token budget when neither --tokens nor --max-time is given (about 30 minutes for a 135M model on 2 CPU cores).
DEFAULT_TOKENS = 256 * 1024
TEACHER_LOGITS = ("live", "top-k")
MAX_TOP_K = 4096
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$", re.IGNORECASE)


@dataclass(kw_only=True)
class HealRequest(WriteRequest):
    """The student (`model`), teacher and output; data; budget; what trains and how; checkpoints."""

    teacher: str
    data: list[str] = field(default_factory=list)
    tokens: int | None = None
    max_time: float | None = None  # seconds for the whole command (loading, data, training, scoring)
    eval: list[str] = field(default_factory=list)
    eval_tokens: int | None = 4096
    eval_seq_len: int = 512
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
    teacher_logits: str = "live"  # live: the teacher runs beside the student; top-k: its targets cached once
    top_k: int = 64
    val_tokens: int = 2048
    eval_every: int = 25
    patience: int = 4
    checkpoint_every: int = 50
    checkpoint_dir: Path | None = None
    resume: bool = False
    sample_tokens: int | None = None
    sample_cache: Path | None = None
    gradient_checkpointing: bool = False
    fsdp: bool = False  # shard the student's weights, gradients and optimizer state over the processes (FSDP2)
    seed: int = 0
    capability: CapabilitySpec = field(default_factory=CapabilitySpec)  # tasks, pass keys: teacher, before, after

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
        """Teacher-written tokens to train on when no --data is given (--sample-tokens, else the token budget)."""
        return self.sample_tokens or self.budget_tokens or DEFAULT_TOKENS


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


def check_options(req: HealRequest) -> None:
    """Every option's value and every input path, before anything is loaded; one-line UsageErrors."""
    if req.tokens is not None and req.max_time is not None:
        raise UsageError("give one budget: --tokens or --max-time, not both")
    if req.train not in TRAIN_CHOICES:
        raise UsageError(f"--train must be one of {', '.join(TRAIN_CHOICES)}, got {req.train!r}")
    if req.teacher_logits not in TEACHER_LOGITS:
        raise UsageError(f"--teacher-logits must be one of {', '.join(TEACHER_LOGITS)}, got {req.teacher_logits!r}")
    check_bounds("--top-k", req.top_k, 1, MAX_TOP_K)
    if req.teacher_logits == "top-k" and req.attn_loss > 0:
        raise UsageError("--attn-loss compares attention with the teacher's, which --teacher-logits top-k does not run")
    if req.fsdp:
        world = processes()
        if world < 2:
            raise UsageError(
                "--fsdp shards the student over processes and this run has 1; launch it with "
                "torchrun --nproc-per-node N or accelerate launch --num_processes N"
            )
    positive = {
        "--batch-size": req.batch_size,
        "--micro-batch-size": req.micro_batch_size,
        "--val-tokens": req.val_tokens,
        "--eval-every": req.eval_every,
        "--checkpoint-every": req.checkpoint_every,
    }
    optional = (
        ("--lr", req.lr),
        ("--tokens", req.tokens),
        ("--sample-tokens", req.sample_tokens),
        ("--max-time", req.max_time),
    )
    positive.update({flag: v for flag, v in optional if v is not None})
    for flag, value in positive.items():
        check_bounds(flag, value)
        if not value > 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    non_negative = {
        "--lora-rank": req.lora_rank,
        "--warmup-steps": req.warmup_steps,
        "--patience": req.patience,
        "--weight-decay": req.weight_decay,
        "--max-grad-norm": req.max_grad_norm,
        "--attn-loss": req.attn_loss,
        "--seed": req.seed,
    }
    for flag, value in non_negative.items():
        check_bounds(flag, value, 0)
    counts = {
        "--batch-size": req.batch_size,
        "--micro-batch-size": req.micro_batch_size,
        "--eval-every": req.eval_every,
        "--checkpoint-every": req.checkpoint_every,
        "--warmup-steps": req.warmup_steps,
        "--patience": req.patience,
        "--seed": req.seed,
    }
    for flag, value in counts.items():
        check_bounds(flag, value, high=MAX_COUNT)
    for flag, value in (
        ("--seq-len", req.seq_len),
        ("--val-tokens", req.val_tokens),
        ("--eval-seq-len", req.eval_seq_len),
    ):
        check_bounds(flag, value, high=MAX_TOKENS)
    check_bounds("--lora-rank", req.lora_rank, high=MAX_LORA_RANK)
    if not 0 <= req.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be in [0, 1], got {req.min_lr_ratio}")
    if req.batch_size % req.micro_batch_size:
        raise UsageError(
            f"--batch-size {req.batch_size} is not a multiple of --micro-batch-size {req.micro_batch_size}"
        )
    for flag, value in (("--seq-len", req.seq_len), ("--eval-seq-len", req.eval_seq_len)):
        if value < 2:
            raise UsageError(f"{flag} must be at least 2, got {value}")
    if req.val_tokens < req.seq_len:
        raise UsageError(f"--val-tokens {req.val_tokens} is shorter than one window (--seq-len {req.seq_len})")
    if req.eval_curve and not req.eval:
        raise UsageError("--eval-curve needs --eval text")
    for path in req.eval:
        if not Path(path).is_file():
            raise AttnkitError(f"{path}: file not found")

    check_text_files(req.eval)
    for path in req.data:
        check_data_path(Path(path))
    check_text_files([p for p in req.data if Path(p).suffix.lower() in (".txt", ".jsonl")])
    if req.resume and not (req.checkpoint_folder / "run.json").is_file():
        raise UsageError(f"--resume: {req.checkpoint_folder} holds no heal checkpoint (run.json)")


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
