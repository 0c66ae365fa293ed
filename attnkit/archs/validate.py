"""Check the config values an architecture maps (types and sane bounds) before anything is derived from them."""

from __future__ import annotations

import math
import reprlib

from attnkit.archs import Arch
from attnkit.errors import AttnkitError

#: Bounds far above any published model, so a crafted config cannot make the work or memory explode.
MAX_LAYERS = 4096
MAX_HEADS = 65536
MAX_HEAD_DIM = 65536
MAX_WIDTH = 1 << 22  # hidden, intermediate and latent sizes
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 40
MAX_EXPERTS = 1 << 16

#: role -> (kind, lowest, highest); kinds: int, number (finite), bool, str, str_list, layer_list (distinct layer
#: indices, checked against num_layers). None values are absent.
#: num_experts may be 0: an all-dense DeepseekV3 (what convert mla writes) has no routed experts.
RULES: dict[str, tuple[str, float | None, float | None]] = {
    "num_layers": ("int", 1, MAX_LAYERS),
    "num_heads": ("int", 1, MAX_HEADS),
    "num_kv_heads": ("int", 1, MAX_HEADS),
    "head_dim": ("int", 1, MAX_HEAD_DIM),
    "hidden_size": ("int", 1, MAX_WIDTH),
    "vocab_size": ("int", 1, MAX_VOCAB),
    "intermediate_size": ("int", 1, MAX_WIDTH),
    "max_positions": ("int", 1, MAX_POSITIONS),
    "sliding_window": ("int", 1, MAX_POSITIONS),
    "sliding_window_pattern": ("int", 1, MAX_LAYERS),
    "max_window_layers": ("int", 0, MAX_LAYERS),
    "kv_lora_rank": ("int", 1, MAX_WIDTH),
    "q_lora_rank": ("int", 1, MAX_WIDTH),
    "qk_rope_head_dim": ("int", 1, MAX_HEAD_DIM),
    "qk_nope_head_dim": ("int", 1, MAX_HEAD_DIM),
    "v_head_dim": ("int", 1, MAX_HEAD_DIM),
    "mla_key_factors": ("int", 0, MAX_HEADS),
    "mla_plain_layers": ("layer_list", None, None),
    "mla_plain_kv_heads": ("int", 1, MAX_HEADS),
    "mla_layer_shapes": ("shape_list", None, None),
    "num_experts": ("int", 0, MAX_EXPERTS),
    "moe_intermediate_size": ("int", 1, MAX_WIDTH),
    "num_shared_experts": ("int", 0, MAX_EXPERTS),
    "first_dense_layers": ("int", 0, MAX_LAYERS),
    "rope_theta": ("number", 0, None),
    "rope_local_theta": ("number", 0, None),
    "partial_rotary_factor": ("number", 0, 1),
    "attn_softcap": ("number", 0, None),
    "final_softcap": ("number", 0, None),
    "query_pre_attn_scalar": ("number", 0, None),
    "rope_type": ("str", None, None),
    "layer_types": ("str_list", None, None),
    "use_sliding_window": ("bool", None, None),
    "tie_word_embeddings": ("bool", None, None),
    "attention_bias": ("bool", None, None),
}
#: The dtype names transformers turns a config's dtype (torch_dtype) into (torch's own attribute names).
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float",
    "half",
    "double",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "int8",
    "uint8",
)
#: Roles every config must give (MLA configs also their latent and head dims).
REQUIRED = ("num_layers", "num_heads", "hidden_size")
REQUIRED_MLA = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


#: RoPE types transformers computes frequencies for ("default" plus its ROPE_INIT_FUNCTIONS, 5.x).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
#: RoPE parameters that are positive numbers wherever a config gives them.
ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def check_rope(config: dict) -> None:
    """RoPE parameters (rope_scaling, rope_parameters and its per-layer-type entries, in a text_config too): a
    known type and positive finite numbers; one-line AttnkitError naming the key."""
    for where, holder in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(holder, dict):
            continue
        for key in ("rope_scaling", "rope_parameters"):
            block = holder.get(key)
            if block is None:
                continue
            if not isinstance(block, dict):
                raise AttnkitError(f"config value {where}{key} = {reprlib.repr(block)} must be an object")
            nested = [(f"{where}{key}.{k}", v) for k, v in block.items() if isinstance(v, dict)]
            for name, params in [(f"{where}{key}", block), *nested]:
                _check_rope_block(name, params)


