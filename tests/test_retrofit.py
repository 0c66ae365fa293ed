"""attnkit retrofit softcap / qknorm / qkclip on tiny fixtures, and SmolLM2-135M through all three."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.cli import app
from attnkit.ops.qknorm import fit_layer, logits, normed_logits
from tests.helpers import PROSE, char_tokenizer, tiny_source


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(PROSE * 8)
    return str(path)


def _tiny_text_model(tiny, family="llama_gqa", **kw):
    return char_tokenizer(tiny(family, vocab_size=128, **kw))


def _run(runner, *args):
    result = runner.invoke(app, ["retrofit", *map(str, args)])
    return result, (json.loads(result.stdout) if result.exit_code == 0 and "json" in args else None)


def _logits(folder, ids, **kw):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), **kw).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model


# ----- softcap -----


def test_softcap_auto_writes_config_copies_weights_and_measures(runner, tiny, text, tmp_path):
    src = _tiny_text_model(tiny)
    out = tmp_path / "out"
    res, doc = _run(
        runner,
        "softcap",
        src,
        out,
        "--auto",
        "--affect-fraction",
        "0.01",
        "--final-cap",
        "30",
        "--calib",
        text,
        "--calib-tokens",
        "256",
        "--calib-seq-len",
        "64",
        "--eval",
        text,
        "--eval-tokens",
        "128",
        "--eval-seq-len",
        "64",
        "-f",
        "json",
    )
    assert res.exit_code == 0, res.output
    auto = doc["auto"]["attn"]
    assert doc["attn_cap"] == auto["cap"] and 0 < auto["affected_fraction"] <= 0.01
    config = json.loads((out / "config.json").read_text())
    assert config["attn_logit_softcapping"] == auto["cap"] and config["final_logit_softcapping"] == 30
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    manifest = json.loads((out / "attnkit.json").read_text())
    assert manifest["operation"] == "retrofit softcap" and manifest["auto"]["attn"]["cap"] == auto["cap"]
    assert doc["eval"]["kl_mean"] >= -1e-6 and doc["eval"]["predicted"] == 126 and doc["eval"]["tokens"] == 128
    assert "ignore attn_logit_softcapping" in res.stderr
    assert "llama.cpp's converter writes a GGUF without attn_logit_softcapping" in " ".join(res.stderr.split())
    assert len(doc["probe"]["layers"]) == 2


@pytest.mark.parametrize(
    "family,said,unsaid",
    [
        ("gemma3", "llama.cpp's converter (convert_hf_to_gguf.py) refuses a config with attn_logit_softcapping", ""),
        ("gemma2", "", "llama.cpp"),
    ],
)
def test_softcap_warnings_name_the_engines_that_ignore_or_refuse_it(runner, tiny, tmp_path, family, said, unsaid):
    """Gemma 3's llama.cpp converter asserts attn_logit_softcapping is absent; Gemma 2 has the caps natively."""
    caps = ("--attn-cap", "20", "--final-cap", "25")
    res, doc = _run(runner, "softcap", tiny(family), tmp_path / "o", *caps, "-f", "json")
    assert res.exit_code == 0, res.output
    text = " ".join(" ".join(doc["warnings"]).split())
    assert said in text and (not unsaid or unsaid not in text)


def test_softcap_bad_input_gives_one_line_errors(runner, tiny, tmp_path):
    src = tiny("llama")
    for cap, code in (("0", 2), ("-3", 2), ("nan", 2), ("abc", 2)):
        res, _ = _run(runner, "softcap", src, tmp_path / "o", "--attn-cap", cap)
        assert res.exit_code == code and len(res.stderr.strip().splitlines()) == 1, (cap, res.output)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    cases = [
        (("softcap", src, full, "--attn-cap", "5"), "not empty"),
        (("softcap", tmp_path / "missing", tmp_path / "o", "--attn-cap", "5"), ""),
        (("softcap", tiny("bert"), tmp_path / "o", "--attn-cap", "5"), "not a causal"),
        (("softcap", src, tmp_path / "o", "--auto"), "--calib"),
        (("softcap", src, tmp_path / "o"), "nothing to do"),
    ]
    for args, words in cases:
        res, _ = _run(runner, *args)
        assert res.exit_code in (1, 2) and len(res.stderr.strip().splitlines()) == 1 and words in res.stderr, res.output
    assert not (tmp_path / "o").exists()


