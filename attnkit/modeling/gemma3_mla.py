"""`attnkit_gemma3_mla`: Gemma 3 decoder layers (sandwich norms, sliding windows, per-layer-type RoPE, gelu MLPs)
whose attention is DeepSeek-V3's MLA, the layout `convert mla --target gemma3-mla` writes.

Each layer's attention is DeepseekV3Attention's MLA (q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; interleaved
RoPE on the shared key) with these changes: its RoPE key turns at P/2 frequencies of its own layer type (Gemma's
cos/sin, sliced at the pairs `rope_pairs` names for the layer; the fastest P/2 where it names none); sliding
layers keep Gemma's window; the latent has no norm; Gemma's per-head QK-norm is
kept exact (the RMS factors of the source's query and key projections, the key's cached per KV head); a layer may
have its own latent width and RoPE key (config `layer_mla_shapes`). The layers
`gemma_attention_layers` names keep Gemma 3's own attention, unchanged (convert mla keeps sliding layers, whose
cache the window bounds, and spends the budget on the global ones). transformers runs it once `register()` has run
(`import attnkit.modeling` does); no serving engine does.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    apply_rotary_pos_emb_interleave,
    eager_attention_forward,
)
from transformers.models.gemma3.configuration_gemma3 import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3TextModel

MODEL_TYPE = "attnkit_gemma3_mla"
ARCHITECTURE = "Gemma3MLAForCausalLM"


@strict
class Gemma3MLAConfig(Gemma3TextConfig):
    """Gemma3TextConfig plus the MLA shape: kv_lora_rank latent values, num_key_value_heads key RMS factors and
    qk_rope_head_dim RoPE-key values cached per token and layer; keys and values per head stay head_dim wide.
    gemma_attention_layers: the layers whose attention is Gemma 3's own (None: every layer is MLA).
    rope_pairs: per layer, the frequency pairs of its layer type its RoPE key turns at, ascending (P/2 of them; an
    empty list or None: the fastest P/2).
    layer_mla_shapes: per layer, its own [kv_lora_rank, qk_rope_head_dim] (an empty list or None: the two above)."""

    model_type = MODEL_TYPE
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    gemma_attention_layers: list[int] | None = None
    rope_pairs: list[list[int]] | None = None
    layer_mla_shapes: list[list[int]] | None = None

    # What DeepseekV3Attention reads from its config, fixed by this layout.
    @property
    def q_lora_rank(self):
        return None

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    @property
    def rope_interleave(self) -> bool:
        return True


def layer_shape(config: Gemma3MLAConfig, layer_idx: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) of layer `layer_idx`: its layer_mla_shapes entry, or the config's."""
    own = list((config.layer_mla_shapes or [[]] * config.num_hidden_layers)[layer_idx] or [])
    if not own:
        return config.kv_lora_rank, config.qk_rope_head_dim
    if len(own) != 2 or own[0] < 1 or own[1] < 2 or own[1] % 2 or own[1] > config.head_dim:
        raise ValueError(
            f"layer_mla_shapes of layer {layer_idx} must be [kv_lora_rank >= 1, an even qk_rope_head_dim of 2.."
            f"{config.head_dim}], got {own}"
        )
    return own[0], own[1]


class _LayerConfig:
    """The config as one layer's DeepseekV3Attention.__init__ reads it: its own kv_lora_rank and
    qk_rope_head_dim (layer_shape), the rest the model's."""

    def __init__(self, config: Gemma3MLAConfig, layer_idx: int):
        self._config = config
        self.kv_lora_rank, self.qk_rope_head_dim = layer_shape(config, layer_idx)

    def __getattr__(self, name):
        return getattr(self._config, name)


