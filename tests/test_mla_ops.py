"""attnkit.ops.mla / mla_deepseek against brute-force references (float64, random data)."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.ops.headmerge import head_gram
from attnkit.ops.mla import (
    MLAOptions,
    MLAShape,
    centered_rows,
    convert_layer,
    factor_latent,
    mean_in_one_channel,
    position_free_scale,
    rope_split,
    value_spread,
)
from attnkit.ops.mla_deepseek import NORM_EPS, kv_tensors, q_lora_tensors
from attnkit.ops.whiten import psd_sqrt


def _cov(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    return x.T @ x / x.shape[0]  # correlated, full rank


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """DeepseekV3RMSNorm in float64."""
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


def _rotate(x: torch.Tensor, freqs: torch.Tensor, t: float) -> torch.Tensor:
    """Rotate-half RoPE of x [..., D] at position t."""
    half = x.shape[-1] // 2
    ang = freqs * t
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.cat([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s], dim=-1)


def _rotate_interleaved(x: torch.Tensor, freqs: torch.Tensor, t: float) -> torch.Tensor:
    ang = freqs * t
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def test_factor_latent_full_rank_is_exact_and_truncation_matches_singular_values():
    g = torch.Generator().manual_seed(1)
    n, m = 12, 8
    rows, cov = torch.randn(m, n, generator=g, dtype=torch.float64), _cov(n)
    down, up, _ = factor_latent(rows, cov, m, torch.eye(m, dtype=torch.float64), 0.0)
    assert torch.allclose(up @ down, rows, atol=1e-9)
    lower = torch.linalg.cholesky(cov)
    sv = torch.linalg.svdvals(rows @ lower)
    for rank in (2, 5):
        down, up, _ = factor_latent(rows, cov, rank, torch.eye(m, dtype=torch.float64), 0.0)
        err = ((rows - up @ down) @ lower).pow(2).sum()
        assert math.isclose(err.item(), sv[rank:].pow(2).sum().item(), rel_tol=1e-9)  # Eckart-Young, whitened


def test_whitened_factor_beats_plain_svd_on_the_activations():
    g = torch.Generator().manual_seed(2)
    n, m, rank = 16, 10, 3
    rows, cov = torch.randn(m, n, generator=g, dtype=torch.float64), _cov(n, seed=3)
    lower = torch.linalg.cholesky(cov)
    down, up, _ = factor_latent(rows, cov, rank, torch.eye(m, dtype=torch.float64), 0.0)
    u, s, vh = torch.linalg.svd(rows)
    plain = (u[:, :rank] * s[:rank]) @ vh[:rank]
    whitened_err = ((rows - up @ down) @ lower).pow(2).sum()
    plain_err = ((rows - plain) @ lower).pow(2).sum()
    assert whitened_err < plain_err


def test_rope_split_mqa_keeps_every_kept_pair_and_the_logits_at_every_position():
    g = torch.Generator().manual_seed(4)
    n, d, heads = 10, 8, 2
    s = MLAShape(num_heads=heads, num_kv=1, head_dim=d, latent_rank=4, rope_dim=d)
    k = torch.randn(d, n, generator=g, dtype=torch.float64)
    q = torch.randn(heads * d, n, generator=g, dtype=torch.float64)
    cov = _cov(n, 5)
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    o = torch.randn(n, heads * d, generator=g, dtype=torch.float64)
    layer = convert_layer(q, k, k.clone(), o, cov, s, freqs, mean=torch.zeros(n, dtype=torch.float64))
    rope, _, fitted = rope_split(k, cov, s, torch.eye(d, dtype=torch.float64)[None], 0.0, s.pairs)
    assert torch.allclose(fitted, k, atol=1e-10)
    x, y = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    for t_q, t_k in ((0, 0), (7, 3), (40, 1)):
        for h in range(heads):
            src = _rotate(q[h * d : (h + 1) * d] @ x, freqs, t_q) @ _rotate(k @ y, freqs, t_k)
            qr = layer.query_head(h, s)[1] @ x
            mla = _rotate_interleaved(qr, freqs, t_q) @ _rotate_interleaved(layer.rope @ y, freqs, t_k)
            assert math.isclose(src.item(), mla.item(), rel_tol=1e-9, abs_tol=1e-9)


def test_position_free_scale_limits():
    freqs = torch.tensor([1.0, 1e-3, 0.0], dtype=torch.float64)
    assert position_free_scale(freqs, "keep", 512).tolist() == [1.0, 1.0, 1.0]
    assert position_free_scale(freqs, "drop", 512).tolist() == [0.0, 0.0, 0.0]
    fade = position_free_scale(freqs, "fade", 512)
    assert math.isclose(fade[0].item(), math.sin(512.0) / 512.0, rel_tol=1e-12)
    assert math.isclose(fade[1].item(), math.sin(0.512) / 0.512, rel_tol=1e-12)
    assert fade[2].item() == 1.0


def test_q_lora_path_reproduces_a_biased_projection():
    g = torch.Generator().manual_seed(6)
    n, m = 12, 7
    w = torch.cat(
        [torch.randn(m, n, generator=g, dtype=torch.float64), 3 * torch.randn(m, 1, generator=g, dtype=torch.float64)],
        1,
    )
    x = torch.randn(20, n, generator=g, dtype=torch.float64) * 2.0
    t = q_lora_tensors(w, float(x.pow(2).sum(1).mean()))
    a = x @ t["q_a_proj.weight"].T + t["q_a_proj.bias"]
    got = _rms_norm(a, t["q_a_layernorm.weight"]) @ t["q_b_proj.weight"].T
    want = x @ w[:, :n].T + w[:, n]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-6, rel


@pytest.mark.parametrize("augmented", [False, True])
def test_kv_latent_norm_channel_makes_kv_a_layernorm_a_known_scale(augmented):
    g = torch.Generator().manual_seed(7)
    n, d, hkv, heads, r = 10, 4, 2, 4, 5
    n1 = n + int(augmented)
    s = MLAShape(num_heads=heads, num_kv=hkv, head_dim=d, latent_rank=r, rope_dim=2)
    cov = _cov(n1, 8)
    q, k, v = (torch.randn(rows, n1, generator=g, dtype=torch.float64) for rows in (heads * d, hkv * d, hkv * d))
    layer = convert_layer(
        q,
        k,
        v,
        torch.randn(n, heads * d, generator=g, dtype=torch.float64),
        cov,
        s,
        10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d),
        mean=torch.zeros(n1, dtype=torch.float64),
    )
    t = kv_tensors(layer, s, augmented)
    x = torch.randn(30, n, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(cov[:n, :n]).T
    xa = torch.cat([x, torch.ones(30, 1, dtype=torch.float64)], 1) if augmented else x
    a = x @ t["kv_a_proj_with_mqa.weight"].T + t["kv_a_proj_with_mqa.bias"]  # [T, r + 1 + P]
    latent = _rms_norm(a[:, : r + 1], t["kv_a_layernorm.weight"])
    assert latent[:, r].abs().max() == 0  # the constant channel is cached as 0: its norm weight is exactly 0
    got = (latent @ t["kv_b_proj.weight"].T).reshape(30, heads, 2 * d)
    want = (xa @ (layer.up @ layer.down).T).reshape(30, hkv, 2 * d).repeat_interleave(heads // hkv, dim=1)
    assert ((got - want).norm() / want.norm()).item() < 1e-6
    assert torch.allclose(a[:, r + 1 :], xa @ layer.rope.T, atol=1e-10)


def _unit_norm_inputs(n: int, count: int, seed: int, mean: float = 0.0) -> torch.Tensor:
    """Rows with |u|^2 = n (what input_layernorm outputs, without its weight), optionally around a mean."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(count, n, generator=g, dtype=torch.float64)
    u[:, 0] += mean
    return u * (n / u.pow(2).sum(1, keepdim=True)).sqrt()