def test_softcap_dry_run_writes_nothing(runner, tiny, tmp_path):
    res, doc = _run(runner, "softcap", tiny("llama"), tmp_path / "o", "--attn-cap", "20", "--dry-run", "-f", "json")
    assert res.exit_code == 0 and doc["dry_run"] and not (tmp_path / "o").exists()


# ----- qknorm -----


def test_lsq_is_exact_when_q_and_k_have_constant_rms():
    torch.manual_seed(0)
    n, h, hkv, t, d = 2, 4, 2, 16, 8
    q = torch.randn(n, h, t, d, dtype=torch.float64)
    k = torch.randn(n, hkv, t, d, dtype=torch.float64)
    q = 3.0 * q / q.pow(2).mean(-1, keepdim=True).sqrt()  # RMS 3 for every token and head
    k = 0.5 * k / k.pow(2).mean(-1, keepdim=True).sqrt()
    pos = torch.arange(t, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    fit = fit_layer(q, k, cos, sin, d**-0.5, 0.0, "lsq")
    want = logits(q, k, cos, sin, d**-0.5)
    assert (
        normed_logits(q, k, cos, sin, d**-0.5, fit, 0.0) - want
    ).abs().max() < 1e-7  # ridge 1e-9 (relative) in the solve
    assert fit.kl < 1e-12
    unit = fit_layer(q, k, cos, sin, d**-0.5, 0.0, "unit")
    assert unit.kl > 1e-4  # the unit weights lose the scale 3 * 0.5


@pytest.mark.parametrize("family, extra", [("llama_gqa", {}), ("qwen2", {}), ("mistral", {})])
def test_qknorm_pad_loads_as_stock_qwen3_and_is_exact(runner, tiny, tmp_path, family, extra):
    src = tiny(family, **extra)
    out = tmp_path / "out"
    res, doc = _run(runner, "qknorm", src, out, "--method", "pad", "-f", "json")
    assert res.exit_code == 0, res.output
    assert any("transformers only" not in w and "no o_proj bias slot" in w for w in doc["warnings"])
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    want, _ = _logits(src, ids)
    got, model = _logits(out, ids)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (10,) and attn.k_norm.weight.shape == (10,)
    assert attn.o_proj.bias is not None and attn.o_proj.bias.abs().max() == 0
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))
    if family == "mistral":
        assert model.config.layer_types == ["sliding_attention"] * 2 and model.config.sliding_window == 16
    if family == "qwen2":  # the source biases carry over on the real dims
        from safetensors.torch import load_file

        b = load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.q_proj.bias"].view(8, 8)
        assert torch.equal(attn.q_proj.bias.detach().view(8, 10)[:, [0, 1, 2, 3, 5, 6, 7, 8]], b)
    assert (
        doc["head_dim_after"] == 10 and json.loads((out / "attnkit.json").read_text())["operation"] == "retrofit qknorm"
    )


def _anchored_source(tmp_path, family: str, biases: bool = False):
    """A tiny checkpoint whose token embeddings share an offset (the near-constant direction of real LLM hidden
    states, which the anchor a.x ~ 1 is fitted to; random tiny models lack it), with a character tokenizer."""

    return tiny_source(tmp_path, family, biases, offset=3.0, head_dim=8)


