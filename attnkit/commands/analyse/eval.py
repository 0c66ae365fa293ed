"""`attnkit eval`: what a model scores, beside a reference when one is given. Perplexity on text windows (KL to the
reference and top-1 agreement), task accuracy through lm-eval and pass-key retrieval at long contexts, scored by
attnkit.scoring (perplexity, capability). Everything is checked before the first model loads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.commands.analyse.eval_plot import check_plot, plot_eval
from attnkit.errors import UsageError
from attnkit.runtime import make_windows
from attnkit.runtime.layerwise import LayerStreamed, check_run_options, open_model
from attnkit.runtime.loader import check_models
from attnkit.runtime.texts import check_text_files, check_window_options, read_texts
from attnkit.scoring.capability import CapabilitySpec, check_capability, run_capability, side_by_side
from attnkit.scoring.perplexity import FIRST_BUCKET, evaluate
from attnkit.units import MAX_COUNT, check_bounds

#: The perplexity fields of the report, null when no text is given.
PERPLEXITY_KEYS = (
    "seq_len",
    "windows",
    "tokens",
    "predicted",
    "nll_mean",
    "perplexity",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "reference_nll_mean",
    "source_perplexity",
    "reference_perplexity",
    "by_distance",
)
#: The key every writer's comparison uses for the reference's perplexity; `reference_perplexity` (the same value)
#: is kept for one release.
SOURCE_KEY = "source_perplexity"


@dataclass(kw_only=True)
class EvalRequest:
    """attnkit eval: the model, an optional reference, the text and how it is cut and run, and the capability
    scores (tasks, pass keys) to add."""

    model: str
    reference: str | None = None
    texts: list[str] = field(default_factory=list)
    text: str | None = None
    seq_len: int = 512
    max_tokens: int | None = None
    batch_size: int = 1
    device: str = "auto"
    dtype: str = "auto"
    layer_stream: str = "auto"  # auto | always | never (attnkit.runtime.layerwise)
    device_map: str | None = None  # auto: accelerate places the model over the GPUs
    by_distance: bool | None = None  # None: whenever the windows are longer than the first distance bucket
    capability: CapabilitySpec = field(default_factory=CapabilitySpec)
    plot: str | None = None

    @property
    def scores_text(self) -> bool:
        return bool(self.texts) or self.text is not None

    @property
    def distance(self) -> bool:
        """Whether the text scores are also reported by distance."""
        if not self.scores_text:
            return False
        return self.seq_len > FIRST_BUCKET if self.by_distance is None else self.by_distance


def check_request(req: EvalRequest):
    """Options, text files, task names and pass-key lengths and both models, before the first model loads;
    returns (the text inputs or None, lm-eval's task manager or None, the models' opened Sources)."""
    models = [req.model, *([req.reference] if req.reference else [])]
    if not req.texts and req.text is None and not req.capability:
        raise UsageError("nothing to score: give text files (or --text), --tasks or --passkey")
    check_bounds("--batch-size", req.batch_size, 1, MAX_COUNT)
    check_run_options(req.layer_stream, req.device_map)
    if req.capability and req.layer_stream == "always":
        raise UsageError("--tasks and --passkey run whole models: they cannot be combined with --layer-stream always")
    texts = None
    if req.scores_text:
        check_window_options(req.seq_len, req.max_tokens)
        _check_distance(req)
        check_text_files(req.texts)
        texts = read_texts(req.texts, req.text)
    elif req.by_distance:
        raise UsageError("--by-distance scores text: give text files (or --text)")
    check_plot(req.plot, req.capability, req.distance)
    fits = _fits_positions(req.seq_len) if texts is not None else None
    sources = check_models(models, req.device, req.dtype, req.layer_stream, fits)
    return texts, check_capability(req.capability, models), sources


def _check_distance(req: EvalRequest) -> None:
    """--by-distance asked for explicitly: windows long enough for two distance buckets."""
    if req.by_distance and req.seq_len <= FIRST_BUCKET:
        raise UsageError(
            f"--by-distance: windows of {req.seq_len} tokens are no longer than the first distance bucket "
            f"({FIRST_BUCKET} tokens); use --seq-len {2 * FIRST_BUCKET} or more"
        )


def _fits_positions(seq_len: int):
    """check_models' refusal of a model whose positions (max_position_embeddings) a window of seq_len passes."""

    def check(ref: str, arch, _spec, config: dict) -> None:
        limit = arch.config_value(config, "max_positions")
        if limit is not None and seq_len > int(limit):
            raise UsageError(
                f"--seq-len {seq_len:,} is past {ref}'s {int(limit):,} positions (max_position_embeddings)"
            )

    return check


def run_eval(req: EvalRequest, log: Callable[[str], None] = lambda message: None) -> dict:
    """The report of `attnkit eval` (docs/eval.md)."""
    texts, manager, sources = check_request(req)
    stream = "never" if req.capability else req.layer_stream  # lm-eval and pass keys generate: whole models
    opened = {"device": req.device, "dtype": req.dtype, "layer_stream": stream, "device_map": req.device_map}
    loaded = open_model(sources[0], **opened)
    ref = open_model(sources[1], **opened) if req.reference else None
    doc = {
        "model": req.model,
        "reference": req.reference,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "layer_streamed": isinstance(loaded, LayerStreamed),
        **dict.fromkeys(PERPLEXITY_KEYS),
    }
    if texts is not None:
        windows = make_windows(loaded.tokenizer, texts, req.seq_len, req.max_tokens)
        log(f"scoring {windows.shape[0]} window(s) of {req.seq_len} tokens")
        result = evaluate(loaded, windows, reference=ref, batch_size=req.batch_size, by_distance=req.distance)
        doc.update(seq_len=req.seq_len, windows=int(windows.shape[0]), **result.to_dict())
        doc[SOURCE_KEY] = doc["reference_perplexity"]
    scores = run_capability(loaded, req.capability, manager, req.model) if req.capability else {}
    ref_scores = run_capability(ref, req.capability, manager, req.reference) if ref is not None and scores else None
    both = (
        side_by_side(ref_scores, scores, ("reference", "model"))
        if ref_scores
        else side_by_side(scores, None, ("model", "reference"))
    )
    doc.update(tasks=both.get("tasks"), passkey=both.get("passkey"))
    if req.plot:
        passkeys = None
        if scores.get("passkey") is not None:
            passkeys = {req.model: scores["passkey"], **({req.reference: ref_scores["passkey"]} if ref_scores else {})}
        distance = (req.model, doc["by_distance"]) if doc["by_distance"] else None
        plot_eval(req.plot, passkeys, distance)
    return doc
