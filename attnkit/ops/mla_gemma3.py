"""Write a converted layer (attnkit.ops.mla) as the attention tensors of attnkit's Gemma 3 MLA layout
(attnkit.modeling.gemma3_mla): a latent without norm on the layer's input, and Gemma's per-head QK-norm kept exact
(the layer takes each head's RMS factors of the source's own query and key projections, per token).

Beside attnkit.ops.mla_deepseek, which writes the stock DeepseekV3 layout the engines serve."""

from __future__ import annotations

import dataclasses

import torch

from attnkit.ops.gqa import augmented_rows, stored_rows
from attnkit.ops.mla import MLAOptions, MLAShape, convert_layer
from attnkit.ops.mla_deepseek import per_query_head, query_rows


def plain_tensors(
    weights: dict, moments: tuple, s: MLAShape, freqs, options: MLAOptions, q_scale: float
) -> tuple[dict, dict]:
    """(tensors, report row) of one layer for a latent without norm: R latent rows on the layer's input (zero rows
    past the rank of the keys and values), the RoPE key, the read-out and the query rows. `moments`: (E[x x^T],
    E[x]) of the calibration inputs; `weights`: the source layer's tensors by role."""
    cov, mean = moments
    q, k, v = stored_rows(weights, "q", False), augmented_rows(weights, "k", False), augmented_rows(weights, "v", False)
    info = min(s.latent_rank, 2 * s.num_kv * s.head_dim, cov.shape[0])
    layer = convert_layer(q, k, v, weights["o"], cov, dataclasses.replace(s, latent_rank=info), freqs, options, mean)
    pad = s.latent_rank - info
    down = torch.cat([layer.down, layer.down.new_zeros(pad, layer.down.shape[1])])  # [R, n]
    up = torch.cat([layer.up, layer.up.new_zeros(layer.up.shape[0], pad)], dim=1)  # [Hkv*2D, R]
    tensors = {
        "q_proj.weight": query_rows(layer, s, q_scale),  # [H*(D+P), n]
        "kv_a_proj_with_mqa.weight": torch.cat([down, layer.rope]),  # [R + P, n]
        "kv_b_proj.weight": per_query_head(up, s),  # [H*2D, R]
        "o_proj.weight": weights["o"],
    }
    row = {"k_err": layer.k_err, "v_err": layer.v_err, "position_free": layer.position_free, "latent_norm": "none"}
    row["rope_pairs"] = layer.pairs
    return tensors, row


def exact_qk_norm(tensors: dict, source: dict, fold, s: MLAShape) -> dict:
    """The tensors of the layout's exact QK-norm: q_rms_proj and k_rms_proj are the source's W_q and W_k (the layer
    takes 1 / RMS of each head of them, per token), and each query head's rows are divided by its constant c_q and
    its KV group's c_k (the latent was fitted to keys and queries times those constants: attnkit.ops.qknorm_fold)."""
    group = s.num_heads // s.num_kv
    per_head = fold.c_q * fold.c_k.repeat_interleave(group)  # [H]
    q = tensors["q_proj.weight"].to(torch.float64)
    q = (q.reshape(s.num_heads, -1, q.shape[1]) / per_head[:, None, None]).reshape(q.shape)
    dtype = tensors["o_proj.weight"].dtype
    return {**tensors, "q_proj.weight": q.to(dtype), "q_rms_proj.weight": source["q"], "k_rms_proj.weight": source["k"]}
