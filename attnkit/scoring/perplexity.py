"""Perplexity of a model on token windows, and its divergence from a reference model on the same windows: the
scoring every command shares (`attnkit eval`, every rewrite's report, heal's validation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from attnkit.errors import AttnkitError
from attnkit.progress import phase
from attnkit.runtime.lm import batch_hidden, head_module, logit_chunks
from attnkit.runtime.loader import unwrap

#: The first distance bucket ends here; each next one is twice as long (0-128, 128-256, ..., up to the window).
FIRST_BUCKET = 128


def distance_buckets(seq_len: int, first: int = FIRST_BUCKET) -> list[tuple[int, int]]:
    """[start, end) ranges of the position of the predicted token in its window (the tokens of context before it):
    [0, first), [first, 2 first), [2 first, 4 first), ..., the last one cut at seq_len. One bucket when the window
    is no longer than `first`."""
    edges = [0, min(first, seq_len)]
    while edges[-1] < seq_len:
        edges.append(min(edges[-1] * 2, seq_len))
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class EvalResult:
    """Token-level scores over every predicted position: `tokens` = N windows x seq_len tokens read (the count
    probe reports for the same windows), of which `predicted` = N x (seq_len - 1) predict a next token.
    `by_distance` (when asked for): the same scores per distance bucket (distance_buckets), one row each."""

    tokens: int
    predicted: int
    nll_mean: float
    perplexity: float
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    reference_nll_mean: float | None = None
    reference_perplexity: float | None = None
    by_distance: list[dict] | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class _PositionSums:
    """Float64 sums per position of the predicted token (index 1..T-1 of a window; slot p-1): the model's NLL, the
    reference's, KL(ref || model), top-1 agreements, and how many tokens each slot holds."""

    def __init__(self, seq_len: int):
        import torch

        self.nll, self.ref_nll, self.kl, self.agree, self.count = (
            torch.zeros(seq_len - 1, dtype=torch.float64) for _ in range(5)
        )

    def add(self, start: int, nll, ref_nll=None, kl=None, agree=None) -> None:
        """Add per-token values [B, c] of the chunk of positions start..start+c-1 (slots)."""
        import torch

        end = start + nll.shape[1]
        self.count[start:end] += nll.shape[0]
        for total, values in ((self.nll, nll), (self.ref_nll, ref_nll), (self.kl, kl), (self.agree, agree)):
            if values is not None:
                total[start:end] += values.to(device="cpu", dtype=torch.float64).sum(0)

    def rows(self, buckets: list[tuple[int, int]], reference: bool) -> list[dict]:
        """One row per bucket [start, end) of predicted-token positions (slot = position - 1)."""
        import math

        out = []
        for lo, hi in buckets:
            part = slice(max(lo, 1) - 1, hi - 1)
            n = float(self.count[part].sum())
            if n == 0:
                continue
            ppl = math.exp(float(self.nll[part].sum()) / n)
            row = {"start": lo, "end": hi, "predicted": int(n), "perplexity": ppl}
            row.update(dict.fromkeys(("reference_perplexity", "ratio", "kl_mean", "top1_agreement")))
            if reference:
                ref = math.exp(float(self.ref_nll[part].sum()) / n)
                row.update(
                    reference_perplexity=ref,
                    ratio=ppl / ref,
                    kl_mean=float(self.kl[part].sum()) / n,
                    top1_agreement=float(self.agree[part].sum()) / n,
                )
            out.append(row)
        return out


def _log_probs(model, hidden):
    """Yield (start, fp32 log-probs [B, c, V]) for the positions 0..T-2 of final hidden states [B, T, d] that
    predict a next token."""
    for start, logits in logit_chunks(head_module(model), hidden[:, :-1]):
        yield start, logits.log_softmax(-1)


def evaluate(
    model,
    windows,
    *,
    reference=None,
    batch_size: int = 1,
    progress: Callable[[int], None] | None = None,
    by_distance: bool = False,
) -> EvalResult:
    """NLL/perplexity of `model` on windows [N, T]; with `reference`, KL(ref || model) and top-1 agreement; with
    `by_distance`, the same per distance bucket of the predicted token's position (distance_buckets(T)).

    Models are LoadedModel, nn.Module or LayerStreamed (run layer by layer); both see identical windows. Sums are
    kept in float64, per position.
    """
    import math

    import torch

    model, reference = unwrap(model), unwrap(reference) if reference is not None else None
    n, t = windows.shape
    sums = _PositionSums(t)
    kl_max = 0.0
    label = f"scoring {n} window(s) x {t} tokens" + (" against the reference" if reference is not None else "")
    with torch.no_grad(), phase(label, n, "windows") as advance:
        ref_batches = batch_hidden(reference, windows, batch_size) if reference is not None else None
        for ids, hidden in batch_hidden(model, windows, batch_size):  # ids [B, T], hidden [B, T, d]
            targets = ids[:, 1:]  # [B, T-1]
            ref_chunks = _log_probs(reference, next(ref_batches)[1]) if ref_batches is not None else None
            for start, logp in _log_probs(model, hidden):  # logp [B, c, V]
                tgt = targets[:, start : start + logp.shape[1]].to(logp.device).unsqueeze(-1)  # [B, c, 1]
                nll = -logp.gather(-1, tgt)[..., 0]  # [B, c]
                if ref_chunks is None:
                    sums.add(start, nll)
                    continue
                _, ref_logp = next(ref_chunks)
                ref_logp = ref_logp.to(logp.device)
                if ref_logp.shape != logp.shape:
                    raise AttnkitError(
                        f"vocabularies differ: reference has {ref_logp.shape[-1]} tokens, model has {logp.shape[-1]}"
                    )
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [B, c]
                kl_max = max(kl_max, kl.max().item())
                agree = ref_logp.argmax(-1) == logp.argmax(-1)  # [B, c]
                sums.add(start, nll, -ref_logp.gather(-1, tgt)[..., 0], kl, agree)
            advance(ids.shape[0])
            if progress is not None:
                progress(ids.shape[0])
    predicted = int(sums.count.sum())
    nll = float(sums.nll.sum()) / predicted
    result = EvalResult(tokens=int(windows.numel()), predicted=predicted, nll_mean=nll, perplexity=math.exp(nll))
    if reference is not None:
        result.kl_mean, result.kl_max = float(sums.kl.sum()) / predicted, kl_max
        result.top1_agreement = float(sums.agree.sum()) / predicted
        result.reference_nll_mean = float(sums.ref_nll.sum()) / predicted
        result.reference_perplexity = math.exp(result.reference_nll_mean)
    if by_distance:
        result.by_distance = sums.rows(distance_buckets(t, FIRST_BUCKET), reference is not None)
    return result
