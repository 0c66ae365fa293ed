"""QK-norm retrofit math: Qwen3-style per-head RMSNorm weights that reproduce a model's attention logits.

Qwen3 computes, per head, qn = g_q * (a_q * q) / rms(a_q * q) (and kn alike), then RoPE, then
qn . kn / sqrt(D). RMSNorm divides by each token's own RMS, so the per-token magnitude of q
(a per-row temperature) and of k (a per-key weight) is lost; a per-head scale of W_q is cancelled.
What is left to fit: the shared post-norm weights g_q, g_k [D] and per-head, per-dim pre-norm
scales a_q [H, D], a_k [Hkv, D] (folded into W_q/W_k rows), which change what the RMS measures.

Methods (`fit_layer`): unit (g = 1), scalar (one g per layer), lsq (per RoPE pair, least squares on
logits), kl (lsq, then gradient descent of a and g on the attention KL). The pad method is exact up to
|q|^2 / (4 B^2): two extra dims per head carry a large constant bias B that dominates the RMS; the bias method
puts B in one dim of the weakest RoPE pair instead (head size kept, that pair given up); the anchor method
carries B a.x on no bias tensor (a.x ~ 1 fitted, attnkit.ops.anchor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("auto", "anchor", "bias", "pad", "kl", "lsq", "scalar", "unit")


@dataclass
class LayerFit:
    """Fitted norm weights of one layer and the attention KL they leave on the calibration rows."""

    g_q: torch.Tensor  # [D]
    g_k: torch.Tensor  # [D]
    a_q: torch.Tensor  # [H, D] pre-norm scales for W_q rows
    a_k: torch.Tensor  # [Hkv, D]
    kl: float | None = None


def unit_fit(heads: int, kv_heads: int, dim: int, dtype=torch.float64) -> LayerFit:
    """All-ones weights: plain RMSNorm, no pre-scales."""
    return LayerFit(
        torch.ones(dim, dtype=dtype),
        torch.ones(dim, dtype=dtype),
        torch.ones(heads, dim, dtype=dtype),
        torch.ones(kv_heads, dim, dtype=dtype),
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, H, T, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (Qwen3RMSNorm in float32)."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _causal(t: int, window: int | None, device) -> torch.Tensor:
    """Bool [T, T]: key j visible from query i (j <= i, and i - j < window when sliding)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    visible = j <= i
    return visible if window is None else visible & (i - j < window)


def logits(q, k, cos, sin, scaling: float) -> torch.Tensor:
    """Attention logits [N, H, T, T] of q [N, H, T, D] and k [N, Hkv, T, D] (GQA: head h reads h // (H/Hkv))."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [N, H, T, D]
    return rope(q, cos, sin) @ rope(k, cos, sin).transpose(-1, -2) * scaling


def normed_logits(q, k, cos, sin, scaling, fit: LayerFit, eps: float) -> torch.Tensor:
    """Logits [N, H, T, T] after Qwen3's QK-norm with `fit`'s weights (pre-scales a, post-weights g)."""
    qn = rms_norm(q * fit.a_q[None, :, None, :], fit.g_q, eps)
    kn = rms_norm(k * fit.a_k[None, :, None, :], fit.g_k, eps)
    return logits(qn, kn, cos, sin, scaling)


def attention_kl(target: torch.Tensor, got: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(target) || softmax(got)), logits [N, H, T, T], visible [T, T]."""
    lp = torch.log_softmax(target.masked_fill(~visible, float("-inf")), -1)
    lq = torch.log_softmax(got.masked_fill(~visible, float("-inf")), -1)
    return (lp.exp() * (lp - lq)).masked_fill(~visible, 0).sum(-1).mean()


def _pair_features(q, k, cos, sin, scaling, eps):
    """Per RoPE frequency f: logit contribution of pair (f, f + D/2) after unit-weight RMSNorm -> [N, H, T, T, D/2]."""
    qn = rope(rms_norm(q, torch.ones(q.shape[-1], dtype=q.dtype), eps), cos, sin)
    kn = rope(rms_norm(k, torch.ones(k.shape[-1], dtype=k.dtype), eps), cos, sin)
    kn = kn.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    half = q.shape[-1] // 2
    prod = qn[..., :, None, :] * kn[..., None, :, :] * scaling  # [N, H, T, T, D]
    return prod[..., :half] + prod[..., half:]


def _centered(x, p, visible):
    """x [..., T, T(, F)] minus its per-row mean under weights p [..., T, T] (rows sum to 1)."""
    if x.dim() == p.dim():
        return (x - (p * x).sum(-1, keepdim=True)).masked_fill(~visible, 0)
    return (x - (p[..., None] * x).sum(-2, keepdim=True)).masked_fill(~visible[..., None], 0)


