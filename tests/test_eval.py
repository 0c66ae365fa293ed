"""evaluate(): NLL/perplexity and KL against brute-force computations; the `attnkit eval` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnkit.cli import app
from attnkit.scoring.perplexity import evaluate
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
    }


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


def test_eval_cli_short_text_is_one_line_error(tiny, runner):
    model = char_tokenizer(tiny("llama"))
    out = runner.invoke(app, ["eval", str(model), "--text", "too short", "--seq-len", "64"])
    assert out.exit_code == 1
    assert "shorter than one window of 64" in out.output and "Traceback" not in out.output


@pytest.mark.real_model
def test_eval_smollm2_matches_model_loss():
    from attnkit.runtime import load_model, make_windows
    from tests.realmodel import smollm2_folder

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
    from attnkit.runtime import load_model
    from tests.realmodel import smollm2_folder, smollm2_gguf

    gguf = smollm2_gguf()
    smollm2_folder()  # dequantized into the test cache once, as a first eval would
    loaded = load_model(str(gguf), device="cpu")
    assert loaded.checkpoint.root == gguf_cache_folder(gguf) and loaded.checkpoint.dequantized_from == gguf
