"""`convert gqa|mqa` on tiny checkpoints: exactness, stock-transformers loading, every supported family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnkit.cli import app
from tests.helpers import PROSE, char_tokenizer
from tests.tiny import build_model, save_model

#: Logits of a lossless conversion match the source to this (fp32 weights, fp32 forward).
LOGIT_ATOL = 1e-5
GROUP_FAMILIES = ["llama", "llama_gqa", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2"]


def _identical_groups(model, groups: int) -> None:
    """Make the K/V heads (weights, biases, full-width k_norm) of each contiguous group identical."""
    cfg = model.config
    hkv, h = cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    r = hkv // groups

    def same(rows):  # rows: [Hkv*D, ...] view, modified in place
        heads = rows.view(hkv, d, *rows.shape[1:])
        for j in range(hkv):
            heads[j] = heads[(j // r) * r]

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "qkv_proj" in name:
                same(p.data[h * d : (h + hkv) * d])
                same(p.data[(h + hkv) * d :])
            elif any(s in name for s in (".k_proj.", ".v_proj.")) or (
                name.endswith("k_norm.weight") and p.shape[0] == hkv * d
            ):
                same(p.data)


def _source(tmp_path: Path, family: str, groups: int | None = None, seed: int = 0, **overrides) -> Path:
    """A tiny checkpoint with a character tokenizer; with `groups`, heads identical within each group."""
    model = build_model(family, seed=seed, **overrides)
    if family == "qwen2":  # non-zero biases so that pooling them matters
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("proj.bias"):
                    p.normal_(0, 0.5)
    if groups is not None:
        _identical_groups(model, groups)
    folder = tmp_path / f"src-{family}"
    save_model(model, folder)
    return char_tokenizer(folder)


def _calib(tmp_path: Path) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(PROSE * 12)
    return path


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _convert(runner, *args: str) -> dict:
    result = runner.invoke(app, ["convert", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


IDS = torch.randint(4, 90, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "family,method",
    [
        ("llama", "mean"),
        ("llama", "first"),
        ("llama", "merge"),
        ("qwen2", "mean"),
        ("qwen2", "first"),
        ("qwen2", "merge"),
    ],
)
def test_identical_heads_convert_losslessly(runner, tmp_path, family, method):
    src = _source(tmp_path, family, groups=2, num_key_value_heads=8 if family == "llama" else 4)
    out = tmp_path / "out"
    calib = (
        ["--calib", str(_calib(tmp_path)), "--calib-tokens", "256", "--calib-seq-len", "64"]
        if method == "merge"
        else []
    )
    report = _convert(runner, "gqa", str(src), str(out), "--kv-heads", "2", "--method", method, *calib)
    assert report["kv_heads_before"] in (4, 8) and report["kv_heads_after"] == 2
    assert max(row["k_err"] for row in report["layers"]) < 1e-6
    assert max(row["v_err"] for row in report["layers"]) < 1e-6
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert torch.allclose(_logits(out, IDS), _logits(src, IDS), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("method", ["mean", "merge"])
def test_identical_heads_of_qwen_shapes_merge_losslessly(runner, tmp_path, method):
    """Qwen2.5's layout (q/k/v biases, 14 query heads over 2 KV heads of 64, theta 1e6): two identical KV heads
    become one without loss."""
    shape = dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6)
    src = _source(tmp_path, "qwen2", groups=1, **shape)
    out = tmp_path / "out"
    calib = ["--calib", str(_calib(tmp_path)), "--calib-tokens", "256", "--calib-seq-len", "64"]
    report = _convert(runner, "mqa", str(src), str(out), "--method", method, *calib, "--no-check")
    assert max(max(row["k_err"], row["v_err"]) for row in report["layers"]) < 1e-6
    assert torch.allclose(_logits(out, IDS), _logits(src, IDS), atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("family", GROUP_FAMILIES)
def test_every_family_merges_losslessly_and_generates(runner, tmp_path, family):
    """Merge (keys fall back to mean under QK-norm) on identical heads reproduces the logits; generate runs."""
    from transformers import AutoModelForCausalLM

    src = _source(tmp_path, family, groups=1)
    out = tmp_path / "out"
    report = _convert(
        runner,
        "mqa",
        str(src),
        str(out),
        "--method",
        "merge",
        "--calib",
        str(_calib(tmp_path)),
        "--calib-tokens",
        "128",
        "--calib-seq-len",
        "64",
    )
    qk_norm = family in ("qwen3", "gemma3", "olmo2")
    assert {row["key_path"] for row in report["layers"]} == {"mean (qk-norm)" if qk_norm else "merge"}
    # The o_proj refit needs attnkit's reference attention to be the model's: no QK-norm or soft-cap (a window
    # shorter than the 64-token calibration windows is part of it: Mistral's 16).
    refit = family in ("llama", "llama_gqa", "mistral", "qwen2", "gemma", "phi3")
    assert {row["value_path"] for row in report["layers"]} == {"merge + o refit" if refit else "merge"}
    assert torch.allclose(_logits(out, IDS), _logits(src, IDS), atol=LOGIT_ATOL, rtol=0)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.num_key_value_heads == 1
    generated = model.generate(IDS[:1, :8], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 12)


def test_mean_equals_hand_written_pooling(runner, tmp_path):
    from safetensors.torch import load_file

    src = _source(tmp_path, "qwen2")  # 4 KV heads, q/k/v biases
    out = tmp_path / "out"
    _convert(runner, "gqa", str(src), str(out), "--kv-heads", "2")
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) == set(after)
    d = 8  # hidden 64 / 8 heads
    for name, tensor in before.items():
        if "k_proj" in name or "v_proj" in name:
            heads = tensor.reshape(4, d, *tensor.shape[1:])
            expected = torch.cat([(heads[0] + heads[1]) / 2, (heads[2] + heads[3]) / 2])
            assert torch.allclose(after[name], expected, atol=1e-7, rtol=0), name
        else:
            assert torch.equal(after[name], tensor), name


def test_merge_beats_mean_on_random_heads(runner, tmp_path):
    """Distinct random heads: the calibrated merge reconstructs K and V better than mean pooling."""
    src = _source(tmp_path, "llama_gqa", seed=3)
    calib = ["--calib", str(_calib(tmp_path)), "--calib-tokens", "256", "--calib-seq-len", "64"]
    mean = _convert(runner, "mqa", str(src), str(tmp_path / "mean"), *calib)
    merge = _convert(runner, "mqa", str(src), str(tmp_path / "merge"), "--method", "merge", *calib)
    assert mean["error_basis"] == merge["error_basis"] == "activations"
    for a, b in zip(mean["layers"], merge["layers"]):
        assert b["k_err"] < a["k_err"] and b["v_err"] < a["v_err"]


def test_fp16_source_keeps_dtype_and_side_files(runner, tmp_path):
    from safetensors import safe_open

    model = build_model("llama_gqa").to(torch.float16)
    src = char_tokenizer(save_model(model, tmp_path / "src"))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    out = tmp_path / "out"
    _convert(runner, "mqa", str(src), str(out))
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(n).dtype for n in fh.keys()} == {torch.float16}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "attnkit.json"):
        assert (out / name).is_file(), name
    manifest = json.loads((out / "attnkit.json").read_text())
    assert manifest["method"] == "mean" and manifest["parameters"]["kv_heads"] == 1
    assert manifest["source"]["ref"] == str(src) and len(manifest["layers"]) == 2
    assert manifest["command"].startswith("attnkit ")


def test_sharded_source_streams_to_shards(runner, tmp_path):
    model = build_model("llama")
    src = char_tokenizer(save_model(model, tmp_path / "src", max_shard_size="100KB"))
    out = tmp_path / "out"
    report = _convert(runner, "gqa", str(src), str(out), "--kv-heads", "4", "--max-shard-size", "100KiB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert report["kv_bytes_per_token"] == {"dtype": "fp32", "before": 2 * 2 * 8 * 8 * 4, "after": 2 * 2 * 4 * 8 * 4}
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(str(out)).config.num_key_value_heads == 4


def test_eval_report_carries_greedy_samples_of_source_and_result(runner, tmp_path):
    src = _source(tmp_path, "llama", groups=2, num_key_value_heads=8)
    text = str(_calib(tmp_path))
    args = [
        "gqa",
        str(src),
        str(tmp_path / "out"),
        "--kv-heads",
        "2",
        "--eval",
        text,
        "--eval-tokens",
        "128",
        "--eval-seq-len",
        "64",
        "--sample-prompt",
        "the cat",
        "--sample-prompt",
        "a dog",
    ]
    report = _convert(runner, *args)
    samples = report["eval"]["samples"]
    assert [s["prompt"] for s in samples] == ["the cat", "a dog"]
    assert all(s["source"] and s["source"] == s["result"] for s in samples)  # a lossless conversion says the same
    long = report["eval"]["long_context"]  # the text in one window of the model's 512 positions, by distance
    assert long["seq_len"] == 512 and long["windows"] == 1 and long["longest"] == long["by_distance"][-1]
    assert [(r["start"], r["end"]) for r in long["by_distance"]] == [(0, 128), (128, 256), (256, 512)]
    assert all(r["ratio"] == pytest.approx(1.0, abs=1e-4) and r["kl_mean"] < 1e-6 for r in long["by_distance"])
    manifest = json.loads((tmp_path / "out" / "attnkit.json").read_text())
    assert manifest["eval"]["samples"] == samples and manifest["eval"]["long_context"] == long
    table = runner.invoke(app, ["convert", *args[:2], str(tmp_path / "out2"), *args[3:]])
    assert table.exit_code == 0 and "greedy sample: 'the cat'" in table.stdout
    flat = " ".join(table.stdout.split())  # the caption wraps to the table's width
    assert "by distance" in flat and "at 256-512 tokens of context perplexity x1.000" in flat


def test_manifest_names_a_gguf_source_as_gguf(tmp_path):
    from attnkit.io.checkpoint import Checkpoint
    from attnkit.io.source import Source

    class Spec:
        model_type = "llama"

    (tmp_path / "config.json").write_text("{}")
    folder = Checkpoint("m.gguf", "folder", {}, root=tmp_path, dequantized_from=Path("m.gguf"))
    record = Source("m.gguf", folder, None, Spec(), "", frozenset()).record()
    assert record["kind"] == "gguf" and record["dequantized"] == str(tmp_path) and len(record["digest"]) == 64
    plain = Source("x", Checkpoint("x", "folder", {}, root=tmp_path), None, Spec(), "", frozenset()).record()
    assert plain["kind"] == "folder" and plain["dequantized"] is None


def test_the_merge_reference_attention_is_a_sliding_layers_own(tmp_path):
    """What the merge's key weights and o_proj refit compute as the layer's attention (attnkit.ops.attnweight)
    equals Mistral's sliding layer, 40 tokens past a window of 16; without the window it would not."""
    from transformers import AutoModelForCausalLM

    from attnkit.ops.attnweight import causal_attention, key_token_weights

    model = AutoModelForCausalLM.from_pretrained(str(_source(tmp_path, "mistral")), dtype=torch.float32).eval()
    attn, seen = model.model.layers[0].self_attn, {}
    attn.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    attn.o_proj.register_forward_pre_hook(lambda _m, args: seen.update(z=args[0]))
    with torch.no_grad():
        model(IDS[:1])
    x, (cos, sin), d = seen["hidden_states"], seen["position_embeddings"], attn.head_dim
    q, k, v = (proj(x).reshape(1, IDS.shape[1], -1, d) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    window = model.config.sliding_window
    assert window == 16
    with torch.no_grad():
        z = causal_attention(q, k, v, cos, sin, attn.scaling, window)  # [1, T, H*D]
        assert torch.allclose(z, seen["z"], atol=1e-5)
        assert not torch.allclose(causal_attention(q, k, v, cos, sin, attn.scaling), seen["z"], atol=1e-3)
        # a window of one token: each key weighs the energies of the queries at its own position
        w = key_token_weights(q, k, cos, sin, attn.scaling, window=1)  # [Hkv, T]
    groups = q.shape[2] // k.shape[2]
    energy = q.square().sum(-1)[0].T.reshape(k.shape[2], groups, -1).sum(1)  # [Hkv, T]
    assert torch.allclose(w, energy.double(), rtol=1e-6)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_windows_are_kept(runner, tmp_path, family):
    """Each layer keeps its window: same config fields and per-layer windows, and the same logits 40 tokens in
    (past 2x the window of 16, where the source without its windows would give other logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnkit.archs.spec import attention_spec

    src = _source(tmp_path, family, groups=2)
    out = tmp_path / "out"
    _convert(runner, "gqa", str(src), str(out), "--kv-heads", "2", "--method", "mean")
    before, after = (json.loads((f / "config.json").read_text()) for f in (src, out))
    for key in ("sliding_window", "layer_types"):
        assert after.get(key) == before.get(key)
    windows = attention_spec(after).layer_windows
    assert windows == attention_spec(before).layer_windows and 16 in windows
    assert torch.allclose(_logits(out, IDS), _logits(src, IDS), atol=LOGIT_ATOL, rtol=0)
    config = AutoConfig.from_pretrained(str(src))
    config.sliding_window = 4096  # longer than IDS: no window in effect
    unwindowed = AutoModelForCausalLM.from_pretrained(str(src), config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(unwindowed(IDS).logits[:, 20:], _logits(src, IDS)[:, 20:], atol=1e-3)
