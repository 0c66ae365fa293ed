"""What attnkit does on a CUDA device: the same figures as on the CPU (within float tolerance), layer streaming
bit for bit, heal under bf16 autocast. Marked `gpu`; skipped where torch sees no CUDA device (CI)."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.cli import app
from tests.helpers import HELDOUT, PROSE, char_tokenizer, tiny_source
from tests.tiny import build_model, save_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXT = [HELDOUT, "--max-tokens", "256", "--seq-len", "128", "--batch-size", "2"]
#: fp32 on a GPU against fp32 on a CPU: other kernels, other summation orders (TF32 is off by default in torch).
RTOL = 1e-4


def _json(runner, args: list[str]) -> dict:
    result = runner.invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("family", ["llama_gqa", "gemma3"])
def test_probe_and_eval_on_cuda_equal_the_cpu(runner, tmp_path, family):
    src = tiny_source(tmp_path, family)
    ref = tiny_source(tmp_path / "ref", family, seed=1)
    runs = {}
    for device in ("cpu", "cuda"):
        common = ["--device", device, "--dtype", "float32"]
        ev = _json(runner, ["eval", str(src), *TEXT, "--reference", str(ref), *common])
        pr = _json(runner, ["probe", str(src), *TEXT, *common])["models"][0]
        runs[device] = (ev, pr)
    (ev_cpu, pr_cpu), (ev_gpu, pr_gpu) = runs["cpu"], runs["cuda"]
    assert ev_gpu["perplexity"] == pytest.approx(ev_cpu["perplexity"], rel=RTOL)
    assert ev_gpu["kl_mean"] == pytest.approx(ev_cpu["kl_mean"], rel=1e-3, abs=1e-6)
    for a, b in zip(pr_cpu["heads"], pr_gpu["heads"], strict=True):
        assert (a["layer"], a["head"]) == (b["layer"], b["head"])
        assert b["max_logit"] == pytest.approx(a["max_logit"], rel=RTOL, abs=1e-5)
        assert b["logz_mean"] == pytest.approx(a["logz_mean"], rel=RTOL, abs=1e-5)


def test_layer_streaming_on_cuda_equals_the_whole_model_bit_for_bit(runner, tmp_path):
    src = tiny_source(tmp_path, "mistral")
    runs = {
        mode: _json(runner, ["probe", str(src), *TEXT, "--device", "cuda", "--layer-stream", mode])["models"][0]
        for mode in ("never", "always")
    }
    assert runs["always"]["heads"] == runs["never"]["heads"] and runs["always"]["final"] == runs["never"]["final"]


def test_convert_mla_on_cuda_scores_as_on_the_cpu(runner, tmp_path):
    src = tiny_source(tmp_path, "llama_gqa", offset=2.0)
    kl = {}
    for device in ("cpu", "cuda"):
        report = _json(
            runner,
            ["convert", "mla", str(src), str(tmp_path / f"mla{len(kl)}"), "--kv-budget", "0.5", "--calib", HELDOUT,
             "--device", device, "--eval", HELDOUT],
        )  # fmt: skip
        kl[device] = report["eval"]["kl_mean"]
    assert kl["cuda"] == pytest.approx(kl["cpu"], rel=1e-2, abs=1e-5)


def test_heal_on_cuda_trains_under_bf16_autocast_and_writes_the_student(runner, tmp_path):
    teacher = char_tokenizer(save_model(build_model("llama_gqa"), tmp_path / "teacher"))
    student = tmp_path / "student"
    assert runner.invoke(app, ["convert", "mqa", str(teacher), str(student), "--method", "mean"]).exit_code == 0
    data = tmp_path / "data.txt"
    data.write_text(PROSE * 30)
    report = _json(
        runner,
        ["heal", str(student), str(tmp_path / "out"), "--teacher", str(teacher), "--data", str(data),
         "--tokens", "4096", "--seq-len", "64", "--batch-size", "4", "--micro-batch-size", "2", "--val-tokens",
         "128", "--eval-every", "4", "--lr", "3e-3", "--device", "cuda"],
    )  # fmt: skip
    training = report["training"]
    assert training["device"].startswith("cuda") and training["precision"] == "bf16 autocast"
    assert training["steps"] == 16 and all(torch.isfinite(torch.tensor(s["loss"])) for s in report["steps"])
    assert report["validation"]["after"]["kl_mean"] < report["validation"]["before"]["kl_mean"]
    assert (tmp_path / "out" / "attnkit.json").is_file()
