"""Token weights from a layer's own attention: how much each key position matters to the logits.

A key error e at position n changes the logit of query m by q_m . e x_n; averaged over the RoPE
phase and weighted by the attention p_mn that the logit feeds, its cost is ~ sum_m p_mn |q_m|^2 |e x_n|^2.
So each KV head j gets token weights w_jn = sum over its query heads h and queries m of p_hmn |q_hm|^2.
"""

from __future__ import annotations

import torch


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE on the first R = cos.shape[-1] dims.  x: [B, T, heads, D], cos/sin: [B, T, R]."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
    return torch.cat([xr * cos[:, :, None] + half * sin[:, :, None], xp], dim=-1)


def key_token_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scaling: float,
    window: int | None = None,
) -> torch.Tensor:
    """w[j, b*T + n] = sum_{h reading j} sum_m p_hmn |q_hm|^2 under causal softmax attention (window: a sliding
    layer's).

    q: [B, T, H, D], k: [B, T, Hkv, D] (before RoPE), cos/sin: [B, T, R].  -> [Hkv, B*T] float64.
    """
    batch, t, heads, _ = q.shape
    num_kv = k.shape[2]
    qr, kr = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
    q_energy = q.square().sum(-1)  # [B, T, H] (RoPE keeps the norm)
    mask = causal_mask(t, window, q.device)  # [T(m), T(n)]
    out = torch.zeros(num_kv, batch, t, dtype=torch.float64)
    for h in range(heads):
        j = h // (heads // num_kv)
        logits = torch.einsum("bmd,bnd->bmn", qr[:, :, h], kr[:, :, j]) * scaling  # [B, T, T]
        p = logits.masked_fill(~mask, float("-inf")).softmax(-1)  # [B, T(m), T(n)]
        out[j] += torch.einsum("bmn,bm->bn", p, q_energy[:, :, h]).to(torch.float64).cpu()
    return out.reshape(num_kv, batch * t)


def weighted_group_covariance(x: torch.Tensor, weights: torch.Tensor, groups: int) -> torch.Tensor:
    """Per group, sum_n w_n x_n x_n^T / sum_n w_n over the group's heads' weights.
    x: [N, n] float64, weights: [Hkv, N].  -> [G, n, n]."""
    per_group = weights.reshape(groups, -1, weights.shape[1]).sum(1)  # [G, N]
    per_group = per_group / per_group.sum(1, keepdim=True).clamp_min(1e-300)
    return torch.einsum("gn,ni,nj->gij", per_group, x, x)


def causal_mask(t: int, window: int | None, device) -> torch.Tensor:
    """[T, T] bool, True where query i may see key j: j <= i, and i - j < window for a sliding layer."""
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return mask if window is None else mask.triu(1 - window)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scaling: float,
    window: int | None = None,
) -> torch.Tensor:
    """Per-head causal softmax attention output before o_proj (transformers' repeat_kv order; window: a sliding
    layer's). q: [B, T, H, D], k, v: [B, T, Hkv, D], cos/sin: [B, T, R].  -> [B, T, H*D]."""
    batch, t, heads, d = q.shape
    num_kv = k.shape[2]
    qr, kr = rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)
    mask = causal_mask(t, window, q.device)
    out = torch.empty(batch, t, heads, v.shape[-1], dtype=q.dtype, device=q.device)
    for h in range(heads):
        j = h // (heads // num_kv)
        logits = torch.einsum("bmd,bnd->bmn", qr[:, :, h], kr[:, :, j]) * scaling  # [B, T, T]
        out[:, :, h] = logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, :, j]
    return out.reshape(batch, t, heads * v.shape[-1])
