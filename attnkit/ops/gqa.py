"""One attention layer from Hkv to G KV heads: plan the new K/V heads, then rewrite the layer's tensors.

A layer is a dict role -> tensor with the roles of attnkit/archs (q, k, v, o, q_bias, k_bias,
v_bias, o_bias, q_norm, k_norm, or fused qkv). Biases are handled by augmenting the input with a
constant 1: a projection with bias is the row stack [W | b] acting on [x; 1], so pooling and the
calibrated merge treat the bias as one more input column (exact where the weights are).
"""

from __future__ import annotations

from dataclasses import dataclass

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
from attnkit.ops.whiten import relative_error

METHODS = ("mean", "first", "merge")
#: How the merge weighs value and key errors (MergeOptions.value_weight, key_weight).
VALUE_WEIGHTS = ("o_proj", "none")
KEY_WEIGHTS = ("query", "uniform", "attention")
#: Layer roles a conversion rewrites (o_bias, q_norm and a per-head k_norm pass through).
KV_ROLES = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "qkv", "k_norm")


@dataclass(frozen=True)
class LayerShape:
    num_heads: int  # H
    num_kv: int  # Hkv (source)
    groups: int  # G (target)
    head_dim: int  # D
    rotary_dim: int  # R <= D (partial rotary: the first R dims of a head rotate)
    qk_norm: str  # none | per_head | full

    @property
    def ratio(self) -> int:
        return self.num_kv // self.groups


@dataclass
class MergeOptions:
    """Ablation knobs of the calibrated merge (defaults are the best measured; see docs/convert-gqa.md)."""

    value_weight: str = "o_proj"  # none | o_proj: measure value error after each head's o_proj read-out
    key_weight: str = "attention"  # uniform | query | attention (query, plus tokens weighted by attention received)
    ridge: float = 1e-6
    o_refit: float | None = 0.1  # ridge of the o_proj refit to the source attention output (None/0: no refit)


@dataclass
class LayerPlan:
    """New K/V rows per group (inputs augmented with 1 when biased) and the folds into q/o.

    k, v: [G*D, n(+1)] float64; coef: [Hkv, R/2] complex (query pairs times conj); k_mix: [Hkv, D-R, D-R]
    for non-rotary key dims; v_mix: [Hkv, D, D] folded into o_proj; k_norm: pooled full-width norm weight.
    """

    key_path: str
    value_path: str
    k: torch.Tensor
    v: torch.Tensor
    coef: torch.Tensor | None = None
    k_mix: torch.Tensor | None = None
    v_mix: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    k_err: float | None = None
    v_err: float | None = None


def split_fused(qkv: torch.Tensor, s: LayerShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [q | k | v] of a fused qkv_proj (Phi-3).  [(H+2Hkv)*D, ...] -> q, k, v."""
    q_rows, kv_rows = s.num_heads * s.head_dim, s.num_kv * s.head_dim
    return qkv[:q_rows], qkv[q_rows : q_rows + kv_rows], qkv[q_rows + kv_rows :]


def augmented_rows(layer: dict, role: str, augment: bool) -> torch.Tensor:
    """Weight rows of `role` as float64, with the bias (or zeros) as a last column when augmenting.  [out, n(+1)]"""
    w = layer[role].to(torch.float64)
    if not augment:
        return w
    bias = layer.get(f"{role}_bias")
    col = torch.zeros(w.shape[0], 1, dtype=torch.float64) if bias is None else bias.to(torch.float64)[:, None]
    return torch.cat([w, col], dim=1)


def stored_rows(layer: dict, role: str, augment: bool) -> torch.Tensor:
    """Weight rows of `role` as stored, for consumers that widen them a head at a time; augmented_rows' float64
    rows with the bias column when augmenting.  [out, n(+1)]"""
    return augmented_rows(layer, role, augment) if augment else layer[role]


def unfused(layer: dict, s: LayerShape) -> dict:
    """The layer with a fused qkv split into q, k, v roles (other layers unchanged)."""
    if "qkv" not in layer:
        return layer
    out = {k: v for k, v in layer.items() if k not in ("qkv", "qkv_bias")}
    out["q"], out["k"], out["v"] = split_fused(layer["qkv"], s)
    if "qkv_bias" in layer:
        out["q_bias"], out["k_bias"], out["v_bias"] = split_fused(layer["qkv_bias"], s)
    return out


def is_biased(layer: dict) -> bool:
    return any(r in layer for r in ("q_bias", "k_bias", "v_bias", "qkv_bias"))


def plan_layer(
    layer: dict,
    s: LayerShape,
    method: str,
    cov: torch.Tensor | None = None,
    options: MergeOptions | None = None,
    key_cov: torch.Tensor | None = None,
) -> LayerPlan:
    """Choose the new K/V heads of one layer.

    cov: E[x x^T] of the attention input (augmented [x; 1] when the layer has q/k/v biases), used by
    `merge` and for the reported errors; without it errors are measured on the weights (cov = I).
    key_cov: per-group key metric [G, n', n'] (attention-weighted tokens) replacing cov for the keys.
    QK-norm layers cannot fold key coefficients through the norm: their keys fall back to mean.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}")
    if method == "merge" and cov is None:
        raise ValueError("the merge method needs calibration statistics")
    options = options or MergeOptions()
    layer = unfused(layer, s)
    augment = is_biased(layer)
    k, v = augmented_rows(layer, "k", augment), augmented_rows(layer, "v", augment)  # [Hkv*D, n']
    basis = None if cov is None else cov.to(torch.float64)  # None: errors on the weights (identity metric)
    pool = "first" if method == "first" else "mean"
    k_norm = layer.get("k_norm") if s.qk_norm == "full" else None
    plan = LayerPlan(
        key_path=pool,
        value_path=pool,
        k=pool_heads(k, s.num_kv, s.groups, pool),
        v=pool_heads(v, s.num_kv, s.groups, pool),
        k_norm=None if k_norm is None else pool_heads(k_norm, s.num_kv, s.groups, pool),
    )
    k_rec, v_rec = expand_heads(plan.k, s.groups, s.ratio), expand_heads(plan.v, s.groups, s.ratio)
    if method == "merge":
        o_gram = head_gram(layer["o"], s.num_heads, s.num_kv) if options.value_weight == "o_proj" else None
        vm = merge_rows(v, basis, s.num_kv, s.groups, o_gram, options.ridge)
        plan.v, plan.v_mix, plan.value_path, v_rec = vm.shared, vm.mix, "merge", vm.reconstruction()
        if s.qk_norm == "none":
            q_rows = stored_rows(layer, "q", augment)  # [H*D, n']
            q_gram = head_gram(q_rows, s.num_heads, s.num_kv, basis)
            if options.key_weight == "uniform":
                q_gram = torch.eye(s.head_dim, dtype=torch.float64).expand(s.num_kv, -1, -1)
            km = merge_keys(
                k, basis if key_cov is None else key_cov, s.num_kv, s.groups, q_gram, s.rotary_dim, options.ridge
            )
            plan.k, plan.coef, plan.key_path, k_rec = km.shared, km.coef, "merge", km.reconstruction()
            plan.k_mix = None if km.rest is None else km.rest.mix
        else:
            plan.key_path = "mean (qk-norm)"
    plan.k_err = relative_error(k, k_rec, basis)
    plan.v_err = relative_error(v, v_rec, basis)
    return plan


