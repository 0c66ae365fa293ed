"""Streaming attention statistics per head, computed blockwise and exactly (online softmax).

Never holds the [T, T] scores of all heads at once: query and key blocks of at most
BLOCK_ELEMENTS scores are scored, reduced into per-head accumulators and dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: Scores per block (all heads of the batch together): 4M fp32 = 16 MiB, a few temporaries of that size.
BLOCK_ELEMENTS = 1 << 22
KEY_BLOCK = 1024


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2 soft-capping)."""
    return cap * torch.tanh(x / cap)


def z_loss(logits: torch.Tensor, lam: float = 1e-4) -> torch.Tensor:
    """PaLM z-loss lambda * mean((log Z)^2) over all rows of logits [..., V]."""
    return lam * torch.logsumexp(logits.double(), -1).pow(2).mean()


class Moments:
    """Per-head count, mean, M2 (float64), min and max of a stream of values; blocks merged exactly (Chan et al.)."""

    def __init__(self, heads: int):
        self.n = torch.zeros(heads, dtype=torch.float64)
        self.mean = torch.zeros(heads, dtype=torch.float64)
        self.m2 = torch.zeros(heads, dtype=torch.float64)
        self.min = torch.full((heads,), math.inf, dtype=torch.float64)
        self.max = torch.full((heads,), -math.inf, dtype=torch.float64)

    def add(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add x [B, H, N] (float) where `valid` (bool, broadcastable to x; None = all) is True."""
        heads = x.shape[1]
        if valid is None:
            n = torch.full((heads,), float(x.shape[0] * x.shape[2]), dtype=torch.float64)
            mean = x.sum((0, 2), dtype=torch.float64) / n.clamp_min(1)
            d = x - mean.view(1, heads, 1).to(x.dtype)
            lo, hi = x.amin((0, 2)), x.amax((0, 2))
        else:
            valid = valid.expand(x.shape)
            n = valid.sum((0, 2)).to(torch.float64)
            mean = torch.where(valid, x, 0).sum((0, 2), dtype=torch.float64) / n.clamp_min(1)
            d = torch.where(valid, x - mean.view(1, heads, 1).to(x.dtype), 0)
            lo = torch.where(valid, x, math.inf).amin((0, 2))
            hi = torch.where(valid, x, -math.inf).amax((0, 2))
        self._merge(n, mean, (d * d).sum((0, 2), dtype=torch.float64), lo.double().cpu(), hi.double().cpu())

    def _merge(self, n, mean, m2, lo, hi) -> None:
        n, mean, m2 = n.cpu(), mean.cpu(), m2.cpu()
        total = self.n + n
        delta = mean - self.mean
        share = torch.where(total > 0, n / total.clamp_min(1), 0)
        self.mean = self.mean + delta * share
        self.m2 = self.m2 + m2 + delta * delta * self.n * share
        self.n = total
        self.min = torch.minimum(self.min, lo)
        self.max = torch.maximum(self.max, hi)

    @property
    def std(self) -> torch.Tensor:
        """Population standard deviation."""
        return (self.m2 / self.n.clamp_min(1)).sqrt()


@dataclass
class LayerStats:
    """Accumulators of one attention layer, per query head (key norms per KV head)."""

    heads: int
    kv_heads: int
    threshold: float = 100.0
    window: int | None = None                  # sliding window of the layer, None = full attention
    logits: Moments = field(init=False)        # q.k * scaling as used (after any soft-cap)
    precap_max: torch.Tensor = field(init=False)
    above: torch.Tensor = field(init=False)    # count of logits > threshold
    logz: Moments = field(init=False)          # per query row: logsumexp over visible keys
    entropy: Moments = field(init=False)
    max_prob: Moments = field(init=False)
    q_rms: Moments = field(init=False)
    k_rms: Moments = field(init=False)

    def __post_init__(self):
        self.logits = Moments(self.heads)
        self.precap_max = torch.full((self.heads,), -math.inf, dtype=torch.float64)
        self.above = torch.zeros(self.heads, dtype=torch.float64)
        self.logz, self.entropy, self.max_prob = Moments(self.heads), Moments(self.heads), Moments(self.heads)
        self.q_rms, self.k_rms = Moments(self.heads), Moments(self.kv_heads)


def _visible(mask5, causal: bool, a: int, b: int, c: int, e: int, offset: int, device=None):
    """Visibility of scores block [a:b) x [c:e): None = all visible, False = none, else bool [B|1, *, *, bq, bk]."""
    if mask5 is not None:
        block = mask5[..., a:b, c:e]
        if not bool(block.any()):
            return False
        return None if bool(block.all()) else block
    if not causal or e - 1 <= a + offset:
        return None
    if c > b - 1 + offset:
        return False
    rows = torch.arange(a, b, device=device)
    return (torch.arange(c, e, device=device)[None, :] <= rows[:, None] + offset).view(1, 1, 1, b - a, e - c)


def _mask5(mask: torch.Tensor | None, batch: int, kv_heads: int, groups: int):
    """Attention mask [B|1, 1|H, Tq, Tk] (bool True = visible, or additive float) -> bool [B|1, 1|Hkv, 1|G, Tq, Tk]."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return mask.view(mask.shape[0], kv_heads, groups, *mask.shape[-2:])


def accumulate_attention(stats: LayerStats, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, *,
                         scaling: float, cap: float | None = None, sinks: torch.Tensor | None = None,
                         causal: bool = True) -> None:
    """Add one attention call to `stats`.

    query [B, H, Tq, D] and key [B, Hkv, Tk, D] as the model uses them (after QK-norm and RoPE, before GQA
    repetition; query head h reads KV head h // (H / Hkv)). `mask` as transformers passes it; None means
    causal (bottom-right aligned) when `causal`, else all visible. `sinks` [H]: per-head sink logits that
    join every row's softmax (gpt-oss); they count in log Z, entropy and max probability, not in logit stats.
    """
    batch, heads, tq, dim = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    offset = tk - tq
    stats.q_rms.add(query.float().pow(2).mean(-1).sqrt())   # [B, H, Tq]
    stats.k_rms.add(key.float().pow(2).mean(-1).sqrt())     # [B, Hkv, Tk]
    qg = (query.float() * scaling).view(batch, kv_heads, groups, tq, dim)  # [B, Hkv, G, Tq, D]
    kt = key.float().transpose(-1, -2)[:, :, None]                          # [B, Hkv, 1, D, Tk]
    mask5 = _mask5(mask, batch, kv_heads, groups)
    bk = min(tk, KEY_BLOCK)
    bq = max(1, min(tq, BLOCK_ELEMENTS // (batch * heads * bk)))
    for a in range(0, tq, bq):
        b = min(tq, a + bq)
        _query_block(stats, qg[:, :, :, a:b], kt, mask5, causal, a, b, offset, bk, cap, sinks)


def _query_block(stats, q, kt, mask5, causal, a, b, offset, bk, cap, sinks) -> None:
    """Scan all key blocks for queries [a, b): logit moments, then per-row log Z, entropy and max probability."""
    batch, kv_heads, groups, rows = q.shape[:4]
    heads = kv_heads * groups
    shape = (batch, kv_heads, groups, rows)
    m = torch.full(shape, -math.inf, device=q.device)   # running max (incl. sink)
    l = torch.zeros(shape, device=q.device)             # running sum exp(s - m)
    t = torch.zeros(shape, device=q.device)             # running sum exp(s - m) * s
    kmax = torch.full(shape, -math.inf, device=q.device)  # max over keys only
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, groups, 1).expand(shape)
        m, l, t = sink.clone(), torch.ones(shape, device=q.device), sink.clone()
    for c in range(0, kt.shape[-1], bk):
        e = min(kt.shape[-1], c + bk)
        vis = _visible(mask5, causal, a, b, c, e, offset, q.device)
        if vis is False:
            continue
        s = q @ kt[..., c:e]  # [B, Hkv, G, bq, bk]
        flat_vis = None if vis is None else vis.reshape(vis.shape[0], vis.shape[1] * vis.shape[2], -1)
        if cap is not None:
            masked = s if vis is None else torch.where(vis, s, -math.inf)
            stats.precap_max = torch.maximum(stats.precap_max, masked.amax((0, 3, 4)).reshape(-1).double().cpu())
            s = cap * torch.tanh(s / cap)
        stats.logits.add(s.view(batch, heads, -1), flat_vis)  # [B, H, bq*bk]
        over = s > stats.threshold if vis is None else (s > stats.threshold) & vis
        stats.above += over.sum((0, 3, 4)).reshape(-1).double().cpu()
        sm = s if vis is None else torch.where(vis, s, -math.inf)
        block_max = sm.amax(-1)                                  # [B, Hkv, G, bq]
        m_new = torch.maximum(m, block_max)
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)  # rows that see nothing yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(sm - m_safe[..., None])                    # masked -> 0
        l = l * alpha + p.sum(-1)
        t = t * alpha + (p * s).sum(-1)
        m, kmax = m_new, torch.maximum(kmax, block_max)
    if cap is None:
        stats.precap_max = torch.maximum(stats.precap_max, stats.logits.max)
    valid = torch.isfinite(kmax).view(batch, heads, rows)
    logz = m + torch.log(l)  # [B, Hkv, G, bq]
    stats.logz.add(logz.view(batch, heads, rows), valid)
    stats.entropy.add((logz - t / l).view(batch, heads, rows), valid)
    stats.max_prob.add(torch.exp(kmax - logz).view(batch, heads, rows), valid)
