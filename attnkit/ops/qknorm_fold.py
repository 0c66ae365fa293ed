"""Per-head QK-norm folded into W_q and W_k by one constant per head, for targets without a per-head norm.

A QK-norm layer (Qwen3) scores q_i . k_j * scaling with q_i = g_q * (W_q x_i) / r_q(i) and k_j likewise
(r: the RMS of the head's projection, per token). A scalar commutes with RoPE, so replacing 1 / r(i) by a
constant c gives logits s_ij * (c_q r_q(i)) (c_k r_k(j)): exact up to a per-token factor on each side. The
key constant makes the folded keys' RMS 1 at the geometric mean over the calibration tokens; the query
constant then minimizes the mean KL between each query's attention distribution before and after (a
golden-section search over log c_q, per query head), which is what the logit error costs downstream.

A RoPE pair whose normalized key is the same on every token (an anchor, as `retrofit qknorm --method anchor`
writes) only shifts each query's logits by a constant, which softmax ignores; folded, it would scale with
r_q(i) r_k(j) and vary by key, so the fold drops such pairs (zero q and k rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from attnkit.ops.attnweight import causal_mask, rotate_half_rope

#: A normalized key dimension is constant when its std over tokens is below this fraction of its RMS.
CONSTANT_KEY = 1e-2
#: Golden-section steps over log c_q (the bracket is the geometric-mean start times e^-2 .. e^2).
SEARCH_STEPS = 24
SEARCH_SPAN = 2.0


@dataclass
class QKNormFold:
    """Per-head constants standing for 1 / RMS of the normalized projections, and what the fold costs."""

    c_q: torch.Tensor  # [H] float64
    c_k: torch.Tensor  # [Hkv] float64
    kl: torch.Tensor  # [H]: mean attention KL(source || folded) per query on the calibration tokens
    dropped: torch.Tensor  # [Hkv, D] bool: rows of constant-key RoPE pairs, zero in the folded q and k
    spread_q: float  # std of log r_q over tokens and heads: how far the per-token RMS strays from one constant
    spread_k: float


def _heads(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """x [B, T, n] @ w.T (+ bias) as heads.  -> [B, T, heads, D] float64"""
    out = x @ w.to(x).T
    if bias is not None:
        out = out + bias.to(x)
    return out.reshape(*x.shape[:2], -1, head_dim)


def _rms(p: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's divisor per head and token: sqrt(mean(p^2) + eps).  p: [B, T, heads, D] -> [B, T, heads]"""
    return (p.square().mean(-1) + eps).sqrt()


def mean_fold(x: torch.Tensor, weights: dict, eps: float, head_dim: int) -> QKNormFold:
    """The geometric-mean constants alone (c = exp(-mean log r) per head; no search, nothing dropped): what a
    layout that applies the exact per-token factors (attnkit.modeling.gemma3_mla) fits its latent in, so that
    keys and queries keep the normalized ones' scale on average.  x: [B, T, n]"""
    x = x.detach().to(torch.float64)
    r_q = _rms(_heads(x, weights["q"], weights.get("q_bias"), head_dim), eps)  # [B, T, H]
    r_k = _rms(_heads(x, weights["k"], weights.get("k_bias"), head_dim), eps)  # [B, T, Hkv]
    return QKNormFold(
        c_q=torch.exp(-r_q.log().mean((0, 1))),
        c_k=torch.exp(-r_k.log().mean((0, 1))),
        kl=torch.zeros(r_q.shape[-1], dtype=torch.float64),
        dropped=torch.zeros(r_k.shape[-1], head_dim, dtype=torch.bool),
        spread_q=float(r_q.log().std()),
        spread_k=float(r_k.log().std()),
    )


