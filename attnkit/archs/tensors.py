"""Match an architecture's tensor-name templates to a checkpoint: the name prefix and expected shapes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from attnkit.archs import Arch
from attnkit.archs.schema import LAYOUT_ROLES, OTHER_ROLES
from attnkit.archs.spec import AttentionSpec
from attnkit.errors import AttnkitError


def find_prefix(arch: Arch, names: Iterable[str]) -> str:
    """The prefix that turns `arch`'s layer-0 templates into names present in `names`.

    E.g. "model." for Llama, "transformer." for a GPT2LMHeadModel, "" for the hub's gpt2,
    "bert.encoder." for a BertForMaskedLM. The prefix matching the most roles wins, so a vision
    tower that shares some names (q_proj, ...) with the language model does not confuse it.
    """
    names = set(names)
    votes: Counter[str] = Counter()
    for role in arch.tensors:
        suffix = arch.tensor_name(role, 0)
        for name in names:
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                if prefix == "" or prefix.endswith("."):
                    votes[prefix] += 1
    if not votes:
        raise AttnkitError(
            f"no tensor matches the {arch.family} templates (e.g. {arch.tensor_name('o', 0)!r}); "
            "is this checkpoint really that architecture?"
        )
    ranked = votes.most_common()
    best = [p for p, n in ranked if n == ranked[0][1]]
    if len(best) > 1:
        raise AttnkitError(f"ambiguous {arch.family} tensor prefix: {', '.join(repr(p) for p in sorted(best))}")
    return best[0]


def role_shape(arch: Arch, spec: AttentionSpec, role: str) -> tuple[int, ...]:
    """Shape a `role` tensor must have (PyTorch Linear layout: [out, in]; GPT-2 Conv1D: [in, out])."""
    d, h, hkv, dk, dv = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    fused = h * dk + hkv * dk + hkv * dv
    if spec.mla is not None:
        m = spec.mla
        q_in = m.q_lora_rank or d
        shapes = {
            "q": (h * dk, d),
            "q_a": (q_in, d),
            "q_a_bias": (q_in,),
            "q_a_norm": (q_in,),
            "q_b": (h * dk, q_in),
            "kv_a": (m.kv_lora_rank + m.qk_rope_head_dim, d),
            "kv_a_bias": (m.kv_lora_rank + m.qk_rope_head_dim,),
            "kv_a_norm": (m.kv_lora_rank,),
            "kv_b": (h * (m.qk_nope_head_dim + dv), m.kv_lora_rank),
            "q_rms": (h * m.qk_nope_head_dim, d),
            "k_rms": (m.key_factors * m.qk_nope_head_dim, d),
            "o": (d, h * dv),
            "o_bias": (d,),
        }
    else:
        per_head_norm = spec.qk_norm == "per_head"
        shapes = {
            "q": (h * dk, d),
            "k": (hkv * dk, d),
            "v": (hkv * dv, d),
            "o": (d, h * dv),
            "q_bias": (h * dk,),
            "k_bias": (hkv * dk,),
            "v_bias": (hkv * dv,),
            "o_bias": (d,),
            "qkv": (d, fused) if arch.qkv_layout == "conv1d_concat" else (fused, d),
            "qkv_bias": (fused,),
            "q_norm": (dk,) if per_head_norm else (h * dk,),
            "k_norm": (dk,) if per_head_norm else (hkv * dk,),
            "sinks": (h,),
        }
    if role not in shapes:
        raise AttnkitError(f"tensor role {role!r} has no shape rule for {arch.family} ({arch.qkv_layout})")
    return shapes[role]


def _attention_roles(arch: Arch, spec: AttentionSpec) -> set[str]:
    """The attention tensor roles of a layer of `spec` (the layout's roles, QK-norm, MLA's norms)."""
    roles = set(LAYOUT_ROLES["mla" if spec.mla is not None else _plain_layout(arch)])
    if spec.qk_norm != "none":
        roles |= {"q_norm", "k_norm"}
    if spec.mla is not None:
        roles |= {"q_a", "q_a_norm", "q_b"} if spec.mla.q_lora_rank else {"q"}
        roles |= {r for r in ("kv_a_norm", "q_rms", "k_rms") if r in arch.tensors}
    return roles


def _plain_layout(arch: Arch) -> str:
    """The qkv layout of a layer without MLA: the architecture's own, or separate q/k/v for an MLA architecture's
    plain layers."""
    return "separate" if arch.qkv_layout == "mla" else arch.qkv_layout


def expected_names(arch: Arch, spec: AttentionSpec, config: dict, prefix: str) -> list[str]:
    """Every tensor the config implies the checkpoint holds: embeddings and final norm (other_tensors), attention
    per layer (the layout's roles, QK-norm, MLA's norms, biases when attention_bias is set), the layer's norms
    (other_tensors), the architecture's other required tensors (MLP, ...) and the (untied) head."""

    def attention(layer_spec: AttentionSpec) -> list[str]:
        roles = _attention_roles(arch, layer_spec)
        if "sinks" in arch.tensors:
            roles.add("sinks")
        if arch.config_value(config, "attention_bias", False):
            roles |= {r for r in arch.tensors if r.endswith("_bias") and r.removesuffix("_bias") in roles}
        return sorted(roles)

    required = arch.data["required"]
    experts = range(arch.config_value(config, "num_experts") or 0)
    model_roles = [r for r, where in OTHER_ROLES.items() if where == "model" and r in arch.other_tensors]
    layer_roles = [r for r, where in OTHER_ROLES.items() if where == "layer" and r in arch.other_tensors]
    names = [arch.tensor_name(role, prefix=prefix) for role in model_roles]
    names += [prefix + t for t in required["model"]]
    for layer in range(spec.num_layers):
        names += [arch.tensor_name(role, layer, prefix) for role in attention(spec.layer_spec(layer))]
        names += [arch.tensor_name(role, layer, prefix) for role in layer_roles]
        for template in required["layer"]:
            if "{e}" in template:
                names += [prefix + template.format(i=layer, e=e) for e in experts]
            else:
                names.append(prefix + template.format(i=layer))
    if arch.head_name is not None and not arch.config_value(config, "tie_word_embeddings", False):
        names.append(arch.head_name)
    return names


