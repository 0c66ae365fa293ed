"""One attention layer from MHA/GQA to DeepSeek MLA: a shared RoPE key plus a calibrated low-rank KV latent.

Conventions: projections are row stacks [out, n'] in float64, n' = n (+1 when the input is augmented
with a constant 1 to carry biases); cov = E[x x^T] over calibration inputs (augmented likewise).
Source keys use the rotate-half layout: pair i of a head is rows (i, i + D/2), rotated by frequency i.
Query head h reads KV head h // (H / Hkv).

Method, per layer:
1. RoPE key: per kept frequency pair, the best (query-weighted, whitened) rank-1 complex fit of the
   KV heads' keys (attnkit.ops.headmerge.merge_keys with one group = a per-frequency PCA across
   heads). The shared row is DeepSeek's k_pe; each head's complex coefficient is folded into its
   queries (it commutes with the rotation), so this part keeps its position dependence.
2. Position-free part: what is left of the keys (the other frequency pairs, and the part of kept
   pairs the shared row misses) is stacked with the values and factored jointly to rank r by an
   SVD of diag(key/value read-out weights)^(1/2) [K_res; V] L, L L^T = cov (whitened, so the error
   is measured on the activations; keys weighted by E[q q^T] (logit error), values by o_proj). With
   center_keys the keys' error is measured on centered inputs x - E x: a position-free key's mean adds the same
   amount to every logit of a query, which the softmax drops, so the latent does not spend channels on it.
3. The latent's basis: a reflection puts all of the channels' mean on the data in the first channel, so the
   others vary about 0 and keep their variation when the latent is stored and computed in bf16 (a channel
   rounds to a fraction of its own size, mean included). The same latent in exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnkit.ops.headmerge import head_gram, merge_keys
from attnkit.ops.whiten import cholesky_in_place, psd_sqrt, regularize, relative_error

KEY_WEIGHTS = ("output", "query", "uniform")
#: Which source pairs the shared RoPE key keeps: the fastest (a stock rotary embedding reproduces them), or those
#: whose rotation costs the most logit error when lost (rotation_cost; a layout that turns any frequencies).
ROPE_PAIRS = ("fastest", "rotation")
VALUE_WEIGHTS = ("o_proj", "none")
RESIDUALS = ("keep", "drop", "fade")


@dataclass(frozen=True)
class MLAShape:
    num_heads: int  # H
    num_kv: int  # Hkv (source)
    head_dim: int  # D (source query/key/value head dim)
    latent_rank: int  # r: position-free latent channels (the cache holds r + 1 norm channel + P)
    rope_dim: int  # P: shared RoPE key dims (even, <= D)

    @property
    def pairs(self) -> list[int]:
        """The P/2 highest source frequency pairs (pairs 0..P/2-1), which a stock DeepSeek rotary embedding of P
        dims reproduces with theta' = theta^(P/D): what the shared RoPE key keeps unless `MLAOptions.rope_pairs`
        lets it choose (a layout that turns its RoPE key at any frequencies)."""
        return list(range(self.rope_dim // 2))


@dataclass
class MLAOptions:
    """Ablation knobs (defaults are the best measured; see docs/convert-mla.md)."""

    key_weight: str = "output"  # output: logit errors in output units (x value spread); query: logit errors; uniform
    value_weight: str = "o_proj"  # o_proj: value errors measured after each head's o_proj; none
    residual: str = "keep"  # what becomes position-free: keep it, drop it, or fade it (see position_free_scale)
    window: int = 512  # fade: distances are taken uniform over [0, window)
    key_balance: float | None = None  # weight of the (scaled) logit error against the output error (None: 1 here;
    # convert mla resolves it by its target: mla_request.key_balance_choice)
    center_keys: bool | None = None  # fit the position-free keys on centered inputs, their mean dropped (None: no
    # here; convert mla resolves it by its target: mla_request.center_keys_choice)
    whiten: bool = True  # False: fit on the weights alone (plain SVD, cov = I; errors still on activations)
    o_refit: float = 0.1  # ridge of the o_proj refit to the source attention output (0: no refit)
    shrink: float = 0.5  # covariance shrinkage toward its diagonal: (1 - s) C + s diag(C); generalizes to other text
    rope_pairs: str = "auto"  # rotation: chosen by rotation_cost over rotation_context; else (fastest, and auto,
    # which convert mla resolves by its target: mla_request.rope_pair_choice) the fastest P/2
    rotation_context: int = 4096  # rotation: distances taken uniform over [0, this) (a sliding layer: its window)
    ridge: float = 1e-6


@dataclass
class MLALayer:
    """The converted layer in source terms (rows act on x or [x; 1]).

    q: [H*D, n'] the source query rows, as given (query_head makes one head's converted rows at a time, so the
    whole float64 query, 1 GiB at a 70B model's width, is never held); fade: [D] the factor of each position-free
    query row; coef: [Hkv, P/2] complex, the kept pairs' key coefficients folded into the RoPE query rows;
    down: [r, n'] latent rows (unit second moment each); up: [Hkv*2D, r] per KV head [k_nope (D); v (D)];
    rope: [P, n'] shared key rows, interleaved (row 2j, 2j+1 = real, imaginary part of kept pair j);
    pairs: the source pairs kept (ascending), pair j of the RoPE key is source pair pairs[j].
    """

    q: torch.Tensor
    fade: torch.Tensor
    coef: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    rope: torch.Tensor
    k_err: float  # relative key error (on centered inputs where center_keys dropped the keys' mean)
    v_err: float
    position_free: float  # fraction of the query-weighted key energy that lost its position dependence
    spectrum: torch.Tensor  # [min(2*Hkv*D, n')] weighted energy per latent rank (squared singular values)
    pairs: list[int]

    def truncation_error(self, rank: int) -> float:
        """Fraction of the weighted key/value energy a latent of `rank` channels leaves out."""
        total = self.spectrum.sum().item()
        return self.spectrum[rank:].sum().item() / total if total > 0 else 0.0

    def query_head(self, h: int, s: MLAShape) -> tuple[torch.Tensor, torch.Tensor]:
        """Query head h's rows, float64: nope [D, n'] (each row times its fade) and rope [s.rope_dim, n'] (the
        kept pairs times conj(coef of h's KV head), interleaved; zero rows past them where s pads the RoPE key)."""
        d, kept = s.head_dim, self.coef.shape[1]
        head = self.q[h * d : (h + 1) * d].to(torch.float64)  # [D, n']
        pairs = torch.tensor(self.pairs, dtype=torch.long)
        c = self.coef[h // (s.num_heads // s.num_kv)].conj()[:, None]  # [P/2, 1]
        z = torch.complex(head[pairs], head[pairs + d // 2]) * c  # [P/2, n']
        rope = torch.zeros(s.rope_dim, head.shape[1], dtype=torch.float64)
        rope[: 2 * kept] = torch.stack([z.real, z.imag], dim=1).reshape(2 * kept, -1)
        return head * self.fade[:, None], rope


def _pair_rows(d: int, pairs: list[int]) -> torch.Tensor:
    """Row indices of rotate-half pairs, interleaved: [i0, i0 + D/2, i1, i1 + D/2, ...]."""
    return torch.tensor([r for i in pairs for r in (i, i + d // 2)], dtype=torch.long)


def rotation_cost(k: torch.Tensor, cov: torch.Tensor, q_gram: torch.Tensor, freqs: torch.Tensor, context: int):
    """Per source pair, the logit error its rotation would cost made position-free: the readers' query energy
    times the key energy at the pair (E|q_i|^2 E|k_i|^2, summed over KV heads), times E|1 - exp(1j w_i t)|^2 =
    2 - 2 sin(w_i T) / (w_i T) for distances t uniform over [0, T = context).  A slow pair costs little, and so does
    a fast pair that carries no energy (docs/convert-mla.md, "RoPE pairs chosen by their rotation").
    k: [Hkv*D, n'], cov: [n', n'], q_gram: [Hkv, D, D], freqs: [D/2].  -> [D/2]"""
    d = q_gram.shape[1]
    key = torch.einsum("ri,ij,rj->r", k, cov, k).reshape(-1, d)  # [Hkv, D]: E|k_row|^2
    query = q_gram.diagonal(dim1=1, dim2=2)  # [Hkv, D]
    energy = (_per_pair(query) * _per_pair(key)).sum(0)  # [D/2]
    x = freqs.to(torch.float64) * context
    turned = torch.where(x > 0, 2 - 2 * torch.sin(x) / x.clamp_min(1e-300), torch.zeros_like(x))
    return energy * turned


def _per_pair(rows: torch.Tensor) -> torch.Tensor:
    """[..., D] per-row values (rotate-half layout: pair i is rows i and i + D/2) -> [..., D/2] their sums."""
    half = rows.shape[-1] // 2
    return rows[..., :half] + rows[..., half:]


def chosen_pairs(cost: torch.Tensor, count: int) -> list[int]:
    """The `count` pairs of highest cost, ascending (ties to the faster pair)."""
    order = sorted(range(len(cost)), key=lambda i: (-float(cost[i]), i))
    return sorted(order[:count])


def rope_split(k: torch.Tensor, cov: torch.Tensor, s: MLAShape, q_gram: torch.Tensor, ridge: float, pairs: list[int]):
    """Shared RoPE key of the kept pairs and the rest of the keys.

    k: [Hkv*D, n'], q_gram: [Hkv, D, D].  Returns rope [P, n'] (interleaved, pair j = source pair pairs[j]),
    coef [Hkv, P/2] complex, fitted [Hkv*D, n'] (what the rope part reproduces at the source's rows, zero on
    unkept pairs).
    """
    d = s.head_dim
    km = merge_keys(k, cov, s.num_kv, 1, q_gram, d, ridge)  # all D/2 pairs; one group = PCA across heads
    rows = _pair_rows(d, pairs)
    rope = km.shared[rows]  # [P, n']
    mask = torch.zeros(d, 1, dtype=torch.float64)
    mask[rows] = 1.0
    fitted = (km.reconstruction().reshape(s.num_kv, d, -1) * mask).reshape(k.shape)  # [Hkv*D, n']
    return rope, km.coef[:, pairs], fitted


def factor_latent(
    rows: torch.Tensor,
    cov: torch.Tensor,
    rank: int,
    weight_roots: torch.Tensor,
    ridge: float,
    chosen_on: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-`rank` fit rows ~= up @ down minimising ||weight_roots (rows - up down) L||_F, L L^T = cov.

    rows: [m, n'], weight_roots: [m, m].  down: [rank, n'] (the top left singular vectors' combinations
    of the weighted rows); up: [m, rank], the least-squares read-out rows C down^T (down C down^T)^-1;
    spectrum: [min(m, n')] the squared singular values (the weighted energy each latent rank captures).
    chosen_on: [m, n'] rows whose energy under cov is what each of `rows` should weigh (attnkit.ops.mla's centered
    keys): the singular vectors are theirs, the combinations still of `rows`, so a full rank stays exact.
    """
    lower = cholesky_in_place(regularize(cov, ridge))  # L L^T = C + ridge: one [n', n'] matrix
    weighted = weight_roots @ rows  # [m, n']
    chooser = weighted if chosen_on is None else weight_roots @ chosen_on  # [m, n']
    u, sv, _ = torch.linalg.svd(chooser @ lower, full_matrices=False)
    down = u[:, :rank].T @ weighted  # [rank, n']
    down_l = down @ lower  # [rank, n']: down C_r = down_l L^T
    gram = down_l @ down_l.T  # [rank, rank]
    # [m, rank]; least squares, not solve: latent rows beyond the weighted rows' rank are zero (a padded latent,
    # or keys with zero rows such as a folded QK-norm's dropped pairs) and make the gram singular
    up = torch.linalg.lstsq(gram, down_l @ (rows @ lower).T, driver="gelsd").solution.T
    return down, up, sv.pow(2)


def _block_roots(grams: torch.Tensor, ridge: float) -> torch.Tensor:
    """blockdiag of the PSD square roots of grams [Hkv, D, D].  -> [Hkv*D, Hkv*D]"""
    return torch.block_diag(*[psd_sqrt(g, ridge) for g in grams])


def position_free_scale(freqs: torch.Tensor, residual: str, window: int) -> torch.Tensor:
    """Per frequency pair, the real factor a_i that replaces the rotation exp(1j theta_i t) for key parts that
    lose their position: keep 1, drop 0, fade E[cos(theta_i t)] = sin(theta_i W) / (theta_i W) for t
    uniform over [0, W) (the least-squares constant: ~1 for slow pairs, ~0 for fast ones).  freqs: [D/2]."""
    if residual == "keep":
        return torch.ones_like(freqs, dtype=torch.float64)
    if residual == "drop":
        return torch.zeros_like(freqs, dtype=torch.float64)
    x = freqs.to(torch.float64) * window
    return torch.where(x > 0, torch.sin(x) / x.clamp_min(1e-300), torch.ones_like(x))


def convert_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    cov: torch.Tensor,
    s: MLAShape,
    freqs: torch.Tensor,
    options: MLAOptions | None = None,
    mean: torch.Tensor | None = None,
) -> MLALayer:
    """Convert one layer.  q: [H*D, n'] (any dtype, kept by the result), k, v: [Hkv*D, n'], o: [n, H*D] (o_proj
    weight), cov: [n', n'], freqs: [D/2] the source's rotary frequencies (radians per token), mean: [n'] E[x]
    (key_weight "output" needs it)."""
    options = options or MLAOptions()
    k, v, cov = (t.to(torch.float64) for t in (k, v, cov))  # q is read a head at a time
    d, hkv = s.head_dim, s.num_kv
    if options.center_keys and mean is None:
        raise ValueError("center_keys needs the calibration inputs' mean")
    mean = None if mean is None else mean.to(torch.float64)
    fit = _shrunk(cov, options)  # the metric the fits use
    spread = value_spread(v, o, cov, mean, s) if options.key_weight == "output" else None  # [H]
    q_gram = head_gram(q, s.num_heads, hkv, fit, spread)  # [Hkv, D, D]: sum over readers of (spread x) E[q q^T]
    if options.key_weight == "uniform":
        q_gram = torch.eye(d, dtype=torch.float64).expand(hkv, d, d).contiguous()
    pairs = s.pairs
    if options.rope_pairs == "rotation":
        pairs = chosen_pairs(rotation_cost(k, fit, q_gram, freqs, options.rotation_context), s.rope_dim // 2)
    rope, coef, fitted = rope_split(k, fit, s, q_gram, options.ridge, pairs)
    residual = k - fitted  # [Hkv*D, n']: position-free from here on
    fade = position_free_scale(freqs, options.residual, options.window).repeat(2)  # [D]: rows i and i + D/2
    nope_gram = q_gram * fade[:, None] * fade[None, :]  # E[q q^T] of the faded queries
    balance = 1.0 if options.key_balance is None else options.key_balance
    k_roots = _block_roots(nope_gram * (balance / d), options.ridge)
    if options.value_weight == "o_proj":
        v_roots = _block_roots(head_gram(o, s.num_heads, hkv), options.ridge)
    else:
        v_roots = torch.eye(hkv * d, dtype=torch.float64)
    key_cov, key_metric, key_rows = cov, fit, residual  # the keys' inputs' second moment, error metric, chosen rows
    if options.center_keys:
        key_cov = cov - torch.outer(mean, mean)  # [n', n'] the covariance of x
        key_metric = _shrunk(key_cov, options)
        key_rows = centered_rows(residual, fit, key_metric, options.ridge)
    roots = torch.block_diag(k_roots, v_roots)  # [2*Hkv*D, 2*Hkv*D]
    stacked = torch.cat([residual, v])  # [2*Hkv*D, n']
    chosen_on = torch.cat([key_rows, v]) if options.center_keys else None
    down, up, spectrum = factor_latent(stacked, fit, s.latent_rank, roots, options.ridge, chosen_on)
    if options.center_keys:  # the keys' read-out: least squares on centered inputs (any weighting gives the same)
        gram = regularize(key_metric, options.ridge)  # [n', n']
        up[: hkv * d] = torch.linalg.lstsq(down @ gram @ down.T, down @ gram @ residual.T, driver="gelsd").solution.T
    if mean is not None:  # the same latent, its mean in the first channel (3. above: bf16)
        down, up = mean_in_one_channel(down, up, mean)
    scale = torch.einsum("ri,ij,rj->r", down, cov, down).clamp_min(1e-300).sqrt()  # unit E[c_j^2] on the data
    down, up = down / scale[:, None], up * scale
    rec = up @ down  # [2*Hkv*D, n']
    k_rec = fitted + rec[: hkv * d]
    lost = k - fitted
    return MLALayer(
        q=q,
        fade=fade,
        coef=coef,
        down=down,
        up=_per_head_kv(up, hkv, d),
        rope=rope,
        k_err=relative_error(k, k_rec, key_cov),
        v_err=relative_error(v, rec[hkv * d :], cov),
        position_free=_weighted_fraction(lost, k, q_gram, cov),
        spectrum=spectrum,
        pairs=pairs,
    )


def mean_in_one_channel(down: torch.Tensor, up: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same latent in a basis whose first channel carries all of the channels' mean on the data (a Householder
    reflection H: down -> H down, up -> up H, so up @ down is unchanged): the others vary about 0, which keeps
    their variation when the latent is rounded (bf16).  down: [r, n'], up: [m, r], mean: [n'] E[x]."""
    means = down @ mean  # [r]
    size = means.norm()
    if size == 0:
        return down, up
    w = means.clone()
    w[0] += size if means[0] >= 0 else -size  # [r]: H means = -/+ |means| e_1 (no cancellation in w[0])
    h = torch.eye(len(w), dtype=down.dtype) - 2 * torch.outer(w, w) / (w @ w)  # [r, r], symmetric orthogonal
    return h @ down, up @ h


def _shrunk(cov: torch.Tensor, options: MLAOptions) -> torch.Tensor:
    """(1 - shrink) cov + shrink diag(cov), a new [n', n'] matrix (the identity when the fit is not whitened)."""
    if not options.whiten:
        return torch.eye(cov.shape[0], dtype=torch.float64)
    out = cov * (1 - options.shrink)
    out.diagonal().add_(cov.diagonal() * options.shrink)
    return out


def centered_rows(rows: torch.Tensor, metric: torch.Tensor, centered: torch.Tensor, ridge: float) -> torch.Tensor:
    """rows L M^(1/2) L^-1, L L^T = metric, M = L^-1 centered L^-T: rows whose energy under `metric` is the energy
    of `rows` under `centered` (so a fit whitened by `metric` weighs them as centered inputs would), with the same
    directions where `centered` and `metric` agree.  rows: [m, n'], metric, centered: [n', n'].  -> [m, n']"""
    lower = torch.linalg.cholesky(regularize(metric, ridge))  # [n', n']
    inner = torch.linalg.solve_triangular(lower, centered, upper=False)  # L^-1 C_c
    inner = torch.linalg.solve_triangular(lower, inner.T, upper=False)  # L^-1 C_c L^-T
    right = rows @ lower @ psd_sqrt((inner + inner.T) / 2, ridge)  # [m, n']: rows L M^(1/2)
    return torch.linalg.solve_triangular(lower.T, right.T, upper=True).T  # right L^-1


def value_spread(v: torch.Tensor, o: torch.Tensor, cov: torch.Tensor, mean: torch.Tensor, s: MLAShape) -> torch.Tensor:
    """[H]: E|O_h (v - E v)|^2 per query head h (o_proj's block of h times the values of its KV head, centered),
    what one nat of logit error moves the head's output: a logit perturbation d_j of the keys a query attends to
    (weights a_j) moves the output by sum_j a_j (d_j - mean d) O_h (v_j - mean v). Weighting each head's key error
    (E[q q^T] / D, a logit error) by it puts keys and values in the same units, the output's.
    v: [Hkv*D, n'], o: [n, H*D], cov: [n', n'] E[x x^T], mean: [n'] E[x]."""
    if mean is None:
        raise ValueError("key_weight 'output' needs the calibration inputs' mean")
    d, per = s.head_dim, s.num_heads // s.num_kv
    centered = cov - torch.outer(mean, mean)  # [n', n'] the covariance of x
    moved = v @ centered @ v.T  # [Hkv*D, Hkv*D]
    spread = torch.empty(s.num_heads, dtype=torch.float64)
    for h in range(s.num_heads):
        g = h // per
        block = o[:, h * d : (h + 1) * d].to(torch.float64)  # [n, D]
        spread[h] = torch.trace(block.T @ block @ moved[g * d : (g + 1) * d, g * d : (g + 1) * d])
    return spread


def _per_head_kv(up: torch.Tensor, hkv: int, d: int) -> torch.Tensor:
    """[K rows of all heads; V rows of all heads] -> per KV head [k (D); v (D)].  [2*Hkv*D, r] -> same shape."""
    k_up, v_up = up[: hkv * d].reshape(hkv, d, -1), up[hkv * d :].reshape(hkv, d, -1)
    return torch.cat([k_up, v_up], dim=1).reshape(2 * hkv * d, -1)


def _weighted_fraction(part: torch.Tensor, whole: torch.Tensor, q_gram: torch.Tensor, cov: torch.Tensor) -> float:
    """sum_rows w_row E|part_row x|^2 / sum_rows w_row E|whole_row x|^2, w = the readers' query energy per
    frequency pair (averaged over its two rows, as the rank-1 RoPE fit weights it, so this is <= 1)."""
    pair = _per_pair(q_gram.diagonal(dim1=1, dim2=2)) / 2  # [Hkv, D/2]
    weights = torch.cat([pair, pair], dim=1).reshape(-1)  # [Hkv*D]

    def energy(rows):
        return (weights * torch.einsum("ri,ij,rj->r", rows, cov, rows)).sum().item()

    total = energy(whole)
    return energy(part) / total if total > 0 else 0.0