def apply_plan(layer: dict, plan: LayerPlan, s: LayerShape) -> dict:
    """The tensors the conversion changes, each in its source dtype (roles as in the source; a role
    missing from the result, e.g. q and o under mean pooling, is copied through unchanged). Each is cast as soon
    as it is computed, so one float64 [H*D, n] matrix is live at a time."""
    fused = "qkv" in layer
    flat = unfused(layer, s)
    augment = is_biased(flat)
    out = {}

    def put(role: str, rows: torch.Tensor) -> None:  # rows [out, n(+1)] -> role (and its bias), source dtype
        out[role] = (rows[:, :-1] if augment else rows).to(flat[role].dtype)
        if f"{role}_bias" in flat:
            out[f"{role}_bias"] = rows[:, -1].to(flat[f"{role}_bias"].dtype)

    put("k", plan.k)
    put("v", plan.v)
    if fused or plan.coef is not None or plan.k_mix is not None:
        q = stored_rows(flat, "q", augment)  # [H*D, n(+1)]
        if plan.coef is not None:
            q = fold_coef_into_q(q, plan.coef, s.num_heads, s.head_dim)
        if plan.k_mix is not None:
            q = fold_mix_into_q(q, plan.k_mix, s.num_heads, slice(s.rotary_dim, s.head_dim))
        put("q", q)
        del q
    if plan.v_mix is not None:
        out["o"] = fold_mix_into_o(flat["o"], plan.v_mix, s.num_heads).to(flat["o"].dtype)
    if plan.k_norm is not None:
        out["k_norm"] = plan.k_norm.to(flat["k_norm"].dtype)
    if fused:
        out["qkv"] = torch.cat([out.pop("q"), out.pop("k"), out.pop("v")])
        if "qkv_bias" in layer:
            out["qkv_bias"] = torch.cat([out.pop("q_bias"), out.pop("k_bias"), out.pop("v_bias")])
    return out


def expand_layer(converted: dict, s: LayerShape) -> dict:
    """Converted tensors with every group's K/V head repeated Hkv/G times: the same function at the
    source's shapes (what repeat_kv computes), for running the converted layer in the source model."""
    out = dict(converted)
    if "qkv" in converted:
        q, k, v = converted["qkv"].split([s.num_heads * s.head_dim, s.groups * s.head_dim, s.groups * s.head_dim])
        out["qkv"] = torch.cat([q, expand_heads(k, s.groups, s.ratio), expand_heads(v, s.groups, s.ratio)])
    for role in ("k", "v", "k_bias", "v_bias"):
        if role in converted:
            out[role] = expand_heads(converted[role], s.groups, s.ratio)
    if "k_norm" in converted and s.qk_norm == "full":
        out["k_norm"] = expand_heads(converted["k_norm"], s.groups, s.ratio)
    return out