#: safetensors dtype codes of floating-point tensors (what weights are stored as).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def check_tensors(
    arch: Arch,
    spec: AttentionSpec,
    config: dict,
    shapes: Mapping[str, tuple],
    where,
    dtypes: Mapping[str, str] | None = None,
) -> str:
    """Check that `shapes` (tensor name -> shape) holds every tensor the config implies, with attention tensors
    of the shapes it implies, embeddings and head of vocab_size x hidden_size rows, and (with `dtypes`,
    name -> safetensors dtype code) floating-point weights; returns the name prefix. AttnkitError naming `where`
    and the first problem."""
    prefix = find_prefix(arch, shapes)
    expected = expected_names(arch, spec, config, prefix)
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise AttnkitError(
            f"{where}: incomplete checkpoint: {len(missing)} tensor(s) that its config implies are "
            f"missing, e.g. {missing[0]!r} (an interrupted download, or an index that leaves out "
            "a shard?)"
        )
    for role in arch.tensors:
        for layer in range(spec.num_layers):
            name = arch.tensor_name(role, layer, prefix)
            if name not in shapes:
                continue
            implied = role_shape(arch, spec.layer_spec(layer), role)
            if tuple(shapes[name]) != implied:
                raise AttnkitError(
                    f"{where}: tensor {name!r} has shape {list(shapes[name])} but the config implies {list(implied)}"
                )
    _check_vocabulary(arch, spec, config, shapes, prefix, where)
    if dtypes is not None:
        for name in expected:
            if dtypes[name] not in FLOAT_DTYPES:
                raise AttnkitError(
                    f"{where}: tensor {name!r} is stored as {dtypes[name]}; weights must be floating "
                    f"point ({', '.join(FLOAT_DTYPES)})"
                )
    return prefix


def _check_vocabulary(
    arch: Arch, spec: AttentionSpec, config: dict, shapes: Mapping[str, tuple], prefix: str, where
) -> None:
    """The token embedding (the embed role) and the output head have one row of hidden_size values per vocabulary
    entry."""
    vocab = arch.config_value(config, "vocab_size")
    names = [arch.tensor_name("embed", prefix=prefix)] if "embed" in arch.other_tensors else []
    if arch.head_name is not None and arch.head_name in shapes:
        names.append(arch.head_name)
    for name in names:
        shape = tuple(shapes.get(name, ()))
        if len(shape) != 2 or (vocab is not None and shape[0] != vocab) or shape[1] != spec.hidden_size:
            raise AttnkitError(
                f"{where}: tensor {name!r} has shape {list(shape)} but the config implies "
                f"[{vocab if vocab is not None else 'vocab_size'}, {spec.hidden_size}] "
                "(vocab_size x hidden_size)"
            )
