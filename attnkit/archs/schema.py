"""Strict schema for architecture data files (attnkit/archs/data/*.json)."""

from __future__ import annotations

from typing import Any

from attnkit.errors import AttnkitError

#: Config roles an architecture may map; each maps to a list of config keys tried in order
#: (dotted keys reach into nested dicts, e.g. "rope_parameters.rope_theta").
CONFIG_ROLES = {
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "max_positions",
    "rope_theta",
    "rope_local_theta",
    "rope_type",
    "partial_rotary_factor",
    "sliding_window",
    "layer_types",
    "sliding_window_pattern",
    "max_window_layers",
    "use_sliding_window",
    "attn_softcap",
    "final_softcap",
    "query_pre_attn_scalar",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "mla_key_factors",
    "mla_plain_layers",
    "mla_plain_kv_heads",
    "mla_layer_shapes",
    "num_experts",
    "moe_intermediate_size",
    "num_shared_experts",
    "first_dense_layers",
    "tie_word_embeddings",
    "attention_bias",
}
REQUIRED_CONFIG_ROLES = {"num_layers", "num_heads", "hidden_size"}

#: Per-layer tensor roles; templates use "{i}" for the layer index and are relative to the
#: checkpoint's prefix (found by matching against the tensor names).
TENSOR_ROLES = {
    "q",
    "k",
    "v",
    "o",
    "qkv",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "q_a",
    "q_a_bias",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_bias",
    "kv_a_norm",
    "kv_b",
    "q_rms",
    "k_rms",
    "sinks",
}

#: Roles of tensors outside attention that every checkpoint of a family holds: "model" roles once (a name relative
#: to the prefix), "layer" roles in every layer (a template with "{i}"). Norm roles name the norm's weight.
OTHER_ROLES = {
    "embed": "model",  # the token embeddings [vocab_size, hidden_size]
    "final_norm": "model",  # the norm before the output head
    "input_norm": "layer",  # the norm of the attention's input (pre-norm layers)
    "post_attention_norm": "layer",  # the norm of the attention's output, before the residual add (Gemma 2/3, OLMo 2)
    "pre_mlp_norm": "layer",  # the norm of the MLP's input (Llama's post_attention_layernorm, GPT-2's ln_2)
    "post_mlp_norm": "layer",  # the norm of the MLP's output, before the residual add (Gemma 2/3, OLMo 2)
}

ENUMS = {
    "position": {"rope", "absolute", "alibi", "none"},
    "sliding_rule": {"none", "all", "layer_types", "alternate", "pattern", "max_window_layers"},
    "qk_norm": {"none", "per_head", "full"},
    "qkv_layout": {"separate", "fused_concat", "fused_per_head", "conv1d_concat", "mla"},
    "mlp": {"gated", "plain", "moe"},
}

TOP_LEVEL = {
    "family": str,
    "model_types": list,
    "description": str,
    "causal": bool,
    "position": str,
    "sliding_rule": str,
    "qk_norm": str,
    "qkv_layout": str,
    "mlp": str,
    "kv_heads_configurable": bool,
    "config": dict,
    "defaults": dict,
    "tensors": dict,
    "other_tensors": dict,
    "required": dict,
    "transformers_class": str,
    "norm_weight_offset": float,  # RMSNorm scales by offset + weight (Gemma: 1.0); absent: 0
    "notes": str,
}
REQUIRED_TOP_LEVEL = {
    "family",
    "model_types",
    "description",
    "causal",
    "position",
    "sliding_rule",
    "qk_norm",
    "qkv_layout",
    "mlp",
    "kv_heads_configurable",
    "config",
    "tensors",
    "required",
    "transformers_class",
}
#: Attention tensor roles every layer of a layout must have.
LAYOUT_ROLES = {
    "separate": {"q", "k", "v", "o"},
    "fused_concat": {"qkv", "o"},
    "fused_per_head": {"qkv", "o"},
    "conv1d_concat": {"qkv", "o"},
    "mla": {"kv_a", "kv_b", "o"},
}
#: Tensors besides attention and the other roles that a checkpoint must hold (relative to the prefix, like the
#: templates): "model" once, "layer" in every layer ("{e}" repeats a template per expert), "head" (the output head,
#: a full name) unless the config ties it to the embeddings.
REQUIRED_KEYS = {"model": list, "layer": list, "head": str}


