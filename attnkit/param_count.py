"""Parameter counts: exact from checkpoint headers, or estimated from a config when there are none."""

from __future__ import annotations

from attnkit.archs import get_arch
from attnkit.archs.spec import AttentionSpec


def estimate_parameters(config: dict, spec: AttentionSpec) -> int:
    """Estimate of the parameter count of a decoder from its config (norms and biases ignored)."""
    arch = get_arch(spec.model_type)
    d, layers = spec.hidden_size, spec.num_layers
    vocab = int(arch.config_value(config, "vocab_size", 32000))
    tied = bool(arch.config_value(config, "tie_word_embeddings", False))
    embed = vocab * d * (1 if tied else 2)

    inter = int(arch.config_value(config, "intermediate_size", 4 * d))
    per_matrix = 3 if arch.mlp in ("gated", "moe") else 2
    dense_mlp = per_matrix * d * inter
    experts = arch.config_value(config, "num_experts")
    if arch.mlp == "moe" and experts:
        moe_inter = int(arch.config_value(config, "moe_intermediate_size", inter))
        shared = int(arch.config_value(config, "num_shared_experts", 0) or 0)
        moe_mlp = (int(experts) + shared) * 3 * d * moe_inter + d * int(experts)
        dense_layers = int(arch.config_value(config, "first_dense_layers", 0) or 0)
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    else:
        mlp_total = layers * dense_mlp
    attn = sum(_attention_parameters(spec.layer_spec(layer)) for layer in range(layers))
    return embed + attn + mlp_total


def _attention_parameters(spec: AttentionSpec) -> int:
    """Attention weights of one layer (a uniform spec: AttentionSpec.layer_spec)."""
    d, h, dk, dv = spec.hidden_size, spec.num_heads, spec.head_dim, spec.v_head_dim
    if spec.mla is None:
        return d * h * dk + d * spec.num_kv_heads * (dk + dv) + h * dv * d
    m = spec.mla
    q = d * h * dk if not m.q_lora_rank else d * m.q_lora_rank + m.q_lora_rank * h * dk
    attn = q + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + dv) + h * dv * d
    if m.key_factors:  # attnkit_gemma3_mla's exact QK-norm: the source's q and k projections
        attn += d * (h + m.key_factors) * m.qk_nope_head_dim
    return attn
