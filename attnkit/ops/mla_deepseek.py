"""Write a converted layer (attnkit.ops.mla.MLALayer) as stock transformers DeepseekV3 attention tensors.

Two routes. The engine route (engine_tensors, the default) writes no bias: input_layernorm's weight is
folded into the projections, the latent norm is handled by attnkit.ops.latent_norm, a source q bias rides
on the anchor a.u ~ 1, and the query goes through q_proj or, where llama.cpp needs it, an exact q_lora
path (q_a = identity on u, whose norm is fixed). The bias route (attention_tensors) below is exact in
transformers but needs bias tensors that llama.cpp, vLLM and SGLang have no slot for:

DeepseekV3Attention (transformers 5.x), with q_lora_rank None and attention_bias True:
  q = q_proj(x) per head [nope | rope];  [c | k_pe] = kv_a_proj_with_mqa(x) (+bias);
  c' = kv_a_layernorm(c) (RMSNorm, always applied; eps 1e-6); per head [k_nope | v] = kv_b_proj(c');
  logits = (q_nope.k_nope + rope(q_pe).rope(k_pe)) * (nope + P)^-0.5;  out = o_proj(attn @ v) (+bias).
attention_bias gives biases to kv_a_proj_with_mqa, o_proj and q_a_proj, never to q_proj or kv_b_proj.

The RMSNorm is made linear with one extra latent channel whose bias is a large constant M (weight 0):
then rms(c) ~= sqrt((M^2 + E|c|^2) / R), a known scale that kv_b_proj absorbs (relative error
(|c|^2 - E|c|^2) / (2 M^2), about 1e-8 for M = 4096 rms(c)); its norm weight is 0, so the cache holds a 0
there. A source q bias needs a query input with a constant: the q_lora path with the same trick
(q_a_proj = [I; 0] with bias [0; M_q], q_b_proj = the query rows and the bias as one more column).
"""

from __future__ import annotations

import math

import torch

from attnkit.ops.anchor import substitute_constant
from attnkit.ops.latent_norm import NormPlan, fold_gamma
from attnkit.ops.mla import MLALayer, MLAShape

#: The constant channel's value relative to the rms of what it dominates.
DOMINANCE = 4096.0
#: DeepseekV3RMSNorm's default epsilon (kv_a_layernorm and q_a_layernorm do not take rms_norm_eps).
NORM_EPS = 1e-6


def _pow2_at_least(x: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(x, 1e-30)))


def _pow2_near(x: float) -> float:
    return 2.0 ** round(math.log2(max(x, 1e-30)))


def _norm_plan(width: int, mean_sq: float) -> tuple[float, float, float]:
    """(constant M, norm weight w of the carried channels, read-out scale) for an RMSNorm over `width`
    channels, one of them the constant: carried channel j comes out as c_j * w / scale."""
    big = _pow2_at_least(DOMINANCE * math.sqrt(max(mean_sq, 1e-30)))
    rms = math.sqrt((big * big + mean_sq) / width + NORM_EPS)
    weight = _pow2_near(big / math.sqrt(width))
    return big, weight, rms / weight


def query_rows(layer: MLALayer, s: MLAShape, q_scale: float, dtype=torch.float64, on_rows=None) -> torch.Tensor:
    """Per head [nope (D) | rope (P)] query rows, times q_scale (softmax-scale fold) and mapped by on_rows (a map
    of float64 rows, e.g. onto u) when given, made a head at a time and stored in `dtype`.  [H*(D+P), n'']"""
    width = s.head_dim + s.rope_dim
    out = None
    for h in range(s.num_heads):
        rows = torch.cat(layer.query_head(h, s)) * q_scale  # [D+P, n']
        rows = rows if on_rows is None else on_rows(rows)
        if out is None:
            out = torch.empty(s.num_heads * width, rows.shape[1], dtype=dtype)
        out[h * width : (h + 1) * width] = rows
    return out


