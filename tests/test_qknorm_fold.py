"""attnkit.ops.qknorm_fold: per-head QK-norm folded into W_q and W_k by constants."""

from __future__ import annotations

import torch

from attnkit.ops.attnweight import rotate_half_rope
from attnkit.ops.qknorm_fold import constant_pairs, fit_fold, folded_weights

D, T = 8, 24


def _rope(t: int):
    freqs = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * freqs  # [T, D/2]
    cos, sin = angles.cos().repeat(1, 2)[None], angles.sin().repeat(1, 2)[None]  # [1, T, D]
    return cos, sin


def _logits(x, wq, wk, cos, sin, norm_gains=None, eps=1e-6):
    q, k = (x @ w.T for w in (wq, wk))  # [1, T, D]
    if norm_gains is not None:
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps) * norm_gains[0]
        k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps) * norm_gains[1]
    qr, kr = (rotate_half_rope(t[:, :, None], cos, sin)[:, :, 0] for t in (q, k))
    return qr[0] @ kr[0].T  # [T, T]


def test_fold_is_exact_when_every_token_has_the_same_rms():
    """Orthogonal W (n = D) on inputs of one norm: r_q and r_k are the same on every token, so constants are exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, D, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True) * 3.0
    wq, wk = (torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0] * s for s in (2.0, 0.5))
    gains = (torch.rand(D, generator=g, dtype=torch.float64) + 0.5, torch.rand(D, generator=g, dtype=torch.float64))
    cos, sin = _rope(T)
    fold = fit_fold(x, {"q": wq, "k": wk}, gains, 1e-6, (cos, sin), 1.0, D)
    assert fold.kl.abs().max() < 1e-8 and fold.spread_q < 1e-12 and not fold.dropped.any()
    plain = folded_weights({"q": wq, "k": wk, "q_norm": gains[0], "k_norm": gains[1]}, fold, gains, D)
    assert set(plain) == {"q", "k"}
    source = _logits(x, wq, wk, cos, sin, gains)
    assert torch.allclose(_logits(x, plain["q"], plain["k"], cos, sin), source, atol=1e-6)


def test_fold_kl_search_beats_the_geometric_mean_when_rms_varies():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, D, generator=g, dtype=torch.float64) * torch.linspace(0.3, 3, T, dtype=torch.float64)[:, None]
    wq, wk = (torch.randn(D, D, generator=g, dtype=torch.float64) for _ in range(2))
    gains = (torch.ones(D, dtype=torch.float64) * 3, torch.ones(D, dtype=torch.float64))
    cos, sin = _rope(T)
    import attnkit.ops.qknorm_fold as qf

    searched = fit_fold(x, {"q": wq, "k": wk}, gains, 1e-6, (cos, sin), 1.0, D)
    span, qf.SEARCH_SPAN = qf.SEARCH_SPAN, 0.0
    try:
        geometric = fit_fold(x, {"q": wq, "k": wk}, gains, 1e-6, (cos, sin), 1.0, D)
    finally:
        qf.SEARCH_SPAN = span
    assert searched.spread_q > 0.1 and searched.kl.item() < geometric.kl.item()


def test_constant_key_pairs_are_found_and_zero_pairs_are_not():
    kn = torch.randn(2, T, 1, D, dtype=torch.float64)
    kn[..., 1] = 8.0  # an anchor: the same value on every token; its pair partner (row 1 + D/2) zero
    kn[..., 1 + D // 2] = 0.0
    kn[..., 2] = kn[..., 2 + D // 2] = 0.0  # a dead pair: nothing to drop
    dropped = constant_pairs(kn)[0]
    assert dropped.tolist() == [i in (1, 1 + D // 2) for i in range(D)]
