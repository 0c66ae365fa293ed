"""evaluate(): NLL/perplexity and KL against brute-force computations; the `attnkit eval` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnkit.cli import app
from attnkit.scoring import perplexity
from attnkit.scoring.perplexity import distance_buckets, evaluate
from tests.helpers import PROSE, char_tokenizer
from tests.tiny import build_model


def _brute(model, ref, ids):
    """Full-matrix fp32 log-probs of both models: (nll mean, KL mean, KL max, top-1 agreement)."""
    with torch.no_grad():
        lp = model(ids).logits[:, :-1].float().log_softmax(-1)  # [N, T-1, V]
        lr = ref(ids).logits[:, :-1].float().log_softmax(-1)
    nll = -lp.gather(-1, ids[:, 1:, None]).mean().item()
    kl = (lr.exp() * (lr - lp)).sum(-1)  # [N, T-1]
    return nll, kl.mean().item(), kl.max().item(), (lr.argmax(-1) == lp.argmax(-1)).float().mean().item()


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2"])
def test_evaluate_matches_brute_force(family):
    model, ref = build_model(family, seed=0), build_model(family, seed=1)
    ids = torch.randint(3, 256, (3, 20))
    res = evaluate(model, ids, reference=ref, batch_size=2)
    nll, kl_mean, kl_max, agree = _brute(model, ref, ids)
    assert res.predicted == 3 * 19 and res.tokens == 3 * 20
    assert res.nll_mean == pytest.approx(nll, rel=1e-5)
    assert res.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert res.kl_mean == pytest.approx(kl_mean, rel=1e-4) and res.kl_max == pytest.approx(kl_max, rel=1e-4)
    assert res.top1_agreement == pytest.approx(agree)
    assert res.reference_nll_mean == pytest.approx(_brute(ref, model, ids)[0], rel=1e-5)
    with torch.no_grad():
        assert res.nll_mean == pytest.approx(model(ids, labels=ids).loss.item(), rel=1e-5)


def test_evaluate_against_itself_is_zero_kl():
    model = build_model("qwen3")
    res = evaluate(model, torch.randint(3, 256, (2, 16)), reference=model)
    # the same float32 computation twice: KL within the rounding of a log-softmax sum over the vocabulary
    tolerance = 256 * torch.finfo(torch.float32).eps
    assert abs(res.kl_mean) < tolerance and abs(res.kl_max) < tolerance and res.top1_agreement == 1.0
    assert set(res.to_dict()) == {
        "tokens",
        "predicted",
        "nll_mean",
        "perplexity",
        "kl_mean",
        "kl_max",
        "top1_agreement",
        "reference_nll_mean",
        "reference_perplexity",
        "by_distance",
    }


def test_distance_buckets_double_from_128_up_to_the_window():
    assert distance_buckets(4096) == [(0, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096)]
    assert distance_buckets(3000)[-1] == (2048, 3000)
    assert distance_buckets(100) == [(0, 100)]
    assert distance_buckets(16, first=4) == [(0, 4), (4, 8), (8, 16)]


def test_by_distance_rows_add_up_to_the_totals(monkeypatch):
    """Each bucket's scores recomputed by hand from per-position values; the buckets together are the totals."""
    monkeypatch.setattr(perplexity, "FIRST_BUCKET", 4)
    model, reference = build_model("llama"), build_model("llama", seed=1)
    windows = torch.randint(3, 256, (3, 20))
    res = evaluate(model, windows, reference=reference, by_distance=True)
    with torch.no_grad():
        logp = model(input_ids=windows).logits[:, :-1].float().log_softmax(-1)  # [N, T-1, V]
        ref = reference(input_ids=windows).logits[:, :-1].float().log_softmax(-1)
    tgt = windows[:, 1:, None]
    nll, ref_nll = -logp.gather(-1, tgt)[..., 0], -ref.gather(-1, tgt)[..., 0]  # [N, T-1]
    kl = (ref.exp() * (ref - logp)).sum(-1)
    agree = (ref.argmax(-1) == logp.argmax(-1)).double()
    assert [(r["start"], r["end"]) for r in res.by_distance] == [(0, 4), (4, 8), (8, 16), (16, 20)]
    for row in res.by_distance:
        cols = slice(max(row["start"], 1) - 1, row["end"] - 1)  # predicted positions start..end-1
        n = nll[:, cols].numel()
        assert row["predicted"] == n
        assert math.isclose(row["perplexity"], math.exp(nll[:, cols].double().mean()), rel_tol=1e-5)
        assert math.isclose(row["reference_perplexity"], math.exp(ref_nll[:, cols].double().mean()), rel_tol=1e-5)
        assert math.isclose(row["ratio"], row["perplexity"] / row["reference_perplexity"], rel_tol=1e-12)
        assert math.isclose(row["kl_mean"], float(kl[:, cols].double().mean()), rel_tol=1e-4, abs_tol=1e-6)
        assert math.isclose(row["top1_agreement"], float(agree[:, cols].mean()), rel_tol=1e-12)
    assert sum(r["predicted"] for r in res.by_distance) == res.predicted
    total_nll = sum(math.log(r["perplexity"]) * r["predicted"] for r in res.by_distance) / res.predicted
    assert math.isclose(total_nll, res.nll_mean, rel_tol=1e-9)


