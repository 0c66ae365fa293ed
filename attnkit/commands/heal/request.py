"""What `attnkit heal` takes, and the checks of options and paths that need no model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.rewrite import WriteRequest
from attnkit.errors import AttnkitError, UsageError
from attnkit.option_fields import POSITIVE, check_fields, option
from attnkit.runtime.texts import check_text_files
from attnkit.scoring.options import EvalOptions, check_eval_options
from attnkit.scoring.selfcheck import CheckOptions
from attnkit.scoring.selfcheck import check_options as check_self_check
from attnkit.units import MAX_COUNT, MAX_TOKENS, check_bounds, parse_tokens

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


def parse_duration(text: str) -> float:
    """'90', '90s' -> 90.0; '30m', '30min' -> 1800.0; '1.5h' -> 5400.0 (seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise UsageError(f"not a duration: {text!r} (use e.g. 90s, 30m, 1.5h)")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}[(m.group(2) or "").lower()]
    if seconds <= 0:
        raise UsageError(f"--max-time must be positive, got {text!r}")
    return seconds


#: Tags of the option fields: what a resumed run must share with its checkpoint (the budget, evaluation and
#: devices may change), the report's settings, and what the training loop reads (heal.loop.LoopConfig).
RESUME, SETTINGS, LOOP = "fingerprint", "settings", "loop"


