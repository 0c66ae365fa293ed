"""What the retrofits share: their source check and the tensor stream that rewrites some tensors on the way.

Flow of a retrofit: check the request and open the source (attnkit.io.source) -> (calibrate) -> write
through attnkit.commands.write.write_checkpoint (weights, config.json, side files, checks, --eval scores and
probe summaries, attnkit.json, rename into place). The source is only read.
"""

from __future__ import annotations

from collections.abc import Callable

from attnkit.commands.rewrite import RewriteRequest, check_rewrite, check_texts, self_check
from attnkit.io.reader import LazyReader
from attnkit.io.source import Source, open_source
from attnkit.progress import phase
from attnkit.runtime import load_model
from attnkit.scoring.comparison import compare_checkpoints


def check_source(req: RewriteRequest, calibrates: bool, check: Callable | None = None) -> Source:
    """The request's options and OUT (attnkit.commands.rewrite.check_rewrite), then the opened source and the
    --calib (when the retrofit `calibrates`) and --eval texts against its tokenizer; `check(arch, spec, config)`
    refuses families the retrofit does not apply to, before any dequantization."""
    check_rewrite(req)
    src = open_source(req.model, "retrofit", check)
    check_texts(req, src, calibrates)
    return src


def scorer(req: RewriteRequest, src: Source, report: dict, operation: str, calibration: dict | None) -> Callable | None:
    """write_checkpoint's score(folder): the self-check of the written folder (unless --no-check; `calibration`:
    the report's entry of the text the retrofit calibrated on, None when it read none) and, with --eval, the eval
    scores and both models' probe summaries, put in the report and the manifest; None when nothing is scored."""
    check = self_check(req, operation, calibration)
    if not req.scoring and check is None:
        return None

    def score(folder) -> dict:
        report.update(compare_checkpoints(req.scoring, src, folder, req.device, check=check, probe=True))
        return {"eval": report["eval"], "probe": report["probe"], "check": report["check"]}

    return score


def load(ref, device: str):
    """A model ready to run in float32 (LoadedModel), soft-caps applied (see attnkit.runtime.capped_attention);
    `ref`: the Source the command opened (not opened again) or a folder it wrote."""

    return load_model(ref, device=device, dtype="float32")


def stream_weights(src: Source, writer, rewrite: Callable[[str, object], dict] | None = None) -> dict:
    """Copy every tensor to the writer; rewrite(name, tensor) -> {name: tensor} replaces one tensor by others.

    Returns name -> shape of everything written (for the write path's check).
    """

    expected: dict[str, tuple] = {}
    with LazyReader(src.ckpt.weight_files) as reader, phase("writing", len(reader.names()), "tensors") as advance:
        for name in reader.names():
            tensor = reader.get(name)
            for new_name, new in (rewrite(name, tensor) if rewrite else {name: tensor}).items():
                writer.add(new_name, new, scanned=new is tensor)  # an unchanged copy was scanned when opened
                expected[new_name] = tuple(new.shape)
            advance(1)
    return expected
