"""The validation layer every command runs before work: config values, and every tensor the config implies."""

from __future__ import annotations

import json
import time

import pytest
from safetensors.torch import load_file, save_file

from attnkit.archs.spec import attention_spec
from attnkit.cli import app
from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_NAME
from tests.helpers import char_tokenizer
from tests.tiny import extra_model

#: (command line after the model and output folder) for every command that reads a checkpoint's weights;
#: "OUT" is replaced by a fresh output folder.
COMMANDS = {
    "inspect": ["inspect", "MODEL"],
    "kvmem": ["kvmem", "MODEL"],
    "convert mqa": ["convert", "mqa", "MODEL", "OUT"],
    "retrofit softcap": ["retrofit", "softcap", "MODEL", "OUT", "--attn-cap", "30"],
    "eval": ["eval", "MODEL", "--text", "some words to score " * 20, "--seq-len", "16"],
}


def _run(runner, name, model, tmp_path):
    out = tmp_path / f"out-{name.replace(' ', '-')}"
    args = [str(model) if a == "MODEL" else str(out) if a == "OUT" else a for a in COMMANDS[name]]
    return runner.invoke(app, args), out


def _assert_refused(result, out, words):
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert lines[-1].startswith("error: ") and words in lines[-1], result.output
    assert not out.exists()


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return folder


def _drop_tensors(folder, *names):
    path = folder / "model.safetensors"
    state = load_file(path)
    for name in names:
        del state[name]
    save_file(state, path, metadata={"format": "pt"})
    return folder


# ------------------------------------------------------------------ config values


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_hidden_layers": -2}, "num_hidden_layers = -2 must be at least 1"),
        ({"num_attention_heads": 8.5}, "num_attention_heads = 8.5 must be a whole number"),
        ({"num_key_value_heads": 0}, "num_key_value_heads = 0 must be at least 1"),
        ({"num_key_value_heads": [8]}, "num_key_value_heads = [8] must be a whole number"),
        ({"num_hidden_layers": 50_000_000}, "num_hidden_layers = 50000000 is over the limit of 4,096"),
        ({"hidden_size": True}, "hidden_size = True must be a whole number"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": "big"}},
            "rope_parameters.rope_theta = 'big' must be a number",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
            "rope_parameters.rope_theta = nan must be a positive number",
        ),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings = 'no' must be true or false"),
        ({"model_type": ["llama"]}, "unsupported model_type ['llama']"),
    ],
)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_bad_config_values_are_refused_by_every_command(runner, tiny, tmp_path, command, changes, words):
    model = _edit_config(tiny("llama"), **changes)
    started = time.perf_counter()
    result, out = _run(runner, command, model, tmp_path)
    _assert_refused(result, out, words)
    assert time.perf_counter() - started < 20  # refused from the config, not after building 50M layers


def test_non_utf8_config_is_one_clean_line(runner, tiny, tmp_path):
    model = tiny("llama")
    (model / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    result, out = _run(runner, "inspect", model, tmp_path)
    _assert_refused(result, out, "config.json: invalid JSON (not UTF-8 text (byte 18))")


def test_values_that_kvmem_would_turn_into_negative_bytes_never_reach_it():
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "hidden_size": 64,
        "num_key_value_heads": -4,
    }
    with pytest.raises(AttnkitError, match="num_key_value_heads = -4 must be at least 1"):
        attention_spec(config)


def test_hidden_smaller_than_heads_without_head_dim(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 4}
    with pytest.raises(AttnkitError, match="hidden_size 4 is not a multiple of its 8 heads"):
        attention_spec(config)


# ------------------------------------------------------------------ completeness


@pytest.mark.parametrize(
    "missing",
    [
        "model.norm.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ],
)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_checkpoint_missing_a_tensor_is_refused_before_work(runner, tiny, tmp_path, command, missing):
    model = _drop_tensors(char_tokenizer(tiny("llama_gqa")), missing)
    result, out = _run(runner, command, model, tmp_path)
    _assert_refused(result, out, f"tensor(s) that its config implies are missing, e.g. {missing!r}")


def test_an_index_that_leaves_out_a_shard_is_refused(runner, tiny, tmp_path):
    model = char_tokenizer(tiny("llama_gqa", max_shard_size="100KB"))
    index = json.loads((model / INDEX_NAME).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last}
    (model / INDEX_NAME).write_text(json.dumps(index))
    for command in ("convert mqa", "inspect"):
        result, out = _run(runner, command, model, tmp_path)
        _assert_refused(result, out, "incomplete checkpoint")


def test_untied_head_is_required_and_tied_head_is_not(runner, tiny, tmp_path):
    untied = _drop_tensors(tiny("llama"), "lm_head.weight")
    result, out = _run(runner, "inspect", untied, tmp_path)
    _assert_refused(result, out, "e.g. 'lm_head.weight'")
    tied = tiny("gemma")  # ties lm_head to the embeddings: no lm_head.weight is stored
    result, _ = _run(runner, "inspect", tied, tmp_path)
    assert result.exit_code == 0, result.output


def test_attention_shapes_must_match_the_config(runner, tiny, tmp_path):
    model = _edit_config(tiny("llama_gqa"), num_key_value_heads=4)  # the weights hold 2 KV heads
    result, out = _run(runner, "convert mqa", model, tmp_path)
    _assert_refused(
        result,
        out,
        "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [16, 64] but the config implies [32, 64]",
    )


def test_weights_the_header_check_leaves_to_transformers_are_refused_when_loading(tmp_path):
    """Qwen3-MoE routers are not in the architecture's required list; transformers' loading report is the
    second line of defence, so no weight is ever initialised at random."""
    from attnkit.runtime import load_model

    folder = tmp_path / "moe"
    extra_model("qwen3_moe").save_pretrained(folder)
    _drop_tensors(folder, "model.layers.1.mlp.gate.weight")
    with pytest.raises(
        AttnkitError, match="1 weight\\(s\\) the model needs are missing, e.g. 'model.layers.1.mlp.gate.weight'"
    ):
        load_model(str(folder), device="cpu")