def fit_fold(
    x: torch.Tensor,
    weights: dict,
    gains: tuple[torch.Tensor, torch.Tensor],
    eps: float,
    rope: tuple[torch.Tensor, torch.Tensor],
    scaling: float,
    head_dim: int,
    window: int | None = None,
) -> QKNormFold:
    """The fold's constants from one layer's attention inputs x [B, T, n] (weights: q, k and their biases;
    gains: the q-norm and k-norm scales [D] as applied; rope: cos, sin [B, T, R]; window: a sliding layer's)."""
    x = x.detach().to(torch.float64)
    cos, sin = (r.detach().to(x) for r in rope)
    q = _heads(x, weights["q"], weights.get("q_bias"), head_dim)  # [B, T, H, D]
    k = _heads(x, weights["k"], weights.get("k_bias"), head_dim)  # [B, T, Hkv, D]
    r_q, r_k = _rms(q, eps), _rms(k, eps)  # [B, T, H], [B, T, Hkv]
    g_q, g_k = (g.to(x) for g in gains)
    qn, kn = q / r_q[..., None] * g_q, k / r_k[..., None] * g_k  # the source's normalized heads
    dropped = constant_pairs(kn)  # [Hkv, D]
    qr, kr = rotate_half_rope(qn, cos, sin), rotate_half_rope(kn, cos, sin)
    kept_k = rotate_half_rope(kn * ~dropped, cos, sin)  # [B, T, Hkv, D]: what the fold's keys keep
    c_k = torch.exp(-r_k.log().mean((0, 1)))  # [Hkv]
    heads, num_kv, t = q.shape[2], k.shape[2], q.shape[1]
    mask = causal_mask(t, window, x.device)
    c_q = torch.empty(heads, dtype=torch.float64)
    kl = torch.empty(heads, dtype=torch.float64)
    for h in range(heads):
        j = h // (heads // num_kv)
        s = torch.einsum("bmd,bnd->bmn", qr[:, :, h], kr[:, :, j]) * scaling  # [B, T, T]
        kept = torch.einsum("bmd,bnd->bmn", qr[:, :, h], kept_k[:, :, j]) * scaling  # [B, T, T]
        rho = r_q[:, :, h, None] * (c_k[j] * r_k[:, None, :, j])  # [B, T, T]: the folded logits are c_q rho kept
        log_p = s.masked_fill(~mask, float("-inf")).log_softmax(-1)
        cost = partial(_attention_kl, log_p, rho * kept, mask)
        start = float(-r_q[:, :, h].log().mean())
        c_q[h], kl[h] = _golden(cost, start - SEARCH_SPAN, start + SEARCH_SPAN)
    return QKNormFold(
        c_q=c_q,
        c_k=c_k,
        kl=kl,
        dropped=dropped,
        spread_q=float(r_q.log().std()),
        spread_k=float(r_k.log().std()),
    )


def constant_pairs(kn: torch.Tensor) -> torch.Tensor:
    """Rows of RoPE pairs whose normalized key is constant over the tokens, not zero on both rows, per KV head.
    kn: [B, T, Hkv, D] -> [Hkv, D] bool"""
    flat = kn.reshape(-1, *kn.shape[2:])  # [N, Hkv, D]
    rms = flat.square().mean(0).sqrt()
    constant = flat.std(0) <= CONSTANT_KEY * rms  # zero rows count as constant
    half = kn.shape[-1] // 2
    pair = constant[:, :half] & constant[:, half:]
    live = (rms[:, :half] > 0) | (rms[:, half:] > 0)
    return (pair & live).repeat(1, 2)


def _attention_kl(log_p: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor, log_c: float) -> float:
    """Mean over queries of KL(p || softmax(e^log_c * logits)) on the visible pairs.  log_p, logits: [B, T, T]"""
    log_a = (math.exp(log_c) * logits).masked_fill(~mask, float("-inf")).log_softmax(-1)
    return float(torch.where(mask, log_p.exp() * (log_p - log_a), 0.0).sum(-1).mean())


def _golden(cost, lo: float, hi: float) -> tuple[float, float]:
    """(exp(argmin), min) of a unimodal cost over [lo, hi] by golden-section search."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = cost(a), cost(b)
    for _ in range(SEARCH_STEPS):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = cost(b)
    best, value = (a, fa) if fa < fb else (b, fb)
    return math.exp(best), value


def folded_weights(weights: dict, fold: QKNormFold, gains: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> dict:
    """The layer's q, k (and biases) with the norm's gain and the fold's constant in their rows; q_norm and k_norm
    dropped: a plain attention whose logits are the fold's."""
    out = {role: w for role, w in weights.items() if role not in ("q_norm", "k_norm")}
    keep_k = (~fold.dropped).to(torch.float64)  # [Hkv, D]
    keep_q = keep_k.repeat_interleave(len(fold.c_q) // len(fold.c_k), dim=0)  # [H, D]
    for side, c, gain, keep in (("q", fold.c_q, gains[0], keep_q), ("k", fold.c_k, gains[1], keep_k)):
        rows = (c[:, None] * gain.to(torch.float64)[None, :] * keep).reshape(-1)  # [heads * D]
        for role in (side, f"{side}_bias"):
            if role in weights:
                w = weights[role]
                scale = rows[:, None] if w.dim() == 2 else rows
                out[role] = (w.to(torch.float64) * scale).to(w.dtype)
    return out
