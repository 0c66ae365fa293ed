"""What every command that writes a checkpoint (convert gqa|mqa|mla, retrofit) takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.quality import DEFAULT_PROMPTS


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
    sample_prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))  # greedy samples with --eval
    sample_tokens: int = 16
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


def source_record(ref: str, src: CheckedSource) -> dict:
    """The "source" of an attnkit.json manifest: the reference as given, its kind (a GGUF file stays "gguf"
    although its weights were read from the dequantized cache folder named in "dequantized"), hub repo and
    revision (a hub snapshot's commit when none was asked for) and model type."""
    ckpt = src.ckpt
    gguf = getattr(ckpt, "dequantized_from", None)
    revision = ckpt.revision
    if revision is None and ckpt.kind == "hub" and ckpt.root is not None:
        revision = Path(ckpt.root).name  # snapshots/<commit>
    return {"ref": ref, "kind": "gguf" if gguf else ckpt.kind, "repo_id": ckpt.repo_id, "revision": revision,
            "model_type": src.spec.model_type, "dequantized": str(ckpt.root) if gguf else None}


def check_rewrite(req: RewriteRequest) -> None:
    """What a rewrite checks before it resolves or loads anything: text files are UTF-8 text, token budgets
    hold a window, --device exists, and OUT is usable and neither is, holds nor lies inside a local input."""
    from attnkit.errors import UsageError
    from attnkit.io.writer import OutputDir
    from attnkit.runtime.loader import resolve_device
    from attnkit.runtime.texts import check_text_files

    check_text_files([*req.calib, *req.eval])
    for kind, files, tokens, seq_len in (("calib", req.calib, req.calib_tokens, req.calib_seq_len),
                                         ("eval", req.eval, req.eval_tokens, req.eval_seq_len)):
        if files and tokens is not None and tokens < seq_len:
            raise UsageError(f"--{kind}-tokens {tokens} is shorter than one window (--{kind}-seq-len {seq_len})")
    resolve_device(req.device)
    OutputDir(Path(req.out), overwrite=req.overwrite, sources=local_sources(req.model))  # checks only


def local_sources(ref: str) -> list[Path]:
    """The local files a model reference reads: a folder, or a weights file's folder; a GGUF file itself."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return [path]
    if path.is_file():
        return [path] if path.suffix.lower() == ".gguf" else [path.parent]
    return []