@pytest.mark.parametrize(
    "family,biases,head_dim,width",
    [
        ("llama_gqa", False, None, 32),
        ("qwen2", True, None, 32),
        ("llama_gqa", False, "8", 8),
        ("llama_gqa", False, "10", 10),
    ],
)
def test_qknorm_anchor_has_no_bias_tensors_and_stays_close(runner, tmp_path, text, family, biases, head_dim, width):
    """Default method: the source's head size when vLLM's CPU kernels run it (64 on real models: the anchor replaces
    the weakest RoPE pair), else the smallest larger size they run (8 -> 32 here); --head-dim 10 (llama.cpp only);
    no bias tensor; logits within a few percent of the source's."""
    from attnkit.io.checkpoint import safetensors_files
    from attnkit.io.reader import LazyReader

    src = _anchored_source(tmp_path, family, biases)
    out = tmp_path / "out"
    extra = ["--head-dim", head_dim] if head_dim else []
    res, doc = _run(
        runner,
        "qknorm",
        src,
        out,
        "--method",
        "anchor",
        "--calib",
        text,
        "--calib-tokens",
        "512",
        "--calib-seq-len",
        "64",
        *extra,
        "-f",
        "json",
    )
    assert res.exit_code == 0, res.output
    assert doc["method"] == "anchor" and doc["head_dim_after"] == width and not doc["attention_bias"]
    assert all(row["max_rel_error"] < 0.05 for row in doc["layers"])
    assert all((row["dropped_pair"] is not None) == (width == 8) for row in doc["layers"])
    with LazyReader(safetensors_files(out)) as reader:
        assert not any(n.endswith(".bias") for n in reader.names())
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    want, _ = _logits(src, ids)
    got, model = _logits(out, ids)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == width
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < (0.2 if width == 8 else 0.02), rel  # a dropped pair of 4 costs more than a per-token scale of ~1%


