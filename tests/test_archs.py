"""Architecture registry: schema strictness, templates against real transformers state dicts, specs."""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources

import pytest

from attnkit import archs
from attnkit.archs import all_archs, get_arch, supported_model_types
from attnkit.archs.schema import validate_arch
from attnkit.archs.spec import attention_spec
from attnkit.archs.tensors import check_tensors, expected_names, find_prefix, role_shape
from attnkit.errors import AttnkitError
from tests.tiny import build_model, extra_model


def _llama_doc() -> dict:
    return json.loads(resources.files("attnkit.archs").joinpath("data", "llama.json").read_text())


# ---------------------------------------------------------------- schema


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.update(colour="red"), "unknown keys ['colour']"),
        (lambda d: d["tensors"].pop("v"), "needs tensor roles ['v']"),
        (lambda d: d.update(position="sinusoidal"), "'position' is 'sinusoidal'"),
        (lambda d: d.update(qkv_layout="interleaved"), "'qkv_layout' is 'interleaved'"),
        (lambda d: d.pop("causal"), "missing keys ['causal']"),
        (lambda d: d["config"].update(heads=["n_head"]), "unknown config roles ['heads']"),
        (lambda d: d["config"].pop("num_heads"), "missing config roles ['num_heads']"),
        (lambda d: d["tensors"].update(q="layers.0.q.weight"), "must be a template containing '{i}'"),
        (lambda d: d["tensors"].update(qq="layers.{i}.qq.weight"), "unknown tensor roles ['qq']"),
        (lambda d: d.update(qk_norm="per_head"), "q_norm/k_norm tensor roles missing"),
        (lambda d: d.update(causal="yes"), "'causal' must be bool"),
        (lambda d: d.pop("required"), "missing keys ['required']"),
        (lambda d: d["required"].update(layer=["layers.0.mlp.down_proj.weight"]), "must contain '{i}'"),
        (lambda d: d["required"].update(layer=["layers.{i}.experts.{e}.w1.weight"]), "no num_experts role is mapped"),
        (lambda d: d["required"].update(head=["lm_head.weight"]), "'required.head' must be a string"),
        (lambda d: d["required"].update(extra=[]), "'required' takes keys"),
        (lambda d: d["other_tensors"].update(mlp="layers.{i}.mlp.weight"), "unknown other_tensors roles ['mlp']"),
        (lambda d: d["other_tensors"].update(embed="layers.{i}.embed.weight"), "'embed' must not contain '{i}'"),
        (lambda d: d["other_tensors"].update(input_norm="input_norm.weight"), "'input_norm' must contain '{i}'"),
        (lambda d: d["other_tensors"].update(final_norm=["norm.weight"]), "'final_norm' must be a string"),
        (lambda d: d["required"]["model"].append("norm.weight"), "has a role in other_tensors: list it once"),
    ],
)
def test_schema_rejects_bad_documents_naming_the_file(mutate, needle):
    doc = _llama_doc()
    mutate(doc)
    with pytest.raises(AttnkitError) as err:
        validate_arch(doc, "broken.json")
    assert "broken.json" in str(err.value)
    assert needle in str(err.value)


def test_every_shipped_file_validates_and_claims_distinct_model_types():
    files = sorted(
        p.name for p in resources.files("attnkit.archs").joinpath("data").iterdir() if p.name.endswith(".json")
    )
    families = {a.family for a in all_archs()}
    assert {f.removesuffix(".json") for f in files} == families
    for arch in all_archs():
        assert validate_arch(copy.deepcopy(arch.data), arch.family) == arch.data
    assert {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "phi3",
        "olmo2",
        "gpt2",
        "gpt_neox",
        "bert",
        "deepseek_v2",
        "deepseek_v3",
        "gpt_oss",
    } <= set(supported_model_types())


def test_a_familys_own_model_type_reads_its_file_alone():
    """get_arch("llama") reads llama.json and no other file (a cold `attnkit kvmem`); a model_type named by no
    file (gemma3_text) reads them all; both give what the registry holds."""
    archs._load.cache_clear()
    archs._registry.cache_clear()
    llama = get_arch("llama")
    assert archs._load.cache_info().currsize == 1
    assert get_arch("gemma3_text").family == "gemma3"
    assert archs._load.cache_info().currsize == len(all_archs())
    assert llama is archs._registry()["llama"]
    for model_type in supported_model_types():
        assert get_arch(model_type) is archs._registry()[model_type]