def test_span_latent_at_full_width_is_exact_through_the_norm():
    from attnkit.ops.latent_norm import rms_norm, span_plan

    n, r = 12, 5
    u = _unit_norm_inputs(n, 200, 0)
    info = torch.randn(r, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plan = span_plan(info, u, n, eps=0.0)
    back = rms_norm(u @ plan.rows.T, plan.norm_weight, 0.0) @ plan.readout  # [N, r]
    # exact up to float64 rounding: the scale error is a mean of squares over n channels, a few ulps at most
    assert plan.kind == "span" and plan.scale_error < n * torch.finfo(torch.float64).eps
    assert torch.allclose(back, u @ info.T, atol=1e-10)


def test_span_latent_pads_zero_rows_beyond_the_hidden_size():
    from attnkit.ops.latent_norm import span_plan

    u = _unit_norm_inputs(6, 50, 2)
    plan = span_plan(torch.randn(3, 6, dtype=torch.float64), u, 9, eps=0.0)
    assert plan.rows.shape == (9, 6) and plan.rows[6:].abs().max() == 0 and plan.readout.shape == (9, 3)


def test_anchor_latent_is_exact_when_the_input_has_a_constant_direction():
    """u = [1 (constant), rest with a fixed norm]: the anchor fit finds a.u = 1 and the norm divides by it."""
    from attnkit.ops.anchor import anchor_row
    from attnkit.ops.latent_norm import anchor_plan, rms_norm

    rest = _unit_norm_inputs(7, 300, 3)
    u = torch.cat([torch.ones(300, 1, dtype=torch.float64), rest], 1)  # [N, 8]
    a = anchor_row(u, ridge=0.0)
    assert torch.allclose(u @ a, torch.ones(300, dtype=torch.float64), atol=1e-8)
    info = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    plan = anchor_plan(info, a, u, rank=6, eps=0.0)  # 4 information rows, one zero row, the anchor
    back = rms_norm(u @ plan.rows.T, plan.norm_weight, 0.0) @ plan.readout
    rel = ((back - u @ info.T).norm() / (u @ info.T).norm()).item()
    assert plan.kind == "anchor" and rel < 1e-4, rel  # the shrunk information channels move the RMS by ~2^-16


def test_anchor_scale_error_measures_how_far_a_u_is_from_constant():
    from attnkit.ops.anchor import anchor_row
    from attnkit.ops.latent_norm import anchor_plan

    info = torch.randn(3, 10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    near = _unit_norm_inputs(10, 400, 6, mean=8.0)  # a strong mean direction: a.u is nearly constant
    far = _unit_norm_inputs(10, 400, 6)  # none: the best linear fit of 1 is poor
    errors = [anchor_plan(info, anchor_row(u), u, 4, 1e-6).scale_error for u in (near, far)]
    assert errors[0] < 0.01 < errors[1]


def test_substitute_constant_replaces_the_bias_column_by_the_anchor():
    from attnkit.ops.anchor import substitute_constant
    from attnkit.ops.latent_norm import fold_gamma

    rows = torch.tensor([[1.0, 2.0, 5.0]], dtype=torch.float64)  # acting on [x0, x1, 1]
    gamma = torch.tensor([2.0, 3.0], dtype=torch.float64)
    on_u = fold_gamma(rows, gamma)
    assert on_u.tolist() == [[2.0, 6.0, 5.0]]
    anchor = torch.tensor([0.5, 0.0], dtype=torch.float64)
    assert substitute_constant(on_u, anchor).tolist() == [[4.5, 6.0]]
    assert substitute_constant(on_u[:, :2], anchor).tolist() == [[2.0, 6.0]]


def test_fold_o_bias_moves_the_output_bias_onto_the_values():
    from attnkit.ops.anchor import fold_o_bias

    g = torch.Generator().manual_seed(8)
    s = MLAShape(num_heads=4, num_kv=2, head_dim=3, latent_rank=2, rope_dim=2)
    o = torch.randn(5, 12, generator=g, dtype=torch.float64)  # [n, H*D], rank 5
    b = torch.randn(5, generator=g, dtype=torch.float64)
    delta, residual = fold_o_bias(o, b, s.num_heads, s.num_kv, s.head_dim)
    z_shift = delta.reshape(2, 1, 3).expand(2, 2, 3).reshape(12)  # each KV head's delta reaches its 2 readers
    assert residual < 1e-10 and torch.allclose(o @ z_shift, b, atol=1e-10)


@pytest.mark.parametrize("width", [4, 6])
def test_span_basis_is_orthonormal_and_spans_the_info_rows_first(width):
    """width 4 = the info rows' count (the path a full latent takes: no [n, n] complement is built); width 6 also
    fills with the highest-energy directions of u outside their span."""
    from attnkit.ops.latent_norm import span_basis

    g = torch.Generator().manual_seed(9)
    info = torch.randn(4, 10, generator=g, dtype=torch.float64)
    u = torch.randn(200, 10, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, 10, dtype=torch.float64)
    basis = span_basis(info, u, width)
    assert basis.shape == (width, 10)
    assert torch.allclose(basis @ basis.T, torch.eye(width, dtype=torch.float64), atol=1e-12)
    first = basis[:4]
    assert torch.allclose(info @ first.T @ first, info, atol=1e-12)  # the info rows lie in the first four
    if width > 4:
        rest = torch.eye(10, dtype=torch.float64) - first.T @ first  # projector off span(info)
        ur = u @ rest
        vals, vecs = torch.linalg.eigh(ur.T @ ur / u.shape[0])
        top = vecs[:, -2:]
        assert torch.allclose(basis[4:].T @ basis[4:], top @ top.T, atol=1e-10)  # the same two directions


def test_value_spread_is_the_centered_output_energy_of_each_heads_values():
    """E|O_h (v - E v)|^2 per query head, against the per-token brute force; a key weight in output units."""
    g = torch.Generator().manual_seed(11)
    n, d, hkv, heads = 12, 4, 2, 6
    s = MLAShape(num_heads=heads, num_kv=hkv, head_dim=d, latent_rank=3, rope_dim=2)
    x = torch.randn(500, n, generator=g, dtype=torch.float64) + torch.randn(n, generator=g, dtype=torch.float64)
    v = torch.randn(hkv * d, n, generator=g, dtype=torch.float64)
    o = torch.randn(n, heads * d, generator=g, dtype=torch.float64)
    spread = value_spread(v, o, x.T @ x / len(x), x.mean(0), s)
    values = x @ v.T  # [T, Hkv*D]
    centered = values - values.mean(0)
    for h in range(heads):
        g_ = h // (heads // hkv)
        out = centered[:, g_ * d : (g_ + 1) * d] @ o[:, h * d : (h + 1) * d].T  # [T, n]
        assert math.isclose(spread[h].item(), out.pow(2).sum(1).mean().item(), rel_tol=1e-9)
    with pytest.raises(ValueError, match="needs the calibration inputs' mean"):
        value_spread(v, o, x.T @ x / len(x), None, s)


def test_head_gram_weights_each_reading_head():
    g = torch.Generator().manual_seed(12)
    q, cov = torch.randn(4 * 3, 5, generator=g, dtype=torch.float64), _cov(5, 13)
    weights = torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    got = head_gram(q, 4, 2, cov, weights)
    for j in range(2):
        want = sum(weights[h] * q[h * 3 : (h + 1) * 3] @ cov @ q[h * 3 : (h + 1) * 3].T for h in (2 * j, 2 * j + 1))
        assert torch.allclose(got[j], want, rtol=1e-12)


def test_rotation_cost_prefers_energy_that_turns():
    """The pairs the rotation choice keeps: energy times how far the pair turns within the context. A fast pair
    without energy costs nothing; a slow pair with much energy little; a turning pair with energy most."""
    from attnkit.ops.mla import chosen_pairs, rotation_cost

    d, n = 8, 6
    k = torch.zeros(d, n, dtype=torch.float64)
    k[0, 0] = 1e-3  # pair 0: fast, no energy to speak of
    k[1, 1] = 1.0  # pair 1: turning, energy 1
    k[2, 2] = 2.0  # pair 2: turning, energy 4
    k[3, 3] = 10.0  # pair 3: hardly turns within the context, energy 100
    freqs = torch.tensor([1.0, 0.1, 0.01, 1e-6], dtype=torch.float64)
    cost = rotation_cost(k, torch.eye(n, dtype=torch.float64), torch.eye(d, dtype=torch.float64)[None], freqs, 4096)
    assert cost[2] > cost[1] > cost[3] > 0 and cost[0] < cost[3]
    assert chosen_pairs(cost, 2) == [1, 2]
    assert chosen_pairs(torch.zeros(4), 2) == [0, 1]  # ties go to the faster pairs


def test_key_balance_moves_the_latent_between_keys_and_values():
    """A latent too small for both (rank 6 of 2 x 16 key/value rows): a low key balance fits the values closer and
    the keys worse than a high one; no balance given is 1 (convert mla gives each target's own, mla_request). Keys
    weighted as logit error (query): with random weights the output weighting scales the keys' error far above the
    values', and the balance then moves little."""
    g = torch.Generator().manual_seed(7)
    n, d, heads, kv = 24, 8, 4, 2
    s = MLAShape(num_heads=heads, num_kv=kv, head_dim=d, latent_rank=6, rope_dim=2)
    q = torch.randn(heads * d, n, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv * d, n, generator=g, dtype=torch.float64) for _ in range(2))
    o = torch.randn(n, heads * d, generator=g, dtype=torch.float64)
    cov, freqs = _cov(n, 3), 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    mean = torch.zeros(n, dtype=torch.float64)

    def fit(balance):
        return convert_layer(q, k, v, o, cov, s, freqs, MLAOptions(key_balance=balance, key_weight="query"), mean=mean)

    values, keys, plain, one = fit(0.05), fit(20.0), fit(None), fit(1.0)
    assert values.k_err > keys.k_err and values.v_err < keys.v_err
    assert (plain.k_err, plain.v_err) == (one.k_err, one.v_err)


def test_centered_rows_carry_the_centered_energy_under_the_plain_metric():
    """centered_rows(rows, C, C_c): under C their energy (and every direction's) is rows' under C_c."""
    g = torch.Generator().manual_seed(11)
    n, m = 10, 4
    x = torch.randn(500, n, generator=g, dtype=torch.float64) + 3 * torch.randn(n, generator=g, dtype=torch.float64)
    cov, mean = x.T @ x / len(x), x.mean(0)
    centered = cov - torch.outer(mean, mean)
    rows = torch.randn(m, n, generator=g, dtype=torch.float64)
    out = centered_rows(rows, cov, centered, 0.0)
    assert torch.allclose(out @ cov @ out.T, rows @ centered @ rows.T, atol=1e-8)
    assert torch.allclose(centered_rows(rows, cov, cov, 0.0), rows, atol=1e-9)  # nothing to drop: unchanged


def _keys_with_a_mean(seed: int):
    """A layer whose inputs have a large mean that its keys read strongly; pair 0's key rows are zero, so the
    shared RoPE key (P = 2, pair 0) holds nothing and the latent carries every key row, and its values are zero, so
    the latent carries nothing else."""
    g = torch.Generator().manual_seed(seed)
    n, d, heads, kv = 24, 8, 4, 2
    x = torch.randn(2000, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    x = x + 4 * torch.randn(n, generator=g, dtype=torch.float64)
    cov, mean = x.T @ x / len(x), x.mean(0)
    q = torch.randn(heads * d, n, generator=g, dtype=torch.float64)
    k, v = (torch.randn(kv * d, n, generator=g, dtype=torch.float64) for _ in range(2))
    k[[h * d + r for h in range(kv) for r in (0, d // 2)]] = 0.0
    v = torch.zeros_like(v)
    o = torch.randn(n, heads * d, generator=g, dtype=torch.float64)
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    return (q, k, v, o, cov, freqs, mean), (heads, kv, d)


def _key_readout(layer, kv: int, d: int) -> torch.Tensor:
    """[Hkv*D, r] the rows of the latent's read-out that give the keys (the values' rows dropped)."""
    return layer.up.reshape(kv, 2 * d, -1)[:, :d].reshape(kv * d, -1)


def _latent_keys(layer, kv: int, d: int) -> torch.Tensor:
    """[Hkv*D, n'] the keys the latent reads out (pair 0 holds nothing: _keys_with_a_mean)."""
    return _key_readout(layer, kv, d) @ layer.down


@pytest.mark.parametrize("rank", [3, 8, 16])
def test_centered_keys_reach_the_best_fit_of_the_keys_on_centered_inputs(rank):
    """center_keys: the latent is fitted to the keys on centered inputs (their mean moves every logit of a query
    alike). With nothing else in the latent its keys' error, weighted as the fit weighs it (E[q q^T] of the reading
    heads), is the Eckart-Young optimum on centered inputs (0 at full rank), below the plain fit's, which spends a
    channel on the mean; the report's k_err is that error unweighted."""
    (q, k, v, o, cov, freqs, mean), (heads, kv, d) = _keys_with_a_mean(5)
    s = MLAShape(num_heads=heads, num_kv=kv, head_dim=d, latent_rank=rank, rope_dim=2)
    centered = cov - torch.outer(mean, mean)
    weight = torch.block_diag(*[psd_sqrt(g, 0.0) for g in head_gram(q, heads, kv, cov)])  # [Hkv*D, Hkv*D]
    total = torch.trace(weight @ k @ centered @ k.T @ weight)

    def fit(center: bool):
        options = MLAOptions(key_weight="query", key_balance=1.0, center_keys=center, shrink=0.0)
        layer = convert_layer(q, k, v, o, cov, s, freqs, options, mean=mean)
        lost = k - _latent_keys(layer, kv, d)  # [Hkv*D, n]
        weighted = weight @ lost
        plain = float(torch.trace(lost @ centered @ lost.T) / torch.trace(k @ centered @ k.T)) ** 0.5
        return float(torch.trace(weighted @ centered @ weighted.T) / total) ** 0.5, plain, layer

    sv = torch.linalg.svdvals(weight @ k @ psd_sqrt(centered, 0.0))
    best = float(sv[rank:].pow(2).sum() / sv.pow(2).sum()) ** 0.5
    (plain, _, _), (dropped, unweighted, layer) = fit(False), fit(True)
    assert math.isclose(layer.k_err, unweighted, rel_tol=1e-6, abs_tol=1e-9)
    assert math.isclose(dropped, best, rel_tol=1e-6, abs_tol=1e-7)
    assert dropped < 1e-7 if rank == kv * d else dropped < plain


def test_centered_keys_need_the_mean():
    (q, k, v, o, cov, freqs, _), (heads, kv, d) = _keys_with_a_mean(5)
    s = MLAShape(num_heads=heads, num_kv=kv, head_dim=d, latent_rank=8, rope_dim=2)
    with pytest.raises(ValueError, match="mean"):
        convert_layer(q, k, v, o, cov, s, freqs, MLAOptions(key_weight="query", center_keys=True))


def _bf16_key_error(down: torch.Tensor, up_k: torch.Tensor, x: torch.Tensor) -> float:
    """Relative error of the keys read out of a latent whose inputs, rows, channels and read-out are rounded to bf16
    (channels scaled to unit E[c^2] first, as convert_layer writes them), against the same latent in float64, on
    centered keys (their mean is free).  down: [r, n], up_k: [m, r], x: [N, n]."""
    scale = (x @ down.T).pow(2).mean(0).sqrt()  # [r]
    down, up_k = down / scale[:, None], up_k * scale
    keys = x @ down.T @ up_k.T  # [N, m]
    c = _bf16(_bf16(x) @ _bf16(down).T)  # [N, r]
    err = c @ _bf16(up_k).T - keys
    return float((err - err.mean(0)).norm() / (keys - keys.mean(0)).norm())


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float64)


def test_the_latent_carries_its_mean_in_one_channel_and_its_keys_through_bf16(monkeypatch):
    """Inputs with two near-constant massive dims and a constant column for biases (Qwen2's layout), keys centered:
    convert_layer's latent has mean 0 on the data in every channel but the first. The SVD's own basis (the
    reflection switched off) is the same latent in float64, but each of its channels is mostly mean (about +-1 with
    a spread of 0.01-0.1 once scaled), and the keys read out of it in bf16 are several times further off."""
    import attnkit.ops.mla as mla

    g = torch.Generator().manual_seed(3)
    n, d, heads, kv = 24, 8, 4, 2
    x = torch.randn(4000, n, generator=g, dtype=torch.float64) @ torch.randn(n, n, generator=g, dtype=torch.float64)
    x = torch.cat([x / 5, torch.ones(len(x), 1, dtype=torch.float64)], 1)  # [N, n + 1]
    x[:, :2] += 100.0
    cov, mean = x.T @ x / len(x), x.mean(0)
    q, o = torch.randn(heads * d, n + 1, generator=g, dtype=torch.float64), torch.randn(n, heads * d, generator=g)
    k, v = (torch.randn(kv * d, n + 1, generator=g, dtype=torch.float64) for _ in range(2))
    k[:, -1] *= 30  # large key biases
    s = MLAShape(num_heads=heads, num_kv=kv, head_dim=d, latent_rank=10, rope_dim=2)
    freqs = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def latent():
        layer = convert_layer(q, k, v, o.double(), cov, s, freqs, MLAOptions(center_keys=True), mean=mean)
        return layer.down, _key_readout(layer, kv, d)  # [r, n + 1], [Hkv*D, r]

    down, up_k = latent()
    means = down @ mean  # [r]
    assert means[1:].abs().max() < 1e-9 * means[0].abs()
    monkeypatch.setattr(mla, "mean_in_one_channel", lambda down, up, mean: (down, up))
    svd_down, svd_up = latent()
    assert torch.allclose(svd_up @ svd_down, up_k @ down, atol=1e-9)
    assert ((svd_down @ mean).abs() > 0.5).all()  # every channel mostly mean (unit E[c^2])
    kept, svd = _bf16_key_error(down, up_k, x), _bf16_key_error(svd_down, svd_up, x)
    assert kept * 3 < svd, (kept, svd)


def test_mean_in_one_channel_is_the_same_latent():
    """up @ down is unchanged, only the first channel has a mean on the data; a latent without a mean is returned
    as it is."""
    g = torch.Generator().manual_seed(4)
    down, up, mean = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((6, 9), (5, 6), (9,)))
    new_down, new_up = mean_in_one_channel(down, up, mean)
    assert torch.allclose(new_up @ new_down, up @ down, atol=1e-12)
    assert (new_down @ mean)[1:].abs().max() < 1e-12 and (new_down @ mean)[0].abs() > 0
    same = mean_in_one_channel(down, up, torch.zeros(9, dtype=torch.float64))
    assert same[0] is down and same[1] is up