def _layer_pairs(config: Gemma3MLAConfig, layer_idx: int) -> list[int]:
    """The frequency pairs layer `layer_idx` turns its RoPE key at: config.rope_pairs' entry (P/2 distinct pairs of
    the head's D/2, ascending), or the fastest P/2 where it names none."""
    half = layer_shape(config, layer_idx)[1] // 2
    named = list((config.rope_pairs or [[]] * config.num_hidden_layers)[layer_idx] or [])
    if not named:
        return list(range(half))
    if len(named) != half or named != sorted(set(named)) or not all(0 <= p < config.head_dim // 2 for p in named):
        raise ValueError(
            f"rope_pairs of layer {layer_idx} must be {half} distinct pairs of 0..{config.head_dim // 2 - 1} in "
            f"ascending order, got {named}"
        )
    return named


class Gemma3MLAAttention(DeepseekV3Attention):
    """DeepseekV3Attention on Gemma's per-layer-type rotary embedding and sliding window, with Gemma's QK-norm
    kept exact: no latent norm (kv_a_layernorm is the identity), each query head scaled by its source RMS factor
    1/sqrt(mean((W_q x)^2) + eps) (q_rms_proj = the source's W_q), each key by its KV group's (k_rms_proj), the
    key factors cached beside the latent (kv_lora_rank + num_key_value_heads + qk_rope_head_dim values per token)."""

    def __init__(self, config: Gemma3MLAConfig, layer_idx: int):
        super().__init__(_LayerConfig(config, layer_idx), layer_idx)  # this layer's R and P
        self.config = config  # the model's: forward reads its attention implementation
        self.num_key_value_groups = 1  # expand_kv already gives every query head its key and value
        self.scaling = self.qk_head_dim**-0.5  # convert mla folds the source's softmax scale into q_proj
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        self.kv_a_layernorm = nn.Identity()
        self.num_kv = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.q_rms_proj = nn.Linear(config.hidden_size, self.num_heads * config.head_dim, bias=False)
        self.k_rms_proj = nn.Linear(config.hidden_size, self.num_kv * config.head_dim, bias=False)
        self.rope_pairs = _layer_pairs(config, layer_idx)

    def _inv_rms(self, raw: torch.Tensor, heads: int) -> torch.Tensor:
        """raw [B, T, heads*D] -> 1 / RMS per head and token, [B, heads, T, 1] (Gemma's RMSNorm, eps inside)."""
        x = raw.view(*raw.shape[:-1], heads, -1).float()
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps).transpose(1, 2).to(raw.dtype)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        kwargs.pop("position_ids", None)
        batch, seq = hidden_states.shape[:-1]
        cos, sin = position_embeddings  # [B, T, D]: Gemma's cat(f, f) over this layer type's D/2 frequencies
        cos = torch.cat([cos[..., self.rope_pairs]] * 2, dim=-1)  # [B, T, P]: the kept P/2 frequencies, twice
        sin = torch.cat([sin[..., self.rope_pairs]] * 2, dim=-1)

        q = self.q_proj(hidden_states).view(batch, seq, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, T, D+P]
        q = q * self._inv_rms(self.q_rms_proj(hidden_states), self.num_heads)
        q_pass, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], -1
        )
        k_scale = self._inv_rms(self.k_rms_proj(hidden_states), self.num_kv)[..., 0].transpose(1, 2)  # [B, T, Hkv]
        cached = torch.cat([latent, k_scale], dim=-1).view(batch, 1, seq, -1)  # [B, 1, T, R + Hkv]
        k_rot = k_rot.view(batch, 1, seq, self.qk_rope_head_dim)
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        if cache is not None:
            cached, k_rot = cache.update(cached, k_rot, self.layer_idx, kwargs=kwargs)
        latent, k_scale = torch.split(cached, [self.kv_lora_rank, self.num_kv], dim=-1)  # [B, 1, S, R], [B, 1, S, Hkv]
        keys, values = self.expand_kv(latent, k_rot)  # [B, H, S, D+P], [B, H, S, D]
        groups = self.num_heads // self.num_kv
        keys = keys * k_scale[:, 0].transpose(1, 2).repeat_interleave(groups, dim=1)[..., None]  # [B, H, S, 1]
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(
            self,
            torch.cat((q_pass, q_rot), dim=-1),
            keys,
            values,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        return self.o_proj(out.reshape(batch, seq, -1).contiguous()), weights


class Gemma3MLADecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's decoder layer with MLA attention, or with its own attention in gemma_attention_layers."""

    def __init__(self, config: Gemma3MLAConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if layer_idx not in (config.gemma_attention_layers or ()):
            self.self_attn = Gemma3MLAAttention(config, layer_idx)


class Gemma3MLATextModel(Gemma3TextModel):
    config_class = Gemma3MLAConfig

    def __init__(self, config: Gemma3MLAConfig):
        super().__init__(config)
        self.layers = type(self.layers)(Gemma3MLADecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()


class Gemma3MLAForCausalLM(Gemma3ForCausalLM):
    config_class = Gemma3MLAConfig
    _no_split_modules = ["Gemma3MLADecoderLayer"]

    def __init__(self, config: Gemma3MLAConfig):
        super().__init__(config)
        self.model = Gemma3MLATextModel(config)
        self.post_init()


def register() -> None:
    """Make AutoConfig and AutoModelForCausalLM read `attnkit_gemma3_mla` checkpoints (idempotent)."""
    AutoConfig.register(MODEL_TYPE, Gemma3MLAConfig, exist_ok=True)
    AutoModelForCausalLM.register(Gemma3MLAConfig, Gemma3MLAForCausalLM, exist_ok=True)