def fit_layer(
    q,
    k,
    cos,
    sin,
    scaling: float,
    eps: float,
    method: str,
    *,
    window: int | None = None,
    steps: int = 150,
    lr: float = 0.03,
) -> LayerFit:
    """Norm weights for one layer from calibration q [N, H, T, D], k [N, Hkv, T, D] (before RoPE and norm).

    scalar/lsq: weighted least squares of the row-centred logits (weights = source attention
    probabilities; softmax ignores per-row offsets). kl: from lsq, Adam on a_q, a_k, g_q, g_k.
    """
    q, k = q.double(), k.double()
    cos, sin = cos.double(), sin.double()
    dim = q.shape[-1]
    ones = unit_fit(q.shape[1], k.shape[1], dim)
    visible = _causal(q.shape[2], window, q.device)
    target = logits(q, k, cos, sin, scaling)  # [N, H, T, T]
    if method == "unit":
        fit = ones
    else:
        w = _least_squares(q, k, cos, sin, scaling, eps, target, visible, method == "scalar")
        root = w.abs().sqrt()
        fit = LayerFit(torch.cat([root * w.sign()] * 2), torch.cat([root] * 2), ones.a_q, ones.a_k)
        if method == "kl":
            fit = _descend(q, k, cos, sin, scaling, eps, fit, target, visible, steps, lr)
    with torch.no_grad():
        fit.kl = float(attention_kl(target, normed_logits(q, k, cos, sin, scaling, fit, eps), visible))
    return fit


def _least_squares(q, k, cos, sin, scaling, eps, target, visible, scalar: bool) -> torch.Tensor:
    """w [D/2] (= g_q * g_k per RoPE pair) minimising sum p * (row-centred logit error)^2, one window at a time."""
    half = q.shape[-1] // 2
    gram = torch.zeros(half, half, dtype=q.dtype)
    rhs = torch.zeros(half, dtype=q.dtype)
    for n in range(q.shape[0]):
        t = target[n : n + 1]  # [1, H, T, T]
        p = torch.softmax(t.masked_fill(~visible, float("-inf")), -1)
        y = _centered(t, p, visible)
        feats = _centered(_pair_features(q[n : n + 1], k[n : n + 1], cos, sin, scaling, eps), p, visible)
        if scalar:
            feats = feats.sum(-1, keepdim=True).expand(*feats.shape[:-1], half)
        wf = feats * p[..., None]  # [1, H, T, T, D/2]
        gram += torch.einsum("...f,...g->fg", wf, feats)
        rhs += torch.einsum("...f,...->f", wf, y)
    if scalar:
        return (rhs[0] / gram[0, 0]).expand(half).clone()
    return torch.linalg.solve(gram + 1e-9 * gram.diagonal().mean() * torch.eye(half, dtype=q.dtype), rhs)


def _descend(q, k, cos, sin, scaling, eps, start: LayerFit, target, visible, steps: int, lr: float) -> LayerFit:
    """Adam on (log a_q, log a_k, g_q, g_k) minimising the attention KL; keeps the best iterate."""
    params = [
        start.a_q.log().clone().requires_grad_(),
        start.a_k.log().clone().requires_grad_(),
        start.g_q.clone().requires_grad_(),
        start.g_k.clone().requires_grad_(),
    ]
    opt = torch.optim.Adam(params, lr=lr)
    best, best_loss = start, float("inf")
    for _ in range(steps + 1):
        fit = LayerFit(params[2], params[3], params[0].exp(), params[1].exp())
        loss = attention_kl(target, normed_logits(q, k, cos, sin, scaling, fit, eps), visible)
        if loss.item() < best_loss:
            best_loss = loss.item()
            best = LayerFit(*(t.detach().clone() for t in (params[2], params[3], params[0].exp(), params[1].exp())))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return best


# ----- exact padding -----


def pad_index(dim: int) -> torch.Tensor:
    """Positions of the D real dims inside D + 2: halves [0, D/2) and [D/2 + 1, D + 1); D/2 and D + 1 are the pads."""
    half = dim // 2
    return torch.cat([torch.arange(half), torch.arange(half + 1, dim + 1)])


def pad_rows(w: torch.Tensor, heads: int, dim: int, fill: float = 0.0) -> torch.Tensor:
    """Per-head rows [heads * D, ...] -> [heads * (D + 2), ...]; the two pad rows of each head hold `fill`."""
    rest = w.shape[1:]
    out = torch.full((heads, dim + 2, *rest), fill, dtype=w.dtype)
    out[:, pad_index(dim)] = w.reshape(heads, dim, *rest)
    return out.reshape(heads * (dim + 2), *rest)