def test_unknown_model_type_lists_supported_ones():
    with pytest.raises(AttnkitError) as err:
        get_arch("falcon_h9")
    message = str(err.value)
    assert "'falcon_h9'" in message
    for model_type in supported_model_types():
        assert model_type in message


# ---------------------------------------------------------------- templates vs real state dicts


@cache
def _tiny(name: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json as saved, {tensor name: shape}) of a tiny random model."""
    import tests.tiny

    model = build_model(name) if name in tests.tiny.FAMILIES else extra_model(name)
    config = json.loads(model.config.to_json_string())
    return config, {k: tuple(v.shape) for k, v in model.state_dict().items()}


# name -> prefix, H, Hkv, D, Dv, windows, attention cap, final cap, qk_norm, roles present in the state dict
SEP = {"q", "k", "v", "o"}
BIAS3 = {"q_bias", "k_bias", "v_bias"}
CASES = {
    "llama": ("model.", 8, 8, 8, 8, (None, None), None, None, "none", SEP),
    "llama_gqa": ("model.", 8, 2, 8, 8, (None, None), None, None, "none", SEP),
    "llama_bias": ("model.", 8, 4, 8, 8, (None, None), None, None, "none", SEP | BIAS3 | {"o_bias"}),
    "mistral": ("model.", 8, 4, 8, 8, (16, 16), None, None, "none", SEP),
    "mixtral": ("model.", 8, 2, 8, 8, (16, 16), None, None, "none", SEP),
    "qwen2": ("model.", 8, 4, 8, 8, (None, None), None, None, "none", SEP | BIAS3),
    "qwen3": ("model.", 8, 4, 8, 8, (None, None), None, None, "per_head", SEP | {"q_norm", "k_norm"}),
    "qwen3_moe": ("model.", 8, 2, 8, 8, (None, None), None, None, "per_head", SEP | {"q_norm", "k_norm"}),
    "gemma": ("model.", 8, 4, 8, 8, (None, None), None, None, "none", SEP),
    "gemma2": ("model.", 8, 4, 8, 8, (16, None), 50.0, 30.0, "none", SEP),
    # two layers are both before the 6th (global) layer of Gemma 3's pattern
    "gemma3": ("model.", 8, 4, 8, 8, (16, 16), None, None, "per_head", SEP | {"q_norm", "k_norm"}),
    "phi3": ("model.", 8, 4, 8, 8, (None, None), None, None, "none", {"qkv", "o"}),
    "olmo2": ("model.", 8, 4, 8, 8, (None, None), None, None, "full", SEP | {"q_norm", "k_norm"}),
    "gpt2": ("transformer.", 8, 8, 8, 8, (None, None), None, None, "none", {"qkv", "qkv_bias", "o", "o_bias"}),
    "gpt_neox": ("gpt_neox.", 8, 8, 8, 8, (None, None), None, None, "none", {"qkv", "qkv_bias", "o", "o_bias"}),
    "bert": ("encoder.", 8, 8, 8, 8, (None, None), None, None, "none", SEP | BIAS3 | {"o_bias"}),
    "gpt_oss": ("model.", 8, 2, 8, 8, (16, None), None, None, "none", SEP | BIAS3 | {"o_bias", "sinks"}),
    # MLA: H = Hkv = 8 (every head has its own up-projected key), D = nope 8 + rope 4
    "deepseek_v2": ("model.", 8, 8, 12, 8, (None, None), None, None, "none", {"q", "kv_a", "kv_a_norm", "kv_b", "o"}),
    "deepseek_v3": (
        "model.",
        8,
        8,
        12,
        8,
        (None, None),
        None,
        None,
        "none",
        {"q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "o"},
    ),
    "deepseek_v3_bias": (
        "model.",
        8,
        8,
        12,
        8,
        (None, None),
        None,
        None,
        "none",
        {"q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a", "kv_a_bias", "kv_a_norm", "kv_b", "o", "o_bias"},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_templates_match_real_state_dicts(name):
    prefix, h, hkv, d, dv, windows, cap, final_cap, qk_norm, present = CASES[name]
    config, shapes = _tiny(name)
    arch = get_arch(config["model_type"])
    spec = attention_spec(config)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim) == (h, hkv, d, dv)
    assert spec.layer_windows == windows
    assert (spec.attn_softcap, spec.final_softcap, spec.qk_norm) == (cap, final_cap, qk_norm)
    assert find_prefix(arch, shapes) == prefix
    assert present <= set(arch.tensors)
    for role in arch.tensors:
        for layer in range(spec.num_layers):
            name_ = arch.tensor_name(role, layer, prefix)
            assert (name_ in shapes) == (role in present), (role, name_)
            if role in present:
                assert shapes[name_] == role_shape(arch, spec, role), (role, name_)


@pytest.mark.parametrize("name", sorted(CASES))
def test_required_tensors_are_what_save_pretrained_writes(name, tmp_path):
    """Every tensor the check expects is in a saved checkpoint, and taking any one of them out is caught."""
    import tests.tiny
    from attnkit.io.checkpoint import safetensors_files
    from attnkit.io.safetensors_header import read_headers

    model = build_model(name) if name in tests.tiny.FAMILIES else extra_model(name)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    shapes = {n: i.shape for n, i in read_headers(safetensors_files(tmp_path)).items()}
    arch, spec = get_arch(config["model_type"]), attention_spec(config)
    prefix = check_tensors(arch, spec, config, shapes, tmp_path)
    expected = expected_names(arch, spec, config, prefix)
    assert len(set(expected)) == len(expected) and set(expected) <= set(shapes)
    for missing in expected:
        with pytest.raises(AttnkitError, match=f"e.g. {missing!r}"):
            check_tensors(arch, spec, config, {n: s for n, s in shapes.items() if n != missing}, tmp_path)


def test_shapes_written_out_for_gqa_fused_and_mla():
    config, shapes = _tiny("llama_gqa")  # H=8, Hkv=2, D=8, d=64
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2 * 8, 64)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (8 * 8, 64)
    config, shapes = _tiny("phi3")  # fused rows: H*D + 2*Hkv*D = 64 + 32 + 32
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (128, 64)
    config, shapes = _tiny("gpt2")  # Conv1D stores [in, out]: 64 x 3*64
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (64, 192)
    config, shapes = _tiny("deepseek_v3")  # kv_a rows: latent 16 + rope 4; kv_b rows: H*(nope 8 + v 8)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (20, 64)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (128, 16)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"] == (8 * 12, 24)


# ---------------------------------------------------------------- roles outside attention do what their names say


def _layer_parts(model, arch, prefix: str, layer: int):
    """(attention module, MLP module) of `layer`: the module of the o template and the layer's MLP child."""
    from attnkit.runtime.calibrate import attention_module_name

    attention = model.get_submodule(attention_module_name(arch.tensors["o"], prefix, layer))
    block = model.get_submodule(attention_module_name(arch.tensors["o"], prefix, layer).rsplit(".", 1)[0])
    mlp = next(getattr(block, n) for n in ("mlp", "block_sparse_moe") if hasattr(block, n))
    return attention, mlp


