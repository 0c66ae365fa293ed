"""Streaming attention statistics per head, computed blockwise and exactly (online softmax).

Never holds the [T, T] scores of all heads at once: query and key blocks of at most
BLOCK_ELEMENTS scores are scored, reduced into per-head accumulators and dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: Scores per block (all heads of the batch together): 512K fp32 = 2 MiB, small enough to stay in cache.
BLOCK_ELEMENTS = 1 << 19
KEY_BLOCK = 256
#: Fill for hidden scores: 0 * HIDDEN is 0 (no NaN, unlike -inf).
HIDDEN = -1e38
#: exp() inputs are clamped here: CPU exp is ~10x slower where it underflows. exp(-80) = 1.8e-35 (also what a
#: hidden score gets), and a row's block sum is >= 1 (its max contributes exp(0)), so the clamp changes
#: nothing fp32 can represent; a row with no visible key in a block gets weight exp(-inf) = 0 in the merge.
EXP_FLOOR = -80.0


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
            n = torch.full((heads,), float(x.shape[0] * x.shape[2]), dtype=torch.float64, device=x.device)
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

    def add_rows(self, n, shift, s1, s2, lo, hi) -> None:
        """Add groups given per row [B, H, R]: count n, sum s1 and square sum s2 of (x - shift), min, max."""
        n, shift, s1, s2 = n.double(), shift.double(), s1.double(), s2.double()
        mean_r = s1 / n.clamp_min(1)
        m2_r = (s2 - s1 * mean_r).clamp_min(0)
        total = n.sum((0, 2))
        mean = ((shift + mean_r) * n).sum((0, 2)) / total.clamp_min(1)
        dev = shift + mean_r - mean.view(1, -1, 1)
        m2 = m2_r.sum((0, 2)) + (n * dev * dev).sum((0, 2))
        self._merge(total, mean, m2, lo.amin((0, 2)).double().cpu(), hi.amax((0, 2)).double().cpu())

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
    window: int | None = None  # sliding window of the layer, None = full attention
    logits: Moments = field(init=False)  # q.k * scaling as used (after any soft-cap)
    precap_max: torch.Tensor = field(init=False)
    above: torch.Tensor = field(init=False)  # count of logits > threshold
    logz: Moments = field(init=False)  # per query row: logsumexp over visible keys
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


def accumulate_attention(
    stats: LayerStats,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> None:
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
    stats.q_rms.add(query.float().pow(2).mean(-1).sqrt())  # [B, H, Tq]
    stats.k_rms.add(key.float().pow(2).mean(-1).sqrt())  # [B, Hkv, Tk]
    qg = (query.float() * scaling).view(batch, kv_heads, groups, tq, dim)  # [B, Hkv, G, Tq, D]
    kt = key.float().transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, Tk]
    mask5 = _mask5(mask, batch, kv_heads, groups)
    bk = min(tk, KEY_BLOCK)
    bq = max(1, min(tq, BLOCK_ELEMENTS // (batch * heads * bk)))
    buffers = [
        torch.empty(batch * heads * bq * bk, dtype=torch.float32, device=query.device)  # scores, exp
        for _ in range(2)
    ]
    for a in range(0, tq, bq):
        b = min(tq, a + bq)
        _query_block(stats, qg[:, :, :, a:b], kt, mask5, causal, a, b, offset, bk, cap, sinks, buffers)


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, rows] -> [B, H, rows]."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], x.shape[3])


def _query_block(stats, q, kt, mask5, causal, a, b, offset, bk, cap, sinks, buffers) -> None:
    """Scan the key blocks for queries [a, b): logit moments per row, then log Z, entropy and max probability.

    `buffers`: two flat float tensors of at least one block's scores each, reused for every block (scores;
    then squares, then exp): an allocation per block costs as much as the exp itself on CPU.

    Running per-row state (online softmax, relative to the running max m): l = sum exp(s - m),
    t = sum exp(s - m) * (s - m); then log Z = m + log l and entropy = log l - t / l.
    """
    batch, kv_heads, groups, rows = q.shape[:4]
    shape = (batch, kv_heads, groups, rows)
    m = torch.full(shape, -math.inf, device=q.device)
    l = torch.zeros(shape, device=q.device)
    t = torch.zeros(shape, device=q.device)
    kmax = torch.full(shape, -math.inf, device=q.device)  # max over keys only (sinks excluded)
    if sinks is not None:
        m, l = sinks.float().view(1, kv_heads, groups, 1).expand(shape).clone(), torch.ones(shape, device=q.device)
    for c in range(0, kt.shape[-1], bk):
        e = min(kt.shape[-1], c + bk)
        vis = _visible(mask5, causal, a, b, c, e, offset, q.device)
        if vis is False:
            continue
        size = batch * kv_heads * groups * rows * (e - c)
        s = buffers[0][:size].view(batch, kv_heads, groups * rows, e - c)
        torch.matmul(q.reshape(batch, kv_heads, groups * rows, -1), kt[:, :, 0, :, c:e], out=s)
        s = s.view(*shape, e - c)  # [B, Hkv, G, bq, bk]
        if cap is not None:
            raw = s if vis is None else s.masked_fill(~vis, -math.inf)
            stats.precap_max = torch.maximum(stats.precap_max, raw.amax((0, 3, 4)).reshape(-1).double().cpu())
            s.div_(cap).tanh_().mul_(cap)
        if vis is not None:
            s.masked_fill_(~vis, HIDDEN)
        row_max = s.amax(-1)  # [B, Hkv, G, bq]
        seen = row_max > HIDDEN / 2  # rows that see a key in this block
        shift = torch.where(seen, row_max, 0.0)
        z = s.sub_(shift[..., None])  # s - row max: <= 0 where visible, ~HIDDEN elsewhere
        count = torch.full_like(shift, e - c) if vis is None else vis.sum(-1).float().expand(shape)
        z0 = z if vis is None else z * vis  # hidden -> 0 (never below a visible min, which is <= 0)
        s1 = z0.sum(-1)
        s2 = torch.mul(z0, z0, out=buffers[1][:size].view_as(z0)).sum(-1)
        stats.logits.add_rows(
            _per_head(count),
            _per_head(shift),
            _per_head(s1),
            _per_head(s2),
            _per_head(torch.where(seen, z0.amin(-1) + shift, math.inf)),
            _per_head(torch.where(seen, row_max, -math.inf)),
        )
        if bool((row_max > stats.threshold).any()):
            over = (z > (stats.threshold - shift)[..., None]).sum(-1)
            stats.above += over.sum((0, 3)).reshape(-1).double().cpu()
        p = torch.clamp(z, min=EXP_FLOOR, out=buffers[1][:size].view_as(z)).exp_()  # exp(s - row max)
        l_blk = p.sum(-1)
        t_blk = p.mul_(z0).sum(-1)  # hidden: p = exp(EXP_FLOOR) and z0 = 0
        m_blk = torch.where(seen, row_max, -math.inf)
        m_new = torch.maximum(m, m_blk)
        m_safe = torch.where(torch.isfinite(m_new), m_new, 0.0)
        a_old, a_blk = torch.exp(m - m_safe), torch.exp(m_blk - m_safe)
        d_old = torch.where(torch.isfinite(m), m - m_safe, 0.0)
        t = a_old * (t + d_old * l) + a_blk * (t_blk + (shift - m_safe) * l_blk)
        l = a_old * l + a_blk * l_blk
        m, kmax = m_new, torch.maximum(kmax, m_blk)
    if cap is None:
        stats.precap_max = torch.maximum(stats.precap_max, stats.logits.max)
    valid = _per_head(torch.isfinite(kmax))
    logz = m + torch.log(l)  # [B, Hkv, G, bq]
    stats.logz.add(_per_head(logz), valid)
    stats.entropy.add(_per_head(torch.log(l) - t / l), valid)
    stats.max_prob.add(_per_head(torch.exp(kmax - logz)), valid)
