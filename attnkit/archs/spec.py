"""AttentionSpec: the attention layout of a model, derived from its config and architecture."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from attnkit.archs import Arch, get_arch
from attnkit.archs.validate import check_config
from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class MLADims:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None
    key_factors: int = 0  # cached per token beside the latent and RoPE key (attnkit_gemma3_mla: key RMS per KV head)
    plain_layers: tuple[int, ...] = ()  # layers that keep the source family's attention (attnkit_gemma3_mla)
    plain_kv_heads: int = 0  # their K and V heads (v_head_dim wide)
    layer_shapes: tuple[tuple[int, ...], ...] = ()  # per layer () or its own (kv_lora_rank, qk_rope_head_dim)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything about a model's attention that kvmem, inspect and the converters need."""

    model_type: str
    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # key/query head dim (MLA: nope + rope)
    v_head_dim: int
    hidden_size: int
    layer_windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full
    position: str
    rope_type: str | None
    rope_theta: float | None
    partial_rotary_factor: float
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: str
    causal: bool
    mla: MLADims | None = None
    rope_local_theta: float | None = None  # the RoPE base of sliding-window layers where it differs (Gemma 3)

    @property
    def variant(self) -> str:
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return f"GQA-{self.num_kv_heads}"

    def kv_elements_per_token(self, layer: int = 0) -> int:
        """Cached elements per token in one layer (K and V, or the MLA latent plus RoPE key)."""
        spec = self.layer_spec(layer)
        if spec.mla is not None:
            return spec.mla.kv_lora_rank + spec.mla.key_factors + spec.mla.qk_rope_head_dim
        return spec.num_kv_heads * (spec.head_dim + spec.v_head_dim)

    def layer_spec(self, layer: int) -> AttentionSpec:
        """The attention of one layer as a uniform spec: this one, or for an MLA layout whose layers differ either
        its MLA at its own shape (layer_shapes) or the source family's own attention (plain_kv_heads heads of
        v_head_dim, per-head QK-norm: attnkit_gemma3_mla's Gemma 3 layers)."""
        if self.uniform:
            return self
        if layer not in self.mla.plain_layers:
            mla = replace(self.mla, plain_layers=(), plain_kv_heads=0, layer_shapes=())
            own = self.mla.layer_shapes[layer] if self.mla.layer_shapes else ()
            if own:
                mla = replace(mla, kv_lora_rank=own[0], qk_rope_head_dim=own[1])
            return replace(self, mla=mla, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        heads, dim = self.mla.plain_kv_heads, self.mla.v_head_dim
        return replace(self, mla=None, num_kv_heads=heads, head_dim=dim, v_head_dim=dim, qk_norm="per_head")

    def first_mla_layer(self) -> int:
        """The first layer that is not plain (0 for a uniform layout)."""
        plain = self.mla.plain_layers if self.mla is not None else ()
        return next((i for i in range(self.num_layers) if i not in plain), 0)

    @property
    def uniform(self) -> bool:
        """Whether every layer caches the same width (no plain layers beside MLA ones, no MLA layer of its own
        shape)."""
        return self.mla is None or not (self.mla.plain_layers or any(self.mla.layer_shapes))

    def sliding_summary(self) -> str:
        windows = [w for w in self.layer_windows if w is not None]
        if not windows:
            return "none"
        if len(windows) == self.num_layers:
            return f"all {self.num_layers} layers, window {_fmt_windows(windows)}"
        return f"{len(windows)}/{self.num_layers} layers, window {_fmt_windows(windows)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_windows"] = list(self.layer_windows)
        d["variant"] = self.variant
        d["kv_elements_per_token_layer"] = self.kv_elements_per_token(self.first_mla_layer())
        if not self.uniform:
            d["kv_elements_per_token_by_layer"] = [self.kv_elements_per_token(i) for i in range(self.num_layers)]
        return d


def _fmt_windows(windows: list[int]) -> str:
    return ",".join(str(w) for w in sorted(set(windows)))


def _int(arch: Arch, config: dict, role: str, default=None) -> int | None:
    """A config value that check_config has already type-checked."""
    return arch.config_value(config, role, default)