def test_by_distance_buckets_of_a_long_window():
    model = build_model("llama")
    res = evaluate(model, torch.randint(3, 256, (1, 300)), by_distance=True)
    assert [(r["start"], r["end"]) for r in res.by_distance] == [(0, 128), (128, 256), (256, 300)]
    assert [r["predicted"] for r in res.by_distance] == [127, 128, 44]
    assert all(r["reference_perplexity"] is None and r["kl_mean"] is None for r in res.by_distance)


def test_eval_cli_json(tiny, runner, tmp_path):
    model = char_tokenizer(tiny("llama_gqa", seed=0))
    ref = char_tokenizer(tiny("llama_gqa", seed=1))
    (tmp_path / "t.txt").write_text(PROSE * 3)
    out = runner.invoke(
        app,
        [
            "eval",
            str(model),
            str(tmp_path / "t.txt"),
            "--reference",
            str(ref),
            "--seq-len",
            "64",
            "--max-tokens",
            "192",
            "--device",
            "cpu",
            "--format",
            "json",
        ],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["windows"] == 3 and doc["predicted"] == 3 * 63 and doc["tokens"] == 3 * 64 and doc["seq_len"] == 64
    assert doc["perplexity"] == pytest.approx(math.exp(doc["nll_mean"]))
    assert doc["kl_mean"] > 0 and 0 <= doc["top1_agreement"] <= 1


def test_eval_cli_reports_scores_by_distance_in_every_format(tiny, runner, tmp_path):
    model = char_tokenizer(tiny("llama_gqa", seed=0))
    ref = char_tokenizer(tiny("llama_gqa", seed=1))
    (tmp_path / "t.txt").write_text(PROSE * 6)
    args = ["eval", str(model), str(tmp_path / "t.txt"), "--reference", str(ref), "--seq-len", "300"]
    args += ["--max-tokens", "600", "--device", "cpu", "--format"]
    out = runner.invoke(app, [*args, "json", "--plot", str(tmp_path / "d.png")])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    rows = doc["by_distance"]
    assert [(r["start"], r["end"], r["predicted"]) for r in rows] == [(0, 128, 254), (128, 256, 256), (256, 300, 88)]
    assert sum(r["predicted"] for r in rows) == doc["predicted"]
    assert all(r["kl_mean"] > 0 and r["ratio"] == r["perplexity"] / r["reference_perplexity"] for r in rows)
    assert (tmp_path / "d.png").stat().st_size > 0
    table = runner.invoke(app, [*args, "markdown"])
    assert table.exit_code == 0 and "**by distance**" in table.stdout and "| 256-300 |" in table.stdout
    csv = runner.invoke(app, [*args, "csv"])
    assert csv.exit_code == 0 and "by_distance" in csv.stdout.splitlines()[0] and '""start"": 256' in csv.stdout
    short = runner.invoke(app, [*args[:6], "64", "--device", "cpu", "--format", "json"])
    assert json.loads(short.stdout)["by_distance"] is None  # one bucket: no table by distance
    off = runner.invoke(app, [*args, "json", "--no-by-distance"])
    assert json.loads(off.stdout)["by_distance"] is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq-len", "100", "--by-distance"], "no longer than the first distance bucket (128 tokens)"),
        (["--seq-len", "513"], "--seq-len 513 is past"),
        (["--seq-len", "64", "--plot", "x.png"], "--plot draws pass-key accuracy or scores by distance"),
    ],
)
def test_eval_by_distance_bad_input_is_refused_before_a_model_loads(tiny, runner, tmp_path, extra, message):
    model = char_tokenizer(tiny("llama"))  # max_position_embeddings 512
    (tmp_path / "t.txt").write_text(PROSE)
    out = runner.invoke(app, ["eval", str(model), str(tmp_path / "t.txt"), "--device", "cpu", *extra])
    assert out.exit_code == 2, out.output
    assert message in " ".join(out.output.split()) and "Traceback" not in out.output


