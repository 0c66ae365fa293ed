"""Run or swap one attention module: a converted layer as a stock DeepseekV3Attention, its output and o_proj input,
the source layer's reference attention output, and output swaps: one-shot (sequential calibration) and for as long
as a context lasts (measuring one converted layer through the model)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnkit.ops.mla import MLAShape


def target_attention(config, layer: int, tensors: dict, device):
    """The converted layer as the target's attention module (fp32; sdpa, its values padded on the CPU:
    runtime.padded_attention) and its rotary embedding `(x, pos) -> (cos, sin)`: a stock DeepseekV3Attention, or
    for an attnkit_gemma3_mla config its Gemma3MLAAttention on the layer type's rotary embedding
    (attnkit.modeling.gemma3_mla)."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from attnkit.modeling.gemma3_mla import Gemma3MLAAttention, Gemma3MLAConfig
    from attnkit.runtime import padded_attention

    padded_attention.register()
    config._attn_implementation = padded_attention.ATTN_NAME
    gemma = isinstance(config, Gemma3MLAConfig)
    with torch.device("meta"):  # no initial weights: the tensors are assigned in float32 (one copy)
        attn = (Gemma3MLAAttention if gemma else DeepseekV3Attention)(config, layer)
    attn.load_state_dict({k: v.to(device=device, dtype=torch.float32) for k, v in tensors.items()}, assign=True)
    if not gemma:
        return attn, DeepseekV3RotaryEmbedding(config).to(device)
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rotary, layer_type = Gemma3RotaryEmbedding(config).to(device), config.layer_types[layer]
    return attn, lambda x, pos: rotary(x, pos, layer_type)


def run_attention(attn, rotary, hidden):
    """(output, input of o_proj [B*T, H*D]) of the converted attention on hidden [B, T, n] (no padding; a
    module with a sliding_window sees only that many tokens back)."""
    import torch

    from attnkit.ops.attnweight import causal_mask

    captured = {}
    handle = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.update(z=args[0]))
    window, t = getattr(attn, "sliding_window", None), hidden.shape[1]
    mask = causal_mask(t, window, hidden.device)[None, None] if window is not None and t > window else None
    try:
        pos = torch.arange(t, device=hidden.device)[None]
        out, _ = attn(hidden_states=hidden, position_embeddings=rotary(hidden, pos), attention_mask=mask)
    finally:
        handle.remove()
    return out, captured["z"].reshape(-1, captured["z"].shape[-1])


def source_attention_inputs(
    weights: dict, hidden, rope, scaling: float, s: MLAShape, norm_eps: float = 1e-6, window: int | None = None
):
    """The source layer's attention output before o_proj on hidden [B, T, n] (per-head QK-norm applied where
    weights has q_norm / k_norm gains [D]; window: a sliding layer's).  -> [B*T, H*D] float32"""
    import torch

    from attnkit.ops.attnweight import causal_attention

    x = hidden.detach().to(torch.float32)

    def project(role):  # [B, T, heads, D]
        out = x @ weights[role].to(x).T
        if f"{role}_bias" in weights:
            out = out + weights[f"{role}_bias"].to(x)
        out = out.reshape(*x.shape[:2], -1, s.head_dim)
        if f"{role}_norm" in weights:
            out = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + norm_eps) * weights[f"{role}_norm"].to(x)
        return out

    cos, sin = (r.detach().to(x) for r in rope)
    z = causal_attention(project("q"), project("k"), project("v"), cos, sin, scaling, window)
    return z.reshape(-1, z.shape[-1])


def replace_output_once(module, config, layer: int, tensors: dict, device, input_scale=None) -> None:
    """Hook `module` (a source attention) so that its next output is the converted layer's, run on its input
    times input_scale [n] when given; the hook then removes itself, freeing the converted module (calibration is
    one forward pass)."""
    converted = {"modules": target_attention(config, layer, tensors, device)}

    def hook(_module, args, kwargs, output):
        attn, rotary = converted.pop("modules")
        handle.remove()
        return _converted_output(attn, rotary, args, kwargs, output, input_scale)

    handle = module.register_forward_hook(hook, with_kwargs=True)


@contextmanager
def replaced_output(module, config, layer: int, tensors: dict, device, input_scale=None):
    """While the context lasts, `module`'s (a source attention's) output is the converted layer's, as
    replace_output_once gives it once."""
    attn, rotary = target_attention(config, layer, tensors, device)
    handle = module.register_forward_hook(
        lambda _module, args, kwargs, output: _converted_output(attn, rotary, args, kwargs, output, input_scale),
        with_kwargs=True,
    )
    try:
        yield
    finally:
        handle.remove()


def _converted_output(attn, rotary, args, kwargs, output, input_scale) -> tuple:
    """A source attention's `output` with its first entry the converted layer's output on the same input (times
    input_scale [n] when given)."""
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, T, n]
    if input_scale is not None:
        hidden = hidden * input_scale.to(hidden)
    out, _ = run_attention(attn, rotary, hidden)
    return (out,) + tuple(output[1:])
