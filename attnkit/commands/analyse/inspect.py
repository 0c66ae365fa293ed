"""inspect: a model's attention layout as a flat summary and a stable JSON document."""

from __future__ import annotations

from attnkit import kvcache
from attnkit.commands.analyse.modelinfo import model_info
from attnkit.units import human_bytes


def inspect_model(ref: str) -> dict:
    info = model_info(ref)
    spec = info.spec
    bf16 = kvcache.cache_dtype("bf16")
    per_token = kvcache.bytes_per_token(spec, bf16)
    rope = "-"
    if spec.position == "rope":
        rope = f"{spec.rope_type} theta={spec.rope_theta:g}" if spec.rope_theta else str(spec.rope_type)
        if spec.partial_rotary_factor != 1.0:
            rope += f" partial={spec.partial_rotary_factor:g}"
        local = spec.rope_local_theta
        if local is not None and local != spec.rope_theta and any(w is not None for w in spec.layer_windows):
            rope += f", sliding layers theta={local:g}"
    else:
        rope = spec.position
    summary = {
        "model_type": spec.model_type,
        "family": spec.family,
        "layers": spec.num_layers,
        "query heads (H)": spec.num_heads,
        "KV heads (Hkv)": spec.num_kv_heads if spec.mla is None else "-",
        "head dim (D)": spec.head_dim
        if spec.head_dim == spec.v_head_dim
        else f"qk {spec.head_dim}, v {spec.v_head_dim}",
        "hidden size": spec.hidden_size,
        "variant": spec.variant,
        "MLA kv_lora_rank + rope": _mla_shapes(spec.mla) if spec.mla else "-",
        "position": rope,
        "sliding window": spec.sliding_summary(),
        "attention soft-cap": spec.attn_softcap if spec.attn_softcap is not None else "-",
        "final-logit soft-cap": spec.final_softcap if spec.final_softcap is not None else "-",
        "QK-norm": spec.qk_norm,
        "parameters": f"{info.parameters:,} ({info.parameters_origin})",
        "KV bytes/token (bf16)": f"{per_token:,.0f} ({human_bytes(per_token)})",
    }
    if not spec.causal:
        summary["note"] = "encoder: attends bidirectionally, no KV cache in use"
    return {
        "model": ref,
        "kind": info.kind,
        "source": info.source,
        "spec": spec.to_dict(),
        "parameters": info.parameters,
        "parameters_origin": info.parameters_origin,
        "weight_bytes": info.weight_bytes,
        "kv_bytes_per_token_bf16": per_token,
        "summary": summary,
    }


def _mla_shapes(mla) -> str:
    """kv_lora_rank + rope, and the layers of their own shape (attnkit_gemma3_mla's layer_mla_shapes)."""
    own = [f"{i}: {shape[0]} + {shape[1]}" for i, shape in enumerate(mla.layer_shapes) if shape]
    return f"{mla.kv_lora_rank} + {mla.qk_rope_head_dim}" + (f" (layers {', '.join(own)})" if own else "")
