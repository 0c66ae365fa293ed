"""Open the checkpoint a command reads: one place that resolves a model reference, refuses what cannot be used,
checks it before any long work, dequantizes a GGUF file through the cache and says what it is in a manifest.

Order of the checks: the reference resolves and has weights; its family is in the registry (and a causal LM);
the caller's own refusals run on the config (for a GGUF file: its header's, before any dequantization); then
the weights: side files inside the folder, strict headers, every tensor the config implies with the shapes it
implies, and no NaN or Inf in any floating-point tensor.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from attnkit.archs import Arch, get_arch
from attnkit.archs.spec import AttentionSpec, attention_spec
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import Checkpoint, checkpoint_digest
from attnkit.io.complete import checked_weights
from attnkit.io.finite import check_finite_files
from attnkit.io.resolve import open_weights


@dataclass
class Source:
    """A checked source checkpoint: the reference as given, its resolved files (a GGUF file's cache folder),
    architecture, attention spec, the prefix in front of its tensor names and those names."""

    ref: str
    ckpt: Checkpoint
    arch: Arch
    spec: AttentionSpec
    prefix: str
    names: frozenset[str]

    def fields(self) -> dict:
        """The fields, for a command's subclass that adds its own (e.g. GQASource(**src.fields(), shape=...))."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Source)}

    @property
    def root(self) -> Path:
        return Path(self.ckpt.root)

    @property
    def config(self) -> dict:
        return self.ckpt.config

    def raw_config(self) -> dict:
        """config.json as written (not the text sub-config view of a multimodal config)."""
        import json

        return json.loads((self.root / "config.json").read_text(encoding="utf-8"))

    def tensor(self, role: str, layer: int) -> str | None:
        """Name of `role` in `layer` when the checkpoint has it."""
        name = self.arch.tensor_name(role, layer, self.prefix)
        return name if name in self.names else None

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of config.json and the weight files' names, sizes and headers (attnkit.io.checkpoint)."""
        return checkpoint_digest(self.ckpt)

    def record(self) -> dict:
        """The "source" of an attnkit.json manifest: the reference as given, its kind (a GGUF file stays "gguf"
        although its weights were read from the cache folder named in "dequantized"), hub repo and revision (a
        hub snapshot's commit when none was asked for), model type and digest."""
        ckpt = self.ckpt
        gguf = ckpt.dequantized_from
        revision = ckpt.revision
        if revision is None and ckpt.kind == "hub" and ckpt.root is not None:
            revision = Path(ckpt.root).name  # snapshots/<commit>
        return {
            "ref": self.ref,
            "kind": "gguf" if gguf else ckpt.kind,
            "repo_id": ckpt.repo_id,
            "revision": revision,
            "model_type": self.spec.model_type,
            "dequantized": str(ckpt.root) if gguf else None,
            "digest": self.digest,
        }


def open_source(
    ref: str, purpose: str, check: Callable[[Arch, AttentionSpec, dict], None] | None = None, *, causal: bool = True
) -> Source:
    """The checked Source of `ref`. `purpose` ends "a config file has no weights to ..." (e.g. "convert");
    `check(arch, spec, config)` raises the caller's refusals before any GGUF file is dequantized; `causal`:
    refuse families that are not causal language models."""

    def refuse(ckpt) -> None:
        arch = get_arch(ckpt.model_type)
        if causal and not arch.causal:
            raise AttnkitError(f"{ref}: {ckpt.model_type} is not a causal language model")
        if check is not None:
            check(arch, attention_spec(ckpt.config), ckpt.config)

    ckpt = open_weights(ref, purpose, refuse)
    arch, spec = get_arch(ckpt.model_type), attention_spec(ckpt.config)
    infos, prefix = checked_weights(ckpt, arch, spec)
    check_finite_files(ckpt.weight_files, ref)
    return Source(ref, ckpt, arch, spec, prefix, frozenset(infos))