def pad_columns(w: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """o_proj [d, heads * D] -> [d, heads * (D + 2)] with zero columns at the pads."""
    return pad_rows(w.T.contiguous(), heads, dim).T.contiguous()


def pad_norm_weight(dim: int, bias: float, eps: float, scale: float) -> torch.Tensor:
    """Norm weight [D + 2]: 0 on the pads, scale * sqrt(2 B^2 / (D + 2) + eps) on the real dims.

    With pads equal to B the RMS is sqrt((|x|^2 + 2 B^2) / (D + 2) + eps), so the real dims come out
    as scale * x / sqrt(1 + |x|^2 / (2 B^2 + (D + 2) eps)): relative error about |x|^2 / (4 B^2).
    """
    w = torch.zeros(dim + 2, dtype=torch.float64)
    w[pad_index(dim)] = scale * (2 * bias * bias / (dim + 2) + eps) ** 0.5
    return w


# --- anchor: the engine-safe retrofit (no bias tensors, a head size serving kernels take) ---------------------


def widen_index(dim: int, new_dim: int) -> torch.Tensor:
    """Positions of the D real dims inside a rotate-half head of new_dim >= D: the halves [0, D/2) and
    [new_dim/2, new_dim/2 + D/2), so pair i stays a pair; the rest are pads."""
    half, new_half = dim // 2, new_dim // 2
    return torch.cat([torch.arange(half), torch.arange(new_half, new_half + half)])


def widen_rows(w: torch.Tensor, heads: int, dim: int, new_dim: int) -> torch.Tensor:
    """Per-head rows [heads * D, ...] -> [heads * new_dim, ...] with zero pad rows."""
    rest = w.shape[1:]
    out = torch.zeros((heads, new_dim, *rest), dtype=w.dtype)
    out[:, widen_index(dim, new_dim)] = w.reshape(heads, dim, *rest)
    return out.reshape(heads * new_dim, *rest)


def widen_columns(w: torch.Tensor, heads: int, dim: int, new_dim: int) -> torch.Tensor:
    """o_proj [d, heads * D] -> [d, heads * new_dim] with zero columns at the pads."""
    return widen_rows(w.T.contiguous(), heads, dim, new_dim).T.contiguous()


def anchor_slots(dim: int, new_dim: int, dropped_pair: int | None) -> tuple[int, list[int]]:
    """(position of the anchor in each head, positions whose norm weight is 0). A wider head puts the anchor
    in its first pad; a head that keeps its size gives up `dropped_pair` (both its rows)."""
    if new_dim > dim:
        pads = sorted(set(range(new_dim)) - set(widen_index(dim, new_dim).tolist()))
        return pads[0], pads
    if dropped_pair is None:
        raise ValueError("an anchor inside the head needs the RoPE pair it replaces")
    return dropped_pair, [dropped_pair, dropped_pair + dim // 2]


def weakest_pair(wq: torch.Tensor, wk: torch.Tensor, cov: torch.Tensor, heads: int, kv_heads: int, dim: int) -> int:
    """The RoPE pair with the least logit energy: sum over query heads of E|q_pair|^2 E|k_pair|^2 (the pair's
    rows of its key head), from the input covariance.  wq: [H*D, n], wk: [Hkv*D, n], cov: [n, n]."""

    def pair_energy(w, count):  # [count, D/2]
        e = torch.einsum("ri,ij,rj->r", w, cov, w).reshape(count, dim)
        return e[:, : dim // 2] + e[:, dim // 2 :]

    eq, ek = pair_energy(wq.double(), heads), pair_energy(wk.double(), kv_heads)
    ek = ek.repeat_interleave(heads // kv_heads, dim=0)
    return int((eq * ek).sum(0).argmin())


def slot_norm_weight(dim: int, zero: list[int], bias: float, eps: float) -> torch.Tensor:
    """Norm weight [D] of a head whose dim zero[0] holds the constant `bias` B (from a bias tensor) and zero[1]
    nothing: 0 at `zero`, sqrt(B^2 / D + eps) elsewhere. The RMS is sqrt((|x|^2 + B^2) / D + eps), so a real dim
    comes out as x / sqrt(1 + |x|^2 / (B^2 + D eps)): relative error about |x|^2 / (2 B^2)."""
    w = torch.full((dim,), (bias * bias / dim + eps) ** 0.5, dtype=torch.float64)
    w[zero] = 0.0
    return w


def anchor_norm_weight(new_dim: int, zero: list[int], pad: float, gain: float, scale: float) -> torch.Tensor:
    """Norm weight [new_dim]: 0 at `zero`, scale * gain * pad / sqrt(new_dim) elsewhere. With an anchor row
    pad * a.x ~ pad the RMS is ~ pad |a.x| / sqrt(new_dim), so a real dim comes out as scale * gain * x / |a.x|
    (gain: the least-squares fit of |a.x| over the calibration tokens)."""
    w = torch.full((new_dim,), scale * gain * pad / new_dim**0.5, dtype=torch.float64)
    w[zero] = 0.0
    return w
