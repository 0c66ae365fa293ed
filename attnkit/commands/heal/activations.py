"""What one decoder layer of a model keeps for the backward pass, per token: measured by running one layer of
the model's own transformers code on the meta device (shapes only: no weights, no memory) under saved-tensor
hooks, at two window lengths.

The count is of distinct storages the layer saves, its parameters left out. It grows as b T + c T^2 with the
window T. The layer's attention runs the CPU's fused SDPA kernel (`fused_on_meta`: torch's sdpa would take the
math path on meta), values padded as attnkit.runtime.padded_attention pads them, so it saves what the real
kernel saves; probabilities, where an eager attention keeps them, heal's memory plan counts apart
(memory.keeps_scores). `per_token` returns b.
"""

from __future__ import annotations

import inspect

#: Name of `fused_on_meta` in transformers' AttentionInterface (with sdpa's mask).
META_ATTN = "attnkit_meta_fused"
#: Window lengths of the two meta runs (any two give b and c; short keeps the run cheap).
LENGTHS = (64, 128)


def per_token(config: dict) -> int | None:
    """Bytes (fp32) one decoder layer of `config`'s architecture keeps per token for the backward pass; None
    where the architecture does not build or run on the meta device (the caller estimates instead)."""
    try:
        layer, rotary, layer_type = _one_layer(config)
        s1, s2 = (_saved_bytes(layer, rotary, layer_type, t, int(config["hidden_size"])) for t in LENGTHS)
    except Exception:  # any family transformers cannot run shapes-only: the plan falls back to its estimate
        return None
    t = LENGTHS[0]  # s1 = b t + c t^2, s2 = 2 b t + 4 c t^2 (LENGTHS[1] = 2 t)
    return max(0, (4 * s1 - s2) // (2 * t))


def _one_layer(config: dict) -> tuple:
    """(decoder layer 0, the rotary embedding, layer 0's type) of a one-layer fp32 model built on meta."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "auto_map")}
    values["num_hidden_layers"] = 1
    if values.get("layer_types"):
        values["layer_types"] = values["layer_types"][:1]
    cfg = AutoConfig.for_model(config["model_type"], **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    _register()
    model.set_attn_implementation(META_ATTN)
    model.train()
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return inner.layers[0], getattr(inner, "rotary_emb", None), (values.get("layer_types") or [None])[0]


def _saved_bytes(layer, rotary, layer_type, seq_len: int, hidden: int) -> int:
    """Bytes of the distinct non-parameter storages `layer` saves for backward on a [1, seq_len] window."""
    import torch

    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    x = torch.empty(1, seq_len, hidden, device="meta", requires_grad=True)  # [1, T, h]
    positions = torch.arange(seq_len, device="meta")[None]  # [1, T]
    kwargs = {"attention_mask": None, "position_ids": positions}
    if rotary is not None:
        typed = "layer_type" in inspect.signature(rotary.forward).parameters
        kwargs["position_embeddings"] = rotary(x, positions, layer_type) if typed else rotary(x, positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(saved.values())


def fused_on_meta(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention through the CPU's fused kernel op (it runs on meta tensors), values zero-padded to the key
    width: what the CPU saves for the backward pass. query [B, H, T, Dk], key [B, Hkv, T, Dk], value
    [B, Hkv, T, Dv] -> (output [B, T, H, Dv], None)."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, T, D*]
    width = value.shape[-1]
    value = F.pad(value, [0, key.shape[-1] - width])  # [B, H, T, Dk]
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scaling)
    return out[..., :width].transpose(1, 2), None  # [B, T, H, Dv]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(META_ATTN, fused_on_meta)
    AttentionMaskInterface.register(META_ATTN, sdpa_mask)
