"""Per-layer fits of the gqa merge that need the layer's calibration activations: the attention-weighted key
metric and the o_proj refit against the source attention output (attnkit.ops.attnweight's reference attention)."""

from __future__ import annotations

from attnkit.ops.attnweight import causal_attention, key_token_weights, weighted_group_covariance
from attnkit.ops.gqa import expand_layer, unfused
from attnkit.ops.orefit import refit_o
from attnkit.runtime.calibrate import token_rows


def reference_attention_ok(spec, layer: int, rope, scaling, sinks: bool) -> bool:
    """Whether attnkit.ops.attnweight's reference causal attention (a sliding layer's window included) equals
    this layer's: no QK-norm, soft-capping or attention sinks, and rotate-half RoPE tables covering the rotary
    dims."""
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    return (
        spec.qk_norm == "none"
        and spec.attn_softcap is None
        and not sinks
        and rope is not None
        and scaling is not None
        and rope[0].shape[-1] == rotary - rotary % 2
    )


def _project(x, flat: dict, role: str, head_dim: int):
    """x [B, T, n] through the `role` projection (+ bias), split into heads -> [B, T, heads, D] float32."""
    import torch

    out = x @ flat[role].to(torch.float32).T
    if f"{role}_bias" in flat:
        out = out + flat[f"{role}_bias"].to(torch.float32)
    return out.reshape(*x.shape[:2], -1, head_dim)


def attention_key_covariance(weights: dict, hidden, rope, scaling: float, shape, augment: bool, window=None):
    """Per-group key metric, tokens weighted by the layer's own attention (attnkit.ops.attnweight; window: a
    sliding layer's).  -> [G, n', n']"""
    import torch

    flat = unfused(weights, shape)
    x = hidden.detach().to(device="cpu", dtype=torch.float32)  # [B, T, n]
    cos, sin = (r.detach().to(device="cpu", dtype=torch.float32) for r in rope)  # [B, T, R]
    w = key_token_weights(
        _project(x, flat, "q", shape.head_dim), _project(x, flat, "k", shape.head_dim), cos, sin, scaling, window
    )  # [Hkv, B*T]
    return weighted_group_covariance(token_rows(hidden, augment), w, shape.groups)


def refit_output(weights: dict, converted: dict, hidden, rope, scaling: float, shape, ridge: float, window=None):
    """o_proj refit so the converted layer's attention output matches the source's on these tokens.
    converted: apply_plan's tensors (its o_proj, the fold, is the prior); window: a sliding layer's.
    -> [hidden, H*D] float64"""
    import torch

    x = hidden.detach().to(device="cpu", dtype=torch.float32)  # [B, T, n]
    cos, sin = (r.detach().to(device="cpu", dtype=torch.float32) for r in rope)

    def outputs(layer: dict):  # attention output before o_proj, [B*T, H*D]
        flat = unfused(layer, shape)
        qkv = (_project(x, flat, r, shape.head_dim) for r in ("q", "k", "v"))
        z = causal_attention(*qkv, cos, sin, scaling, window)  # [B, T, H*D]
        return z.reshape(-1, z.shape[-1])

    new = unfused({**weights, **expand_layer(converted, shape)}, shape)
    return refit_o(outputs(new), outputs(weights), unfused(weights, shape)["o"], new["o"], ridge)