def test_eval_cli_short_text_is_one_line_error(tiny, runner):
    model = char_tokenizer(tiny("llama"))
    out = runner.invoke(app, ["eval", str(model), "--text", "too short", "--seq-len", "64"])
    assert out.exit_code == 1
    assert "shorter than one window of 64" in out.output and "Traceback" not in out.output


@pytest.mark.real_model
def test_eval_smollm2_matches_model_loss():
    from attnkit.realmodels import smollm2_folder
    from attnkit.runtime import load_model, make_windows

    loaded = load_model(str(smollm2_folder()), device="cpu")
    windows = make_windows(loaded.tokenizer, [PROSE * 4], seq_len=64, max_tokens=128)
    res = evaluate(loaded, windows, batch_size=2)
    with torch.no_grad():
        loss = loaded.model(windows, labels=windows).loss.item()
    assert res.predicted == 2 * 63
    assert res.nll_mean == pytest.approx(loss, rel=1e-5)
    assert 1.0 < res.perplexity < 1000.0


def test_eval_and_probe_count_the_same_tokens_and_take_both_dtype_spellings(tiny, runner, tmp_path):
    model = char_tokenizer(tiny("llama_gqa"))
    (tmp_path / "t.txt").write_text(PROSE * 3)
    common = [str(tmp_path / "t.txt"), "--seq-len", "64", "--max-tokens", "128", "--device", "cpu", "--format", "json"]
    docs = {}
    for command, dtype in (("eval", "bf16"), ("probe", "bfloat16")):
        out = runner.invoke(app, [command, str(model), *common, "--dtype", dtype])
        assert out.exit_code == 0, out.output
        docs[command] = json.loads(out.stdout)
    assert docs["eval"]["dtype"] == "bfloat16"
    assert docs["eval"]["tokens"] == docs["probe"]["models"][0]["tokens"] == 128


@pytest.mark.parametrize("command", ["eval", "probe"])
def test_every_model_and_option_is_checked_before_one_loads(tiny, runner, tmp_path, monkeypatch, command):
    from attnkit.commands.analyse import eval as eval_command
    from attnkit.commands.analyse import probe

    model = char_tokenizer(tiny("llama_gqa"))
    (tmp_path / "t.txt").write_text(PROSE * 3)
    for module in (eval_command, probe):
        monkeypatch.setattr(module, "open_model", lambda *a, **k: pytest.fail("a model was loaded before the checks"))
    second = ["--reference", str(tmp_path / "nope")] if command == "eval" else [str(tmp_path / "nope")]
    out = runner.invoke(app, [command, str(model), *second, str(tmp_path / "t.txt")])
    assert out.exit_code == 1 and "nope: no such file or folder" in out.stderr
    for option in (["--dtype", "bf17"], ["--device", "tpu9"]):
        out = runner.invoke(app, [command, str(model), str(tmp_path / "t.txt"), *option])
        assert out.exit_code == 2 and option[1] in out.stderr


@pytest.mark.real_model
def test_a_gguf_model_runs_from_its_cache_folder():
    from attnkit.io.gguf_load import gguf_cache_folder
    from attnkit.realmodels import smollm2_folder, smollm2_gguf
    from attnkit.runtime import load_model

    gguf = smollm2_gguf()
    smollm2_folder()  # dequantized into the test cache once, as a first eval would
    loaded = load_model(str(gguf), device="cpu")
    assert loaded.checkpoint.root == gguf_cache_folder(gguf) and loaded.checkpoint.dequantized_from == gguf
