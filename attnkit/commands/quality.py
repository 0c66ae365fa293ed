"""How a rewrite scores against its source, for every command that writes one (convert, retrofit, heal): on the
--eval text the perplexity of both, KL(source || result) and top-1 agreement, and greedy continuations of the
sample prompts by both (a perplexity can hide a wrong answer)."""

from __future__ import annotations

from collections.abc import Callable

from attnkit.commands.analyse.evaluate import evaluate
from attnkit.commands.analyse.probe import probe as run_probe
from attnkit.commands.analyse.probe import probe_summary
from attnkit.commands.rewrite import eval_windows
from attnkit.runtime import load_model
from attnkit.runtime.generate import greedy


def samples(source, result, prompts, new_tokens: int) -> list[dict]:
    """Per prompt the greedy continuation of source and result (empty without a tokenizer)."""

    if source.tokenizer is None:
        return []
    return [
        {"prompt": p, "source": greedy(source, p, new_tokens), "result": greedy(result, p, new_tokens)} for p in prompts
    ]


def quality(source, result, req, windows) -> dict:
    """The "eval" section of a report (see docs/convert-gqa.md): both loaded models scored on `windows` of the
    request's --eval text, and their greedy continuations of its sample prompts."""

    res = evaluate(result, windows, reference=source)
    return {
        "files": list(req.eval),
        "tokens": res.tokens,
        "predicted": res.predicted,
        "seq_len": req.eval_seq_len,
        "source_perplexity": res.reference_perplexity,
        "perplexity": res.perplexity,
        "kl_mean": res.kl_mean,
        "kl_max": res.kl_max,
        "top1_agreement": res.top1_agreement,
        "samples": samples(source, result, req.sample_prompts, req.sample_tokens),
    }


def score_rewrite(
    req, source_root, result_root, *, probe: bool = False, extra: Callable[[object], dict] | None = None
) -> dict:
    """Load source and result (fp32, on --device) and score the result: {"eval": quality(...)}, plus with
    `probe` both models' attention statistics side by side under "probe" (analyse.probe.probe_summary).
    `extra(result)` may check the loaded result (raising on what is wrong) and returns more "eval" entries."""

    source = load_model(str(source_root), device=req.device, dtype="float32")
    result = load_model(str(result_root), device=req.device, dtype="float32")
    more = extra(result) if extra is not None else {}
    windows = eval_windows(source.tokenizer, req)
    scores = {"eval": {**quality(source, result, req, windows), **more}}
    if probe:
        scores["probe"] = probe_summary(
            run_probe(source, windows, name="source"), run_probe(result, windows, name="result")
        )
    return scores
