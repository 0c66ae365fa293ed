"""What every command that writes a checkpoint (convert gqa|mqa|mla, retrofit) takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class RewriteRequest:
    """Source and target, calibration and evaluation text, safe-write and device options."""

    model: str
    out: Path
    calib: list[str] = field(default_factory=list)
    calib_tokens: int = 2048
    calib_seq_len: int = 512
    eval: list[str] = field(default_factory=list)
    eval_tokens: int | None = 4096
    eval_seq_len: int = 512
    overwrite: bool = False
    dry_run: bool = False
    device: str = "auto"
    max_shard_bytes: int = 2**30
    command: str = ""  # the command line, recorded in attnkit.json


@dataclass
class CheckedSource:
    """A source checkpoint that passed a command's checks: resolved files, architecture, attention spec and the
    prefix in front of its tensor names."""

    ckpt: object
    arch: object
    spec: object
    prefix: str