def validate_arch(data: Any, source: str) -> dict:
    """Check an architecture document against the schema; raise AttnkitError naming `source`."""

    def bad(msg: str) -> AttnkitError:
        return AttnkitError(f"invalid architecture file {source}: {msg}")

    if not isinstance(data, dict):
        raise bad("top level must be an object")
    unknown = set(data) - set(TOP_LEVEL)
    if unknown:
        raise bad(f"unknown keys {sorted(unknown)}")
    missing = REQUIRED_TOP_LEVEL - set(data)
    if missing:
        raise bad(f"missing keys {sorted(missing)}")
    for key, typ in TOP_LEVEL.items():
        if key in data and not isinstance(data[key], typ):
            raise bad(f"'{key}' must be {typ.__name__}")
    for key, allowed in ENUMS.items():
        if data[key] not in allowed:
            raise bad(f"'{key}' is {data[key]!r}, expected one of {sorted(allowed)}")
    if not data["model_types"] or not all(isinstance(t, str) for t in data["model_types"]):
        raise bad("'model_types' must be a non-empty list of strings")

    config = data["config"]
    if set(config) - CONFIG_ROLES:
        raise bad(f"unknown config roles {sorted(set(config) - CONFIG_ROLES)}")
    if REQUIRED_CONFIG_ROLES - set(config):
        raise bad(f"missing config roles {sorted(REQUIRED_CONFIG_ROLES - set(config))}")
    for role, keys in config.items():
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise bad(f"config role '{role}' must be a non-empty list of key names")
    if set(data.get("defaults", {})) - CONFIG_ROLES:
        raise bad(f"unknown default roles {sorted(set(data['defaults']) - CONFIG_ROLES)}")

    tensors = data["tensors"]
    if set(tensors) - TENSOR_ROLES:
        raise bad(f"unknown tensor roles {sorted(set(tensors) - TENSOR_ROLES)}")
    for role, template in tensors.items():
        if not isinstance(template, str) or "{i}" not in template:
            raise bad(f"tensor role '{role}' must be a template containing '{{i}}'")
    layout = data["qkv_layout"]
    needs = LAYOUT_ROLES[layout]
    if needs - set(tensors):
        raise bad(f"qkv_layout '{layout}' needs tensor roles {sorted(needs - set(tensors))}")
    if data["qk_norm"] != "none" and not {"q_norm", "k_norm"} <= set(tensors):
        raise bad("qk_norm set but q_norm/k_norm tensor roles missing")
    _validate_other(data.get("other_tensors", {}), bad)
    _validate_required(data, bad)
    return data


def _validate_other(other: dict, bad) -> None:
    if set(other) - set(OTHER_ROLES):
        raise bad(f"unknown other_tensors roles {sorted(set(other) - set(OTHER_ROLES))}")
    for role, template in other.items():
        if not isinstance(template, str):
            raise bad(f"other_tensors role '{role}' must be a string")
        per_layer = OTHER_ROLES[role] == "layer"
        if ("{i}" in template) != per_layer:
            raise bad(f"other_tensors role '{role}' {'must' if per_layer else 'must not'} contain '{{i}}'")


def _validate_required(data: dict, bad) -> None:
    required = data["required"]
    if set(required) - set(REQUIRED_KEYS) or not {"model", "layer"} <= set(required):
        raise bad(f"'required' takes keys {sorted(REQUIRED_KEYS)} ('model' and 'layer' at least)")
    for key, typ in REQUIRED_KEYS.items():
        value = required.get(key, typ())
        if not isinstance(value, typ) or (typ is list and not all(isinstance(t, str) for t in value)):
            raise bad(f"'required.{key}' must be {'a list of strings' if typ is list else 'a string'}")
    named = set(data.get("other_tensors", {}).values())
    for template in [*required["model"], *required["layer"]]:
        if template in named:
            raise bad(f"required tensor {template!r} has a role in other_tensors: list it once, there")
    for template in required["layer"]:
        if "{i}" not in template:
            raise bad(f"required layer tensor {template!r} must contain '{{i}}'")
        if "{e}" in template and "num_experts" not in data["config"]:
            raise bad(f"required layer tensor {template!r} repeats per expert but no num_experts role is mapped")