@dataclass(kw_only=True)
class HealRequest(WriteRequest):
    """The student (`model`), teacher and output; data; budget; what trains and how; checkpoints; what the report
    scores before and after training (`scoring`, as every rewrite's report does). Each option field is its
    command-line option (attnkit.option_fields)."""

    teacher: str = option(flag="--teacher", help="The source model the student was rewritten from.", short="-t")
    data: list[str] = option(
        flag="--data",
        help="Training text: .txt, .jsonl, .parquet or a datasets folder (repeatable); none: the teacher writes its "
        "own.",
        default_factory=list,
    )
    tokens: int | None = option(
        None, "--tokens", "Token budget (e.g. 256k); default 256k.", low=POSITIVE, parse=parse_tokens
    )
    max_time: float | None = option(  # seconds for the whole command (loading, data, training, scoring)
        None,
        "--max-time",
        "Wall-clock budget of the whole run: loading, data, training, scoring (e.g. 30m).",
        low=POSITIVE,
        parse=parse_duration,
        tags=(LOOP,),
    )
    scoring: EvalOptions = field(default_factory=EvalOptions)  # --eval text, samples, tasks, pass keys
    check: CheckOptions = field(default_factory=CheckOptions)  # the self-check of OUT against the teacher
    eval_curve: bool = option(
        False, "--eval-curve", "Also score --eval at every validation (reported, never used to stop).", tags=(SETTINGS,)
    )
    train: str = option(
        "rewritten",
        "--train",
        "rewritten (attention tensors the rewrite changed) or all.",
        choices=TRAIN_CHOICES,
        tags=(RESUME, SETTINGS),
    )
    lora_rank: int = option(
        0,
        "--lora-rank",
        "Train LoRA adapters of this rank (merged back); 0: off.",
        low=0,
        high=MAX_LORA_RANK,
        tags=(RESUME, SETTINGS),
    )
    lr: float | None = option(  # None: trainable.default_lr of the student
        None,
        "--lr",
        "Peak learning rate of AdamW (default 3e-4; 1e-4 for MLA students).",
        low=POSITIVE,
        hidden_default=True,
        tags=(RESUME, SETTINGS, LOOP),
    )
    warmup_steps: int = option(
        5, "--warmup-steps", "Linear warmup steps.", low=0, high=MAX_COUNT, tags=(RESUME, SETTINGS, LOOP)
    )
    min_lr_ratio: float = option(
        0.1, "--min-lr-ratio", "Cosine decays to lr x this.", low=0, high=1, tags=(RESUME, SETTINGS, LOOP)
    )
    weight_decay: float = option(0.0, "--weight-decay", "AdamW weight decay.", low=0, tags=(RESUME, SETTINGS, LOOP))
    max_grad_norm: float = option(
        1.0, "--max-grad-norm", "Gradient clipping norm; 0: off.", low=0, tags=(RESUME, SETTINGS, LOOP)
    )
    batch_size: int = option(
        4,
        "--batch-size",
        "Windows per optimizer step, over all processes.",
        low=POSITIVE,
        high=MAX_COUNT,
        tags=(RESUME, SETTINGS, LOOP),
    )
    micro_batch_size: int = option(
        4,
        "--micro-batch-size",
        "Windows per forward pass (accumulated).",
        low=POSITIVE,
        high=MAX_COUNT,
        tags=(SETTINGS, LOOP),
    )
    seq_len: int = option(
        256, "--seq-len", "Tokens per training window.", low=2, high=MAX_TOKENS, tags=(RESUME, SETTINGS)
    )
    attn_loss: float = option(
        0.0,
        "--attn-loss",
        "Weight of the attention-output matching term; 0: off.",
        low=0,
        tags=(RESUME, SETTINGS, LOOP),
    )
    precision: str = option(  # resolved against the device by heal.models.precision_for
        "auto",
        "--precision",
        "auto (bf16 autocast on a CUDA GPU, fp32 elsewhere), fp32, or bf16 (autocast on the CPU too, where it has "
        "bf16 instructions).",
        choices=PRECISIONS,
    )
    teacher_logits: str = option(
        "live",
        "--teacher-logits",
        "live: the teacher runs beside the student; top-k: its top-k log-probabilities computed once and cached on "
        "disk, the teacher out of memory while training.",
        choices=TEACHER_LOGITS,
        tags=(RESUME, SETTINGS),
    )
    top_k: int = option(
        64,
        "--top-k",
        "Tokens per position kept by --teacher-logits top-k.",
        low=1,
        high=MAX_TOP_K,
        tags=(RESUME, SETTINGS),
    )
    fsdp: bool = option(
        False,
        "--fsdp",
        "Shard the student's weights, gradients and optimizer state over the processes (FSDP2; launch with torchrun "
        "or accelerate launch).",
        tags=(SETTINGS, LOOP),
    )
    val_tokens: int = option(
        2048,
        "--val-tokens",
        "Training text held out for validation.",
        low=POSITIVE,
        high=MAX_TOKENS,
        tags=(RESUME, SETTINGS),
    )
    eval_every: int = option(
        25, "--eval-every", "Validate every N steps.", low=POSITIVE, high=MAX_COUNT, tags=(SETTINGS, LOOP)
    )
    patience: int = option(
        4,
        "--patience",
        "Stop after N validations without improvement; 0: never.",
        low=0,
        high=MAX_COUNT,
        tags=(SETTINGS, LOOP),
    )
    checkpoint_every: int = option(
        50,
        "--checkpoint-every",
        "Save a resumable checkpoint every N steps.",
        low=POSITIVE,
        high=MAX_COUNT,
        tags=(SETTINGS, LOOP),
    )
    checkpoint_dir: Path | None = option(None, "--checkpoint-dir", "Checkpoint folder (OUT.checkpoint).")
    resume: bool = option(False, "--resume", "Continue the run saved in the checkpoint folder.")
    teacher_tokens: int | None = option(
        None,
        "--teacher-tokens",
        "Teacher-written training tokens when no --data (default: the budget).",
        low=POSITIVE,
        parse=parse_tokens,
    )
    retrieval_mix: float | None = option(  # checked in _check_combinations (its own message)
        None,
        "--retrieval-mix",
        "Share (above 0, at most 1) of the training windows made long-range retrieval tasks (a number said once and "
        "asked at the end, a table looked up, a passage repeated), built offline from the data.",
        tags=(RESUME, SETTINGS),
    )
    sample_cache: Path | None = option(None, "--sample-cache", "Where teacher-written text is cached.")
    gradient_checkpointing: bool = option(
        False,
        "--gradient-checkpointing",
        "Recompute activations in backward (less memory).",
        negative="--no-gradient-checkpointing",
        tags=(SETTINGS,),
    )
    seed: int = option(
        0, "--seed", "Seed of data order and teacher sampling.", low=0, high=MAX_COUNT, tags=(RESUME, LOOP)
    )

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


def processes() -> int:
    """Processes in this run, as torchrun and accelerate launch tell each one (WORLD_SIZE)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def check_options(req: HealRequest) -> None:
    """Every option's value and every input path, before anything is loaded; one-line UsageErrors."""
    if req.tokens is not None and req.max_time is not None:
        raise UsageError("give one budget: --tokens or --max-time, not both")
    check_fields(req)
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


def _check_combinations(req: HealRequest) -> None:
    """Options that are each valid but not together."""
    if req.teacher_logits == "top-k" and req.attn_loss > 0:
        raise UsageError("--attn-loss compares attention with the teacher's, which --teacher-logits top-k does not run")
    if req.fsdp and processes() < 2:
        raise UsageError(
            "--fsdp shards the student over processes and this run has 1; launch it with "
            "torchrun --nproc-per-node N or accelerate launch --num_processes N"
        )
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
