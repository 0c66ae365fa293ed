"""Open a checkpoint: the one place that resolves a model reference, refuses what cannot be used, checks it before
any long work, dequantizes a GGUF file through the cache and says what it is in a manifest. Every path that reads
or runs weights starts here: the writing commands (convert, retrofit, heal, export, diff), a model loaded whole
(attnkit.runtime.loader.load_model), a model run layer by layer (attnkit.runtime.streaming, .layerwise) and the
checks eval and probe make before the first model loads; each passes the opened Source down, so a reference is
resolved once.

Order of the checks: the reference resolves and has weights; its family is in the registry (and a causal LM);
the caller's own refusals run on the config (for a GGUF file: its header's, before any dequantization); then
the weights: side files inside the folder, strict headers, every tensor the config implies with the shapes it
implies, and no NaN or Inf in any floating-point tensor (open_source(scan=False) leaves that scan to the caller:
see Source.check_finite).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.archs import Arch, get_arch, supported_model_types
from attnkit.archs.spec import AttentionSpec, attention_spec
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import Checkpoint, checkpoint_digest
from attnkit.io.complete import checked_weights
from attnkit.io.finite import check_finite_files
from attnkit.io.resolve import resolve_weights


@dataclass
class Source:
    """A checked source checkpoint: the reference as given, its resolved files (a GGUF file's cache folder),
    architecture, attention spec, the prefix in front of its tensor names and those names; `numel` counts the
    elements of every stored tensor (from the headers), `scanned` says whether the weight files were scanned for
    NaN and Inf. `arch` and `spec` are None only for a family outside the registry opened with registry=False."""

    ref: str
    ckpt: Checkpoint
    arch: Arch | None
    spec: AttentionSpec | None
    prefix: str
    names: frozenset[str]
    numel: int = field(default=0, kw_only=True)
    scanned: bool = field(default=False, kw_only=True)

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

    def check_finite(self) -> None:
        """Scan every weight file for NaN and Inf, one tensor at a time, unless that was done: the first tensor
        that holds one is named ("<ref>: tensor 'name' holds NaN or Inf"). One read of every weight."""
        if not self.scanned:
            check_finite_files(self.ckpt.weight_files, self.ref)
            self.scanned = True

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
    ref: str,
    purpose: str,
    check: Callable[[Arch, AttentionSpec, dict], None] | None = None,
    *,
    causal: bool = True,
    registry: bool = True,
    scan: bool = True,
    dequantize: bool = True,
) -> Source:
    """The checked Source of `ref`. `purpose` ends "a config file has no weights to ..." (e.g. "convert");
    `check(arch, spec, config)` raises the caller's refusals before any GGUF file is dequantized; `causal`:
    refuse families that are not causal language models; `registry`: refuse families outside the architecture
    registry (False: let them through unchecked beyond their headers, for transformers' own loading report);
    `scan`: scan the weights for NaN and Inf now (False: the caller does, Source.check_finite, or checks what it
    loads); `dequantize`: False leaves a GGUF file as its header describes it (no weight files to read)."""
    from attnkit.io.gguf_load import dequantized

    ckpt = resolve_weights(ref, purpose)
    arch = spec = None
    if registry or not isinstance(ckpt.model_type, str) or ckpt.model_type in supported_model_types():
        arch = get_arch(ckpt.model_type)  # refuses a model_type that is not a string
        if causal and not arch.causal:
            raise AttnkitError(f"{ref}: {ckpt.model_type} is not a causal language model")
        spec = attention_spec(ckpt.config)  # the config's values, before anything is dequantized
        if check is not None:
            check(arch, spec, ckpt.config)
    if dequantize:
        ckpt = dequantized(ckpt)
    if ckpt.weight_files and arch is not None:  # a GGUF file's cache folder has a config of its own
        arch, spec = get_arch(ckpt.model_type), attention_spec(ckpt.config)
    infos, prefix = checked_weights(ckpt, arch, spec) if ckpt.weight_files else ({}, "")
    src = Source(ref, ckpt, arch, spec, prefix, frozenset(infos), numel=sum(i.numel for i in infos.values()))
    if scan:
        src.check_finite()
    return src
