"""One layer of `convert mla`: its DeepseekV3 attention tensors from its source tensors and calibration inputs
(the bias route or the engine route's anchor/span latent, attnkit.ops.latent_norm), what the engine route folds
first (the input norm's scale, o_proj's bias, a per-head QK-norm's constants), and the o_proj refit that runs the
converted layer against the source's attention output."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from attnkit.errors import AttnkitError
from attnkit.ops.anchor import anchor_row, fold_o_bias, substitute_constant
from attnkit.ops.gqa import augmented_rows, is_biased, stored_rows
from attnkit.ops.latent_norm import anchor_plan, fold_gamma, span_plan
from attnkit.ops.mla import MLAOptions, MLAShape, convert_layer
from attnkit.ops.mla_deepseek import attention_tensors, engine_tensors, q_lora_readout
from attnkit.ops.mla_gemma3 import exact_qk_norm, plain_tensors
from attnkit.ops.orefit import refit_o
from attnkit.ops.qknorm_fold import fit_fold, folded_weights, mean_fold
from attnkit.runtime.attention import run_attention, source_attention_inputs, target_attention
from attnkit.runtime.calibrate import input_moments

if TYPE_CHECKING:
    from attnkit.commands.convert.mla_request import MLASource


def source_freqs(src: MLASource, layer: int):
    """The source layer's rotary frequencies [D/2] (radians per token), as its transformers class computes them
    (Gemma 3: the layer type's own rope parameters)."""
    rope = layer_rope(src, layer)
    per_type = rope is not src.rope  # rope parameters per layer type (Gemma 3): the init function picks by type
    return pair_frequencies(src.hf_config, rope, src.shape.head_dim, src.layer_types[layer] if per_type else None)


def pair_frequencies(hf_config, rope: dict, head_dim: int, layer_type: str | None = None):
    """Rotary frequencies [D/2] (radians per token, fastest first) of rope parameters `rope` (rope_type, rope_theta,
    scaling keys) at `head_dim`, as transformers computes them for the checkpoint whose transformers config is
    `hf_config` (not changed; `layer_type`: where its rope parameters are per layer type)."""
    import copy

    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope["rope_type"] == "default":
        return float(rope["rope_theta"]) ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cfg = copy.deepcopy(hf_config)
    cfg.head_dim = head_dim
    kwargs = {"layer_type": layer_type} if layer_type else {}
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", **kwargs)
    return inv_freq.to(torch.float64)


def layer_rope(src: MLASource, layer: int) -> dict:
    """The rope parameters of one source layer: the source's, or its layer type's where they are per type."""
    return src.rope[src.layer_types[layer]] if src.layer_types and src.layer_types[layer] in src.rope else src.rope


def input_gamma(src: MLASource, weight):
    """The scale input_layernorm applies (Gemma stores w and applies 1 + w), float64 [n]."""
    import torch

    gamma = weight.to(torch.float64) + src.arch.norm_offset
    if bool((gamma.abs() < 1e-12).any()):
        raise AttnkitError(
            f"{src.ref}: input_layernorm has zero weights, which cannot be folded into the "
            "projections; use --latent-norm bias (transformers only)"
        )
    return gamma


def fold_qk_norm(
    src: MLASource, weights: dict, hidden, rope, scaling, norm_eps: float, window: int | None = None
) -> tuple[dict, dict, object]:
    """(weights, plain weights, fold): without per-head QK-norm the weights as they are twice and no fold; with
    it, q_norm and k_norm as the scales they apply (offset + stored weight, float64 [D]), the weights with the
    norm replaced by constants fitted on this layer's inputs hidden [B, T, n] (attnkit.ops.qknorm_fold; window:
    the layer's sliding window), and the fold."""
    import torch

    if "q_norm" not in weights:
        return weights, weights, None
    if rope is None or scaling is None:
        raise AttnkitError("folding QK-norm needs the source's rotary embedding and softmax scale")
    gains = {role: weights[role].to(torch.float64) + src.arch.norm_offset for role in ("q_norm", "k_norm")}
    weights = {**weights, **gains}
    pair = (weights["q_norm"], weights["k_norm"])
    if src.target.exact_qk_norm:  # the layout applies the exact factors: the constants only set the scale
        fold = mean_fold(hidden, weights, norm_eps, src.shape.head_dim)
    else:
        fold = fit_fold(hidden, weights, pair, norm_eps, rope, scaling, src.shape.head_dim, window)
    return weights, folded_weights(weights, fold, pair, src.shape.head_dim), fold


def fold_row(fold) -> dict:
    """A layer's QK-norm fold in its report row (attnkit.ops.qknorm_fold)."""
    return {
        "qk_norm_fold_kl": float(fold.kl.mean()),
        "qk_norm_c_q": fold.c_q.tolist(),
        "qk_norm_c_k": fold.c_k.tolist(),
        "qk_norm_dropped_pairs": int(fold.dropped.sum()) // 2,
        "qk_norm_rms_spread": [fold.spread_q, fold.spread_k],
    }


def fit_layer(
    options: MLAOptions, src: MLASource, layer: int, reader, inputs: tuple, config, device, dtype
) -> tuple[dict, dict, object]:
    """(tensors under the attention module's own names in `dtype`, report row, the input scale the converted layer
    runs its input at or None) of converting `layer` of `src` at its own shape (src.for_layer) from its source
    tensors (`reader`) and its calibration inputs (`inputs`: hidden [B, T, n], the rotary embedding, the softmax
    scale, the source layer's sliding window); the RoPE pairs chosen go into config.rope_pairs."""
    import torch

    from attnkit.commands.convert.mla_request import layer_options

    hidden, rope, scaling, window = inputs
    weights = {role: reader.get(name) for role, name in src.layer_names[layer].items()}
    gamma = scale = None
    if src.route.folds_input_norm:  # the engine route: no o_proj bias, the input norm folded in
        weights = without_o_bias(src, weights)
        gamma = input_gamma(src, reader.get(src.tensor("input_norm", layer)))
        scale = (1.0 / gamma).to(torch.float32)
    weights, plain, fold = fold_qk_norm(src, weights, hidden, rope, scaling, config.rms_norm_eps, window)
    own = src.for_layer(layer)  # at the layer's own shape where it has one
    tensors, row = convert_one(
        own,
        plain,
        hidden,
        gamma,
        source_freqs(src, layer),
        layer_options(options, src.target, window),
        dtype,
        src.route.latent_norm,
        config.rms_norm_eps,
        scaling,
    )
    if src.target.exact_qk_norm:
        tensors = exact_qk_norm(tensors, weights, fold, own.shape)
        row |= {"qk_norm": "exact", "qk_norm_rms_spread": [fold.spread_q, fold.spread_k]}
    elif fold is not None:
        row |= fold_row(fold)
    if own is not src:
        row["shape"] = [own.rank, own.shape.rope_dim]
    if "rope_pairs" in row:  # the layout turns each layer's RoPE key at the pairs chosen for it
        config.rope_pairs[layer] = row["rope_pairs"]
    if options.o_refit > 0:
        tensors["o_proj.weight"] = refit_o_proj(
            config,
            layer,
            tensors,
            weights,
            hidden,
            rope,
            scaling,
            own.shape,
            options.o_refit,
            device,
            scale,
            norm_eps=config.rms_norm_eps,
            window=window,
        )
    return tensors, row, scale


def convert_one(
    src: MLASource,
    weights: dict,
    hidden,
    gamma,
    freqs,
    options: MLAOptions,
    dtype,
    latent_norm: str,
    norm_eps: float,
    scaling: float | None = None,
) -> tuple[dict, dict]:
    """(DeepseekV3 attention tensors of one layer in `dtype`, report row) from its source tensors and the
    calibration inputs hidden [B, T, n] of its attention (gamma: input_layernorm's scale, for the engine route;
    scaling: the source's softmax scale, D^-1/2 when not given)."""

    s, augmented = src.shape, is_biased(weights)
    cov, mean = input_moments(hidden, augmented)  # [n(+1), n(+1)], [n(+1)]
    source_scale = s.head_dim**-0.5 if scaling is None else scaling
    q_scale = source_scale * math.sqrt(s.head_dim + s.rope_dim)  # softmax-scale fold: source's -> (D + P)^-1/2
    if latent_norm == "none":  # attnkit.ops.mla_gemma3: rows on the layer input, a latent without norm
        tensors, row = plain_tensors(weights, (cov, mean), s, freqs, options, q_scale)
    elif latent_norm == "bias":
        q, k, v = (augmented_rows(weights, r, augmented) for r in ("q", "k", "v"))
        layer = convert_layer(q, k, v, weights["o"], cov, s, freqs, options, mean)
        n = src.spec.hidden_size
        tensors = attention_tensors(
            layer,
            s,
            q_scale=q_scale,
            augmented=augmented,
            q_bias=src.q_lora,
            o=weights["o"],
            o_bias=weights.get("o_bias"),
            x_mean_sq=float(cov[:n, :n].diagonal().sum()),
        )
        row = {
            "k_err": layer.k_err,
            "v_err": layer.v_err,
            "position_free": layer.position_free,
            "latent_norm": "bias",
            "norm_error": 0.0,
        }
    else:
        tensors, row = _engine_layer(
            src, weights, hidden, (cov, mean), gamma, freqs, options, latent_norm, norm_eps, q_scale, dtype
        )
    return {name: t.to(dtype) for name, t in tensors.items()}, row


def _engine_layer(
    src: MLASource,
    weights: dict,
    hidden,
    moments: tuple,
    gamma,
    freqs,
    options: MLAOptions,
    latent_norm: str,
    norm_eps: float,
    q_scale: float,
    dtype,
) -> tuple[dict, dict]:
    """One layer by the engine route: factor at the ranks the anchor and span latents need, keep the latent
    (attnkit.ops.latent_norm) that leaves the smaller error on the calibration tokens, write it without biases.
    `moments`: (E[x x^T], E[x]) of the calibration inputs."""
    import dataclasses

    import torch

    cov, mean = moments
    s, augmented, rank = src.shape, is_biased(weights), src.rank
    shape = dataclasses.replace(s, rope_dim=min(s.rope_dim, s.head_dim))  # wider RoPE keys are padded below
    u = hidden.detach().reshape(-1, hidden.shape[-1]).to(device="cpu", dtype=torch.float64) / gamma  # [N, n]
    anchor = anchor_row(u)
    q = stored_rows(weights, "q", augmented)  # read a head at a time
    k, v = (augmented_rows(weights, r, augmented) for r in ("k", "v"))
    full = min(2 * s.num_kv * s.head_dim, cov.shape[0])  # rank of the stacked keys and values
    candidates = []
    for kind in ("anchor", "span") if latent_norm == "auto" else (latent_norm,):
        info_rank = min(rank - 1 if kind == "anchor" else rank, full)
        layer = convert_layer(
            q, k, v, weights["o"], cov, dataclasses.replace(shape, latent_rank=info_rank), freqs, options, mean
        )
        info = substitute_constant(fold_gamma(layer.down, gamma), anchor)  # [r, n] on u
        plan = anchor_plan(info, anchor, u, rank, norm_eps) if kind == "anchor" else span_plan(info, u, rank, norm_eps)
        lost = layer.truncation_error(info_rank)
        candidates.append((lost + (1 - lost) * plan.scale_error, layer, plan))
    total, layer, plan = min(candidates, key=lambda c: c[0])
    if s.rope_dim > shape.rope_dim:
        layer = _pad_rope(layer, shape, s.rope_dim)
    q_lora_scale = q_lora_readout(u, norm_eps) if src.q_lora else None
    tensors = engine_tensors(
        layer,
        plan,
        s,
        gamma=gamma,
        anchor=anchor,
        q_scale=q_scale,
        q_lora_scale=q_lora_scale,
        o=weights["o"],
        dtype=dtype,
    )
    row = {
        "k_err": layer.k_err,
        "v_err": layer.v_err,
        "position_free": layer.position_free,
        "latent_norm": plan.kind,
        "norm_error": math.sqrt(plan.scale_error),
    }
    return tensors, row


def without_o_bias(src: MLASource, weights: dict) -> dict:
    """The layer's tensors with o_proj's bias moved onto the value bias (attention weights sum to 1, so a value
    bias reaches the output as o_proj of it): same outputs, no o_proj bias for the engine route."""
    import torch

    if "o_bias" not in weights:
        return weights
    delta, residual = fold_o_bias(
        weights["o"], weights["o_bias"], src.shape.num_heads, src.shape.num_kv, src.shape.head_dim
    )
    if residual > 1e-4:
        raise AttnkitError(
            f"{src.ref}: o_proj's bias is not in the range of o_proj (residual "
            f"{residual:.2g}); use --latent-norm bias (transformers only)"
        )
    base = weights["v_bias"].to(torch.float64) if "v_bias" in weights else torch.zeros_like(delta)
    return {**{k: w for k, w in weights.items() if k != "o_bias"}, "v_bias": base + delta}


def _pad_rope(layer, shape: MLAShape, rope_dim: int):
    """The layer with its RoPE key rows padded by zero pairs from shape.rope_dim to rope_dim (slower frequencies
    that the source does not have; MLALayer.query_head pads the query rows to the shape it is given)."""
    import dataclasses

    import torch

    extra = rope_dim - shape.rope_dim
    rope = torch.cat([layer.rope, torch.zeros(extra, layer.rope.shape[1], dtype=layer.rope.dtype)])
    return dataclasses.replace(layer, rope=rope)


def refit_o_proj(
    config,
    layer: int,
    tensors: dict,
    weights: dict,
    hidden,
    rope,
    scaling,
    s: MLAShape,
    ridge: float,
    device,
    input_scale=None,
    norm_eps: float = 1e-6,
    window: int | None = None,
):
    """o_proj refit (attnkit.ops.orefit) so the converted layer's output matches the source's on these tokens
    (the converted layer runs on hidden * input_scale when given; a source with QK-norm carries its gains as
    q_norm and k_norm in weights; window: the source layer's sliding window)."""
    if rope is None or scaling is None:
        raise AttnkitError("o_proj refit needs the source's rotary embedding and softmax scale")
    attn, rotary = target_attention(config, layer, tensors, device)
    x = hidden.detach().to(device).float()
    _, z_new = run_attention(attn, rotary, x if input_scale is None else x * input_scale.to(x))
    del attn  # its float32 weights (0.75 GiB at a 70B width) are not needed for the fit
    z_old = source_attention_inputs(weights, hidden.to(device), rope, scaling, s, norm_eps, window)
    o = weights["o"]
    return refit_o(z_new.cpu(), z_old.cpu(), o, o, ridge).to(tensors["o_proj.weight"].dtype)