def _layer_shapes(arch: Arch, config: dict) -> tuple[tuple[int, ...], ...]:
    """Per layer () or its own (kv_lora_rank, qk_rope_head_dim) (check_config has checked them); () where no
    layer has its own."""
    shapes = tuple(tuple(v) for v in arch.config_value(config, "mla_layer_shapes") or ())
    return shapes if any(shapes) else ()


def _layer_windows(arch: Arch, config: dict, num_layers: int) -> tuple[int | None, ...]:
    rule = arch.sliding_rule
    window = arch.config_value(config, "sliding_window")
    if rule == "none":
        return (None,) * num_layers
    layer_types = arch.config_value(config, "layer_types")
    if layer_types is not None:
        if window is None and any(t == "sliding_attention" for t in layer_types):
            raise AttnkitError("config has sliding_attention layers but no sliding_window")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None or not arch.config_value(config, "use_sliding_window", True):
        return (None,) * num_layers
    window = int(window)
    if rule == "all" or rule == "layer_types":
        return (window,) * num_layers
    if rule == "alternate":  # Gemma 2: even layers slide, odd layers are global
        return tuple(window if i % 2 == 0 else None for i in range(num_layers))
    if rule == "pattern":  # Gemma 3: every N-th layer is global
        n = _int(arch, config, "sliding_window_pattern", 6)
        return tuple(None if (i + 1) % n == 0 else window for i in range(num_layers))
    # max_window_layers (Qwen2/Qwen3): layers from max_window_layers on slide
    first = _int(arch, config, "max_window_layers", num_layers)
    return tuple(window if i >= first else None for i in range(num_layers))


def attention_spec(config: dict) -> AttentionSpec:
    """Derive the attention layout from a config dict (HF key names)."""
    model_type = config.get("model_type")
    arch = get_arch(model_type)
    check_config(arch, config)
    num_layers = _int(arch, config, "num_layers")
    num_heads = _int(arch, config, "num_heads")
    hidden = _int(arch, config, "hidden_size")
    num_kv_heads = _int(arch, config, "num_kv_heads", num_heads)
    head_dim = _int(arch, config, "head_dim")
    if not head_dim and hidden % num_heads and arch.qkv_layout != "mla":  # MLA's head dims are its own keys
        raise AttnkitError(
            f"config: hidden_size {hidden} is not a multiple of its {num_heads} heads and no head_dim is given"
        )
    head_dim = head_dim or max(hidden // num_heads, 1)
    v_head_dim = head_dim
    mla = None
    if arch.qkv_layout == "mla":
        rope = _int(arch, config, "qk_rope_head_dim")
        nope = _int(arch, config, "qk_nope_head_dim")
        mla = MLADims(
            kv_lora_rank=_int(arch, config, "kv_lora_rank"),
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=_int(arch, config, "v_head_dim"),
            q_lora_rank=_int(arch, config, "q_lora_rank"),
            key_factors=_int(arch, config, "mla_key_factors") or 0,
            plain_layers=tuple(sorted(arch.config_value(config, "mla_plain_layers") or ())),
            plain_kv_heads=_int(arch, config, "mla_plain_kv_heads") or 0,
            layer_shapes=_layer_shapes(arch, config),
        )
        num_kv_heads, head_dim, v_head_dim = num_heads, nope + rope, mla.v_head_dim
    if num_heads % num_kv_heads:
        raise AttnkitError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    rope_type = theta = local_theta = None
    if arch.position == "rope":
        rope_type = arch.config_value(config, "rope_type", "default")
        theta = arch.config_value(config, "rope_theta")
        local_theta = arch.config_value(config, "rope_local_theta")
    softcap = arch.config_value(config, "attn_softcap")
    final_cap = arch.config_value(config, "final_softcap")
    return AttentionSpec(
        model_type=model_type,
        family=arch.family,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        hidden_size=hidden,
        layer_windows=_layer_windows(arch, config, num_layers),
        position=arch.position,
        rope_type=rope_type,
        rope_theta=float(theta) if theta is not None else None,
        partial_rotary_factor=float(arch.config_value(config, "partial_rotary_factor", 1.0)),
        attn_softcap=float(softcap) if softcap is not None else None,
        final_softcap=float(final_cap) if final_cap is not None else None,
        qk_norm=arch.qk_norm,
        causal=arch.causal,
        mla=mla,
        rope_local_theta=float(local_theta) if local_theta is not None else None,
    )
