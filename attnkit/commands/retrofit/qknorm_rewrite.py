"""The tensor rewrites of `retrofit qknorm` (rewrite(name, tensor) for attnkit.commands.retrofit.common.stream_weights):
per layer the q/k/v/o changes of the method, the biases and q_norm/k_norm weights Qwen3 needs and the source lacks."""

from __future__ import annotations

from attnkit.commands.retrofit.qknorm_fit import AnchorFit
from attnkit.commands.retrofit.qknorm_target import qwen3_name
from attnkit.errors import AttnkitError
from attnkit.ops.anchor import fold_o_bias, substitute_constant
from attnkit.ops.qknorm import (
    anchor_norm_weight,
    anchor_slots,
    pad_columns,
    pad_norm_weight,
    pad_rows,
    slot_norm_weight,
    widen_columns,
    widen_rows,
)


def read_biases(src, reader_get) -> dict:
    """(layer, role) -> bias [out] for every q/k/v/o bias, and (layer, "o_weight") where o_proj has a bias."""
    out = {}
    for i in range(src.spec.num_layers):
        for role in ("q", "k", "v", "o"):
            name = src.tensor(f"{role}_bias", i)
            if name:
                out[(i, role)] = reader_get(name)
        if (i, "o") in out:
            out[(i, "o_weight")] = reader_get(src.tensor("o", i))
    return out


def _attention_roles(src) -> dict:
    """Tensor name -> (layer, role) for every attention weight and bias the source has."""
    roles = {}
    for i in range(src.spec.num_layers):
        for role in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"):
            name = src.tensor(role, i)
            if name:
                roles[name] = (i, role)
    return roles


def _value_bias(src, layer: int, biases: dict):
    """The layer's v bias (float64, or None) with o_proj's bias folded in (attention weights sum to 1, so a value
    bias reaches the output as o_proj of it), when o_proj's range holds it: engines read no o_proj bias."""
    import torch

    spec = src.spec
    bias = biases.get((layer, "v"))
    if (layer, "o") not in biases:
        return None if bias is None else bias.to(torch.float64)
    delta, residual = fold_o_bias(
        biases[(layer, "o_weight")], biases[(layer, "o")], spec.num_heads, spec.num_kv_heads, spec.head_dim
    )
    if residual > 1e-4:
        raise AttnkitError(f"{src.ref}: o_proj's bias is not in the range of o_proj; use --method pad")
    return delta if bias is None else bias.to(torch.float64) + delta


def _unbiased_rows(src, layer: int, role: str, t, biases: dict, anchor):
    """role's weight [rows, n] with its bias folded in as b a^T (the constant 1 ~ a.x); v takes o_proj's bias
    too (_value_bias)."""
    import torch

    w = t.to(torch.float64)
    bias = _value_bias(src, layer, biases) if role == "v" else biases.get((layer, role))
    if bias is None:
        return w
    return substitute_constant(torch.cat([w, bias.to(torch.float64)[:, None]], dim=1), anchor)


def anchor_rewriter(src, fits: list[AnchorFit], pads: list, biases: dict, new_dim: int):
    """rewrite(name, tensor) for the anchor method: no bias tensors; q/k rows get an anchor row and (new_dim > D)
    zero pad rows, v/o zero pad rows/columns, and q_norm/k_norm weights that are 0 on every pad."""
    import torch

    spec = src.spec
    h, hkv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    roles = _attention_roles(src)

    def rewrite(name, t):
        if name not in roles:
            return {name: t}
        i, role = roles[name]
        if role.endswith("_bias"):
            return {}  # folded into the weights (_unbiased_rows)
        fit = fits[i]
        slot, zero = anchor_slots(dim, new_dim, fit.dropped_pair)
        if role == "o":
            w = t.to(torch.float64)
            out = {name: (widen_columns(w, h, dim, new_dim) if new_dim > dim else w).to(t.dtype)}
            for which, pad, scale in (("q", pads[i][0], (new_dim / dim) ** 0.5), ("k", pads[i][1], 1.0)):
                g = anchor_norm_weight(new_dim, zero, pad, fit.gain, scale)
                out[qwen3_name(src, f"{which}_norm", i)] = g.to(t.dtype)
            return out
        heads = h if role == "q" else hkv
        w = _unbiased_rows(src, i, role, t, biases, fit.anchor)  # [heads * D, n]
        w = (widen_rows(w, heads, dim, new_dim) if new_dim > dim else w.clone()).view(heads, new_dim, -1)
        if role in ("q", "k"):
            w[:, zero] = 0.0
            w[:, slot] = (pads[i][0] if role == "q" else pads[i][1]) * fit.anchor
        return {name: w.reshape(heads * new_dim, -1).to(t.dtype)}

    return rewrite


