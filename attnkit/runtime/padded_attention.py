"""SDPA for attention whose values are narrower than its queries and keys (MLA: qk_nope + qk_rope wide keys,
v_head_dim wide values), fused on the CPU too.

torch's CPU SDPA takes its fused (flash) kernel only when queries, keys and values are equally wide; otherwise it
runs the math path, which materializes and keeps every layer's probabilities [B, H, T, T]. `padded_sdpa` pads the
values with zeros to the key width on the CPU, runs transformers' own sdpa function and drops the padded columns:
the same output (the zero columns add nothing), fused speed and memory. Other devices (CUDA's memory-efficient
kernel takes narrower values) and equal widths go to transformers' sdpa unchanged.
"""

from __future__ import annotations

#: Name of the function in transformers' AttentionInterface (and of its mask, sdpa's).
ATTN_NAME = "attnkit_sdpa"


def padded_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa_attention_forward with values zero-padded to the key width on the CPU.

    query [B, H, Tq, Dk], key [B, Hkv, Tk, Dk], value [B, Hkv, Tk, Dv]; returns (output [B, Tq, H, Dv], None)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    if query.device.type != "cpu" or width >= key.shape[-1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    value = F.pad(value, [0, key.shape[-1] - width])  # [B, Hkv, Tk, Dk]
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return out[..., :width], weights  # [B, Tq, H, Dv]


def register() -> None:
    """Register `attnkit_sdpa` (with sdpa's mask) in transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, padded_sdpa)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def narrow_values(config) -> bool:
    """Whether `config`'s attention has values narrower than its queries and keys (MLA's v_head_dim < qk_head_dim)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    qk, v = getattr(config, "qk_head_dim", None), getattr(config, "v_head_dim", None)
    return qk is not None and v is not None and v < qk


def use_padded_sdpa(model) -> None:
    """Switch `model` from sdpa to `attnkit_sdpa` where its values are narrower."""
    if model.config._attn_implementation == "sdpa" and narrow_values(model.config):
        register()
        model.set_attn_implementation(ATTN_NAME)
