"""Latent RMSNorms without biases: making DeepSeek's kv_a_layernorm act (nearly) linearly in serving engines.

DeepseekV3 normalises the cached latent c (RMSNorm over kv_lora_rank channels) before reading keys and
values from it, so a plain low-rank latent comes out divided by its own per-token RMS. Serving engines
(llama.cpp, vLLM, SGLang) have no bias slot, so the latent cannot carry an exact constant channel. What
is exact instead: after input_layernorm (its weight folded into the projections) the attention input u
has a fixed norm, |u|^2 = n ms/(ms + eps). Two constructions use that, chosen per layer by the error they
leave on the calibration tokens:

- anchor: one channel is M a.u, where a.u ~ 1 is the ridge least-squares fit of the constant 1 on u; it
  dominates the RMS, so every other channel comes out divided by |a.u| (a per-token scale error of
  std(a.u), a few percent on real models) and a constant carried by a latent row comes out exact.
- span: the channels are an orthonormal basis (in u) of the information rows plus the highest-energy
  directions of the rest of u, as many as the rank allows: |c| = |P u| is then nearly constant, and
  exactly constant once the basis spans u (rank >= hidden size).

Rows here act on u ([m, n]) or on [u; 1] ([m, n + 1], the constant column of a bias), float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.ops.anchor import scale_error


def fold_gamma(rows: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Rows acting on x = gamma * u (and a constant column, kept) -> rows acting on u.  [m, n(+1)]"""
    out = rows.clone()
    out[:, : gamma.shape[0]] = rows[:, : gamma.shape[0]] * gamma[None, :]
    return out


def span_basis(info: torch.Tensor, u: torch.Tensor, width: int) -> torch.Tensor:
    """Orthonormal rows [min(width, n), n] spanning the info rows [r, n] (acting on u), then the highest-energy
    directions of u [N, n] outside their span, as many as `width` allows."""
    n, r = u.shape[1], info.shape[0]
    fills = max(0, min(width, n) - r)
    if fills == 0:  # the info rows fill the width: no [n, n] complement to build
        return torch.linalg.qr(info.T)[0].T
    q, _ = torch.linalg.qr(info.T, mode="complete")  # [n, n]: span(info) first, then its complement
    rest = q[:, r:]  # [n, n - r]
    ur = u @ rest  # [N, n - r]
    _, vecs = torch.linalg.eigh((ur.T @ ur).div_(u.shape[0]))
    fill = rest @ vecs.flip(1)[:, :fills]  # [n, k] top-energy complement directions
    return torch.cat([q[:, :r], fill], dim=1).T


@dataclass
class NormPlan:
    """One layer's latent: rows [R, n] on u (before the norm), the RMSNorm weight [R], and the read-out
    [R, r] mapping the normalised latent back to the r information channels (info ~ readout @ norm(rows u))."""

    kind: str  # "anchor" or "span"
    rows: torch.Tensor
    norm_weight: torch.Tensor
    readout: torch.Tensor
    scale_error: float  # relative mean-square error of the per-token scale the norm leaves (calibration tokens)


#: Channel scale of the anchor route: information channels are this much smaller than the anchor before the norm.
ANCHOR_SHRINK = 2.0**-8


def rms_norm(c: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * c / sqrt(mean(c^2) + eps) over the last dim."""
    return weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)


def anchor_plan(info: torch.Tensor, anchor: torch.Tensor, u: torch.Tensor, rank: int, eps: float) -> NormPlan:
    """info rows [r, n] (r < rank; zero rows pad them to rank - 1) plus one dominant anchor channel
    sqrt(rank) a.u; norm weights put the information channels back at their own scale, divided by |a.u|."""
    r, n = info.shape
    if r >= rank:
        raise ValueError(f"anchor latent: {r} information rows leave no channel for the anchor at rank {rank}")
    pad = torch.zeros(rank - 1 - r, n, dtype=info.dtype)
    rows = torch.cat([info * ANCHOR_SHRINK, pad, anchor[None, :] * rank**0.5])  # [R, n]
    weight = torch.full((rank,), 1.0 / ANCHOR_SHRINK, dtype=info.dtype)
    weight[-1] = rank**-0.5
    normed = rms_norm(u @ rows.T, weight, eps)  # [N, R]
    target = u @ info.T  # [N, r]
    gains = (normed[:, :r] * target).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-300)  # [N]
    s, err = scale_error(gains)
    readout = torch.zeros(rank, r, dtype=info.dtype)
    readout[:r] = torch.eye(r, dtype=info.dtype) * s
    return NormPlan("anchor", rows, weight, readout, err)


def span_plan(info: torch.Tensor, u: torch.Tensor, rank: int, eps: float) -> NormPlan:
    """An orthonormal basis of the info rows [r, n] plus filler directions, scaled so mean(c^2) ~ 1; zero rows
    beyond the hidden size."""
    basis = span_basis(info, u, rank)  # [k, n], k = min(rank, n)
    c = u @ basis.T  # [N, k]
    scale = (rank / c.pow(2).sum(-1).mean()).sqrt()  # mean(c^2) = 1 on average
    rows = torch.cat([basis * scale, torch.zeros(rank - basis.shape[0], basis.shape[1], dtype=basis.dtype)])
    weight = torch.ones(rank, dtype=info.dtype)
    normed = rms_norm(u @ rows.T, weight, eps)  # [N, R]
    coords = info @ basis.T  # [r, k]: info = coords @ (basis u)
    target = c @ coords.T  # [N, r] the information channels
    back = normed[:, : basis.shape[0]] @ coords.T / scale  # [N, r] the same read from the normalised latent
    gains = (back * target).sum(-1) / target.pow(2).sum(-1).clamp_min(1e-300)
    s, err = scale_error(gains)
    readout = torch.cat([coords.T / scale, torch.zeros(rank - basis.shape[0], info.shape[0], dtype=info.dtype)]) * s
    return NormPlan("span", rows, weight, readout, err)
