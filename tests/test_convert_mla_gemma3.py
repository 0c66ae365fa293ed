"""`attnkit convert mla --target gemma3-mla` on tiny Gemma 3 checkpoints: exactness at full rank (QK-norm
included), the layout's cache and sliding windows, loading through attnkit, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit.cli import app
from attnkit.io.source import open_source
from tests.helpers import FAST_CALIB, one_line_error, tiny_source
from tests.tiny import build_model, save_model

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _gemma3(tmp_path: Path, **overrides) -> Path:
    """A tiny Gemma 3: MQA, head_dim 8, a 16-token window on layers 0 and 2, softmax scale 20^-1/2 (not D^-1/2)."""
    return tiny_source(
        tmp_path,
        "gemma3",
        head_dim=8,
        num_hidden_layers=3,
        sliding_window=16,
        query_pre_attn_scalar=20,
        layer_types=LAYER_TYPES,
        **{"num_key_value_heads": 1, **overrides},
    )


def _decode(out: Path) -> tuple[list, bool]:
    """Greedy decoding of 30 tokens after a 6-token prompt: (the cache's layers, whether one forward pass over the
    whole sequence predicts the tokens decoded)."""
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gen = model.generate(
            prompt, max_new_tokens=30, min_new_tokens=30, do_sample=False, return_dict_in_generate=True
        )
        logits = model(gen.sequences).logits
    return gen.past_key_values.layers, torch.equal(logits[0, 5:-1].argmax(-1), gen.sequences[0, 6:])


def _convert(runner, src: Path, out: Path, *args: str):
    return runner.invoke(
        app, ["convert", "mla", str(src), str(out), *FAST_CALIB, "--target", "gemma3-mla", *args, "--format", "json"]
    )


@pytest.fixture(scope="module")
def full_rank(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(source, result, report) of a conversion at P = D and a latent wider than the input, no o_proj refit."""
    from typer.testing import CliRunner

    tmp = tmp_path_factory.mktemp("gemma3_full_rank")
    src, out = _gemma3(tmp), tmp / "out"
    args = [
        "--kv-lora-rank",
        "72",
        "--rope-dim",
        "8",
        "--o-refit",
        "0",
        "--device",
        "cpu",
        "--sliding-layers",
        "convert",
    ]
    result = _convert(CliRunner(), src, out, *args)
    assert result.exit_code == 0, result.output
    return src, out, json.loads(result.stdout)


