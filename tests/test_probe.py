"""probe(): per-head statistics against q/k recomputed by hand from the weights; the `attnkit probe` command."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from attnkit.cli import app
from attnkit.commands.analyse.probe_rules import parse_rule
from attnkit.errors import UsageError
from attnkit.runtime.hook import attention_hook
from attnkit.scoring.attention_stats import probe
from tests.helpers import PROSE, char_tokenizer
from tests.tiny import build_model


def _manual_qk(model, ids):
    """Per layer: (q [B, H, T, D], k [B, Hkv, T, D]) from the attention inputs, projections, QK-norm and RoPE."""
    captured = {}

    def grab(module, args, kwargs):
        captured[module.layer_idx] = (module, kwargs["hidden_states"], kwargs["position_embeddings"])

    handles = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    out = {}
    for idx, (attn, x, (cos, sin)) in captured.items():
        rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, -1, attn.head_dim)
        k = attn.k_proj(x).view(b, t, -1, attn.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        out[idx] = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return out


def _expected(model, ids):
    """Per layer, per head: brute-force full-matrix (fp64) max/min/mean logit, log Z mean/max, entropy, max p."""
    cfg = model.config
    scaling = getattr(cfg, "query_pre_attn_scalar", None) or cfg.head_dim
    scaling = scaling**-0.5
    cap = getattr(cfg, "attn_logit_softcapping", None)
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * 2
    rows = {}
    with torch.no_grad():
        qk = _manual_qk(model, ids)
    for layer, (q, k) in qk.items():
        t = q.shape[2]
        i = torch.arange(t)
        visible = i[None, :] <= i[:, None]
        if types[layer] == "sliding_attention":
            visible &= i[None, :] > i[:, None] - window
        groups = q.shape[1] // k.shape[1]
        s = (q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * scaling
        raw = s
        if cap:
            s = cap * torch.tanh(s / cap)
        sm = torch.where(visible, s, -math.inf)
        logz, p = torch.logsumexp(sm, -1), torch.softmax(sm, -1)
        ent = -(torch.where(p > 0, p * p.log(), 0)).sum(-1)
        for h in range(q.shape[1]):
            vals = s[:, h][visible.expand(s.shape[0], -1, -1)]
            rows[layer, h] = {
                "max_logit": vals.max().item(),
                "min_logit": vals.min().item(),
                "mean_logit": vals.mean().item(),
                "max_logit_precap": torch.where(visible, raw[:, h], -math.inf).max().item(),
                "logz_mean": logz[:, h].mean().item(),
                "logz_max": logz[:, h].max().item(),
                "entropy_mean": ent[:, h].mean().item(),
                "max_prob_mean": p[:, h].amax(-1).mean().item(),
            }
    return rows


@pytest.mark.parametrize("family", ["llama_gqa", "mistral", "gemma2", "qwen3"])
def test_probe_matches_brute_force(family):
    model = build_model(family)
    ids = torch.randint(3, 256, (3, 40))  # 40 > sliding window 16
    res = probe(model, ids, batch_size=2)
    expected = _expected(model, ids)
    assert len(res.heads) == len(expected) == 2 * 8
    for row in res.heads:
        for key, value in expected[row["layer"], row["head"]].items():
            assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (row["layer"], row["head"], key)
    with torch.no_grad():
        logits = model(ids).logits.double()
    logz = torch.logsumexp(logits, -1)
    assert res.final["final_logit_max"] == pytest.approx(logits.max().item(), rel=1e-5)
    assert res.final["final_logz_mean"] == pytest.approx(logz.mean().item(), rel=1e-5)
    assert res.final["z_loss"] == pytest.approx(1e-4 * logz.pow(2).mean().item(), rel=1e-5)
    assert res.tokens == 120 and res.final["positions"] == 120


@pytest.mark.parametrize("family", ["llama_gqa", "mistral", "gemma2", "qwen3", "gpt2", "gemma3"])
def test_hooked_logits_equal_unhooked(family):
    model = build_model(family)
    ids = torch.randint(3, 256, (2, 40))
    calls = []
    with torch.no_grad():
        plain = model(ids).logits
        with attention_hook(model, lambda *args: calls.append(args[0])):
            hooked = model(ids).logits
        after = model(ids).logits
    assert torch.equal(plain, hooked) and torch.equal(plain, after)
    assert len(calls) == model.config.num_hidden_layers


def test_parse_rule():
    rule = parse_rule("max_logit>100")
    assert (rule.metric, rule.op, rule.value) == ("max_logit", ">", 100.0) and rule.crossed(100.5)
    assert parse_rule(" entropy_min <= 0.5 ").crossed(0.5)
    for bad in ("max_logit=>1", "nonsense>1", "z_loss>abc"):
        with pytest.raises(UsageError):
            parse_rule(bad)


@pytest.fixture
def two_models(tiny, tmp_path):
    (tmp_path / "t.txt").write_text(PROSE * 3)
    return (char_tokenizer(tiny("llama_gqa", seed=0)), char_tokenizer(tiny("gemma2", seed=1)), tmp_path / "t.txt")


def test_probe_cli_two_models_json_out_and_plot(two_models, runner, tmp_path):
    import pandas as pd

    a, b, text = two_models
    out = runner.invoke(
        app,
        [
            "probe",
            str(a),
            str(b),
            str(text),
            "--seq-len",
            "64",
            "--max-tokens",
            "128",
            "--device",
            "cpu",
            "--format",
            "json",
            "--out",
            str(tmp_path / "s.parquet"),
            "--plot",
            str(tmp_path / "p.png"),
        ],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert [m["model"] for m in doc["models"]] == [str(a), str(b)]
    assert all(m["tokens"] == 128 and len(m["heads"]) == 16 for m in doc["models"])
    assert doc["models"][1]["heads"][0]["max_logit"] <= 50.0  # gemma2 soft-caps at 50
    frame = pd.read_parquet(tmp_path / "s.parquet")
    assert len(frame) == 32 and frame["max_logit"].max() == max(
        h["max_logit"] for m in doc["models"] for h in m["heads"]
    )
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_cli_fail_if_names_heads_and_exits_3(two_models, runner):
    a, _, text = two_models
    out = runner.invoke(
        app,
        [
            "probe",
            str(a),
            str(text),
            "--seq-len",
            "64",
            "--max-tokens",
            "64",
            "--device",
            "cpu",
            "--format",
            "csv",
            "--fail-if",
            "max_logit>-1000",
            "--fail-if",
            "z_loss>1e9",
        ],
    )
    assert out.exit_code == 3
    assert "max_logit>-1000:" in out.stderr and "layer 0 head 0" in out.stderr and "z_loss" not in out.stderr
    assert out.stdout.splitlines()[0].startswith("model,layer,head,kv_head")
    assert len(out.stdout.splitlines()) == 1 + 16


def test_probe_cli_bad_rule_is_usage_error(two_models, runner):
    a, _, text = two_models
    out = runner.invoke(app, ["probe", str(a), str(text), "--fail-if", "max_logit=1"])
    assert out.exit_code == 2 and "expected METRIC>VALUE" in out.output


@pytest.mark.real_model
def test_probe_smollm2_matches_manual_head():
    from attnkit.realmodels import smollm2_folder
    from attnkit.runtime import load_model, make_windows

    loaded = load_model(str(smollm2_folder()), device="cpu")
    ids = make_windows(loaded.tokenizer, [PROSE * 4], seq_len=64, max_tokens=64)
    res = probe(loaded, ids)
    model = loaded.model
    qk = _manual_qk(model, ids)
    layer, head = 5, 3
    q, k = qk[layer]
    groups = q.shape[1] // k.shape[1]
    s = (q[:, head] @ k[:, head // groups].transpose(-1, -2)) * model.config.head_dim**-0.5  # [1, T, T]
    s = s.masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), -math.inf)
    row = next(r for r in res.heads if (r["layer"], r["head"]) == (layer, head))
    assert row["max_logit"] == pytest.approx(s.max().item(), rel=1e-5)
    assert row["logz_max"] == pytest.approx(torch.logsumexp(s, -1).max().item(), rel=1e-5)
    assert len(res.heads) == model.config.num_hidden_layers * model.config.num_attention_heads


def test_plot_uses_one_colour_scale_and_marks_the_fail_if_bound(tmp_path, monkeypatch):
    import matplotlib.figure

    from attnkit.commands.analyse.probe_report import plot
    from attnkit.commands.analyse.probe_rules import max_logit_limit, parse_rule
    from attnkit.scoring.attention_stats import ProbeResult

    def result(name, scale):
        heads = [
            {"layer": l, "head": h, "max_logit": scale * (h + l), "logz_mean": 1.0, "logz_max": 2.0}
            for l in range(2)
            for h in range(4)
        ]
        return ProbeResult(model=name, tokens=1, windows=1, seq_len=1, threshold=100, z_lambda=0, heads=heads)

    figures = []

    def savefig(fig, path, **_kwargs):
        figures.append(fig)
        open(path, "wb").close()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    limit = max_logit_limit([parse_rule("max_logit>40"), parse_rule("max_logit>=12"), parse_rule("z_loss>1")])
    assert limit == 12
    plot([result("source", 10.0), result("clipped", 1.0)], str(tmp_path / "p.png"), limit=limit)
    (fig,) = figures
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [im.get_clim() for im in images] == [(0.0, 40.0), (0.0, 40.0)]
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "max attention logit"]
    assert len(bars) == 2 and all(any(line.get_ydata()[0] == 12 for line in bar.lines) for bar in bars)


def test_out_and_plot_suffixes_are_refused_before_any_model_loads(tiny, runner, tmp_path, monkeypatch):
    from attnkit.commands.analyse import probe

    monkeypatch.setattr(probe, "open_model", lambda *a, **k: pytest.fail("a model was loaded before the checks"))
    (tmp_path / "t.txt").write_text("some text " * 50)
    model = str(tiny("llama_gqa"))
    for option, path in (("--out", "stats.txt"), ("--plot", "heads.svgz")):
        result = runner.invoke(app, ["probe", model, str(tmp_path / "t.txt"), option, str(tmp_path / path)])
        assert result.exit_code == 2 and option in result.stderr, result.output