def bias_rewriter(src, pairs: list[int], pads: list, biases: dict):
    """rewrite(name, tensor) for the bias method: head size D, every layer gives up its weakest RoPE pair
    (`pairs`), whose first dim carries the pad bias B through the q and k bias tensors (its rows zero); the v bias
    takes o_proj's (_value_bias), and o_proj's own bias is written zero (Qwen3's attention_bias has one; vLLM reads
    none); q_norm/k_norm are 0 on the pair (slot_norm_weight)."""
    import torch

    spec = src.spec
    h, hkv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    roles = _attention_roles(src)

    def rewrite(name, t):
        if name not in roles:
            return {name: t}
        i, role = roles[name]
        slot, zero = anchor_slots(dim, dim, pairs[i])
        if role.endswith("_bias"):
            return {}  # every bias of the layer is written with its o_proj weight (below)
        if role in ("q", "k"):
            w = t.clone().view(h if role == "q" else hkv, dim, -1)
            w[:, zero] = 0.0
            return {name: w.reshape(t.shape)}
        if role == "v":
            return {name: t}
        out = {name: t}
        for which, heads, pad in (("q", h, pads[i][0]), ("k", hkv, pads[i][1])):
            b = biases.get((i, which))
            b = torch.zeros(heads * dim, dtype=torch.float64) if b is None else b.to(torch.float64).clone()
            b = b.view(heads, dim)
            b[:, zero] = 0.0
            b[:, slot] = pad
            out[qwen3_name(src, f"{which}_bias", i)] = b.reshape(-1).to(t.dtype)
            out[qwen3_name(src, f"{which}_norm", i)] = slot_norm_weight(dim, zero, pad, eps).to(t.dtype)
        v = _value_bias(src, i, biases)
        out[qwen3_name(src, "v_bias", i)] = (torch.zeros(hkv * dim) if v is None else v).to(t.dtype)
        out[qwen3_name(src, "o_bias", i)] = torch.zeros(spec.hidden_size, dtype=t.dtype)
        return out

    return rewrite


def rewriter(src, method: str, fits: list | None, pads: list | None, bias: bool):
    """rewrite(name, tensor) for stream_weights: per-layer q/k/v/o changes, new biases and norm weights."""
    import torch

    spec = src.spec
    h, hkv, dim, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    roles = _attention_roles(src)

    def rewrite(name, t):
        if name not in roles:
            return {name: t}
        i, role = roles[name]
        heads = h if role in ("q", "q_bias", "o") else hkv
        out: dict = {}
        if method == "pad":
            b_q, b_k, _ = pads[i]
            fill = {"q_bias": b_q, "k_bias": b_k}.get(role, 0.0)
            out[name] = pad_columns(t, h, dim) if role == "o" else pad_rows(t, heads, dim, fill)
        elif role in ("q", "q_bias", "k", "k_bias"):
            a = (fits[i].a_q if role.startswith("q") else fits[i].a_k).reshape(-1)  # [heads * D]
            out[name] = (t.double() * (a[:, None] if t.dim() == 2 else a)).to(t.dtype)
        else:
            out[name] = t
        if role == "o":  # the last tensor of the layer: add what Qwen3 needs and the source lacks
            new_dim = dim + 2 if method == "pad" else dim
            if bias:
                for r, n_heads, fill in (
                    ("q", h, pads[i][0] if pads else 0.0),
                    ("k", hkv, pads[i][1] if pads else 0.0),
                    ("v", hkv, 0.0),
                ):
                    if not src.tensor(f"{r}_bias", i):
                        z = torch.zeros(n_heads * dim, dtype=t.dtype)
                        zero_bias = pad_rows(z, n_heads, dim, fill) if method == "pad" else z
                        out[qwen3_name(src, f"{r}_bias", i)] = zero_bias
                if not src.tensor("o_bias", i):
                    out[qwen3_name(src, "o_bias", i)] = torch.zeros(hidden, dtype=t.dtype)
            for which in ("q", "k"):
                if method == "pad":
                    b = pads[i][0] if which == "q" else pads[i][1]
                    g = pad_norm_weight(dim, b, eps, ((dim + 2) / dim) ** 0.5 if which == "q" else 1.0)
                else:
                    g = fits[i].g_q if which == "q" else fits[i].g_k
                assert g.shape == (new_dim,)
                out[qwen3_name(src, f"{which}_norm", i)] = g.to(t.dtype)
        return out

    return rewrite
