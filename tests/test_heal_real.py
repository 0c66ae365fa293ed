"""`attnkit heal` on SmolLM2-135M: a few steps on a mean-pooled MQA student lower its KL to the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnkit.cli import app
from attnkit.realmodels import smollm2_folder

CALIB = Path(__file__).parent / "data" / "prose" / "calib.txt"


@pytest.mark.real_model
def test_smollm2_mqa_mean_heals(runner, tmp_path):
    from attnkit.io.safetensors_header import read_headers

    src, student, out = smollm2_folder(), tmp_path / "mqa", tmp_path / "healed"
    converted = runner.invoke(app, ["convert", "mqa", str(src), str(student), "--method", "mean", "--no-check"])
    assert converted.exit_code == 0, converted.output
    result = runner.invoke(
        app,
        [
            "heal",
            str(student),
            str(out),
            "--teacher",
            str(src),
            "--data",
            str(CALIB),
            "--tokens",
            "512",
            "--seq-len",
            "64",
            "--batch-size",
            "2",
            "--micro-batch-size",
            "2",
            "--val-tokens",
            "256",
            "--lr",
            "1e-3",
            "--device",
            "cpu",
            "--no-check",
            "--format",
            "json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["training"]["steps"] == 4 and report["trainable"]["tensors"] == 60  # k and v of 30 layers
    assert report["validation"]["after"]["kl_mean"] < report["validation"]["before"]["kl_mean"]
    layout = {n: (i.dtype, i.shape) for n, i in read_headers(sorted(out.glob("*.safetensors"))).items()}
    assert layout == {n: (i.dtype, i.shape) for n, i in read_headers(sorted(student.glob("*.safetensors"))).items()}
