"""What every `attnkit retrofit` shares: source checks, calibration windows, safe writing, eval and probe summaries.

Flow of a retrofit: check the source and the target -> (calibrate) -> write weights, config.json,
side files and attnkit.json into a temp folder next to OUT -> check names/shapes/finiteness ->
(--eval) score source and result and probe both -> rename into place. The source is only read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from attnkit import __version__
from attnkit.commands.rewrite import CheckedSource, RewriteRequest, check_rewrite, source_record
from attnkit.errors import AttnkitError


@dataclass(kw_only=True)
class RetrofitOptions(RewriteRequest):
    """Options shared by all retrofits."""


@dataclass
class Source(CheckedSource):
    """A checked source and the names of its tensors."""

    names: set

    def tensor(self, role: str, layer: int) -> str | None:
        """Name of `role` in `layer` when the checkpoint has it."""
        name = self.arch.tensor_name(role, layer, self.prefix)
        return name if name in self.names else None


def check_options(opts: RetrofitOptions) -> None:
    """Text files, token budgets, --device and the target (see attnkit.commands.rewrite.check_rewrite)."""
    check_rewrite(opts)


def open_source(ref: str) -> Source:
    """Resolve `ref` (GGUF files are materialized to safetensors first) and match its tensor names."""
    from attnkit.archs import get_arch
    from attnkit.archs.spec import attention_spec
    from attnkit.io.complete import checked_weights
    from attnkit.io.gguf_load import dequantized
    from attnkit.io.resolve import resolve

    ckpt = resolve(ref)
    if ckpt.kind == "config":
        raise AttnkitError(f"{ref}: a config file has no weights to retrofit")
    arch = get_arch(ckpt.model_type)
    if not arch.causal:
        raise AttnkitError(f"{ref}: {ckpt.model_type} is not a causal language model")
    ckpt = dequantized(ckpt)
    if not ckpt.weight_files and ckpt.kind == "hub":
        from attnkit.io.hub import resolve_hub

        ckpt.weight_files = resolve_hub(ckpt.ref, need_weights=True).weight_files
    if not ckpt.weight_files:
        raise AttnkitError(f"{ref}: no safetensors weights found")
    spec = attention_spec(ckpt.config)
    infos, prefix = checked_weights(ckpt, arch, spec)
    return Source(ckpt, arch, spec, prefix, set(infos))


def raw_config(src: Source) -> dict:
    """The source's config.json as written (not the text sub-config view)."""
    return json.loads((Path(src.ckpt.root) / "config.json").read_text(encoding="utf-8"))


def load(ref, device: str):
    """A model ready to run in float32 (LoadedModel), soft-caps applied (see attnkit.runtime.softcap)."""
    from attnkit.runtime import load_model

    return load_model(str(ref), device=device, dtype="float32")


def windows(loaded, files: list[str], seq_len: int, tokens: int | None, kind: str = "calib"):
    """Token windows [N, seq_len] from text files; `kind` (calib, eval) names the options in messages."""
    from attnkit.runtime import make_windows, read_texts

    return make_windows(loaded.tokenizer, read_texts(files), seq_len, tokens,
                        flags=(f"--{kind}-seq-len", f"--{kind}-tokens"))


def stream_weights(src: Source, folder: Path, max_shard_bytes: int,
                   rewrite: Callable[[str, object], dict] | None = None) -> dict:
    """Copy every tensor into new shards; rewrite(name, tensor) -> {name: tensor} replaces one tensor by others.

    Returns name -> shape of everything written (for verify_output).
    """
    from attnkit.io.reader import LazyReader
    from attnkit.io.writer import ShardedWriter
    from attnkit.progress import phase

    expected: dict[str, tuple] = {}
    writer = ShardedWriter(folder, max_shard_bytes)
    with LazyReader(src.ckpt.weight_files) as reader, phase("writing", len(reader.names()), "tensors") as advance:
        for name in reader.names():
            tensor = reader.get(name)
            for new_name, new in (rewrite(name, tensor) if rewrite else {name: tensor}).items():
                writer.add(new_name, new)
                expected[new_name] = tuple(new.shape)
            advance(1)
        writer.finish()
    return expected


def write_output(src: Source, opts: RetrofitOptions, config: dict, write_weights: Callable[[Path], dict | None],
                 manifest: dict, report: dict, check: Callable[[Path], None] | None = None) -> None:
    """Write weights, config, side files and attnkit.json to a temp folder; check, evaluate, then commit.

    `report["eval"]` / `report["probe"]` are filled when opts.eval is set; the manifest gets them too.
    """
    from attnkit.io.writer import OutputDir, copy_side_files, verify_output

    with OutputDir(Path(opts.out), overwrite=opts.overwrite, sources=[Path(src.ckpt.root)]) as out:
        expected = write_weights(out.path)
        (out.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(Path(src.ckpt.root), out.path)
        verify_output(out.path, expected)
        if check is not None:
            check(out.path)
        if opts.eval:
            report.update(compare(opts, Path(src.ckpt.root), out.path))
        doc = {"attnkit_version": __version__, "command": opts.command,
               "source": source_record(opts.model, src),
               **manifest, "eval": report.get("eval"), "probe": report.get("probe")}
        (out.path / "attnkit.json").write_text(json.dumps(doc, indent=2) + "\n")
        out.commit()


def compare(opts: RetrofitOptions, source_root: Path, result_root: Path) -> dict:
    """Perplexity, KL(source || result) and greedy samples on the --eval text (attnkit.commands.quality), and both
    models' probe summaries side by side."""
    from attnkit.commands.analyse.probe import probe
    from attnkit.commands.quality import quality

    source, result = load(source_root, opts.device), load(result_root, opts.device)
    wins = windows(source, opts.eval, opts.eval_seq_len, opts.eval_tokens, kind="eval")
    before, after = probe(source, wins, name="source"), probe(result, wins, name="result")
    return {"eval": quality(source, result, opts, wins), "probe": probe_summary(before, after)}


def _layer_summary(heads: list[dict]) -> dict[int, dict]:
    layers: dict[int, dict] = {}
    for row in heads:
        s = layers.setdefault(row["layer"], {"max_logit": None, "logz_mean": [], "logz_max": None})
        s["max_logit"] = _max(s["max_logit"], row["max_logit"])
        s["logz_max"] = _max(s["logz_max"], row["logz_max"])
        if row["logz_mean"] is not None:
            s["logz_mean"].append(row["logz_mean"])
    for s in layers.values():
        s["logz_mean"] = sum(s["logz_mean"]) / len(s["logz_mean"]) if s["logz_mean"] else None
    return layers


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def probe_summary(before, after) -> dict:
    """Per layer: max attention logit (over heads), mean and max log Z, source vs result; final-logit stats."""
    b, a = _layer_summary(before.heads), _layer_summary(after.heads)
    rows = [{"layer": layer,
             "max_logit_before": b[layer]["max_logit"], "max_logit_after": a[layer]["max_logit"],
             "logz_mean_before": b[layer]["logz_mean"], "logz_mean_after": a[layer]["logz_mean"],
             "logz_max_before": b[layer]["logz_max"], "logz_max_after": a[layer]["logz_max"]}
            for layer in sorted(set(b) & set(a))]
    keys = ("final_logit_max", "final_logz_mean", "final_logz_max", "z_loss")
    return {"layers": rows, "final": {k: {"before": before.final.get(k), "after": after.final.get(k)} for k in keys}}
