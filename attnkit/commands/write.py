"""Write a checkpoint: the one path every writing command (convert, retrofit, heal, export) takes.

A temp folder next to OUT (made at the first write) gets the weights (the caller's function writes the shards
and returns the name -> shape it wrote), config.json, the source's tokenizer and generation files byte for
byte; the folder is checked (names and shapes; NaN/Inf was refused as each tensor was added, and a file copied
whole is the source's, scanned when it was opened; then the caller's own check, e.g. that it loads);
the caller may score it (e.g. --eval) before attnkit.json is written; then it is renamed into place. On any
error or signal the temp folder is removed and OUT is untouched (attnkit.io.writer.OutputDir).

attnkit.json has one schema for every command (docs/checkpoints.md): attnkit_version, operation (e.g.
"convert mla"), command (the command line), source (attnkit.io.source.Source.record), parameters,
warnings, eval (null without scores), then what the operation adds.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from attnkit import __version__
from attnkit.commands.rewrite import WriteRequest, local_sources
from attnkit.io.source import Source
from attnkit.io.writer import OutputDir, ShardedWriter, copy_side_files, verify_output

MANIFEST = "attnkit.json"


def manifest(req: WriteRequest, source: Source, operation: str, body: dict) -> dict:
    """The attnkit.json document: the common head, then `body` (parameters, warnings and eval default to
    {}, [] and null)."""
    return {
        "attnkit_version": __version__,
        "operation": operation,
        "command": req.command,
        "source": source.record(),
        "parameters": {},
        "warnings": [],
        "eval": None,
        **body,
    }


def write_checkpoint(
    req: WriteRequest,
    source: Source,
    operation: str,
    *,
    config,
    weights: Callable[[ShardedWriter], dict[str, tuple]],
    body: Callable[[], dict],
    check: Callable[[Path], None] | None = None,
    score: Callable[[Path], dict] | None = None,
    inputs: list[Path] | None = None,
) -> Path:
    """Write OUT from `source`; returns OUT.

    config: a dict (written as JSON), a config.json to copy byte for byte, or a transformers config.
    weights(writer) adds every tensor to the sharded writer (or copies weight files into writer.folder) and
    returns {name: shape}; `check(folder)` runs after the standard checks;
    `score(folder)` returns manifest entries computed on the written folder (e.g. {"eval": ...}); body() gives
    the operation's own entries, asked for once the weights are written and checked. `inputs`:
    further folders or files OUT must not overwrite (the source's are always included)."""
    protected = [*local_sources(source.ref), source.root, *(inputs or [])]
    with OutputDir(Path(req.out), overwrite=req.overwrite, sources=protected) as out:
        writer = ShardedWriter(lambda: out.path, req.max_shard_bytes)  # the temp folder appears at the first write
        expected = weights(writer)
        if writer.tensors:  # a caller may copy whole files into writer.folder instead
            writer.finish()
        if isinstance(config, dict):
            (out.path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        elif isinstance(config, Path):
            shutil.copyfile(config, out.path / "config.json")
        else:
            config.save_pretrained(out.path)
        copy_side_files(source.root, out.path)
        verify_output(
            out.path, expected, scan=False
        )  # the writer scanned what it wrote; copies are of a scanned source
        if check is not None:
            check(out.path)
        scores = score(out.path) if score else {}
        doc = manifest(req, source, operation, {**body(), **scores})
        (out.path / MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
        return out.commit()