def kv_tensors(layer: MLALayer, s: MLAShape, augmented: bool) -> dict[str, torch.Tensor]:
    """kv_a_proj_with_mqa (weight, bias), kv_a_layernorm and kv_b_proj for latent rank r + 1 (norm channel)."""
    r, d, n = s.latent_rank, s.head_dim, layer.down.shape[1] - int(augmented)
    big, weight, readout = _norm_plan(r + 1, float(r))  # each latent channel has unit second moment
    const = torch.zeros(1, layer.down.shape[1], dtype=torch.float64)
    rows = torch.cat([layer.down, const, layer.rope])  # [r + 1 + P, n']
    bias = rows[:, n].clone() if augmented else torch.zeros(rows.shape[0], dtype=torch.float64)
    bias[r] = big
    norm = torch.full((r + 1,), weight, dtype=torch.float64)
    norm[r] = 0.0
    per_kv = layer.up.reshape(s.num_kv, 2 * d, r)  # [Hkv, 2D, r]
    per_q = per_kv.repeat_interleave(s.num_heads // s.num_kv, dim=0)  # [H, 2D, r]
    kv_b = torch.cat([per_q * readout, torch.zeros(s.num_heads, 2 * d, 1, dtype=torch.float64)], dim=2)
    return {
        "kv_a_proj_with_mqa.weight": rows[:, :n],
        "kv_a_proj_with_mqa.bias": bias,
        "kv_a_layernorm.weight": norm,
        "kv_b_proj.weight": kv_b.reshape(s.num_heads * 2 * d, r + 1),
    }


def q_lora_tensors(q: torch.Tensor, x_mean_sq: float) -> dict[str, torch.Tensor]:
    """q_a_proj / q_a_layernorm / q_b_proj reproducing q = W x + b (q: [m, n+1] = [W | b]) through the
    q_lora path of rank n + 1.  x_mean_sq: E|x|^2 of the attention input."""
    n = q.shape[1] - 1
    big, weight, readout = _norm_plan(n + 1, x_mean_sq)
    q_a = torch.cat([torch.eye(n, dtype=torch.float64), torch.zeros(1, n, dtype=torch.float64)])  # [n+1, n]
    q_a_bias = torch.zeros(n + 1, dtype=torch.float64)
    q_a_bias[n] = big
    norm = torch.full((n + 1,), weight, dtype=torch.float64)
    norm[n] = 1.0  # the constant comes out as M / rms: its column in q_b carries b * rms / M
    q_b = torch.cat([q[:, :n] * readout, q[:, n:] * (readout * weight / big)], dim=1)  # [m, n+1]
    return {"q_a_proj.weight": q_a, "q_a_proj.bias": q_a_bias, "q_a_layernorm.weight": norm, "q_b_proj.weight": q_b}


def attention_tensors(
    layer: MLALayer,
    s: MLAShape,
    *,
    q_scale: float,
    augmented: bool,
    q_bias: bool,
    o: torch.Tensor,
    o_bias: torch.Tensor | None,
    x_mean_sq: float,
) -> dict[str, torch.Tensor]:
    """All DeepseekV3Attention tensors of one layer (names relative to self_attn), float64."""
    q = query_rows(layer, s, q_scale)  # [H*(D+P), n']
    out = kv_tensors(layer, s, augmented)
    if q_bias:
        out.update(q_lora_tensors(q, x_mean_sq))
    else:
        out["q_proj.weight"] = q[:, : q.shape[1] - int(augmented)]
    out["o_proj.weight"] = o.to(torch.float64)
    out["o_proj.bias"] = torch.zeros(o.shape[0], dtype=torch.float64) if o_bias is None else o_bias.to(torch.float64)
    return out


def per_query_head(up: torch.Tensor, s: MLAShape) -> torch.Tensor:
    """Latent read-out rows per KV head [Hkv*2D, r] repeated for each query head that reads it.  -> [H*2D, r]"""
    per_kv = up.reshape(s.num_kv, 2 * s.head_dim, -1)  # [Hkv, 2D, r]
    return per_kv.repeat_interleave(s.num_heads // s.num_kv, dim=0).reshape(s.num_heads * 2 * s.head_dim, -1)


def q_lora_readout(u: torch.Tensor, eps: float) -> float:
    """Scale that undoes q_a_layernorm on the fixed-norm input u [N, n] (identity q_a): 1 / E-fit of the
    per-token gain 1 / sqrt(mean(u^2) + eps), ~1 up to input_layernorm's eps."""
    from attnkit.ops.anchor import scale_error

    s, _ = scale_error(torch.rsqrt(u.pow(2).mean(-1) + eps))
    return s


def engine_tensors(
    layer: MLALayer,
    plan: NormPlan,
    s: MLAShape,
    *,
    gamma: torch.Tensor,
    anchor: torch.Tensor,
    q_scale: float,
    q_lora_scale: float | None,
    o: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """All DeepseekV3Attention tensors of one layer without biases (names relative to self_attn): the query rows
    made a head at a time in `dtype`, o_proj's weight `o` as given, the others float64.

    Rows act on u = x / gamma (input_layernorm written with weight 1); plan: the latent (attnkit.ops.latent_norm);
    q_lora_scale: None for a plain q_proj, else the q_lora read-out scale (q_a = identity on u)."""

    def on_u(rows):  # rows on x or [x; 1] -> rows on u, a constant column replaced by the anchor
        return substitute_constant(fold_gamma(rows, gamma), anchor)

    out: dict[str, torch.Tensor] = {}
    if q_lora_scale is None:
        out["q_proj.weight"] = query_rows(layer, s, q_scale, dtype, on_u)  # [H*(D+P), n]
    else:
        q = query_rows(layer, s, q_scale, dtype, lambda rows: on_u(rows) * q_lora_scale)  # [H*(D+P), n]
        n = q.shape[1]
        out.update(
            {
                "q_a_proj.weight": torch.eye(n, dtype=torch.float64),
                "q_a_layernorm.weight": torch.ones(n, dtype=torch.float64),
                "q_b_proj.weight": q,
            }
        )
    out["kv_a_proj_with_mqa.weight"] = torch.cat([plan.rows, on_u(layer.rope)])  # [R + P, n]
    out["kv_a_layernorm.weight"] = plan.norm_weight
    out["kv_b_proj.weight"] = per_query_head(layer.up, s) @ plan.readout.T  # [H*2D, R]
    out["o_proj.weight"] = o
    return out
