"""The checkpoints `convert mla` writes, one MLATarget per output layout (TARGETS, what --target names): which
sources it takes, which engines serve it, what it caches beside the latent, its config and model class, and the
tensor names and shapes it must hold. The layouts' tensors are in attnkit.ops (mla_deepseek, mla_gemma3); adding
a layout is its ops module, its config builder here and one TARGETS entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnkit.archs import get_arch
from attnkit.archs.tensors import find_prefix
from attnkit.runtime.calibrate import attention_module_name

if TYPE_CHECKING:
    from attnkit.commands.convert.mla_request import MLASource

#: Families whose attention maps onto DeepseekV3 (the stock target's; the others name their own).
SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "qwen3")
#: The target convert mla writes without --target: the stock DeepseekV3 checkpoint the engines serve.
DEFAULT_TARGET = "deepseek-v3"


@dataclass(frozen=True)
class MLATarget:
    """One output layout of convert mla, chosen once from --target.

    engines: the serving engines load it (else transformers only, with attnkit imported, and it has no latent norm
    and no bias route); exact_qk_norm: the layout applies a source's per-head QK-norm exactly and caches one key RMS
    factor per KV head beside the latent (else one latent-norm channel is cached there and QK-norm is folded into
    constants); widens_rope: one RoPE base serves every layer, so the budget split may widen the RoPE key to the
    source's rotating pairs (attnkit.commands.convert.mla_request.budget_split); any_rope_pairs: each layer's
    RoPE key turns at whichever of the source's frequencies it keeps (config `rope_pairs`), so --rope-pairs auto
    chooses them by what losing their rotation costs (else the fastest, which a stock rotary embedding reproduces);
    key_balance: what --key-balance is when not given (measured per layout: docs/convert-mla.md, "Pass keys at 4k");
    center_keys: what --center-keys is when not given: whether the position-free keys are fitted on centered inputs
    (measured per layout: docs/convert-mla.md, "### Keys centered");
    text_only: a multimodal config is refused; keeps_windows: sliding windows are kept (else a note says they are
    dropped); layer_shapes: a layer may have its own latent width and RoPE key (--layer-shape; else one shape, as
    the engines read it); config(src, bias_route): the result's transformers config; model_class(): its class;
    note: what the report's notes say of the layout."""

    name: str
    model_type: str
    families: tuple[str, ...]
    engines: bool
    exact_qk_norm: bool
    widens_rope: bool
    any_rope_pairs: bool
    key_balance: float
    center_keys: bool
    text_only: bool
    keeps_windows: bool
    layer_shapes: bool
    config: Callable
    model_class: Callable
    note: str | None = None

    def besides_latent(self, spec) -> int:
        """Values cached per token and layer besides the latent proper (counted in kv_lora_rank)."""
        return spec.num_kv_heads if self.exact_qk_norm else 1

    def padded_latent(self) -> str:
        """What the channels past the rank of the source's keys and values hold, for a warning."""
        return "are zero" if not self.engines else "steady the latent norm"


def target_arch(config):
    """The registry entry of the result's architecture (attnkit/archs/data/deepseek_v3.json or gemma3_mla.json):
    the tensor names it is written under."""
    return get_arch(config.model_type)


def target_config(src: MLASource, bias_route: bool):
    """The config of the result, by its target's builder."""
    return src.target.config(src, bias_route)


def gemma3_mla_config(src: MLASource, bias_route: bool = False):
    """The source's Gemma 3 text config with the MLA shape (kv_lora_rank R, qk_rope_head_dim P; a layer's own
    where --layer-shape gives it one), the layers kept as Gemma 3's own attention and each converted layer's RoPE
    pairs added (the fastest P/2 here; convert mla sets the pairs it chooses as each layer is converted). No bias
    route: the layout writes no biases."""
    from attnkit.modeling.gemma3_mla import ARCHITECTURE, Gemma3MLAConfig

    fields = src.hf_config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "quantization_config"):
        fields.pop(key, None)
    layers = range(src.spec.num_layers)
    own = [src.layer_shapes.get(i) for i in layers]  # --layer-shape's, else None
    config = Gemma3MLAConfig(
        **fields,
        kv_lora_rank=src.shape.latent_rank,
        qk_rope_head_dim=src.shape.rope_dim,
        gemma_attention_layers=list(src.plain_layers) or None,
        rope_pairs=[[] if i in src.plain_layers else src.for_layer(i).shape.pairs for i in layers],
        layer_mla_shapes=[[s.latent_rank, s.rope_dim] if s else [] for s in own] if src.layer_shapes else None,
    )
    config.architectures = [ARCHITECTURE]
    return config


def deepseek_config(src: MLASource, bias_route: bool):
    """The DeepseekV3Config of the result: dense MLPs in every layer, no experts, the source's rope.

    Written for the engines' loaders as well as transformers: `architectures`, expert counts 0 with no
    routing fields (llama.cpp asserts n_expert_groups < n_expert otherwise; every layer is dense through
    first_k_dense_replace), an untied lm_head (vLLM's DeepSeek never ties), interleaved RoPE (the only layout
    vLLM and llama.cpp apply), biases only on the bias route."""
    import torch
    from transformers import DeepseekV3Config

    s, spec = src.shape, src.spec
    cfg = src.hf_config
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


def expected_shapes(target: MLATarget, config) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the result, from its target's model class built on the meta device."""
    import torch

    with torch.device("meta"):
        model = target.model_class()(config)
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


def _deepseek_class():
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM


def _gemma3_mla_class():
    from attnkit.modeling.gemma3_mla import Gemma3MLAForCausalLM

    return Gemma3MLAForCausalLM


#: --target -> its layout.
TARGETS = {
    "deepseek-v3": MLATarget(
        name="deepseek-v3",
        model_type="deepseek_v3",
        families=SUPPORTED,
        engines=True,
        exact_qk_norm=False,
        widens_rope=True,
        any_rope_pairs=False,
        key_balance=0.5,  # with centered keys: SmolLM2's pass keys kept at 2k and 4k, Qwen2.5-Coder no worse (docs)
        center_keys=True,  # a position-free key's mean moves every logit of a query alike (docs/convert-mla.md)
        text_only=False,
        keeps_windows=False,
        layer_shapes=False,
        config=deepseek_config,
        model_class=_deepseek_class,
    ),
    "gemma3-mla": MLATarget(
        name="gemma3-mla",
        model_type="attnkit_gemma3_mla",
        families=("gemma3",),
        engines=False,
        exact_qk_norm=True,
        widens_rope=False,  # each layer type has its own RoPE base
        any_rope_pairs=True,
        key_balance=4.0,  # Gemma 3's keys bind: measured at 0.25, 0.5, 1 and 4 (docs/convert-mla.md)
        center_keys=False,  # each key is scaled by its own RMS factor: its mean does not move a query's logits alike
        text_only=True,
        keeps_windows=True,
        layer_shapes=True,
        config=gemma3_mla_config,
        model_class=_gemma3_mla_class,
        note=(
            "attnkit's Gemma 3 MLA layout (model_type attnkit_gemma3_mla): Gemma 3's decoder layers, sliding windows "
            "and per-layer-type RoPE kept, each layer's RoPE key at the frequencies of its own type it keeps (config "
            "rope_pairs), no latent norm, "
            "QK-norm exact (each key's RMS factor cached per KV head beside the latent: kv_lora_rank counts them); "
            "transformers runs it with attnkit.modeling imported, no serving engine does"
        ),
    ),
}