def test_full_rank_equals_the_source(full_rank):
    """P = D and a latent wider than the input: the result equals the source, QK-norm included (the layout applies
    its per-token RMS factors exactly), over 60 tokens, past the 16-token window, with the sliding and full
    layers' own RoPE bases and a softmax scale that is not D^-1/2; measured 7e-7 on logits of size 0.6."""
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401  (registers attnkit_gemma3_mla)

    src, out, report = full_rank
    assert report["target_model_type"] == "attnkit_gemma3_mla" and report["parameters"]["target"] == "gemma3-mla"
    assert all(row["qk_norm"] == "exact" and row["latent_norm"] == "none" for row in report["layers"])
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnkit_gemma3_mla" and config["architectures"] == ["Gemma3MLAForCausalLM"]
    assert config["layer_types"] == LAYER_TYPES and config["sliding_window"] == 16
    assert config["kv_lora_rank"] == report["kv_lora_rank"] - 1  # one key RMS factor per KV head beside it
    result_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = result_model(ids).logits, source(ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_full_rank_with_two_kv_heads_equals_the_source(runner, tmp_path):
    """Two KV heads whose raw keys differ by a factor of 2 (so their normalized keys, and the one shared RoPE key,
    agree): exact only if each query head's keys are scaled by its own group's cached RMS factor."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    src, out = _gemma3(tmp_path, num_key_value_heads=2), tmp_path / "out"
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith("k_proj.weight")]:
        tensors[name][8:] = 2 * tensors[name][:8]  # [Hkv*D, n]: KV head 1 = 2 x KV head 0
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    args = [
        "--kv-lora-rank",
        "72",
        "--rope-dim",
        "8",
        "--o-refit",
        "0",
        "--device",
        "cpu",
        "--sliding-layers",
        "convert",
    ]
    result = _convert(runner, src, out, *args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["kv_lora_rank"] == 70  # 72 less one factor per KV head
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("choice,exact", [("auto", True), ("fastest", False)])
def test_the_rope_key_keeps_the_pairs_whose_rotation_matters(runner, tmp_path, choice, exact):
    """Keys with no energy on pairs 0 and 2 of four (Gemma 3 270M's global layers put 0.1-0.4% of the logit energy on
    their 32 fastest of 128): with a 4-wide RoPE key, the rotation choice (the layout's default) keeps pairs 1 and 3,
    neither the fastest nor the slowest two, and the global layer is exact at full rank over 60 tokens, where
    theta 100 turns pair 3 by 1.9 radians; the fastest pairs (0 and 1) leave pair 3's rotation out and the logits
    move."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    rope = {"rope_type": "default", "rope_theta": 100.0}
    src, out = _gemma3(tmp_path, rope_parameters={"full_attention": rope, "sliding_attention": rope}), tmp_path / "o"
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith("k_proj.weight")]:
        tensors[name][[0, 2, 4, 6]] = 0  # [D, n]: pairs 0 and 2 are rows (0, 4) and (2, 6)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    args = ["--kv-lora-rank", "72", "--rope-dim", "4", "--o-refit", "0", "--device", "cpu", "--rope-pairs", choice]
    result = _convert(runner, src, out, *args)
    assert result.exit_code == 0, result.output
    report, config = json.loads(result.stdout), json.loads((out / "config.json").read_text())
    pairs = [1, 3] if exact else [0, 1]
    assert report["kept_layers"] == [0, 2] and report["layers"][1]["rope_pairs"] == pairs
    assert config["rope_pairs"] == [[], pairs, []]
    assert report["parameters"]["rope_pair_choice"] == ("rotation" if exact else "fastest")
    assert report["parameters"]["key_balance"] == 4.0  # the layout's own default (the stock target's is 0.5)
    assert report["parameters"]["center_keys"] is False  # each key is scaled by its own RMS factor
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    off = (got - want).abs().max() / want.abs().max()
    assert off < 1e-5 if exact else off > 1e-2


def test_rotation_pairs_are_refused_for_the_stock_target(runner, tmp_path):
    """The stock DeepseekV3's rotary embedding turns at the fastest pairs only: auto keeps them (the report says so),
    --rope-pairs rotation is refused there before any work, and a value outside the choices everywhere."""
    folder = tiny_source(tmp_path, "llama")
    args = ["convert", "mla", str(folder), str(tmp_path / "dry"), *FAST_CALIB, "--kv-budget", "0.5", "--dry-run"]
    dry = runner.invoke(app, [*args, "--format", "json"])
    assert dry.exit_code == 0, dry.output
    parameters = json.loads(dry.stdout)["parameters"]
    assert parameters["rope_pair_choice"] == "fastest"
    assert parameters["rope_pairs"] == list(range(parameters["rope_dim"] // 2))
    for value, needle in (("rotation", "needs a layout whose RoPE key turns at any"), ("slow", "--rope-pairs must")):
        out = tmp_path / f"out-{value}"
        args = ["convert", "mla", str(folder), str(out), *FAST_CALIB, "--kv-budget", "0.5", "--rope-pairs", value]
        one_line_error(runner.invoke(app, args), 2, needle)
        assert not out.exists()


def test_a_config_naming_impossible_rope_pairs_is_refused_when_built():
    """rope_pairs must name P/2 distinct pairs of the head in ascending order: anything else fails when the layer
    is built, naming the layer, not later inside the rotary embedding."""
    from attnkit.modeling.gemma3_mla import Gemma3MLAConfig, Gemma3MLAForCausalLM

    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    base |= dict(num_key_value_heads=1, head_dim=8, kv_lora_rank=8, qk_rope_head_dim=4)
    Gemma3MLAForCausalLM(Gemma3MLAConfig(**base, rope_pairs=[[1, 3]]))  # two of the head's four pairs
    for bad in ([[3, 1]], [[1, 1]], [[1, 4]], [[0, 1, 2]]):
        with pytest.raises(ValueError, match="rope_pairs of layer 0"):
            Gemma3MLAForCausalLM(Gemma3MLAConfig(**base, rope_pairs=bad))


def test_budget_output_caches_the_latent_and_decodes_as_it_scores(runner, tmp_path):
    """At half the cache the result generates with a cache of R latent and P RoPE-key values per token and layer,
    the sliding layers holding at most the window, and greedy decoding agrees with one forward pass over its
    output (the cache and the masks agree); `attnkit eval --reference` loads it and reports by distance."""

    import attnkit.modeling  # noqa: F401

    src, out = _gemma3(tmp_path), tmp_path / "out"
    result = _convert(runner, src, out, "--kv-budget", "0.5", "--device", "cpu", "--sliding-layers", "convert")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rank, rope = report["kv_lora_rank"], report["rope_dim"]
    assert report["kept_layers"] == [] and rank + rope == 8 and report["kv_bytes_per_token"]["elements_after"] == 8
    assert open_source(str(out), "inspect").spec.kv_elements_per_token() == 8  # what kvmem and inspect count
    cache, agrees = _decode(out)
    shapes = [(layer.keys.shape[-2:], layer.values.shape[-1]) for layer in cache]
    assert [v for _, v in shapes] == [rope] * 3 and all(k[-1] == rank for k, _ in shapes)
    assert [k[0] for k, _ in shapes] == [15, 35, 15]  # sliding layers keep window - 1 tokens, the full one all
    assert agrees
    scored = runner.invoke(
        app, ["eval", str(out), "--reference", str(src), "--text", "abc " * 130, "--seq-len", "256", "--format", "json"]
    )
    assert scored.exit_code == 0, scored.output
    by_distance = json.loads(scored.stdout)["by_distance"]
    assert by_distance and all(b["kl_mean"] is not None and b["kl_mean"] >= 0 for b in by_distance)


def test_final_cap_is_applied_once(runner, full_rank, tmp_path):
    """The layout keeps Gemma3ForCausalLM's own final soft-cap: attnkit's loader must not add its own on top."""
    from attnkit.runtime import load_model

    _, out, _ = full_rank
    capped = tmp_path / "capped"
    result = runner.invoke(app, ["retrofit", "softcap", str(out), str(capped), "--final-cap", "0.05"])
    assert result.exit_code == 0, result.output
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        raw = load_model(out, device="cpu").model(ids).logits
        got = load_model(capped, device="cpu").model(ids).logits
    assert raw.abs().max() > 0.1  # the cap bites
    torch.testing.assert_close(got, 0.05 * torch.tanh(raw / 0.05), rtol=1e-4, atol=1e-6)


def test_verify_refuses_the_layout(runner, full_rank):
    _, out, _ = full_rank
    one_line_error(runner.invoke(app, ["verify", str(out)]), 1, "runs in transformers only")


@pytest.mark.parametrize(
    "family,args,code,needle",
    [
        ("gemma3", [], 1, "pass --target gemma3-mla"),
        ("llama", ["--target", "gemma3-mla"], 1, "--target gemma3-mla takes gemma3 sources, not llama"),
        ("gemma3", ["--target", "gemma3-mla", "--engine", "vllm"], 2, "runs in transformers only"),
        ("gemma3", ["--target", "gemma3-mla", "--latent-norm", "bias"], 2, "leave --latent-norm bias out"),
        ("gemma3", ["--target", "deepseek"], 2, "--target must be one of deepseek-v3, gemma3-mla"),
    ],
)
def test_target_refusals_are_one_line_before_work(runner, tmp_path, family, args, code, needle):
    folder = tmp_path / family
    save_model(build_model(family, num_key_value_heads=1), folder)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mla", str(folder), str(out), *FAST_CALIB, "--kv-budget", "0.5", *args])
    one_line_error(result, code, needle)
    assert not out.exists()


def test_the_target_route_is_the_sources_and_the_request_is_not_edited(tmp_path):
    """check_request gives the source the target's route (engine transformers, no latent norm) and leaves the request
    as it was, so checking it again gives the same."""
    import dataclasses

    from attnkit.commands.convert.mla_request import MLARequest, Route, check_request

    calib = tmp_path / "calib.txt"
    calib.write_text("calibration text " * 100)
    req = MLARequest(
        model=str(_gemma3(tmp_path)),
        out=tmp_path / "out",
        calib=[str(calib)],
        calib_tokens=512,
        calib_seq_len=128,
        target="gemma3-mla",
        kv_budget=0.5,
    )
    before = dataclasses.asdict(req)
    assert check_request(req).route == Route("transformers", "none")
    assert dataclasses.asdict(req) == before
    assert check_request(req).route == Route("transformers", "none")


@pytest.mark.parametrize(
    "budget,kv_heads,split",
    # D = 8: the source caches 16 values per KV head; 12 of them could hold every key dimension and a latent of 4
    [(0.75, 1, (8, 4)), (0.5, 1, (6, 2)), (0.5, 2, (12, 4))],
)
def test_a_budget_splits_one_kv_head_as_it_splits_more(tmp_path, budget, kv_heads, split):
    """--target gemma3-mla --kv-budget: one KV head gets the usual split (P the largest power of two <= total / 3),
    not every key dimension in the RoPE key where the budget would hold it (keys exact, the latent for the values:
    worse on Gemma 3 270M at every budget measured, docs/convert-mla.md "### Sliding layers kept")."""
    from attnkit.commands.convert.mla_request import MLARequest, check_request

    calib = tmp_path / "calib.txt"
    calib.write_text("calibration text " * 100)
    src = _gemma3(tmp_path, num_key_value_heads=kv_heads)
    req = MLARequest(
        model=str(src),
        out=tmp_path / "out",
        calib=[str(calib)],
        calib_tokens=512,
        calib_seq_len=128,
        target="gemma3-mla",
        kv_budget=budget,
        sliding_layers="convert",
    )
    checked = check_request(req)
    assert (checked.rank, checked.shape.rope_dim) == split


def test_each_target_is_one_object_and_its_layout_lives_outside_commands():
    """--target names one MLATarget (attnkit.commands.convert.mla_target.TARGETS); the layouts' tensors are written
    in attnkit.ops and their classes live in transformers or attnkit.modeling, so no module under attnkit/commands
    spells an MLA layout's attention tensor names."""
    from pathlib import Path

    from attnkit.commands.convert.mla_target import TARGETS

    for name, target in TARGETS.items():
        assert target.name == name
        assert target.model_class().__module__.split(".")[0] in ("transformers", "attnkit")
        assert not target.model_class().__module__.startswith("attnkit.commands")
    commands = Path(__file__).resolve().parent.parent / "attnkit" / "commands"
    layout_names = ("kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "q_rms_proj.weight", "k_rms_proj.weight")
    spelled = [str(p) for p in commands.rglob("*.py") if any(n in p.read_text() for n in layout_names)]
    assert spelled == []
    targets_tested = [p for p in commands.rglob("*.py") if '== "gemma3-mla"' in p.read_text()]
    assert targets_tested == []


def test_sliding_layers_are_kept_and_the_budget_goes_to_the_global_ones(runner, tmp_path):
    """--sliding-layers auto (the default for this target): the sliding layers' attention is written bit for bit as
    the source's and caches the source's K and V (at most the window); the global layer takes what the budget
    leaves at the longest context (512 tokens here), so the whole cache there is at most half the source's, as kvmem
    counts it on the output; greedy decoding agrees with one forward pass."""
    from safetensors.torch import load_file

    import attnkit.modeling  # noqa: F401
    from attnkit import kvcache

    src, out = _gemma3(tmp_path), tmp_path / "out"
    result = _convert(runner, src, out, "--kv-budget", "0.5", "--device", "cpu")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["kept_layers"] == [0, 2] and json.loads((out / "config.json").read_text())[
        "gemma_attention_layers"
    ] == [0, 2]
    # 16 values per token and layer; at 512 tokens the source holds 16 + 512 + 16 token slots: half of it less the
    # two sliding layers' 2 x 16 x 16 leaves (4352 - 512) / 512 = 7.5 values per token for the global layer
    rank, rope = report["kv_lora_rank"], report["rope_dim"]
    assert rank + rope == 7 and report["layers"][0] == {"layer": 0, "kept": "the source's attention"}
    source_tensors, result_tensors = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    for layer in (0, 2):
        kept = [n for n in source_tensors if n.startswith(f"model.layers.{layer}.self_attn.")]
        assert len(kept) == 6 and all(torch.equal(result_tensors[n], source_tensors[n]) for n in kept)
    at_longest = report["kv_cache_at_context"][-1]
    assert at_longest["context"] == 512 and at_longest["ratio"] <= 0.5
    spec = open_source(str(out), "kvmem").spec
    assert kvcache.kv_bytes(spec, kvcache.cache_dtype("fp32"), 512, 1) == at_longest["after"]
    cache, agrees = _decode(out)
    shapes = [(tuple(layer.keys.shape[-2:]), tuple(layer.values.shape[-2:])) for layer in cache]
    assert shapes[0] == shapes[2] == ((15, 8), (15, 8))  # the source's key and value, window - 1 tokens
    assert shapes[1] == ((35, rank), (35, rope))
    assert agrees


def test_kept_sliding_layers_at_full_rank_equal_the_source(runner, tmp_path):
    """The global layer at P = D with a wide latent and no o_proj refit, the sliding layers kept: the source."""
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    src, out = _gemma3(tmp_path), tmp_path / "out"
    args = ["--kv-lora-rank", "72", "--rope-dim", "8", "--o-refit", "0", "--device", "cpu", "--sliding-layers", "keep"]
    result = _convert(runner, src, out, *args)
    assert result.exit_code == 0, result.output
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize(
    "family,args,needle",
    [
        ("llama", ["--sliding-layers", "keep"], "--target deepseek-v3 drops sliding windows"),
        ("gemma3", ["--target", "gemma3-mla", "--sliding-layers", "some"], "--sliding-layers must be one of"),
        ("gemma3", ["--target", "gemma3-mla", "--kv-budget", "0.02"], "give more, or --sliding-layers convert"),
    ],
)
def test_sliding_layer_refusals_are_one_line_before_work(runner, tmp_path, family, args, needle):
    folder = tmp_path / family
    overrides = {"layer_types": LAYER_TYPES, "sliding_window": 16, "num_hidden_layers": 3} if family == "gemma3" else {}
    save_model(build_model(family, num_key_value_heads=1, **overrides), folder)
    out = tmp_path / "out"
    budget = [] if "--kv-budget" in args else ["--kv-budget", "0.5"]
    result = runner.invoke(app, ["convert", "mla", str(folder), str(out), *FAST_CALIB, *budget, *args])
    one_line_error(result, 2, needle)
    assert not out.exists()


def test_the_budget_of_gemma3_270m_goes_to_its_global_layers():
    """Gemma 3 270M's geometry (18 layers, every sixth global, window 512, one KV head of 256, 32,768 positions):
    half the whole cache at 32,768 tokens leaves each global layer 236 of its 512 values per token, and 0.77 of it
    385, split 257 + 128."""
    from attnkit.commands.convert.mla_request import budget_split, budget_values

    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    spec = type("Spec", (), {"num_kv_heads": 1, "head_dim": 256, "layer_windows": windows})
    plain = tuple(i for i, w in enumerate(windows) if w is not None)
    assert budget_values(0.5, spec, plain, 32768) == 236
    assert budget_values(0.5, spec, (), 32768) == 256  # every layer converted: half of each
    assert budget_values(0.77, spec, plain, 32768) == 385 and budget_split(385, 256) == (257, 128)


def test_heal_trains_the_converted_layers_only(runner, tmp_path):
    """heal of an output whose sliding layers were kept: only the global layer's attention trains (the kept layers
    equal the teacher's), and the kept layers come out bit for bit as they went in."""
    from safetensors.torch import load_file

    src, student, healed = _gemma3(tmp_path), tmp_path / "student", tmp_path / "healed"
    assert _convert(runner, src, student, "--kv-budget", "0.5", "--device", "cpu", "--no-check").exit_code == 0
    result = _heal(runner, student, healed, src, tmp_path)
    trained = json.loads(result.stdout)["trainable"]["names"]
    assert trained and all(name.startswith("model.layers.1.self_attn.") for name in trained)
    before, after = load_file(student / "model.safetensors"), load_file(healed / "model.safetensors")
    kept = [n for n in before if n.startswith(("model.layers.0.self_attn.", "model.layers.2.self_attn."))]
    assert kept and all(torch.equal(before[n], after[n]) for n in kept)


def _heal(runner, student: Path, healed: Path, teacher: Path, tmp_path: Path):
    """A few steps of `attnkit heal` on CPU; its CLI result (checked to exit 0)."""
    from tests.helpers import PROSE

    data = tmp_path / "data.txt"
    data.write_text(PROSE * 30)
    fast = ["--tokens", "512", "--seq-len", "32", "--batch-size", "2", "--micro-batch-size", "2", "--val-tokens", "64"]
    args = ["heal", str(student), str(healed), "--teacher", str(teacher), "--data", str(data), *fast]
    result = runner.invoke(app, [*args, "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.output
    return result


def test_a_layer_of_its_own_shape_at_full_rank_equals_the_source(runner, tmp_path):
    """--layer-shape 1=17+8: the global layer caches a latent of 16 (the rank of its stacked keys and values) and
    one key factor, P = D, the others 72 + 8: still the source (the layer's own tensors, config entry and cache)."""
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    src, out = _gemma3(tmp_path), tmp_path / "out"
    args = ["-R", "72", "-P", "8", "--o-refit", "0", "--device", "cpu", "--sliding-layers", "convert"]
    result = _convert(runner, src, out, *args, "--layer-shape", "1=17+8")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["layer_shapes"] == {"1": [17, 8]} == report["parameters"]["layer_shapes"]
    assert report["layers"][1]["shape"] == [17, 8] and "shape" not in report["layers"][0]
    config = json.loads((out / "config.json").read_text())
    assert config["layer_mla_shapes"] == [[], [16, 8], []] and config["kv_lora_rank"] == 71
    spec = open_source(str(out), "kvmem").spec
    assert [spec.kv_elements_per_token(i) for i in range(3)] == [80, 25, 80]
    shown = json.loads(runner.invoke(app, ["inspect", str(out), "--format", "json"]).stdout)["summary"]
    assert shown["MLA kv_lora_rank + rope"] == "71 + 8 (layers 1: 16 + 8)"
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_layer_shapes_take_their_part_of_the_budget_and_cache_it(runner, tmp_path):
    """--kv-budget 0.5 over three converted layers of 16 values is 24 per token; --layer-shape 1=12+4 takes 16, the
    other two share 8 (2 + 2 each): the report, kvmem on the output and the cache generate fills agree, and greedy
    decoding agrees with one forward pass."""

    import attnkit.modeling  # noqa: F401
    from attnkit import kvcache

    src, out = _gemma3(tmp_path), tmp_path / "out"
    args = ["--kv-budget", "0.5", "--device", "cpu", "--sliding-layers", "convert", "--layer-shape", "1=12+4"]
    result = _convert(runner, src, out, *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["kv_lora_rank"], report["rope_dim"]) == (2, 2)
    assert report["kv_bytes_per_token"]["elements_after_by_layer"] == [4, 16, 4]
    assert report["kv_bytes_per_token"]["after"] == report["kv_bytes_per_token"]["before"] / 2
    spec = open_source(str(out), "kvmem").spec
    dtype = kvcache.cache_dtype(report["kv_bytes_per_token"]["dtype"])
    assert kvcache.bytes_per_token(spec, dtype) == report["kv_bytes_per_token"]["after"]
    cache, agrees = _decode(out)
    widths = [(layer.keys.shape[-1], layer.values.shape[-1]) for layer in cache]
    assert widths == [(2, 2), (12, 4), (2, 2)]  # latent + key factor, RoPE key
    assert agrees
    _heal(runner, out, tmp_path / "healed", src, tmp_path)  # heal builds the student from the config's shapes
    healed = json.loads((tmp_path / "healed" / "config.json").read_text())
    assert healed["layer_mla_shapes"] == [[], [11, 4], []]


@pytest.mark.parametrize(
    "family,args,needle",
    [
        ("llama", ["--layer-shape", "1=12+4"], "--target deepseek-v3 gives every layer one shape"),
        ("gemma3", ["--layer-shape", "1:12+4"], "--layer-shape takes LAYER=R+P"),
        ("gemma3", ["--layer-shape", "1=12+4", "--layer-shape", "1=8+2"], "names layer 1 twice"),
        ("gemma3", ["--layer-shape", "0=12+4"], "layer 0 is a layer kept as the source's"),
        ("gemma3", ["--layer-shape", "7=12+4"], "layer 7 is not a layer of the 3"),
        ("gemma3", ["--layer-shape", "1=12+3"], "P even, 2..8"),
        ("gemma3", ["--layer-shape", "1=12+4"], "names every converted layer"),
    ],
)
def test_layer_shape_refusals_are_one_line_before_work(runner, tmp_path, family, args, needle):
    folder = tmp_path / family
    overrides = {"layer_types": LAYER_TYPES, "sliding_window": 16, "num_hidden_layers": 3} if family == "gemma3" else {}
    save_model(build_model(family, num_key_value_heads=1, **overrides), folder)
    target = ["--target", "gemma3-mla"] if family == "gemma3" else []
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", "mla", str(folder), str(out), *FAST_CALIB, "--kv-budget", "0.5", *target, *args]
    )
    one_line_error(result, 2, needle)
    assert not out.exists()


def test_the_budget_trades_a_layers_share_where_measuring_says_it_matters(runner, tmp_path):
    """--layer-budget auto (the default), three global layers: layers 0 and 2 write nothing (o_proj zero), so
    converting either costs nothing, and layer 1 holds the model. At 0.75 of 64 values (32 + 16 each, head dim 32,
    one KV head) layer 1 takes layer 0's or 2's share down to 11 latent channels + its key factor + its RoPE key,
    and puts its whole key in its RoPE key (36 + 32: keys and values exact); the trade stands, the whole cache is
    what the budget gives, and the result is the source. `--layer-budget even` leaves every layer at the even
    share; with sliding windows on layers 0 and 2 no layer holds the tokens layer 1 holds: layer 1 takes nothing,
    and the two that cost nothing gain nothing by trading."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import attnkit.modeling  # noqa: F401

    src = tiny_source(
        tmp_path,
        "gemma3",
        head_dim=32,
        num_hidden_layers=3,
        sliding_window=16,
        query_pre_attn_scalar=20,
        layer_types=["full_attention"] * 3,
        num_key_value_heads=1,
    )
    tensors = load_file(src / "model.safetensors")
    for layer in (0, 2):
        tensors[f"model.layers.{layer}.self_attn.o_proj.weight"].zero_()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    args = ["--kv-budget", "0.75", "--device", "cpu", "--sliding-layers", "convert", "--o-refit", "0"]
    result = _convert(runner, src, tmp_path / "auto", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    budget = report["layer_budget"]
    assert budget["chosen"] == "traded" and budget["costs"]["1"] > 0 == budget["costs"]["0"] == budget["costs"]["2"]
    trade = budget["trades"][0]
    assert trade["taker"] == 1 and trade["giver"] in (0, 2) and trade["stands"] and trade["cost"] < 1e-6
    assert report["layer_shapes"] == {"1": [36, 32], str(trade["giver"]): [12, 16]}
    assert any(
        note.startswith(f"--layer-budget auto: layer 1 takes layer {trade['giver']}'s") for note in report["notes"]
    )
    plan = json.loads(_convert(runner, src, tmp_path / "plan", *args, "--dry-run").stdout)
    assert plan["layer_shapes"] == {} and any(
        "measures each converted layer when converting" in n for n in plan["notes"]
    )
    even = _convert(runner, src, tmp_path / "even", *args, "--layer-budget", "even")
    assert even.exit_code == 0, even.output
    even = json.loads(even.stdout)
    assert (
        even["layer_shapes"] == {}
        and even["layer_budget"] is None
        and (even["kv_lora_rank"], even["rope_dim"]) == (32, 16)
    )
    assert report["kv_cache_at_context"] == even["kv_cache_at_context"]
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp_path / "auto", dtype=torch.float32).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "layer_types": LAYER_TYPES}))
    windowed = _convert(runner, src, tmp_path / "windowed", *args)
    assert windowed.exit_code == 0, windowed.output
    windowed = json.loads(windowed.stdout)
    assert windowed["layer_shapes"] == {} and windowed["layer_budget"]["chosen"] == "even"
    assert all(trade["taker"] != 1 and not trade["stands"] for trade in windowed["layer_budget"]["trades"])


def test_trades_at_gemma3_270m_geometry_are_the_measured_split():
    """At half of Gemma 3 270M's cache each global layer's share is 172 + 64 (one key factor in 172): a giver keeps
    12 + 64 and a taker gets 140 + 256, the split measured to hold the pass keys (docs/convert-mla.md); a share too
    small for the taker to hold its whole key trades nothing."""
    from types import SimpleNamespace

    from attnkit.commands.convert.mla_layer_budget import trade_shapes
    from attnkit.commands.convert.mla_target import TARGETS

    def source(rank: int, rope: int):
        spec = SimpleNamespace(num_kv_heads=1, head_dim=256)
        return SimpleNamespace(target=TARGETS["gemma3-mla"], spec=spec, rank=rank, shape=SimpleNamespace(rope_dim=rope))

    assert trade_shapes(source(172, 64)) == ((12, 64), (140, 256))
    assert trade_shapes(source(96, 32)) is None  # 128 a layer: 256 - 44 leaves no key of 256 with a latent


@pytest.mark.parametrize(
    "shapes,needle",
    [
        ([[16, 8]], "has 1 entries for 3 layers"),
        ([[], [16, 3], []], "gives a layer 3 RoPE dims"),
        ([[], [16, 8, 1], []], "must be a list of [] or [latent width, RoPE dims]"),
        ([[], [0, 8], []], "must be a list of [] or [latent width, RoPE dims]"),
    ],
)
def test_a_config_with_impossible_layer_shapes_is_refused_in_one_line(runner, full_rank, tmp_path, shapes, needle):
    import shutil

    _, out, _ = full_rank
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "layer_mla_shapes": shapes}))
    one_line_error(runner.invoke(app, ["kvmem", str(bad)]), 1, needle)
