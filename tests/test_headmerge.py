"""attnkit.ops.headmerge and whiten against brute-force references (float64, tolerance 1e-9 unless stated)."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.headmerge import (
    expand_heads,
    fold_coef_into_q,
    fold_mix_into_o,
    fold_mix_into_q,
    head_gram,
    merge_keys,
    merge_rows,
    pool_heads,
)
from attnkit.ops.whiten import regularize, relative_error

H, HKV, D, N = 8, 4, 8, 12  # query heads, KV heads, head dim, input width


def whitening_factor(cov: torch.Tensor, ridge: float) -> torch.Tensor:
    """Reference whitening: L with L L^T = cov + ridge (the merges' optimality is stated in this metric)."""
    return torch.linalg.cholesky(regularize(cov, ridge))


def _cov(n: int = N, tokens: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    return x, x.T @ x / tokens


def _rand(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rope(x: torch.Tensor, pos: torch.Tensor, rot: int) -> torch.Tensor:
    """transformers' rotate-half RoPE on the first `rot` dims.  x: [T, D], pos: [T]."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = pos[:, None].to(torch.float64) * inv[None]  # [T, rot/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xr, xp = x[:, :rot], x[:, rot:]
    half = torch.cat([-xr[:, rot // 2 :], xr[:, : rot // 2]], -1)
    return torch.cat([xr * cos + half * sin, xp], -1)


def _attention(q_w, k_w, v_w, o_w, x, heads, kv, rot=D):
    """Causal softmax attention with RoPE, transformers' repeat_kv order.  x: [T, N] -> [T, hidden]."""
    t = x.shape[0]
    pos = torch.arange(t)
    q = (x @ q_w.T).reshape(t, heads, D)
    k = (x @ k_w.T).reshape(t, kv, D)
    v = (x @ v_w.T).reshape(t, kv, D)
    out = []
    for h in range(heads):
        j = h // (heads // kv)
        qh, kh = _rope(q[:, h], pos, rot), _rope(k[:, j], pos, rot)
        s = qh @ kh.T / D**0.5 + torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)
        out.append(torch.softmax(s, -1) @ v[:, j])
    return torch.cat(out, -1) @ o_w.T


def test_pool_heads_matches_loop():
    w = _rand(HKV * D, N)
    heads = [w[j * D : (j + 1) * D] for j in range(HKV)]
    mean = torch.cat([(heads[0] + heads[1]) / 2, (heads[2] + heads[3]) / 2])
    first = torch.cat([heads[0], heads[2]])
    assert torch.equal(pool_heads(w, HKV, 2, "first"), first)
    assert torch.allclose(pool_heads(w, HKV, 2, "mean"), mean, atol=1e-12)
    bias = _rand(HKV * D)
    assert torch.allclose(pool_heads(bias, HKV, 1, "mean"), bias.reshape(HKV, D).mean(0), atol=1e-12)


def test_expand_heads_is_repeat_kv_order():
    w = _rand(2 * D, N)
    out = expand_heads(w, 2, 3)
    assert torch.equal(out.reshape(6, D, N), w.reshape(2, D, N).repeat_interleave(3, dim=0))


def test_whitening_factor_and_relative_error():
    x, cov = _cov()
    low = whitening_factor(cov, ridge=0.0)
    assert torch.allclose(low @ low.T, cov, atol=1e-9)
    a, b = _rand(5, N, seed=2), _rand(5, N, seed=3)
    brute = ((x @ (a - b).T).square().sum() / (x @ a.T).square().sum()).sqrt()
    assert relative_error(a, b, cov) == pytest.approx(float(brute), rel=1e-9)


def _grouped_identical(w: torch.Tensor, groups: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Make the heads of each contiguous group identical (optionally head j scaled by scale[j])."""
    heads = w.reshape(HKV, D, -1).clone()
    r = HKV // groups
    for j in range(HKV):
        heads[j] = heads[(j // r) * r] * (1.0 if scale is None else scale[j])
    return heads.reshape(w.shape)


def test_merge_rows_exact_when_group_spans_d_dims():
    _, cov = _cov()
    w = _grouped_identical(_rand(HKV * D, N), 2)
    mixed = w.reshape(HKV, D, N).clone()
    mixed[1] = _rand(D, D, seed=4) @ mixed[1]  # head 1 = invertible mixing of head 0: still rank D per group
    w = mixed.reshape(HKV * D, N)
    merged = merge_rows(w, cov, HKV, 2)
    assert merged.shared.shape == (2 * D, N) and merged.mix.shape == (HKV, D, D)
    assert relative_error(w, merged.reconstruction(), cov) < 1e-8


def test_merge_rows_error_is_the_whitened_svd_tail():
    _, cov = _cov()
    w = _rand(HKV * D, N, seed=5)
    merged = merge_rows(w, cov, HKV, 1, ridge=0.0)
    sv = torch.linalg.svdvals(w @ whitening_factor(cov, ridge=0.0))
    expected = float((sv[D:].square().sum() / sv.square().sum()).sqrt())
    assert relative_error(w, merged.reconstruction(), cov) == pytest.approx(expected, rel=1e-7)
    assert expected < relative_error(w, expand_heads(pool_heads(w, HKV, 1), 1, HKV), cov)


def test_weighted_merge_rows_lowers_the_weighted_error():
    _, cov = _cov()
    w, o = _rand(HKV * D, N, seed=6), _rand(16, H * D, seed=7)
    weights = head_gram(o, H, HKV)

    def weighted_err(m):
        e = (w - m.reconstruction()).reshape(HKV, D, N)
        return sum(float(torch.trace(weights[j] @ e[j] @ cov @ e[j].T)) for j in range(HKV))

    assert weighted_err(merge_rows(w, cov, HKV, 1, weights)) < weighted_err(merge_rows(w, cov, HKV, 1))


def test_head_gram_brute_force():
    o = _rand(16, H * D, seed=8)
    g = head_gram(o, H, HKV)
    j = 1
    brute = sum(o[:, h * D : (h + 1) * D].T @ o[:, h * D : (h + 1) * D] for h in (2, 3))
    assert torch.allclose(g[j], brute, atol=1e-10)
    _, cov = _cov()
    q = _rand(H * D, N, seed=9)
    gq = head_gram(q, H, HKV, cov)
    brute_q = sum(q[h * D : (h + 1) * D] @ cov @ q[h * D : (h + 1) * D].T for h in (2, 3))
    assert torch.allclose(gq[j], brute_q, atol=1e-9)


@pytest.mark.parametrize("rot", [D, D // 2])
def test_merge_keys_and_values_exact_attention(rot):
    """Keys that differ by a complex scalar per frequency and values that differ by a mixing: exact."""
    x, cov = _cov(tokens=24)
    q, o = _rand(H * D, N, seed=10), _rand(16, H * D, seed=11)
    k = _rand(HKV * D, N, seed=12).reshape(HKV, D, N)
    half = rot // 2
    for j in range(1, HKV):  # rotate/scale head 0's rotary pairs, mix its non-rotary dims
        c = torch.polar(torch.rand(half, dtype=torch.float64) + 0.5, torch.rand(half, dtype=torch.float64) * 6)
        z = c[:, None] * torch.complex(k[0, :half], k[0, half:rot])
        k[j, :half], k[j, half:rot] = z.real, z.imag
        k[j, rot:] = _rand(D - rot, D - rot, seed=20 + j) @ k[0, rot:]
    k = k.reshape(HKV * D, N)
    v = _rand(HKV * D, N, seed=13).reshape(HKV, D, N)
    for j in range(1, HKV):
        v[j] = _rand(D, D, seed=30 + j) @ v[0]
    v = v.reshape(HKV * D, N)
    km = merge_keys(k, cov, HKV, 1, head_gram(q, H, HKV, cov), rotary_dim=rot)
    vm = merge_rows(v, cov, HKV, 1)
    q2 = fold_coef_into_q(q, km.coef, H, D)
    if km.rest is not None:
        q2 = fold_mix_into_q(q2, km.rest.mix, H, slice(rot, D))
    o2 = fold_mix_into_o(o, vm.mix, H)
    ref = _attention(q, k, v, o, x, H, HKV, rot)
    out = _attention(q2, km.shared, vm.shared, o2, x, H, 1, rot)
    assert relative_error(k, km.reconstruction(), cov) < 1e-7
    assert torch.allclose(out, ref, atol=1e-7 * float(ref.abs().max()))


def test_merge_keys_beats_mean_on_logit_weighted_error():
    _, cov = _cov()
    q, k = _rand(H * D, N, seed=14), _rand(HKV * D, N, seed=15)
    gram = head_gram(q, H, HKV, cov)
    km = merge_keys(k, cov, HKV, 2, gram)
    assert relative_error(k, km.reconstruction(), cov) < relative_error(
        k, expand_heads(pool_heads(k, HKV, 2), 2, 2), cov
    )


def test_merge_keys_rank1_matches_brute_force_optimum():
    """One frequency pair, uniform query energy: error equals the tail of the whitened complex SVD."""
    _, cov = _cov()
    k = _rand(HKV * 2, N, seed=16)  # D = 2: one pair per head
    gram = torch.eye(2, dtype=torch.float64).expand(HKV, 2, 2)
    km = merge_keys(k, cov, HKV, 1, gram, ridge=0.0)
    kc = torch.complex(k[0::2], k[1::2]) @ whitening_factor(cov, ridge=0.0).to(torch.complex128)
    sv = torch.linalg.svdvals(kc)
    expected = float((sv[1:].square().sum() / sv.square().sum()).sqrt())
    assert relative_error(k, km.reconstruction(), cov) == pytest.approx(expected, rel=1e-6)


def _rope_tables(batch: int, t: int, rot: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1).expand(batch, t, rot)
    return emb.cos(), emb.sin()


def test_causal_attention_matches_reference():
    from attnkit.ops.attnweight import causal_attention

    x, _ = _cov(tokens=20)
    q, k, v = _rand(H * D, N, seed=40), _rand(HKV * D, N, seed=41), _rand(HKV * D, N, seed=42)
    o = torch.eye(H * D, dtype=torch.float64)
    cos, sin = _rope_tables(1, 20, D)
    z = causal_attention(
        (x @ q.T).reshape(1, 20, H, D),
        (x @ k.T).reshape(1, 20, HKV, D),
        (x @ v.T).reshape(1, 20, HKV, D),
        cos,
        sin,
        D**-0.5,
    )
    assert torch.allclose(z[0], _attention(q, k, v, o, x, H, HKV), atol=1e-10)


def test_key_token_weights_brute_force():
    from attnkit.ops.attnweight import key_token_weights, weighted_group_covariance

    t = 6
    x, _ = _cov(tokens=t)
    q, k = _rand(H * D, N, seed=43), _rand(HKV * D, N, seed=44)
    cos, sin = _rope_tables(1, t, D)
    qh, kh = (x @ q.T).reshape(1, t, H, D), (x @ k.T).reshape(1, t, HKV, D)
    w = key_token_weights(qh, kh, cos, sin, D**-0.5)
    pos = torch.arange(t)
    brute = torch.zeros(HKV, t, dtype=torch.float64)
    for h in range(H):
        j = h // (H // HKV)
        qr, kr = _rope(qh[0, :, h], pos, D), _rope(kh[0, :, j], pos, D)
        for m in range(t):
            p = torch.softmax(qr[m] @ kr[: m + 1].T / D**0.5, -1)
            brute[j, : m + 1] += p * qh[0, m, h].square().sum()
    assert torch.allclose(w, brute, atol=1e-10)
    cov = weighted_group_covariance(x, w, 2)
    wg = brute[:2].sum(0) / brute[:2].sum()
    assert torch.allclose(cov[0], (x * wg[:, None]).T @ x, atol=1e-10)


@pytest.mark.parametrize("slice_rows", [None, 4])
def test_refit_o_is_the_ridge_least_squares_solution(monkeypatch, slice_rows):
    """Also with o_proj and the prior read in float32 slices of 4 rows (a short last one), as a 70B o_proj is."""
    import attnkit.ops.orefit as orefit

    z_new, z_old = _rand(50, 16, seed=45), _rand(50, 16, seed=46)
    o, prior = _rand(6, 16, seed=47), _rand(6, 16, seed=48)
    if slice_rows:
        monkeypatch.setattr(orefit, "SLICE_ELEMENTS", slice_rows * 16)
        o, prior = o.float().double(), prior.float().double()  # the values the float32 inputs below carry
    fit = orefit.refit_o(z_new, z_old, o.float() if slice_rows else o, prior.float() if slice_rows else prior, 0.05)
    lam = 0.05 * (z_new.T @ z_new).diagonal().mean()
    grad = (z_new @ fit.T - z_old @ o.T).T @ z_new + lam * (fit - prior)  # gradient of the objective / 2
    assert grad.abs().max() < 1e-8
    exact = orefit.refit_o(z_new, z_new, o, o, ridge=0.05)  # target reachable and prior agrees: the source o_proj
    assert torch.allclose(exact, o, atol=1e-10)


def test_cholesky_in_place_overwrites_the_matrix_with_its_lower_factor():
    from attnkit.ops.whiten import cholesky_in_place

    a = _rand(12, 12, seed=50)
    spd = a @ a.T + torch.eye(12, dtype=torch.float64)
    work = spd.clone()
    lower = cholesky_in_place(work)
    assert lower.data_ptr() == work.data_ptr()  # no copy: what bounds the 70B refits' memory
    assert torch.equal(lower, lower.tril())
    assert torch.allclose(lower @ lower.T, spd, atol=1e-12)
    assert torch.allclose(lower, torch.linalg.cholesky(spd), atol=1e-12)


def test_regularize_adds_the_ridge_to_the_diagonal_only():
    a = _rand(6, 6, seed=51)
    cov = a @ a.T
    out = regularize(cov, 0.1)
    scale = cov.diagonal().mean()
    assert torch.equal(out - torch.diag(out.diagonal()), cov - torch.diag(cov.diagonal()))
    assert torch.allclose(out.diagonal(), cov.diagonal() + 0.1 * scale, atol=0)
    assert out.data_ptr() != cov.data_ptr()
