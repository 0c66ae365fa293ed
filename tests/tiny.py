"""Tiny random checkpoints built with transformers config classes (hidden 64, 8 heads, head_dim 8, 2 layers)."""

from __future__ import annotations

from pathlib import Path

BASE = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

#: name -> (config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=8, head_dim=8)),
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=4, head_dim=8, sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=4, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=4, head_dim=8)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_key_value_heads=4,
            head_dim=8,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=8,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(num_key_value_heads=4, head_dim=8, sliding_window=16, query_pre_attn_scalar=8),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=4)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=4)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_head=8, n_layer=2, n_positions=512)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict()),
    "bert": ("BertConfig", "BertModel", dict()),
}


def build_model(family: str, seed: int = 0, **overrides):
    """A randomly initialised fp32 model of `family` (see FAMILIES) with the tiny shape."""
    import torch
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**BASE, **extra, **overrides}
    if family == "gpt2":
        for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "max_position_embeddings"):
            kwargs.pop(k, None)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    return model


def save_model(model, folder: Path, *, max_shard_size: str | None = None) -> Path:
    folder = Path(folder)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def make_checkpoint(folder: Path, family: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Build and save a tiny checkpoint; returns its folder."""
    return save_model(build_model(family, seed=seed, **overrides), folder, max_shard_size=max_shard_size)


SMALL = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
)


MLA = dict(
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
#: attnkit's own model types (attnkit.modeling): class names there.
_ATTNKIT_CLASSES = {"attnkit_gemma3_mla": "Gemma3MLAForCausalLM"}


def extra_model(name: str):
    import torch
    import transformers as tf

    from attnkit.modeling import gemma3_mla

    configs = {
        "llama_bias": lambda: tf.LlamaConfig(**SMALL, num_key_value_heads=4, head_dim=8, attention_bias=True),
        "mixtral": lambda: tf.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, sliding_window=16),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **SMALL, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        ),
        "gpt_oss": lambda: tf.GptOssConfig(
            **SMALL, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=16
        ),
        "deepseek_v2": lambda: tf.DeepseekV2Config(**SMALL, **MLA, q_lora_rank=None, first_k_dense_replace=1),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **SMALL, **MLA, q_lora_rank=24, n_group=1, topk_group=1, first_k_dense_replace=1
        ),
        "deepseek_v3_bias": lambda: tf.DeepseekV3Config(
            **SMALL, **MLA, q_lora_rank=24, n_group=1, topk_group=1, first_k_dense_replace=2, attention_bias=True
        ),
        "gemma3_mla": lambda: gemma3_mla.Gemma3MLAConfig(
            **SMALL, num_key_value_heads=1, head_dim=8, sliding_window=16, kv_lora_rank=12, qk_rope_head_dim=4
        ),
    }
    config = configs[name]()
    torch.manual_seed(0)
    if config.model_type in _ATTNKIT_CLASSES:
        return getattr(gemma3_mla, _ATTNKIT_CLASSES[config.model_type])(config)
    return getattr(tf, _CLASSES[config.model_type])(config)
