"""How a rewrite scores against its source, for every command that writes one (convert, retrofit, heal): on the
--eval text the perplexity of both, KL(source || result) and top-1 agreement, and greedy continuations of the
sample prompts by both (a perplexity can hide a wrong answer); with --eval-tasks and --eval-passkey, task
accuracy and pass-key retrieval of both with their paired differences (attnkit.commands.analyse.capability)."""

from __future__ import annotations

from collections.abc import Callable

from attnkit.commands.analyse.capability import check_capability, run_capability, side_by_side
from attnkit.commands.analyse.evaluate import evaluate
from attnkit.commands.analyse.probe import probe as run_probe
from attnkit.commands.analyse.probe import probe_summary
from attnkit.commands.rewrite import eval_windows
from attnkit.runtime import load_model
from attnkit.runtime.generate import greedy

#: The "eval" fields of quality(), null when no --eval text is given.
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
)


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
    """Load source and result (fp32, on --device) and score the result: {"eval": ...}: quality(...) on the --eval
    text (its fields null without it), "tasks" and "passkey" source beside result (null without them); with
    `probe` and --eval text both models' attention statistics side by side under "probe"
    (analyse.probe.probe_summary). `extra(result)` may check the loaded result (raising on what is wrong) and
    returns more "eval" entries."""
    source = load_model(str(source_root), device=req.device, dtype="float32")
    result = load_model(str(result_root), device=req.device, dtype="float32")
    more = extra(result) if extra is not None else {}
    scores = {"eval": dict.fromkeys(EVAL_KEYS), "probe": None}
    if req.eval:
        windows = eval_windows(source.tokenizer, req)
        scores["eval"].update(quality(source, result, req, windows))
        if probe:
            scores["probe"] = probe_summary(
                run_probe(source, windows, name="source"), run_probe(result, windows, name="result")
            )
    scores["eval"].update(capability(source, result, req), **more)
    return scores


def capability(source, result, req) -> dict:
    """{"tasks": ..., "passkey": ...} of the request's capability scores, source beside result (null when not
    asked for)."""
    if not req.capability:
        return {"tasks": None, "passkey": None}
    manager = check_capability(req.capability, [])
    return side_by_side(
        run_capability(source, req.capability, manager, "source"),
        run_capability(result, req.capability, manager, "result"),
        ("source", "result"),
    )
