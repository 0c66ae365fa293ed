"""Is the student a rewrite of the teacher, and which of its tensors did the rewrite change?

Before any model loads: configs (vocabulary, layer count, hidden size), tokenizers (same vocabulary)
and stored weights (a rewrite copies the tensors outside attention, so some must be bit-equal).
After loading: the student's attention parameters that differ from the teacher's are what trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.reader import LazyReader
from attnkit.io.resolve import resolve_weights
from attnkit.io.source import Source, open_source
from attnkit.runtime.loader import load_tokenizer

#: Config keys a rewrite keeps; a student that differs in one is not a rewrite of the teacher.
SAME_CONFIG = (("vocab_size", "vocabulary size"), ("num_hidden_layers", "layer count"), ("hidden_size", "hidden size"))
#: How many shared tensors outside attention to compare before deciding that none is copied.
SHARED_CHECKS = 4


@dataclass
class Pair:
    """Checked student and teacher sources, the student's rewrite manifest (None without attnkit.json) and the
    stored tensors that train (the rewritten attention tensors, or every tensor)."""

    student: Source
    teacher: Source
    manifest: dict | None
    trained: list[str]


def check_pair(student_ref: str, teacher_ref: str, rewritten: bool = True) -> Pair:
    """Open both and refuse a student that is not a rewrite of the teacher, in one line; the same checkpoint
    given twice is refused before anything is dequantized; with `rewritten`, a student whose stored attention
    equals the teacher's (nothing for the default --train to train) too, before any model loads."""
    student, teacher = (
        resolve_weights(student_ref, "use as the student"),
        resolve_weights(teacher_ref, "use as the teacher"),
    )
    if _identity(student) == _identity(teacher):
        raise AttnkitError(f"{student_ref}: the student and the teacher are the same checkpoint")
    student, teacher = open_source(student_ref, "use as the student"), open_source(teacher_ref, "use as the teacher")
    for key, what in SAME_CONFIG:
        s, t = student.config.get(key), teacher.config.get(key)
        if s != t:
            raise AttnkitError(
                f"{student_ref}: {what} {s} differs from the teacher's {t}; "
                "the student must be a rewrite of the teacher"
            )
    _check_tokenizers(student, teacher)
    _check_shared_weights(student, teacher)
    if rewritten:
        trained = _check_attention_rewritten(student, teacher)
    else:
        with LazyReader(student.ckpt.weight_files) as reader:
            trained = list(reader.names())
    return Pair(student, teacher, read_manifest(student.root), trained)


def _identity(ckpt) -> Path:
    """What a resolved reference reads: its GGUF file or its folder, symlinks resolved."""
    return Path(ckpt.gguf_file or ckpt.root).resolve()


def _check_tokenizers(student, teacher) -> None:
    """The teacher has a tokenizer; the student's, if it has one, has the same vocabulary."""

    t = load_tokenizer(teacher.root)
    if t is None:
        raise AttnkitError(f"{teacher.ref}: the teacher has no tokenizer; heal needs one to read text")
    s = load_tokenizer(student.root)
    if s is not None and s.get_vocab() != t.get_vocab():
        raise AttnkitError(f"{student.ref}: its tokenizer differs from the teacher's (different vocabulary)")


def _check_shared_weights(student, teacher) -> None:
    """Among tensors outside attention with the same name and shape in both, at least one is bit-equal."""
    import torch

    with LazyReader(student.ckpt.weight_files) as s, LazyReader(teacher.ckpt.weight_files) as t:
        shared = [
            n for n in s.names() if n in t and "attn" not in n and tuple(s.info(n).shape) == tuple(t.info(n).shape)
        ]
        if not shared:
            raise AttnkitError(
                f"{student.ref}: shares no tensor outside attention with the teacher; not a rewrite of it"
            )
        shared.sort(key=lambda n: ("mlp" not in n, n))  # MLP weights first: every rewrite copies them
        for name in shared[:SHARED_CHECKS]:
            a, b = s.get(name), t.get(name)
            low = a.dtype if a.element_size() <= b.element_size() else b.dtype
            if torch.equal(a.to(low), b.to(low)):
                return
    raise AttnkitError(
        f"{student.ref}: none of its weights outside attention equals the teacher's "
        f"(checked {min(len(shared), SHARED_CHECKS)}, e.g. {shared[0]!r}); not a rewrite of it"
    )


def rewritten_tensors(student, teacher) -> list[str]:
    """Names of the student's stored attention tensors that the teacher lacks or holds with another shape or
    other values (what --train rewritten trains), from the checkpoints, nothing loaded."""
    import torch

    with LazyReader(student.ckpt.weight_files) as s, LazyReader(teacher.ckpt.weight_files) as t:
        theirs = set(t.names())
        return [
            name
            for name in s.names()
            if "attn" in name
            and (
                name not in theirs
                or tuple(s.info(name).shape) != tuple(t.info(name).shape)
                or not torch.equal(s.get(name), t.get(name))
            )
        ]


def _check_attention_rewritten(student, teacher) -> list[str]:
    """rewritten_tensors, refused when empty (nothing for --train rewritten to train)."""
    names = rewritten_tensors(student, teacher)
    if not names:
        raise AttnkitError(
            f"{student.ref}: its attention weights equal the teacher's: nothing was rewritten to heal "
            "(use --train all to train every tensor)"
        )
    return names


def read_manifest(folder: Path) -> dict | None:
    """The folder's attnkit.json, or None when there is none."""
    path = folder / "attnkit.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise AttnkitError(f"{path}: not valid JSON") from None


def rewrite_summary(manifest: dict | None) -> dict | None:
    """What produced the student: conversion or retrofit, its method and source, from its manifest."""
    if manifest is None:
        return None
    kind = manifest.get("operation") or manifest.get("conversion") or manifest.get("retrofit")  # older manifests
    return {
        "rewrite": kind,
        "method": manifest.get("method") or (manifest.get("parameters") or {}).get("method"),
        "source": (manifest.get("source") or {}).get("ref"),
        "command": manifest.get("command"),
    }


def attention_modules(model) -> dict[str, object]:
    """{qualified name: module} of the decoder's attention blocks (transformers names them *Attention)."""
    found = {name: m for name, m in model.named_modules() if type(m).__name__.endswith("Attention")}
    return {name: m for name, m in found.items() if not any(name.startswith(o + ".") for o in found)}


def rewritten_parameters(student, teacher) -> list[str]:
    """Student attention parameters that the teacher lacks, or holds with another shape or other values."""
    import torch

    theirs = dict(teacher.named_parameters())
    prefixes = tuple(name + "." for name in attention_modules(student))
    changed = []
    for name, p in student.named_parameters():
        if not name.startswith(prefixes):
            continue
        q = theirs.get(name)
        if q is None or q.shape != p.shape or not torch.equal(q.detach().to(p.device), p.detach()):
            changed.append(name)
    return changed
