"""Perplexity of a model on token windows, and its divergence from a reference model on the same windows: the
scoring every command shares (`attnkit eval`, every rewrite's report, heal's validation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from attnkit.errors import AttnkitError
from attnkit.progress import phase
from attnkit.runtime.lm import batch_hidden, head_module, logit_chunks
from attnkit.runtime.loader import unwrap


@dataclass
class EvalResult:
    """Token-level scores over every predicted position: `tokens` = N windows x seq_len tokens read (the count
    probe reports for the same windows), of which `predicted` = N x (seq_len - 1) predict a next token."""

    tokens: int
    predicted: int
    nll_mean: float
    perplexity: float
    kl_mean: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    reference_nll_mean: float | None = None
    reference_perplexity: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _log_probs(model, hidden):
    """Yield (start, fp32 log-probs [B, c, V]) for the positions 0..T-2 of final hidden states [B, T, d] that
    predict a next token."""
    for start, logits in logit_chunks(head_module(model), hidden[:, :-1]):
        yield start, logits.log_softmax(-1)


def evaluate(
    model, windows, *, reference=None, batch_size: int = 1, progress: Callable[[int], None] | None = None
) -> EvalResult:
    """NLL/perplexity of `model` on windows [N, T]; with `reference`, KL(ref || model) and top-1 agreement.

    Models are LoadedModel, nn.Module or LayerStreamed (run layer by layer); both see identical windows. Sums are
    kept in float64.
    """
    import math

    import torch

    model, reference = unwrap(model), unwrap(reference) if reference is not None else None
    nll_sum = ref_nll_sum = kl_sum = 0.0
    kl_max = 0.0
    agree = predicted = 0
    n, t = windows.shape
    label = f"scoring {n} window(s) x {t} tokens" + (" against the reference" if reference is not None else "")
    with torch.no_grad(), phase(label, n, "windows") as advance:
        ref_batches = batch_hidden(reference, windows, batch_size) if reference is not None else None
        for ids, hidden in batch_hidden(model, windows, batch_size):  # ids [B, T], hidden [B, T, d]
            targets = ids[:, 1:]  # [B, T-1]
            ref_chunks = _log_probs(reference, next(ref_batches)[1]) if ref_batches is not None else None
            for start, logp in _log_probs(model, hidden):  # logp [B, c, V]
                tgt = targets[:, start : start + logp.shape[1]].to(logp.device)  # [B, c]
                nll_sum -= logp.gather(-1, tgt.unsqueeze(-1)).sum(dtype=torch.float64).item()
                predicted += tgt.numel()
                if ref_chunks is not None:
                    _, ref_logp = next(ref_chunks)
                    ref_logp = ref_logp.to(logp.device)
                    if ref_logp.shape != logp.shape:
                        raise AttnkitError(
                            f"vocabularies differ: reference has {ref_logp.shape[-1]} tokens, "
                            f"model has {logp.shape[-1]}"
                        )
                    ref_nll_sum -= ref_logp.gather(-1, tgt.unsqueeze(-1)).sum(dtype=torch.float64).item()
                    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [B, c]
                    kl_sum += kl.sum(dtype=torch.float64).item()
                    kl_max = max(kl_max, kl.max().item())
                    agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            advance(ids.shape[0])
            if progress is not None:
                progress(ids.shape[0])
    nll = nll_sum / predicted
    result = EvalResult(tokens=int(windows.numel()), predicted=predicted, nll_mean=nll, perplexity=math.exp(nll))
    if reference is not None:
        result.kl_mean, result.kl_max, result.top1_agreement = kl_sum / predicted, kl_max, agree / predicted
        result.reference_nll_mean = ref_nll_sum / predicted
        result.reference_perplexity = math.exp(result.reference_nll_mean)
    return result