def _check_rope_block(name: str, params: dict) -> None:
    kind = params.get("rope_type", params.get("type"))
    if kind is not None and kind not in ROPE_TYPES:
        raise AttnkitError(
            f"config value {name}.rope_type = {reprlib.repr(kind)} is not a RoPE type transformers "
            f"knows ({', '.join(ROPE_TYPES)})"
        )
    for key in ROPE_NUMBERS:
        value = params.get(key)
        problem = None if value is None else _problem(value, "number", 0, None)
        if problem:
            raise AttnkitError(f"config value {name}.{key} = {reprlib.repr(value)} {problem}")


def check_config(arch: Arch, config: dict) -> None:
    """Every role `arch` maps must hold a value of the right type within RULES' bounds, and RoPE parameters must
    make sense (check_rope); one-line AttnkitError."""
    check_rope(config)
    _check_dtype(config)
    required = REQUIRED + (REQUIRED_MLA if arch.qkv_layout == "mla" else ())
    for role in arch.data["config"]:
        key, value = arch.config_item(config, role)
        if value is None:
            if role in required:
                raise AttnkitError(f"config for {arch.family} lacks {' or '.join(arch.data['config'][role])}")
            continue
        problem = _problem(value, *RULES[role])
        if problem:
            raise AttnkitError(f"config value {key} = {reprlib.repr(value)} {problem}")
    layers = arch.config_value(config, "num_layers")
    layer_types = arch.config_value(config, "layer_types")
    if layer_types is not None and len(layer_types) != layers:
        raise AttnkitError(f"layer_types has {len(layer_types)} entries for {layers} layers")
    if "mla_plain_layers" in arch.data["config"]:
        key, plain = arch.config_item(config, "mla_plain_layers")
        outside = [i for i in plain or () if not 0 <= i < layers]
        if outside:
            raise AttnkitError(f"config value {key} names layer {outside[0]}; the model has {layers} layers")
    if "mla_layer_shapes" in arch.data["config"]:
        key, shapes = arch.config_item(config, "mla_layer_shapes")
        if shapes and len(shapes) != layers:
            raise AttnkitError(f"config value {key} has {len(shapes)} entries for {layers} layers")
        head_dim = arch.config_value(config, "head_dim")
        odd = [v for v in shapes or () if v and (v[1] % 2 or (head_dim and v[1] > head_dim))]
        if odd:
            raise AttnkitError(f"config value {key} gives a layer {odd[0][1]} RoPE dims; even, at most the head dim")


def _check_dtype(config: dict) -> None:
    """A dtype (torch_dtype) the config names is one transformers can turn into a torch dtype: else its tokenizer
    and config would not load later, after the weights had."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is not None and value not in DTYPES:
            raise AttnkitError(
                f"config value {key} = {reprlib.repr(value)} is not a dtype torch knows (float32, bfloat16, "
                "float16, float8_e4m3fn, ...)"
            )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(value, kind: str, low, high) -> str | None:
    """Why `value` breaks the rule, or None."""
    if kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "str":
        return None if isinstance(value, str) else "must be a string"
    if kind == "layer_list":
        ok = isinstance(value, list) and all(_whole(v) for v in value)
        return None if ok and len(set(value)) == len(value) else "must be a list of distinct layer indices"
    if kind == "shape_list":  # per layer: [] or [latent width, RoPE dims]
        ok = isinstance(value, list) and all(
            isinstance(v, list) and len(v) in (0, 2) and all(_whole(w) and 1 <= w <= MAX_WIDTH for w in v)
            for v in value
        )
        return None if ok else f"must be a list of [] or [latent width, RoPE dims] per layer (1..{MAX_WIDTH})"
    if kind == "str_list":
        ok = isinstance(value, list) and len(value) <= MAX_LAYERS and all(isinstance(v, str) for v in value)
        return None if ok else f"must be a list of at most {MAX_LAYERS} strings"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number" if kind == "number" else "must be a whole number"
    if kind == "int":
        if not isinstance(value, int):
            return "must be a whole number"
        if value < low:
            return f"must be at least {low}"
        if value > high:
            return f"is over the limit of {high:,}"
        return None
    if not math.isfinite(value) or value <= low or (high is not None and value > high):
        return f"must be a number in (0, {high}]" if high is not None else "must be a positive number"
    return None