@pytest.mark.parametrize("name", sorted(set(CASES) - {"bert"}))
def test_other_roles_are_the_tensors_their_names_say(name):
    """embed is the input embedding; each norm role's module feeds (or is fed by) what its name says, seen by
    running the tiny model: input_norm -> attention, attention -> post_attention_norm, pre_mlp_norm -> MLP,
    MLP -> post_mlp_norm, final_norm -> output head."""
    import torch

    import tests.tiny

    model = (build_model(name) if name in tests.tiny.FAMILIES else extra_model(name)).eval()
    config = json.loads(model.config.to_json_string())
    arch, spec = get_arch(config["model_type"]), attention_spec(config)
    prefix = find_prefix(arch, dict(model.state_dict()))
    assert {"embed", "final_norm"} <= set(arch.other_tensors)
    assert model.get_parameter(arch.tensor_name("embed", prefix=prefix)) is model.get_input_embeddings().weight
    seen: dict = {}

    def keep(key, where):
        def hook(_module, args, kwargs, output):
            inputs = args[0] if args else kwargs["hidden_states"]
            value = output[0] if isinstance(output, tuple) else output
            seen[key] = inputs if where == "in" else value

        return hook

    def module_of(role, layer=None):
        return model.get_submodule(arch.tensor_name(role, layer, prefix).removesuffix(".weight"))

    hooks = [module_of("final_norm").register_forward_hook(keep("final_norm", "out"), with_kwargs=True)]
    hooks.append(model.get_output_embeddings().register_forward_hook(keep("head", "in"), with_kwargs=True))
    for layer in range(spec.num_layers):
        attention, mlp = _layer_parts(model, arch, prefix, layer)
        for key, module, where in (
            ("attention in", attention, "in"),
            ("attention out", attention, "out"),
            ("mlp in", mlp, "in"),
            ("mlp out", mlp, "out"),
        ):
            hooks.append(module.register_forward_hook(keep((layer, key), where), with_kwargs=True))
        for role in ("input_norm", "pre_mlp_norm"):
            if role in arch.other_tensors:
                hooks.append(module_of(role, layer).register_forward_hook(keep((layer, role), "out"), with_kwargs=True))
        for role in ("post_attention_norm", "post_mlp_norm"):
            if role in arch.other_tensors:
                hooks.append(module_of(role, layer).register_forward_hook(keep((layer, role), "in"), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 100, (1, 12)))
    for hook in hooks:
        hook.remove()
    assert torch.equal(seen["final_norm"], seen["head"])
    pairs = {"input_norm": "attention in", "post_attention_norm": "attention out"}
    pairs |= {"pre_mlp_norm": "mlp in", "post_mlp_norm": "mlp out"}
    for layer in range(spec.num_layers):
        for role, other in pairs.items():
            if role in arch.other_tensors:
                assert torch.equal(seen[(layer, role)], seen[(layer, other)]), (role, layer)


