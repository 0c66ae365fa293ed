"""Capture attention-input statistics E[x x^T] layer by layer, optionally converting each layer as it is reached.

One forward pass over the calibration windows with a pre-hook on every attention module. When the
pass reaches layer l, the hook hands l's input activations to a callback; in sequential mode the
callback returns layer l's converted tensors (at the source's shapes), which are loaded into the
model before l's attention runs, so layers l+1.. are calibrated on the converted model's activations.
Only one layer's statistics and weights are handled at a time; callers pass a model from
attnkit.runtime.streaming.load_for_calibration, which keeps only the running decoder layer resident.
Also here: the per-layer helpers that need a layer's activations (attention-weighted key metric,
o_proj refit against the source attention output).
"""

from __future__ import annotations

from typing import Callable

from attnkit.errors import AttnkitError


def attention_module_name(k_template: str, prefix: str, layer: int) -> str:
    """Module path of layer `layer`'s attention from the k (or qkv) tensor template:
    'layers.{i}.self_attn.k_proj.weight' -> 'model.layers.3.self_attn'."""
    return prefix + k_template.format(i=layer).rsplit(".", 2)[0]


def token_rows(hidden, augment: bool):
    """hidden [B, T, n] -> float64 CPU rows [B*T, n], with a constant-1 column when augmenting."""
    import torch

    x = hidden.detach().reshape(-1, hidden.shape[-1]).to(device="cpu", dtype=torch.float64)  # [B*T, n]
    if augment:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)  # [B*T, n+1]
    return x


def input_covariance(hidden, augment: bool):
    """E[x x^T] over all tokens of hidden [B, T, n]: float64 on CPU, [n(+1), n(+1)]."""
    x = token_rows(hidden, augment)
    return x.T @ x / x.shape[0]


def calibrate(model, windows, module_names: list[str], on_layer: Callable[..., dict | None]) -> None:
    """Run `model` once on windows [N, T]; for each layer in forward order call
    on_layer(l, hidden [N, T, n], position_embeddings (cos, sin) or None, the module's softmax scaling).

    on_layer may return {parameter name: tensor} to load into the model before that layer's
    attention runs (sequential calibration), or None to leave the model unchanged.
    """
    import torch

    reached: list[int] = []

    def make_hook(layer: int):
        def hook(_module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, T, n]
            updates = on_layer(layer, hidden, kwargs.get("position_embeddings"), getattr(_module, "scaling", None))
            for name, tensor in (updates or {}).items():
                param = model.get_parameter(name)
                param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))
            reached.append(layer)

        return hook

    handles = []
    try:
        for layer, name in enumerate(module_names):
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise AttnkitError(f"calibration: the loaded model has no module {name!r}") from None
            handles.append(module.register_forward_pre_hook(make_hook(layer), with_kwargs=True))
        with torch.no_grad():
            model(input_ids=windows.to(model.get_input_embeddings().weight.device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    if sorted(reached) != list(range(len(module_names))):
        raise AttnkitError(f"calibration reached {len(reached)} of {len(module_names)} attention layers")


def reference_attention_ok(spec, layer: int, seq_len: int, rope, scaling, sinks: bool) -> bool:
    """Whether attnkit.ops.attnweight's reference causal attention equals this layer's: no QK-norm,
    soft-capping or attention sinks, no sliding window shorter than the calibration windows, and
    rotate-half RoPE tables covering the rotary dims."""
    window = spec.layer_windows[layer]
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    return (spec.qk_norm == "none" and spec.attn_softcap is None and not sinks
            and (window is None or window >= seq_len) and rope is not None and scaling is not None
            and rope[0].shape[-1] == rotary - rotary % 2)


def _project(x, flat: dict, role: str, head_dim: int):
    """x [B, T, n] through the `role` projection (+ bias), split into heads -> [B, T, heads, D] float32."""
    import torch

    out = x @ flat[role].to(torch.float32).T
    if f"{role}_bias" in flat:
        out = out + flat[f"{role}_bias"].to(torch.float32)
    return out.reshape(*x.shape[:2], -1, head_dim)


def attention_key_covariance(weights: dict, hidden, rope, scaling: float, shape, augment: bool):
    """Per-group key metric, tokens weighted by the layer's own attention (attnkit.ops.attnweight).  -> [G, n', n']"""
    import torch

    from attnkit.ops.attnweight import key_token_weights, weighted_group_covariance
    from attnkit.ops.gqa import unfused

    flat = unfused(weights, shape)
    x = hidden.detach().to(device="cpu", dtype=torch.float32)  # [B, T, n]
    cos, sin = (r.detach().to(device="cpu", dtype=torch.float32) for r in rope)  # [B, T, R]
    w = key_token_weights(_project(x, flat, "q", shape.head_dim), _project(x, flat, "k", shape.head_dim),
                          cos, sin, scaling)  # [Hkv, B*T]
    return weighted_group_covariance(token_rows(hidden, augment), w, shape.groups)


def refit_output(weights: dict, plan, hidden, rope, scaling: float, shape, ridge: float):
    """o_proj refit so the converted layer's attention output matches the source's on these tokens.  -> [hidden, H*D]"""
    import torch

    from attnkit.ops.attnweight import causal_attention
    from attnkit.ops.gqa import apply_plan, expand_layer, unfused
    from attnkit.ops.orefit import refit_o

    x = hidden.detach().to(device="cpu", dtype=torch.float32)  # [B, T, n]
    cos, sin = (r.detach().to(device="cpu", dtype=torch.float32) for r in rope)

    def outputs(layer: dict):  # attention output before o_proj, [B*T, H*D]
        flat = unfused(layer, shape)
        z = causal_attention(*(_project(x, flat, r, shape.head_dim) for r in ("q", "k", "v")), cos, sin, scaling)
        return z.reshape(-1, z.shape[-1])

    converted = unfused({**weights, **expand_layer(apply_plan(weights, plan, shape), shape)}, shape)
    return refit_o(outputs(converted), outputs(weights), unfused(weights, shape)["o"], converted["o"], ridge)
