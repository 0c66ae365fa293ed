"""How a rewrite scores against its source on the --eval text: perplexity of both, KL(source || result),
top-1 agreement, and greedy continuations of the sample prompts by both (a perplexity can hide a wrong
answer). Shared by convert gqa|mqa|mla and retrofit."""

from __future__ import annotations

#: Prompt of the greedy sample when none is given: a fact a small model knows and a damaged one gets wrong.
DEFAULT_PROMPTS = ("The capital of the United States is",)


def eval_windows(source, req):
    """The --eval text as windows [N, --eval-seq-len], tokenized by the source's tokenizer."""
    from attnkit.runtime import make_windows, read_texts

    return make_windows(source.tokenizer, read_texts(req.eval), req.eval_seq_len, req.eval_tokens,
                        flags=("--eval-seq-len", "--eval-tokens"))


def samples(source, result, prompts, new_tokens: int) -> list[dict]:
    """Per prompt the greedy continuation of source and result (empty without a tokenizer)."""
    from attnkit.runtime.generate import greedy

    if source.tokenizer is None:
        return []
    return [{"prompt": p, "source": greedy(source, p, new_tokens), "result": greedy(result, p, new_tokens)}
            for p in prompts]


def quality(source, result, req, windows=None) -> dict:
    """The "eval" section of a rewrite report (see docs/convert-gqa.md): both loaded models, the request's
    --eval files and sample prompts; `windows` when the caller made them already."""
    from attnkit.commands.analyse.evaluate import evaluate

    windows = eval_windows(source, req) if windows is None else windows
    res = evaluate(result, windows, reference=source)
    return {"files": list(req.eval), "tokens": res.tokens, "predicted": res.predicted,
            "seq_len": req.eval_seq_len, "source_perplexity": res.reference_perplexity,
            "perplexity": res.perplexity, "kl_mean": res.kl_mean, "kl_max": res.kl_max,
            "top1_agreement": res.top1_agreement,
            "samples": samples(source, result, req.sample_prompts, req.sample_tokens)}
