"""The checkpoint `convert mla` writes: its config (a stock DeepseekV3, or with --target gemma3-mla attnkit's Gemma 3
MLA layout, attnkit.modeling.gemma3_mla) and the tensor names and shapes it must hold."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnkit.archs import get_arch
from attnkit.archs.tensors import find_prefix
from attnkit.runtime.calibrate import attention_module_name

if TYPE_CHECKING:
    from attnkit.commands.convert.mla_request import MLASource


def target_arch(config):
    """The registry entry of the result's architecture (attnkit/archs/data/deepseek_v3.json or gemma3_mla.json):
    the tensor names it is written under."""
    return get_arch(config.model_type)


def target_config(src: MLASource, bias_route: bool):
    """The config of the result: DeepseekV3 (deepseek_config), or Gemma3MLAConfig for --target gemma3-mla."""
    return gemma3_mla_config(src) if src.target == "gemma3-mla" else deepseek_config(src, bias_route)


def gemma3_mla_config(src: MLASource):
    """The source's Gemma 3 text config with the MLA shape (kv_lora_rank R, qk_rope_head_dim P) added."""
    from transformers import AutoConfig

    from attnkit.modeling.gemma3_mla import ARCHITECTURE, Gemma3MLAConfig

    fields = AutoConfig.from_pretrained(str(src.root)).to_dict()
    for key in ("model_type", "architectures", "transformers_version", "quantization_config"):
        fields.pop(key, None)
    config = Gemma3MLAConfig(**fields, kv_lora_rank=src.shape.latent_rank, qk_rope_head_dim=src.shape.rope_dim)
    config.architectures = [ARCHITECTURE]
    return config


def deepseek_config(src: MLASource, bias_route: bool):
    """The DeepseekV3Config of the result: dense MLPs in every layer, no experts, the source's rope.

    Written for the engines' loaders as well as transformers: `architectures`, expert counts 0 with no
    routing fields (llama.cpp asserts n_expert_groups < n_expert otherwise; every layer is dense through
    first_k_dense_replace), an untied lm_head (vLLM's DeepSeek never ties), interleaved RoPE (the only layout
    vLLM and llama.cpp apply), biases only on the bias route."""
    import torch
    from transformers import AutoConfig, DeepseekV3Config

    s, spec = src.shape, src.spec
    cfg = AutoConfig.from_pretrained(str(src.root))
    rope = dict(src.rope)
    rope["rope_theta"] = float(rope["rope_theta"]) ** (s.rope_dim / s.head_dim)  # same frequencies at width P
    dtype = getattr(cfg, "dtype", None) or torch.float32
    q_lora_rank = None
    if src.q_lora:
        q_lora_rank = spec.hidden_size + 1 if bias_route else spec.hidden_size
    config = DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        kv_lora_rank=s.latent_rank + 1,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=s.rope_dim,
        qk_nope_head_dim=s.head_dim,
        v_head_dim=s.head_dim,
        first_k_dense_replace=spec.num_layers,
        n_routed_experts=0,
        num_experts_per_tok=None,
        n_group=None,
        topk_group=None,
        n_shared_experts=0,
        moe_intermediate_size=cfg.intermediate_size,
        num_mtp_layers=0,
        hidden_act=getattr(cfg, "hidden_activation", None) or cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=bias_route,
        attention_dropout=0.0,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        architectures=["DeepseekV3ForCausalLM"],
    )
    config.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
    return config


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the target, from its model class built on the meta device."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from attnkit.modeling.gemma3_mla import Gemma3MLAConfig, Gemma3MLAForCausalLM

    with torch.device("meta"):
        model = (Gemma3MLAForCausalLM if isinstance(config, Gemma3MLAConfig) else DeepseekV3ForCausalLM)(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop(target_arch(config).head_name, None)
    return shapes


def target_attention_names(config, expected: dict) -> list[str]:
    """Each layer's attention module in the result (e.g. model.layers.3.self_attn), from its tensor names
    (expected_shapes) and the registry's templates."""
    arch = target_arch(config)
    prefix = find_prefix(arch, expected)
    return [attention_module_name(arch.tensors["o"], prefix, layer) for layer in range(config.num_hidden_layers)]
