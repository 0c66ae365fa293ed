"""How a result scores against its source, for every command that writes one: convert and retrofit (the result
against its source) and heal (the student before and after training, against the teacher). On the --eval text the
perplexity of both, KL(source || result) and top-1 agreement, and greedy continuations of the sample prompts by
both (a perplexity can hide a wrong answer); with tasks and pass keys, both models' scores with their paired
differences (attnkit.scoring.capability).

`Comparison` holds the one list of what the "eval" block of a report measures: a new figure goes into
Comparison.text (and EVAL_KEYS) and appears in the reports of convert, retrofit and heal alike.
`compare_checkpoints` loads two checkpoint folders and compares them (convert and retrofit score the folder they
wrote); heal holds its models and calls a Comparison itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from attnkit.runtime import load_model
from attnkit.runtime.generate import greedy
from attnkit.runtime.layerwise import LayerStreamed, open_model
from attnkit.scoring import attention_stats
from attnkit.scoring.capability import check_capability, run_capability, side_by_side
from attnkit.scoring.options import EvalOptions
from attnkit.scoring.perplexity import evaluate
from attnkit.scoring.selfcheck import SelfCheck, run_check

#: The fields of the "eval" block of a report; null when not asked for (the text ones without --eval text, tasks
#: and passkey without them).
EVAL_KEYS = (
    "files",
    "tokens",
    "predicted",
    "seq_len",
    "source_perplexity",
    "perplexity",
    "kl_mean",
    "kl_max",
    "top1_agreement",
    "samples",
    "long_context",
    "tasks",
    "passkey",
)


def samples(source, result, prompts, new_tokens: int) -> list[dict]:
    """Per prompt the greedy continuation of source and result (empty without a tokenizer)."""

    if source.tokenizer is None:
        return []
    return [
        {"prompt": p, "source": greedy(source, p, new_tokens), "result": greedy(result, p, new_tokens)} for p in prompts
    ]


class Comparison:
    """Results scored against one source on one EvalOptions and the windows [N, seq_len] of its --eval text (None
    without). Models are LoadedModels in inference mode. The source's own task and pass-key scores are computed
    at the first call and kept for the next ones: heal compares the student before and after training with one
    teacher, which it may free and load again in between. `result_capability` keeps each result's task and
    pass-key scores in the order compared (with per-item values: heal pairs the first and the last)."""

    def __init__(self, options: EvalOptions, windows=None):
        self.options = options
        self.windows = windows
        self._source_capability: dict | None = None
        self.result_capability: list[dict] = []
        self._long = None  # (length, windows [N, length] or None), made at the first call

    def __call__(self, source, result) -> dict:
        """The "eval" block of a report (EVAL_KEYS; see docs/convert-gqa.md): `result` against `source`."""
        block = dict.fromkeys(EVAL_KEYS)
        if self.windows is not None:
            block.update(self.text(source, result))
        if self.options.capability:
            block.update(self.capability(source, result))
        return block

    def text(self, source, result) -> dict:
        """Both models on the --eval windows: perplexities, KL(source || result), top-1 agreement, and their
        greedy continuations of the sample prompts."""
        res = evaluate(result, self.windows, reference=source)
        return {
            "files": list(self.options.files),
            "tokens": res.tokens,
            "predicted": res.predicted,
            "seq_len": self.options.seq_len,
            "source_perplexity": res.reference_perplexity,
            "perplexity": res.perplexity,
            "kl_mean": res.kl_mean,
            "kl_max": res.kl_max,
            "top1_agreement": res.top1_agreement,
            "samples": samples(source, result, self.options.sample_prompts, self.options.sample_tokens),
            "long_context": self.long_context(source, result) if self.options.long_seq_len else None,
        }

    def long_context(self, source, result) -> dict:
        """Both models on long windows of the --eval text (EvalOptions.long_windows), scored by distance of the
        predicted token: the rows, and the longest bucket (where a rewrite that forgets far context shows it)."""
        if self._long is None:
            config = source.model.config.get_text_config()
            self._long = self.options.long_windows(source.tokenizer, getattr(config, "max_position_embeddings", None))
        length, windows = self._long
        block = {"seq_len": length, "windows": 0, "tokens": 0, "by_distance": None, "longest": None, "skipped": None}
        if windows is None:
            block["skipped"] = f"the --eval text holds less than one window of {length:,} tokens"
            return block
        res = evaluate(result, windows, reference=source, by_distance=True)
        rows = res.by_distance
        block.update(windows=int(windows.shape[0]), tokens=res.tokens, by_distance=rows, longest=rows[-1])
        return block

    def capability(self, source, result) -> dict:
        """{"tasks": ..., "passkey": ...}: per kind the source's scores, the result's and the result against the
        source (attnkit.scoring.capability.side_by_side; null for a kind not asked for)."""
        spec = self.options.capability
        manager = check_capability(spec, [])
        if self._source_capability is None:
            self._source_capability = run_capability(source, spec, manager, "source")
        self.result_capability.append(run_capability(result, spec, manager, "result"))
        return side_by_side(self._source_capability, self.result_capability[-1], ("source", "result"))

    def probe(self, source, result) -> dict | None:
        """Both models' attention statistics on the --eval windows, side by side (probe_summary); None without
        --eval text."""
        if self.windows is None:
            return None
        return attention_stats.probe_summary(
            attention_stats.probe(source, self.windows, name="source"),
            attention_stats.probe(result, self.windows, name="result"),
        )


def compare_checkpoints(
    options: EvalOptions,
    source,
    result_root: Path,
    device: str,
    *,
    check: SelfCheck | None = None,
    probe: bool = False,
    extra: Callable[[object], dict] | None = None,
) -> dict:
    """Load source (the Source the command opened, not opened again) and result (fp32, on `device`) and compare
    them: {"eval": the Comparison's block (null when `options` score nothing), "probe": with `probe` both models'
    attention statistics (null without it or without --eval text), "check": the self-check's block (null without
    `check`)}. `extra(result)` may check the loaded result (raising on what is wrong) and returns more "eval"
    entries. Without --eval, tasks or pass keys the models are opened as the self-check needs them: in the
    source's 16-bit dtype where the device computes it natively (attnkit.runtime.loader.native_dtype), whole where
    they fit, else layer by layer (bounded memory)."""
    if options or probe:
        source = load_model(source, device=device, dtype="float32")
        result = load_model(str(result_root), device=device, dtype="float32")
    else:
        source = open_model(source, device=device, dtype=_check_dtype(source.config, device))
        result = open_model(str(result_root), device=device, dtype=str(source.dtype).removeprefix("torch."))
    out = {"eval": None, "probe": None, "check": None}
    if options:
        more = extra(result) if extra is not None else {}
        comparison = Comparison(options, options.windows(source.tokenizer) if options.files else None)
        out["eval"] = {**comparison(source, result), **more}
        out["probe"] = comparison.probe(source, result) if probe else None
    if check is not None:
        both_whole = not isinstance(source, LayerStreamed) and not isinstance(result, LayerStreamed)
        out["check"] = run_check(source, result, check.text, check.limit, check.options, passkeys=both_whole)
    return out


def _check_dtype(config: dict, device: str) -> str:
    """The dtype the self-check runs both models in: the source's native one on this device (native_dtype;
    `config`: the source's)."""
    from attnkit.runtime.loader import native_dtype, resolve_device

    return native_dtype(resolve_device(device), config)
