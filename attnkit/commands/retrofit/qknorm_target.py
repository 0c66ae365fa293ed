"""The Qwen3 checkpoint `retrofit qknorm` writes: its config (RoPE kept at the new head size), whether it has
attention biases, the names of the tensors it adds (from the registry, attnkit/archs/data/qwen3.json) and the check
that the written folder is what Qwen3ForCausalLM loads."""

from __future__ import annotations

from attnkit.archs import get_arch
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import safetensors_files
from attnkit.io.reader import LazyReader

#: What the result is: its new tensors' names come from the registry (attnkit/archs/data/qwen3.json).
QWEN3 = get_arch("qwen3")
#: Source config keys that Qwen3 does not have (or that the conversion rewrites).
DROP_KEYS = (
    "pretraining_tp",
    "mlp_bias",
    "architectures",
    "model_type",
    "auto_map",
    "_name_or_path",
    "transformers_version",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
)


def attention_bias(src, method: str) -> bool:
    """Whether the result has q/k/v/o biases: pad and bias write them always, anchor never (it folds the source's
    into the weights), the fitted methods where the source has any."""
    has_bias = any(src.tensor(r, 0) for r in ("q_bias", "k_bias", "v_bias", "o_bias"))
    return (has_bias and method != "anchor") or method in ("pad", "bias")


def qwen3_config(src, bias: bool, dim: int) -> dict:
    """The Qwen3 config.json: source keys plus head_dim `dim`, attention_bias, sliding layers and a RoPE base
    that keeps the source's frequencies at the new head size."""
    spec, raw = src.spec, src.raw_config()
    config = {k: v for k, v in raw.items() if k not in DROP_KEYS}
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", spec.rope_type or "default")
    config.pop("rope_scaling", None)
    config.pop("rope_theta", None)
    rope["rope_theta"] = float(spec.rope_theta) ** (dim / spec.head_dim)  # pair i keeps frequency theta^(-2i/D)
    windows_ = [w for w in spec.layer_windows if w is not None]
    config.update(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        head_dim=dim,
        attention_bias=bias,
        rope_parameters=rope,
        use_sliding_window=bool(windows_),
        sliding_window=windows_[0] if windows_ else None,
        max_window_layers=spec.num_layers,
        layer_types=["sliding_attention" if w else "full_attention" for w in spec.layer_windows],
    )
    if len(set(windows_)) > 1:
        raise AttnkitError(f"{spec.model_type}: several sliding window sizes; Qwen3 has one")
    return config


def _rope_frequencies(config: dict):
    """(inv_freq [D/2], attention scaling) that transformers computes for a config dict."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(**config)
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        import torch

        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.double(), float(scale)


def check_rope(src, config: dict) -> None:
    """Refuse a pad conversion whose RoPE (type, scaling) would not keep the source frequencies."""
    source_inv, source_scale = _rope_frequencies(src.raw_config())
    new_inv, new_scale = _rope_frequencies(config)
    half = source_inv.shape[0]
    rel = float(((new_inv[:half] - source_inv) / source_inv).abs().max())
    if rel > 1e-6 or abs(new_scale - source_scale) > 1e-6:
        raise AttnkitError(
            f"RoPE type {config['rope_parameters'].get('rope_type')!r} does not keep its frequencies "
            f"when head_dim grows (relative change {rel:.2g}); use --method kl or lsq"
        )


def qwen3_name(src, role: str, layer: int) -> str:
    """The name of a tensor the source lacks and Qwen3 has (q_norm, o_bias, ...), by role from the registry."""
    return QWEN3.tensor_name(role, layer, src.prefix)


def check_loads(folder) -> None:
    """The written folder is a Qwen3 checkpoint whose tensors match what Qwen3ForCausalLM expects."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    if config.model_type != "qwen3":
        raise AttnkitError(f"{folder}: wrote a {config.model_type} config, expected qwen3")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    with LazyReader(safetensors_files(folder)) as reader:
        got = {n: tuple(reader.info(n).shape) for n in reader.names()}
    if config.tie_word_embeddings:
        want.pop(QWEN3.head_name, None)
        got.pop(QWEN3.head_name, None)
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise AttnkitError(f"{folder}: tensors do not match Qwen3ForCausalLM, e.g. {diff[0]}")
