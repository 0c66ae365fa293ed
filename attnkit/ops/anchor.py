"""Biases without bias tensors: what serving engines have no slot for, moved onto weights they do have.

- anchor_row: a.x ~ 1, the ridge least-squares fit of the constant 1 on the attention input. Many LLMs' hidden
  states have a near-constant direction, so this is a few percent off per token (SmolLM2: docs/convert-mla.md);
  some have none (Qwen2.5-Coder-1.5B: 12-95% off on held-out text, docs/retrofit.md), and random tiny models
  have none. heldout_error measures it on tokens the fit did not see: what a rewrite that relies on it checks.
- substitute_constant: rows acting on [x; 1] (a bias column) -> rows on x, the 1 replaced by a.x.
- fold_o_bias: o_proj's bias as a value bias (attention weights sum to 1), exact when it is in o_proj's range.
"""

from __future__ import annotations

import torch

#: Ridge of the anchor fit, relative to the mean diagonal of E[x x^T].
ANCHOR_RIDGE = 1e-3
#: Where a layer's anchor is off by more than this on held-out calibration tokens (RMS of a.x - 1, heldout_error),
#: or turns a token's sign, rewrites do not rely on it: measured 0.03-0.11 on SmolLM2 and 0.07-0.32 on
#: Qwen2.5-Coder-1.5B, whose anchor outputs are broken (docs/retrofit.md, docs/convert-mla.md).
ANCHOR_HELDOUT_MAX = 0.25


def anchor_row(u: torch.Tensor, ridge: float = ANCHOR_RIDGE) -> torch.Tensor:
    """a [n] with a.u ~ 1 on the tokens u [N, n]: argmin E[(a.u - 1)^2] + ridge mean(diag E[uu^T]) |a|^2."""
    gram = u.T @ u / u.shape[0]  # [n, n]
    lam = ridge * gram.diagonal().mean()
    return torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), u.mean(0))


def heldout_error(u: torch.Tensor, ridge: float = ANCHOR_RIDGE) -> tuple[float, float]:
    """How the anchor holds on tokens it was not fitted on: (the worse RMS of a.u - 1, the smallest a.u) over the
    two halves of the token rows u [N, n], each scored by the anchor fitted on the other (rows are tokens in window
    order, so each half is mostly whole windows). A fit on N tokens of width n can hit 1 on every one of them when
    n is near N; real hidden states with a near-constant direction keep a.u near 1 on held-out tokens too (a few
    percent, docs/retrofit.md), and a.u <= 0 turns a token's sign."""
    half = u.shape[0] // 2
    if half < 2:
        return 0.0, 1.0
    worst, low = 0.0, float("inf")
    for fit, test in ((u[:half], u[half:]), (u[half:], u[:half])):
        au = test @ anchor_row(fit, ridge)  # [N/2]
        worst = max(worst, float((au - 1).pow(2).mean().sqrt()))
        low = min(low, float(au.min()))
    return worst, low


def substitute_constant(rows: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Rows on [u; 1] -> rows on u, with the constant 1 replaced by a.u.  [m, n+1] -> [m, n] (no-op for [m, n])."""
    n = anchor.shape[0]
    if rows.shape[1] == n:
        return rows
    return rows[:, :n] + rows[:, n:] * anchor[None, :]


def scale_error(gains: torch.Tensor) -> tuple[float, float]:
    """(best scalar s, relative mean-square error min_s E[(s g - 1)^2]) for per-token gains g [N] that the norm
    applies to the latent: s = E[g] / E[g^2], error = 1 - E[g]^2 / E[g^2]."""
    g = gains.to(torch.float64)
    m1, m2 = g.mean().item(), g.pow(2).mean().item()
    return m1 / m2, max(0.0, 1.0 - m1 * m1 / m2)


def fold_o_bias(
    o: torch.Tensor, o_bias: torch.Tensor, num_heads: int, num_kv: int, head_dim: int
) -> tuple[torch.Tensor, float]:
    """A value bias delta [Hkv*D] with the same effect as o_proj's bias (attention weights sum to 1, so a value
    bias reaches the output as o_proj of it): least squares of sum over each KV head's readers of o columns,
    and the relative residual |W delta - b| / |b| (0 when b is in the range of o_proj).  o: [n, H*D]."""
    per_head = o.to(torch.float64).reshape(o.shape[0], num_kv, num_heads // num_kv, head_dim)
    grouped = per_head.sum(dim=2).reshape(o.shape[0], num_kv * head_dim)  # [n, Hkv*D]
    b = o_bias.to(torch.float64)
    delta = torch.linalg.lstsq(grouped, b[:, None]).solution[:, 0]
    return delta, ((grouped @ delta - b).norm() / b.norm().clamp_min(1e-300)).item()
