"""Merge KV heads into fewer groups: pooling (mean, first) and the calibrated merge.

Conventions: a projection over KV heads is a row stack [Hkv*D, n] (n = hidden size, plus one
column for a bias when the inputs are augmented with a constant 1). Groups are contiguous
(transformers' repeat_kv order): old KV head j belongs to new head j // r, r = Hkv / G.
Query head h reads old KV head h // (H / Hkv). All math runs in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.ops.whiten import psd_sqrt, regularize


def pool_heads(w: torch.Tensor, num_kv: int, groups: int, how: str = "mean") -> torch.Tensor:
    """Pool contiguous head groups of a per-head row stack: [Hkv*D, ...] -> [G*D, ...] ("mean" or "first")."""
    r = num_kv // groups
    heads = w.reshape(groups, r, w.shape[0] // num_kv, *w.shape[1:])  # [G, r, D, ...]
    if how == "mean":
        return heads.to(torch.float64).mean(dim=1).to(w.dtype).reshape(-1, *w.shape[1:])
    if how == "first":
        return heads[:, 0].reshape(-1, *w.shape[1:]).clone()
    raise ValueError(f"unknown pooling {how!r}")


def expand_heads(w: torch.Tensor, groups: int, r: int) -> torch.Tensor:
    """Repeat each group's head r times: [G*D, ...] -> [G*r*D, ...] (the model repeat_kv computes)."""
    heads = w.reshape(groups, 1, w.shape[0] // groups, *w.shape[1:])
    return heads.expand(groups, r, *heads.shape[2:]).reshape(-1, *w.shape[1:])


def head_gram(
    w: torch.Tensor,
    num_heads: int,
    num_kv: int,
    cov: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per old KV head, the sum over the query heads reading it of W_h^T W_h (cov=None, for o_proj blocks
    w: [hidden, H*D]) or of E[q_h q_h^T] = W_h C W_h^T (for q_proj rows w: [H*D, n]), each head's term times
    weights[h] when given ([H]).  -> [Hkv, D, D]. w in any dtype; one head at a time is made float64."""
    per = num_heads // num_kv
    d = (w.shape[1] if cov is None else w.shape[0]) // num_heads
    gram = torch.zeros(num_kv, d, d, dtype=torch.float64)
    cov = None if cov is None else cov.to(torch.float64)
    for h in range(num_heads):
        if cov is None:
            block = w[:, h * d : (h + 1) * d].to(torch.float64)  # [hidden, D]
            term = block.T @ block
        else:
            block = w[h * d : (h + 1) * d].to(torch.float64)  # [D, n]
            term = block @ cov @ block.T
        gram[h // per] += term if weights is None else term * float(weights[h])
    return gram


@dataclass
class ValueMerge:
    """A group-shared projection and per-old-head mixing: old head j's rows ~= mix[j] @ shared[j // r]."""

    shared: torch.Tensor  # [G*D, n]
    mix: torch.Tensor  # [Hkv, D, D]

    def reconstruction(self) -> torch.Tensor:
        """The approximation of the old row stack.  [Hkv*D, n]"""
        num_kv, d = self.mix.shape[0], self.mix.shape[1]
        groups = self.shared.shape[0] // d
        shared = self.shared.reshape(groups, 1, d, -1).expand(groups, num_kv // groups, d, self.shared.shape[1])
        return (self.mix.reshape(groups, num_kv // groups, d, d) @ shared).reshape(num_kv * d, -1)


def merge_rows(
    w: torch.Tensor,
    cov: torch.Tensor,
    num_kv: int,
    groups: int,
    head_weights: torch.Tensor | None = None,
    ridge: float = 1e-6,
) -> ValueMerge:
    """Whitened rank-D merge of each group's stacked head rows (values; non-rotary key dims).

    Per group, the shared D rows span the best rank-D subspace of S L (S: the group's stacked rows
    [r*D, n], L L^T = cov), optionally weighted by R = blockdiag(head_weights[j]^(1/2)) so that the
    error is measured after each head's read-out (o_proj for values). The subspace is the top-D
    eigenvectors of (R S) C (R S)^T (= left singular vectors of R S L). Each head's mixing matrix is
    the least-squares fit mix_j = S_j C V^T (V C V^T)^-1 under the activation covariance.
    w: [Hkv*D, n], cov: [n, n], head_weights: [Hkv, D, D] PSD or None.
    """
    w = w.to(torch.float64)
    d = w.shape[0] // num_kv
    r = num_kv // groups
    cov_r = regularize(cov, ridge)
    shared, mixes = [], []
    for g in range(groups):
        s = w[g * r * d : (g + 1) * r * d]  # [r*D, n]
        if head_weights is None:
            weighted = s
        else:
            roots = [psd_sqrt(head_weights[g * r + j], ridge) for j in range(r)]
            weighted = torch.block_diag(*roots) @ s  # [r*D, n]
        _, vecs = torch.linalg.eigh(weighted @ cov_r @ weighted.T)  # ascending eigenvalues
        v = vecs[:, -d:].T @ weighted  # [D, n]
        gram = v @ cov_r @ v.T  # [D, D]
        mix = torch.linalg.solve(gram, v @ cov_r @ s.T).T  # [r*D, D]: S_j C V^T (V C V^T)^-1
        shared.append(v)
        mixes.append(mix.reshape(r, d, d))
    return ValueMerge(torch.cat(shared), torch.cat(mixes))


def fold_mix_into_o(o_w: torch.Tensor, mix: torch.Tensor, num_heads: int) -> torch.Tensor:
    """o_proj columns of query head h times mix[h's old KV head].  o_w: [hidden, H*D] (any dtype) -> same shape,
    float64, one head's columns at a time."""
    num_kv, d = mix.shape[0], mix.shape[1]
    out = torch.empty(o_w.shape, dtype=torch.float64)
    mix = mix.to(torch.float64)
    for h in range(num_heads):
        cols = slice(h * d, (h + 1) * d)
        out[:, cols] = o_w[:, cols].to(torch.float64) @ mix[h // (num_heads // num_kv)]  # [hidden, D]
    return out


def fold_mix_into_q(q_w: torch.Tensor, mix: torch.Tensor, num_heads: int, dims: slice) -> torch.Tensor:
    """Query rows `dims` of head h become mix[j]^T q_h (so q'.k' = q.(mix k')).  q_w: [H*D, n] (any dtype) -> same
    shape, float64, one head at a time."""
    num_kv = mix.shape[0]
    d = q_w.shape[0] // num_heads
    out = torch.empty(q_w.shape, dtype=torch.float64)
    mix = mix.to(torch.float64)
    for h in range(num_heads):
        head = out[h * d : (h + 1) * d]  # [D, n], a view
        head.copy_(q_w[h * d : (h + 1) * d])
        head[dims] = mix[h // (num_heads // num_kv)].T @ head[dims]
    return out


@dataclass
class KeyMerge:
    """Group-shared key rows and one complex coefficient per (old KV head, rotary frequency pair).

    Old head j's complex key row at pair i (rows i and i + R/2, R = rotary dims) ~= coef[j, i] * shared
    pair i of its group; rows past R (partial rotary) use `rest`, a real mixing like values.
    """

    shared: torch.Tensor  # [G*D, n]
    coef: torch.Tensor  # [Hkv, R/2] complex128
    rest: ValueMerge | None  # non-rotary dims, or None when R = D

    def reconstruction(self) -> torch.Tensor:
        """The approximation of the old key row stack.  [Hkv*D, n]"""
        num_kv, half = self.coef.shape
        d = 2 * half + (0 if self.rest is None else self.rest.mix.shape[1])
        groups = self.shared.shape[0] // d
        r = num_kv // groups
        sh = self.shared.reshape(groups, d, -1).repeat_interleave(r, dim=0)  # [Hkv, D, n]
        z = torch.complex(sh[:, :half], sh[:, half : 2 * half]) * self.coef[:, :, None]  # [Hkv, R/2, n]
        parts = [z.real, z.imag]
        if self.rest is not None:
            parts.append(self.rest.reconstruction().reshape(num_kv, d - 2 * half, -1))
        return torch.cat(parts, dim=1).reshape(num_kv * d, -1)


def merge_keys(
    w: torch.Tensor,
    cov: torch.Tensor,
    num_kv: int,
    groups: int,
    query_gram: torch.Tensor,
    rotary_dim: int | None = None,
    ridge: float = 1e-6,
) -> KeyMerge:
    """Rank-1 complex merge per RoPE frequency pair (rotate-half layout) of each group's key rows.

    Per group and pair i, K: [r, n] complex rows (row i + 1j * row i + R/2); weight each head by its
    queries' energy at that pair, w_j = sum_h E|q_h,i|^2, take the best rank-1 fit of diag(w)^(1/2) K L,
    and re-fit each head's coefficient by least squares under the activation covariance.
    w: [Hkv*D, n], cov: [n, n] or one per group [G, n, n], query_gram: [Hkv, D, D] (head_gram of
    q_proj), rotary_dim: R <= D.
    """
    w = w.to(torch.float64)
    d = w.shape[0] // num_kv
    rot = d if rotary_dim is None else rotary_dim
    half, r = rot // 2, num_kv // groups
    covs = cov if cov.dim() == 3 else cov.expand(groups, *cov.shape)  # [G, n, n]: one metric per group
    heads = w.reshape(num_kv, d, -1)  # [Hkv, D, n]
    kc = torch.complex(heads[:, :half], heads[:, half:rot])  # [Hkv, R/2, n]
    diag = query_gram.to(torch.float64).diagonal(dim1=1, dim2=2)  # [Hkv, D]
    energy = (diag[:, :half] + diag[:, half:rot]).clamp_min(0)  # [Hkv, R/2]
    shared = torch.empty(groups, half, w.shape[1], dtype=torch.complex128)
    coef = torch.empty(num_kv, half, dtype=torch.complex128)
    for g in range(groups):
        cov_r = regularize(covs[g], ridge)  # real: complex rows are multiplied by it part by part
        k = kc[g * r : (g + 1) * r].transpose(0, 1)  # [R/2, r, n]: per pair, the group's complex rows
        sw = (energy[g * r : (g + 1) * r].T + 1e-30).sqrt().to(torch.complex128)[:, :, None]  # [R/2, r, 1]
        a = sw * k  # [R/2, r, n]
        _, vecs = torch.linalg.eigh(_times_real(a, cov_r) @ a.conj().transpose(1, 2))  # [R/2, r, r] ascending
        u = vecs[:, :, -1]  # [R/2, r]: top left singular vector of a L
        row = torch.einsum("fr,frn->fn", u.conj(), a)  # [R/2, n]
        kcr = _times_real(k, cov_r) @ row.conj()[:, :, None]  # [R/2, r, 1]
        energy_row = (_times_real(row, cov_r) * row.conj()).sum(-1)[:, None]  # [R/2, 1]
        # [R/2, r] least squares; a pair whose rows are all zero (a folded QK-norm's dropped pair) gets 0
        c = torch.where(energy_row.abs() > 0, kcr[:, :, 0] / torch.where(energy_row.abs() > 0, energy_row, 1), 0)
        shared[g], c = _normalize(row, c)
        coef[g * r : (g + 1) * r] = c.T
    parts = [shared.real, shared.imag]
    rest = None
    if rot < d:
        rest = merge_rows(
            heads[:, rot:].reshape(num_kv * (d - rot), -1),
            covs.mean(0),
            num_kv,
            groups,
            query_gram[:, rot:, rot:],
            ridge,
        )
        parts.append(rest.shared.reshape(groups, d - rot, -1))
    return KeyMerge(torch.cat(parts, dim=1).reshape(groups * d, -1), coef, rest)


def _times_real(z: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """z @ mat for complex z [..., n] and real mat [n, n], without a complex copy of mat."""
    return torch.complex(z.real @ mat, z.imag @ mat)


def _normalize(row: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale per pair (row, c) -> (s row, c / s) so each pair's coefficients sum to a real positive
    number and have rms 1.  row: [F, n], c: [F, r] complex."""
    total = c.sum(dim=1)  # [F]
    phase = torch.where(total.abs() > 0, total / total.abs().clamp_min(1e-300), torch.ones_like(total))
    rms = c.abs().square().mean(dim=1).sqrt().clamp_min(1e-30)  # [F]
    s = phase * rms
    return row * s[:, None], c / s[:, None]


def fold_coef_into_q(q_w: torch.Tensor, coef: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Query pairs (i, i + R/2) of head h times conj(coef[h's old KV head, i]).  q_w: [H*D, n] (any dtype) -> same
    shape, float64, one head at a time."""
    num_kv, half = coef.shape
    out = torch.empty(q_w.shape, dtype=torch.float64)
    conj = coef.conj()
    for h in range(num_heads):
        head = out[h * head_dim : (h + 1) * head_dim]  # [D, n], a view
        head.copy_(q_w[h * head_dim : (h + 1) * head_dim])
        z = conj[h // (num_heads // num_kv), :, None] * torch.complex(head[:half], head[half : 2 * half])  # [R/2, n]
        head[:half], head[half : 2 * half] = z.real, z.imag
    return out