def _zero_pair_source(tmp_path, pair: int = 2):
    """A tiny Qwen2 (q/k/v biases, head_dim 8, no near-constant direction) whose query rows and bias of RoPE pair
    `pair` are zero in every head: that pair adds nothing to any logit, so giving it up is exact."""
    from safetensors.torch import load_file, save_file

    src = tiny_source(tmp_path, "qwen2", biases=True, head_dim=8)
    weights = load_file(str(src / "model.safetensors"))
    for name in list(weights):
        if "q_proj" in name:
            t = weights[name].clone().view(8, 8, -1) if name.endswith("weight") else weights[name].clone().view(8, 8)
            t[:, [pair, pair + 4]] = 0.0
            weights[name] = t.reshape(weights[name].shape).contiguous()
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def test_qknorm_bias_method_keeps_the_head_size_and_is_exact_but_for_the_pair_it_gives_up(runner, tmp_path, text):
    """--method bias: head_dim 8 kept, the weakest pair (here one that carries nothing) holds the pad bias through
    the q/k bias tensors; q/k/v/o biases written (o zero); logits equal the source's."""
    src = _zero_pair_source(tmp_path)
    out = tmp_path / "out"
    calib = ("--calib", text, "--calib-tokens", "512", "--calib-seq-len", "64")
    res, doc = _run(runner, "qknorm", src, out, "--method", "bias", *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    assert doc["method"] == "bias" and doc["head_dim_after"] == 8 and doc["attention_bias"]
    assert all(row["dropped_pair"] == 2 for row in doc["layers"])
    assert any("transformers and vLLM only" in w for w in doc["warnings"])
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    want, _ = _logits(src, ids)
    got, model = _logits(out, ids)
    attn = model.model.layers[0].self_attn
    assert type(model).__name__ == "Qwen3ForCausalLM" and attn.o_proj.bias.abs().max() == 0
    assert float(attn.q_proj.bias.view(8, 8)[0, 2]) == doc["layers"][0]["pad_bias_q"]
    assert (got - want).abs().max() < 1e-4 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("method", ["pad", "bias"])
def test_qknorm_exact_methods_on_qwen_shapes(runner, tmp_path, text, method):
    """Qwen2.5's layout (q/k/v biases, 14 heads over 2 KV heads of 64, theta 1e6): pad is exact; bias is exact but
    for the pair it gives up, here one whose query rows and bias are zero."""
    from safetensors.torch import load_file, save_file

    src = tiny_source(
        tmp_path, "qwen2", True, num_attention_heads=14, num_key_value_heads=2, head_dim=64, rope_theta=1e6
    )
    weights = load_file(str(src / "model.safetensors"))
    for name in [n for n in weights if "q_proj" in n]:
        t = weights[name].clone().view(14, 64, -1) if name.endswith("weight") else weights[name].clone().view(14, 64, 1)
        t[:, [31, 63]] = 0.0  # the slowest pair
        weights[name] = t.reshape(weights[name].shape).contiguous()
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    calib = ("--calib", text, "--calib-tokens", "512", "--calib-seq-len", "64")
    res, doc = _run(runner, "qknorm", src, out, "--method", method, *calib, "--no-check", "-f", "json")
    assert res.exit_code == 0, res.output
    assert doc["head_dim_after"] == (66 if method == "pad" else 64)
    if method == "bias":
        assert all(row["dropped_pair"] == 31 for row in doc["layers"])
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    want, _ = _logits(src, ids)
    got, _ = _logits(out, ids)
    assert (got - want).abs().max() < 1e-4 * max(1.0, float(want.abs().max()))


def test_qknorm_auto_takes_the_anchor_where_it_holds(runner, tmp_path, text):
    src = _anchored_source(tmp_path, "llama_gqa")
    calib = ("--calib", text, "--calib-tokens", "512", "--calib-seq-len", "64", "--head-dim", "32")
    res, doc = _run(runner, "qknorm", src, tmp_path / "out", *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    assert doc["method"] == "anchor" and [t["method"] for t in doc["tried"]] == ["anchor"]
    assert doc["tried"][0]["verdict"] == "ok" and doc["check"]["verdict"] == "ok"


def test_qknorm_auto_passes_over_an_anchor_that_does_not_hold(runner, tmp_path, text):
    """No near-constant direction: a random tiny Qwen2 calibrated on as few tokens as its width, so the anchor fits
    them all and misses held-out ones. The anchor's held-out error is measured, the anchor is not written, the bias
    method is, and both say why."""
    src = _zero_pair_source(tmp_path)
    calib = ("--calib", text, "--calib-tokens", "128", "--calib-seq-len", "64")
    res, doc = _run(runner, "qknorm", src, tmp_path / "out", *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    tried = doc["tried"]
    assert doc["method"] == "bias" and [t["method"] for t in tried] == ["anchor", "bias"]
    assert tried[0]["verdict"] == "not tried" and "on held-out calibration tokens" in tried[0]["why"]
    assert "--method auto passed over anchor: not tried" in " ".join(res.stderr.split())


def test_qknorm_auto_moves_on_when_the_self_check_rejects_the_anchor(runner, tmp_path, text, monkeypatch):
    from attnkit.scoring import selfcheck

    monkeypatch.setitem(selfcheck.LIMITS, "retrofit qknorm", selfcheck.Limit(1.0, 1.0, "exact"))
    src = _anchored_source(tmp_path, "llama_gqa")
    out = tmp_path / "out"
    calib = ("--calib", text, "--calib-tokens", "512", "--calib-seq-len", "64", "--head-dim", "32")
    res, doc = _run(runner, "qknorm", src, out, *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    assert [(t["method"], t["verdict"]) for t in doc["tried"]][0] == ("anchor", "worse than its limit")
    assert doc["method"] == "bias" and json.loads((out / "attnkit.json").read_text())["parameters"]["method"] == "bias"
    assert not list(tmp_path.glob(".out*"))  # the rejected anchor output left nothing behind


def test_qknorm_fitted_methods_keep_head_dim_and_kl_improves_on_unit(runner, tiny, text, tmp_path):
    src = _tiny_text_model(tiny)
    kls = {}
    for method in ("unit", "scalar", "lsq", "kl"):
        res, doc = _run(
            runner,
            "qknorm",
            src,
            tmp_path / method,
            "--method",
            method,
            "--steps",
            "20",
            "--calib",
            text,
            "--calib-tokens",
            "256",
            "--calib-seq-len",
            "64",
            "-f",
            "json",
        )
        assert res.exit_code == 0, res.output
        assert doc["head_dim_after"] == 8 and not doc["attention_bias"]
        kls[method] = sum(r["attention_kl"] for r in doc["layers"])
    assert kls["kl"] <= kls["lsq"] + 1e-9 and kls["lsq"] <= kls["scalar"] + 1e-9


def test_qknorm_refusals(runner, tiny, tmp_path):
    for family, code, words in (
        ("qwen3", 2, "already has QK-norm"),
        ("olmo2", 2, "already has QK-norm"),
        ("gemma2", 1, "supports llama, mistral, qwen2"),
    ):
        res, _ = _run(runner, "qknorm", tiny(family), tmp_path / "o", "--method", "pad")
        assert res.exit_code == code and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
    for method in ("lsq", "anchor", "auto", "bias"):
        res, _ = _run(runner, "qknorm", tiny("llama"), tmp_path / "o", "--method", method)
        assert res.exit_code == 2 and "--calib" in res.stderr
    res, _ = _run(runner, "qknorm", tiny("llama"), tmp_path / "o", "--method", "pad", "--head-dim", "12")
    assert res.exit_code == 2 and "--head-dim applies to --method anchor" in res.stderr


# ----- qkclip -----


def test_qkclip_clips_only_heads_above_tau(runner, tiny, text, tmp_path):
    src = _tiny_text_model(tiny)
    calib = ("--calib", text, "--calib-tokens", "256", "--calib-seq-len", "64")
    res, dry = _run(runner, "qkclip", src, tmp_path / "probe", "--tau", "1e9", *calib, "-f", "json")
    assert res.exit_code == 0 and dry["clipped_heads"] == 0
    assert dry["output"] is None and not (tmp_path / "probe").exists()  # no unchanged copy
    assert "nothing to clip" in res.stderr and "not written" in res.stderr
    layer0 = sorted(r["max_logit_before"] for r in dry["heads"] if r["layer"] == 0)
    tau = (layer0[3] + layer0[4]) / 2  # clips the 4 largest heads of layer 0
    res, doc = _run(runner, "qkclip", src, tmp_path / "out", "--tau", tau, *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    from safetensors.torch import load_file

    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    for r in doc["heads"]:
        name = f"model.layers.{r['layer']}.self_attn.q_proj.weight"
        rows = slice(8 * r["head"], 8 * r["head"] + 8)
        if r["clipped"]:
            assert r["max_logit_after"] <= tau * (1 + 1e-5)
            assert r["factor"] < 1
        else:
            assert torch.equal(after[name][rows], before[name][rows])
            if r["layer"] == 0:
                assert r["max_logit_after"] == r["max_logit_before"]
    assert sum(r["clipped"] for r in doc["heads"] if r["layer"] == 0) == 4
    for name in before:
        if "q_proj" not in name:
            assert torch.equal(before[name], after[name])


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo2"])
def test_qkclip_on_qk_norm_scales_the_norm_weight(runner, tiny, text, tmp_path, family):
    """Per-head QK-norm (Qwen3, Gemma 3: weight shared by a layer's heads): the layer is clipped as one, every head
    by its worst head's factor; QK-norm over the whole projection (OLMo 2): only the heads above tau."""
    src = _tiny_text_model(tiny, family)
    calib = ("--calib", text, "--calib-tokens", "256", "--calib-seq-len", "64")
    res, dry = _run(runner, "qkclip", src, tmp_path / "probe", "--tau", "1e9", *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    layer0 = sorted(r["max_logit_before"] for r in dry["heads"] if r["layer"] == 0)
    tau = (layer0[-1] + layer0[-2]) / 2  # layer 0's worst head is above, the others below
    res, doc = _run(runner, "qkclip", src, tmp_path / "out", "--tau", tau, *calib, "-f", "json")
    assert res.exit_code == 0, res.output
    per_head_norm = family != "olmo2"
    assert doc["scope"] == ("layer" if per_head_norm else "head")
    assert all(r["max_logit_after"] <= tau * (1 + 1e-4) for r in doc["heads"])
    rows0 = [r for r in doc["heads"] if r["layer"] == 0]
    if per_head_norm:
        assert "every head of a clipped layer" in res.stderr
        worst = max(r["max_logit_seen"] for r in rows0)
        assert all(r["clipped"] and r["factor"] == pytest.approx(tau / worst, rel=1e-6) for r in rows0)
        assert max(r["max_logit_after"] for r in rows0) == pytest.approx(tau, rel=1e-4)
    else:
        assert [r["clipped"] for r in rows0].count(True) == 1
    from safetensors.torch import load_file

    before = load_file(str(src / "model.safetensors"))
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    clipped = {r["layer"] for r in doc["heads"] if r["clipped"]}
    for name in before:
        layer = int(name.split(".")[2]) if ".layers." in name else None
        if name.endswith("q_norm.weight") and layer in clipped:
            assert not torch.equal(before[name], after[name])
        else:
            assert torch.equal(before[name], after[name]), name


def test_qkclip_refuses_mla_and_bad_tau(runner, tiny, text, tmp_path):
    from tests.tiny import extra_model

    extra_model("deepseek_v3").save_pretrained(tmp_path / "mla")
    res, _ = _run(runner, "qkclip", tmp_path / "mla", tmp_path / "o", "--calib", text)
    assert res.exit_code == 1 and "MLA attention is not supported" in res.stderr
    res, _ = _run(runner, "qkclip", tiny("llama"), tmp_path / "o", "--tau", "0", "--calib", text)
    assert res.exit_code == 2 and "--tau" in res.stderr


# ----- real model -----


@pytest.mark.real_model
def test_smollm2_through_all_three_retrofits(runner, tmp_path):
    from attnkit.realmodels import smollm2_folder

    src = smollm2_folder()
    prose = "tests/data/prose/"
    calib = ("--calib", prose + "calib.txt", "--calib-tokens", "128", "--calib-seq-len", "64")
    ev = ("--eval", prose + "heldout.txt", "--eval-tokens", "64", "--eval-seq-len", "64", "-f", "json")
    res, soft = _run(runner, "softcap", src, tmp_path / "s", "--attn-cap", "50", "--final-cap", "30", *ev, "--no-check")
    assert res.exit_code == 0, res.output
    res, norm = _run(runner, "qknorm", src, tmp_path / "n", "--method", "pad", *ev)  # the default self-check
    assert res.exit_code == 0, res.output
    res, clip = _run(runner, "qkclip", src, tmp_path / "c", "--tau", "8", *calib, *ev, "--no-check")
    assert res.exit_code == 0, res.output
    assert norm["eval"]["kl_mean"] < 1e-4  # pad is exact up to fp32 rounding
    check = norm["check"]  # on heldout.txt (the --eval text): 4 windows of 512, one of 4,096 by distance, pass keys
    assert check["verdict"] == "ok" and check["text"]["origin"] == "--eval", check
    assert check["short"]["windows"] == 4 and abs(check["short"]["ratio"] - 1) < 1e-3
    assert check["long"]["seq_len"] == 4096 and all(abs(r["ratio"] - 1) < 1e-3 for r in check["long"]["by_distance"])
    assert check["passkey"]["result"] == check["passkey"]["source"] and not check["passkey"]["lost"]
    assert 0 < clip["clipped_heads"] < len(clip["heads"])
    assert all(r["max_logit_after"] <= 8 * (1 + 1e-4) for r in clip["heads"] if r["clipped"])
    for doc in (soft, norm, clip):
        e = doc["eval"]
        assert e["perplexity"] > 1 and e["kl_mean"] >= -1e-6 and doc["probe"]["layers"]


def test_softcap_that_changes_nothing_is_refused(runner, tiny, tmp_path):
    res, _ = _run(runner, "softcap", tiny("gemma2"), tmp_path / "o", "--attn-cap", "50", "--final-cap", "30")
    assert res.exit_code == 2 and "nothing to change" in res.stderr and "attn_logit_softcapping = 50" in res.stderr
    assert not (tmp_path / "o").exists()
    res, _ = _run(runner, "softcap", tiny("gemma2"), tmp_path / "o", "--attn-cap", "40", "--dry-run")
    assert res.exit_code == 0, res.output


@pytest.mark.real_model
def test_a_gguf_source_is_recorded_as_gguf(runner, tmp_path):
    from attnkit.realmodels import smollm2_gguf

    res, doc = _run(runner, "softcap", smollm2_gguf(), tmp_path / "s", "--attn-cap", "50", "--no-check", "-f", "json")
    assert res.exit_code == 0, res.output
    source = json.loads((tmp_path / "s" / "attnkit.json").read_text())["source"]
    assert source["kind"] == "gguf" and source["ref"] == str(smollm2_gguf()) and source["dequantized"]
