"""Tiny random checkpoints built with transformers config classes (hidden 64, 8 heads, head_dim 8, 2 layers)."""

from __future__ import annotations

from pathlib import Path

BASE = dict(hidden_size=64, num_attention_heads=8, num_hidden_layers=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: name -> (config class name, model class name, extra config kwargs)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=8, head_dim=8)),
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=4, head_dim=8, sliding_window=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=4)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=4, head_dim=8)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=4, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=4, head_dim=8, sliding_window=16,
                                                           attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                           query_pre_attn_scalar=8)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=4, head_dim=8, sliding_window=16,
                                                               query_pre_attn_scalar=8)),
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
