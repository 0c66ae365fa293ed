"""Attention statistics of a model on text windows, per layer and head, and CI thresholds on them."""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Callable

from attnkit.errors import ThresholdError, UsageError
from attnkit.runtime.loader import unwrap

#: Per-head metrics a --fail-if rule may test (entropy_min: the head's mean entropy, tested on every head).
HEAD_METRICS = {"max_logit": "max_logit", "max_logit_precap": "max_logit_precap", "logz_max": "logz_max",
                "logz_mean": "logz_mean", "frac_above": "frac_above", "entropy_min": "entropy_mean",
                "max_prob_mean": "max_prob_mean"}
MODEL_METRICS = ("z_loss", "final_logit_max", "final_logz_max")
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


@dataclass
class ProbeResult:
    """Per-head rows (see docs/probe.md for the field names) and final-logit statistics of one model."""

    model: str
    tokens: int
    windows: int
    seq_len: int
    threshold: float
    z_lambda: float
    heads: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"model": self.model, "tokens": self.tokens, "windows": self.windows, "seq_len": self.seq_len,
                "threshold": self.threshold, "z_lambda": self.z_lambda, "final": self.final, "heads": self.heads}


def _f(x) -> float | None:
    x = float(x)
    return None if math.isinf(x) or math.isnan(x) else x


def _head_rows(name: str, layers: dict) -> list[dict]:
    rows = []
    for layer in sorted(layers):
        st = layers[layer]
        groups = st.heads // st.kv_heads
        for h in range(st.heads):
            n = float(st.logits.n[h])
            kv = h // groups
            rows.append({
                "model": name, "layer": layer, "head": h, "kv_head": kv, "window": st.window, "scores": int(n),
                "max_logit": _f(st.logits.max[h]), "max_logit_precap": _f(st.precap_max[h]),
                "min_logit": _f(st.logits.min[h]), "mean_logit": _f(st.logits.mean[h]), "std_logit": _f(st.logits.std[h]),
                "frac_above": float(st.above[h]) / n if n else None,
                "logz_mean": _f(st.logz.mean[h]), "logz_std": _f(st.logz.std[h]),
                "logz_min": _f(st.logz.min[h]), "logz_max": _f(st.logz.max[h]),
                "entropy_mean": _f(st.entropy.mean[h]), "max_prob_mean": _f(st.max_prob.mean[h]),
                "q_rms_mean": _f(st.q_rms.mean[h]), "q_rms_max": _f(st.q_rms.max[h]),
                "k_rms_mean": _f(st.k_rms.mean[kv]), "k_rms_max": _f(st.k_rms.max[kv]),
            })
    return rows


def probe(model, windows, *, threshold: float = 100.0, z_lambda: float = 1e-4, batch_size: int = 1,
          progress: Callable[[int], None] | None = None, name: str = "model") -> ProbeResult:
    """Run `model` (LoadedModel or nn.Module) over windows [N, T] and collect per-head attention statistics."""
    import torch

    from attnkit.ops.attnstats import LayerStats, Moments, accumulate_attention
    from attnkit.progress import phase
    from attnkit.runtime.hook import attention_hook, layer_index
    from attnkit.runtime.lm import final_hidden, logit_chunks
    from attnkit.runtime.texts import batches

    model = unwrap(model)
    layers: dict[int, LayerStats] = {}
    index = layer_index(model)

    def on_attention(module, query, key, mask, kwargs):
        layer = index(module)
        st = layers.get(layer)
        if st is None:
            st = layers[layer] = LayerStats(query.shape[1], key.shape[1], threshold, kwargs.get("sliding_window"))
        scaling = kwargs.get("scaling")
        causal = kwargs.get("is_causal")
        accumulate_attention(st, query.detach(), key.detach(), mask,
                             scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
                             cap=kwargs.get("softcap"), sinks=getattr(module, "sinks", None),
                             causal=getattr(module, "is_causal", True) if causal is None else causal)

    final_logz, final_max = Moments(1), -math.inf
    sum_sq = 0.0
    label = f"probing {name}: {windows.shape[0]} window(s) x {windows.shape[1]} tokens"
    with torch.no_grad(), attention_hook(model, on_attention), phase(label, windows.shape[0], "windows") as advance:
        for ids in batches(windows, batch_size):  # ids [B, T]
            hidden = final_hidden(model, ids)  # [B, T, d]
            for _, logits in logit_chunks(model, hidden):  # [B, c, V]
                logz = torch.logsumexp(logits, -1)  # [B, c]
                final_logz.add(logz.reshape(1, 1, -1))
                sum_sq += logz.double().pow(2).sum().item()
                final_max = max(final_max, logits.max().item())
            advance(ids.shape[0])
            if progress is not None:
                progress(ids.shape[0])
    positions = int(final_logz.n[0])
    final = {"positions": positions, "final_logit_max": _f(final_max), "final_logz_mean": _f(final_logz.mean[0]),
             "final_logz_std": _f(final_logz.std[0]), "final_logz_max": _f(final_logz.max[0]),
             "z_loss": z_lambda * sum_sq / positions}
    return ProbeResult(model=name, tokens=int(windows.numel()), windows=int(windows.shape[0]),
                       seq_len=int(windows.shape[1]), threshold=threshold, z_lambda=z_lambda,
                       heads=_head_rows(name, layers), final=final)


@dataclass(frozen=True)
class Rule:
    """One --fail-if rule, e.g. max_logit>100."""

    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"

    def crossed(self, x: float | None) -> bool:
        return x is not None and _OPS[self.op](x, self.value)


def parse_rule(text: str) -> Rule:
    """'METRIC OP NUMBER' with OP one of > >= < <=."""
    m = re.fullmatch(r"\s*([a-z_]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*", text)
    if not m:
        raise UsageError(f"--fail-if {text!r}: expected METRIC>VALUE (or >=, <, <=)")
    metric, op, value = m.groups()
    if metric not in HEAD_METRICS and metric not in MODEL_METRICS:
        raise UsageError(f"--fail-if {text!r}: unknown metric {metric!r}; choose from "
                         f"{', '.join([*HEAD_METRICS, *MODEL_METRICS])}")
    try:
        return Rule(metric, op, float(value))
    except ValueError:
        raise UsageError(f"--fail-if {text!r}: {value!r} is not a number") from None


def max_logit_limit(rules: list[Rule]) -> float | None:
    """The lowest upper bound the --fail-if rules put on max_logit (what a plot marks), or None."""
    bounds = [r.value for r in rules if r.metric in ("max_logit", "max_logit_precap") and r.op in (">", ">=")]
    return min(bounds) if bounds else None


def check_rules(results: list[ProbeResult], rules: list[Rule], limit: int = 8) -> None:
    """Raise ThresholdError naming the offending models, layers and heads of every crossed rule."""
    failures = []
    for rule in rules:
        hits = []
        for res in results:
            if rule.metric in MODEL_METRICS:
                value = res.final[rule.metric]
                if rule.crossed(value):
                    hits.append(f"{res.model} {value:.4g}")
                continue
            for row in res.heads:
                value = row[HEAD_METRICS[rule.metric]]
                if rule.crossed(value):
                    hits.append(f"{res.model} layer {row['layer']} head {row['head']} ({value:.4g})")
        if hits:
            more = f", +{len(hits) - limit} more" if len(hits) > limit else ""
            failures.append(f"{rule}: {', '.join(hits[:limit])}{more}")
    if failures:
        raise ThresholdError("threshold crossed: " + "; ".join(failures))