# ---------------------------------------------------------------- find_prefix


def test_find_prefix_bare_and_task_head_names():
    _, shapes = _tiny("gpt2")
    hub_style = [n.removeprefix("transformer.") for n in shapes]  # the hub's gpt2 has no prefix
    assert find_prefix(get_arch("gpt2"), hub_style) == ""
    _, shapes = _tiny("bert")
    assert find_prefix(get_arch("bert"), ["bert." + n for n in shapes]) == "bert.encoder."


def test_find_prefix_prefers_the_prefix_matching_most_roles():
    _, shapes = _tiny("gemma3")
    language = ["model.language_model." + n.removeprefix("model.") for n in shapes]
    vision = [f"model.vision_tower.encoder.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]  # no o_proj
    assert find_prefix(get_arch("gemma3"), language + vision) == "model.language_model."


def test_find_prefix_errors_are_one_line():
    with pytest.raises(AttnkitError, match="no tensor matches the llama templates"):
        find_prefix(get_arch("llama"), ["transformer.h.0.attn.c_attn.weight"])
    _, shapes = _tiny("llama")
    twice = [p + n.removeprefix("model.") for n in shapes for p in ("a.", "b.")]
    with pytest.raises(AttnkitError, match="ambiguous llama tensor prefix: 'a.', 'b.'"):
        find_prefix(get_arch("llama"), twice)


# ---------------------------------------------------------------- spec rules from hand-written configs


def test_qwen2_window_starts_at_max_window_layers_when_enabled():
    base = {
        "model_type": "qwen2",
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "sliding_window": 32,
        "max_window_layers": 2,
    }
    assert attention_spec({**base, "use_sliding_window": True}).layer_windows == (None, None, 32, 32)
    assert attention_spec({**base, "use_sliding_window": False}).layer_windows == (None,) * 4
    assert attention_spec(base).layer_windows == (None,) * 4  # Qwen2Config defaults use_sliding_window=False


def test_qwen3_moe_window_needs_use_sliding_window():
    base = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "head_dim": 16,
        "sliding_window": 4096,
    }
    assert attention_spec(base).layer_windows == (None,) * 3
    assert attention_spec({**base, "use_sliding_window": True}).layer_windows == (4096,) * 3


def test_gemma3_old_hub_config_pattern_and_global_theta():
    config = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2560,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    }
    spec = attention_spec(config)
    # layers 6 and 12 (1-based) are global
    assert spec.layer_windows == (1024,) * 5 + (None,) + (1024,) * 5 + (None,)
    assert (spec.rope_theta, spec.rope_type) == (1000000.0, "linear")


