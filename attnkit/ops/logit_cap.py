"""Soft-capping math: cap * tanh(z / cap), which logits it affects, and a cap chosen from a |z| histogram.

"Affected" (attnkit's definition): a logit z is affected by cap C when the cap moves it by more
than a relative tolerance `rel` (default 1%): |z - C tanh(z/C)| > rel * |z|. Since 1 - tanh(u)/u
grows monotonically in u = |z|/C, that is exactly |z| > C * u_rel with u_rel solving
tanh(u)/u = 1 - rel (u_rel = 0.17425 for rel = 1%).
"""

from __future__ import annotations

import math

import torch

#: Default relative change that counts a logit as affected.
AFFECT_REL = 0.01


def softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(z / cap) (Gemma 2 soft-capping); bounded by +-cap, slope 1 at 0."""
    return cap * torch.tanh(z / cap)


def affect_ratio(rel: float = AFFECT_REL) -> float:
    """u with 1 - tanh(u)/u = rel: a logit is affected by cap C iff |z| > C * u (bisection to 1e-15)."""
    if not 0.0 < rel < 1.0:
        raise ValueError(f"relative tolerance must be in (0, 1), got {rel}")
    lo, hi = 0.0, 1.0
    while 1.0 - math.tanh(hi) / hi < rel:
        hi *= 2.0
    while hi - lo > 1e-15 * hi:
        mid = 0.5 * (lo + hi)
        if 1.0 - math.tanh(mid) / mid < rel:
            lo = mid
        else:
            hi = mid
    return hi


def affect_threshold(cap: float, rel: float = AFFECT_REL) -> float:
    """|z| above which cap `cap` changes a logit by more than `rel` of its size."""
    return cap * affect_ratio(rel)


class AbsHistogram:
    """Streaming histogram of |z| on log-spaced bins (`per_decade` bins per factor 10), counted in float64.

    Bin edges are lo * 10**(i / per_decade); values below `lo` go to bin 0, above `hi` to the last bin.
    `count_above(edge_index)` is exact for thresholds that are bin edges.
    """

    def __init__(self, lo: float = 1e-4, hi: float = 1e6, per_decade: int = 200):
        self.lo, self.per_decade = lo, per_decade
        self.bins = int(round(math.log10(hi / lo) * per_decade))
        self.counts = torch.zeros(self.bins + 1, dtype=torch.float64)  # last bin: >= hi
        self.max = 0.0

    def edge(self, i: int) -> float:
        return self.lo * 10.0 ** (i / self.per_decade)

    def add(self, z: torch.Tensor) -> None:
        """Count the values of z (any shape; pass only the visible logits)."""
        a = z.detach().abs().float().reshape(-1)
        if a.numel() == 0:
            return
        self.max = max(self.max, float(a.max()))
        idx = torch.floor(torch.log10(a.clamp_min(self.lo) / self.lo) * self.per_decade)  # [N]
        idx = idx.clamp(0, self.bins).long()
        self.counts += torch.bincount(idx.cpu(), minlength=self.bins + 1).double()

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    def count_above(self, i: int) -> float:
        """Values with |z| >= edge(i)."""
        return float(self.counts[i:].sum())


def cap_for_fraction(hist: AbsHistogram, fraction: float, rel: float = AFFECT_REL) -> tuple[float, float]:
    """Smallest cap that affects at most `fraction` of the counted logits; returns (cap, affected fraction).

    The threshold cap * u_rel is the smallest bin edge with at most `fraction` of the values at or
    above it, so the returned fraction is counted exactly from the histogram.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"affected fraction must be in (0, 1), got {fraction}")
    total = hist.total
    if total == 0:
        raise ValueError("no logits were observed")
    tail = torch.flip(torch.cumsum(torch.flip(hist.counts, [0]), 0), [0])  # tail[i] = count(|z| >= edge(i))
    ok = torch.nonzero(tail <= fraction * total).flatten()
    i = int(ok[0]) if ok.numel() else hist.bins
    i = max(i, 1)
    return hist.edge(i) / affect_ratio(rel), float(tail[i]) / total
