"""SDPA for attention whose values are narrower than its queries and keys (DeepSeek-V3's MLA: 192-dim queries and
keys, 128- or 64-dim values). torch's CPU flash kernel takes one head size only, so transformers' sdpa runs such
layers on the math path, which materializes each layer's [T, T] attention weights (and keeps them for a backward
pass): memory and time quadratic in the window. Zero-padding the values to the query width and cutting the output
back gives the same numbers through the flash kernel."""

from __future__ import annotations

NAME = "attnkit_sdpa_padded"


def padded_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa with value [B, Hkv, T, Dv] zero-padded to the query's Dq; -> ([B, T, H, Dv], None)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    width = value.shape[-1]
    if query.shape[-1] > width:
        value = F.pad(value, (0, query.shape[-1] - width))  # [B, Hkv, T, Dq]: the extra columns are zeros
    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return output[..., :width], weights


def narrow_values(config) -> bool:
    """Whether a config's attention values are narrower than its queries and keys (DeepSeek-V3 / MLA layouts)."""
    v = getattr(config, "v_head_dim", None)
    qk = getattr(config, "qk_head_dim", None) or (
        (getattr(config, "qk_nope_head_dim", 0) or 0) + (getattr(config, "qk_rope_head_dim", 0) or 0)
    )
    return bool(v and qk and v < qk)


def use_padded_sdpa(model, device=None) -> None:
    """Run `model`'s attention through padded_sdpa where it would take sdpa's math path: CPU, sdpa, narrow values.
    `device`: where it runs, when its parameters do not say (a model whose layers are on the meta device)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if model.config._attn_implementation != "sdpa" or not narrow_values(model.config) or (device or model.device).type != "cpu":
        return
    AttentionInterface.register(NAME, padded_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