def test_gemma3_v5_rope_parameters_per_layer_type():
    config, _ = _tiny("gemma3")
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0
    assert attention_spec(config).rope_theta == 1000000.0


def test_layer_types_list_wins_over_the_rule():
    config = {
        "model_type": "gemma2",
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    }
    assert attention_spec(config).layer_windows == (None, 8, 8)  # the alternate rule would give (8, None, 8)


def test_gpt_oss_without_layer_types_alternates_like_transformers():
    import transformers

    config = {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_size": 64,
        "sliding_window": 128,
    }
    reference = transformers.GptOssConfig(**{k: v for k, v in config.items() if k != "model_type"}).layer_types
    assert reference == ["sliding_attention", "full_attention"] * 2
    assert attention_spec(config).layer_windows == (128, None, 128, None)


def test_gpt_neox_old_keys_and_defaults():
    base = {"model_type": "gpt_neox", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512}
    old = attention_spec({**base, "rotary_pct": 0.5, "rotary_emb_base": 20000})
    assert (old.partial_rotary_factor, old.rope_theta, old.head_dim) == (0.5, 20000.0, 64)
    assert attention_spec(base).partial_rotary_factor == 0.25  # GPTNeoXConfig's default rotary_pct


def test_gemma3_multimodal_config_reads_text_config(tmp_path):
    from attnkit.io.config import read_config

    text = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2560,
        "sliding_window": 1024,
    }
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "gemma3", "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}}
        )
    )
    spec = attention_spec(read_config(tmp_path / "config.json"))
    assert (spec.family, spec.num_kv_heads, spec.qk_norm) == ("gemma3", 4, "per_head")
    assert spec.layer_windows == (1024,) * 5 + (None,)


# ---------------------------------------------------------------- real checkpoints


def test_real_minilm_bert_through_inspect():
    from attnkit.commands.analyse.inspect import inspect_model
    from attnkit.commands.analyse.modelinfo import model_info
    from attnkit.realmodels import minilm_folder

    folder = minilm_folder()
    doc = inspect_model(str(folder))
    s = doc["summary"]
    # all-MiniLM-L6-v2: 6 layers, hidden 384, 12 heads of 32
    assert (s["family"], s["layers"], s["query heads (H)"], s["KV heads (Hkv)"], s["head dim (D)"]) == (
        "bert",
        6,
        12,
        12,
        32,
    )
    assert s["position"] == "absolute" and doc["spec"]["causal"] is False and "encoder" in s["note"]
    info = model_info(str(folder))
    arch = get_arch("bert")
    prefix = find_prefix(arch, info.tensor_names)
    assert prefix == "encoder."
    for role in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"):
        for layer in range(6):
            assert arch.tensor_name(role, layer, prefix) in info.tensor_names


@pytest.mark.real_model
def test_real_smollm2_through_inspect():
    from attnkit.commands.analyse.inspect import inspect_model
    from attnkit.commands.analyse.modelinfo import model_info
    from attnkit.io.safetensors_header import read_headers
    from attnkit.realmodels import smollm2_folder

    folder = smollm2_folder()
    doc = inspect_model(str(folder))
    s = doc["summary"]
    assert (s["family"], s["layers"], s["query heads (H)"], s["KV heads (Hkv)"], s["head dim (D)"]) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert s["variant"] == "GQA-3" and s["position"] == "default theta=100000"
    # 30 layers x 2 (K and V) x 3 heads x 64 dims x 2 bytes
    assert doc["kv_bytes_per_token_bf16"] == 30 * 2 * 3 * 64 * 2 == 23040
    info = model_info(str(folder))
    arch, spec = get_arch("llama"), info.spec
    headers = read_headers(sorted(folder.glob("*.safetensors")))
    prefix = find_prefix(arch, headers)
    assert prefix == "model."
    for role in ("q", "k", "v", "o"):
        for layer in range(30):
            assert headers[arch.tensor_name(role, layer, prefix)].shape == role_shape(arch, spec, role)
    assert headers["model.layers.29.self_attn.k_proj.weight"].shape == (3 * 64, 576)
