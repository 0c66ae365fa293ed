"""--fail-if rules of `attnkit probe`: parse 'METRIC OP NUMBER', and check them against probe results (exit 3)."""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnkit.errors import ThresholdError, UsageError

if TYPE_CHECKING:
    from attnkit.scoring.attention_stats import ProbeResult

#: Per-head metrics a --fail-if rule may test (entropy_min: the head's mean entropy, tested on every head).
HEAD_METRICS = {
    "max_logit": "max_logit",
    "max_logit_precap": "max_logit_precap",
    "logz_max": "logz_max",
    "logz_mean": "logz_mean",
    "frac_above": "frac_above",
    "entropy_min": "entropy_mean",
    "max_prob_mean": "max_prob_mean",
}
MODEL_METRICS = ("z_loss", "final_logit_max", "final_logz_max")
_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


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
        raise UsageError(
            f"--fail-if {text!r}: unknown metric {metric!r}; choose from {', '.join([*HEAD_METRICS, *MODEL_METRICS])}"
        )
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"--fail-if {text!r}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise UsageError(f"--fail-if {text!r}: the bound must be a finite number")
    return Rule(metric, op, number)


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
