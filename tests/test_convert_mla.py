"""`attnkit convert mla` on tiny checkpoints: exactness, stock DeepseekV3 loading, the cache, CLI errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from attnkit.cli import app
from tests.test_runtime import char_tokenizer
from tests.tiny import build_model, save_model

CALIB = str(Path(__file__).parent / "data" / "prose" / "calib.txt")
HELDOUT = str(Path(__file__).parent / "data" / "prose" / "heldout.txt")
FAST = ["--calib", CALIB, "--calib-tokens", "512", "--calib-seq-len", "128"]


def _source(tmp_path: Path, family: str, biases: bool = False, **overrides) -> Path:
    """A tiny checkpoint with a character tokenizer; biases: random nonzero q/k/v/o biases."""
    model = build_model(family, **overrides)
    if biases:
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.data.copy_(0.5 * torch.randn(p.shape, generator=g))
    folder = tmp_path / f"src-{family}"
    save_model(model, folder)
    return char_tokenizer(folder)


def _digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _convert(runner, src: Path, out: Path, *args: str):
    return runner.invoke(app, ["convert", "mla", str(src), str(out), *FAST, *args, "--format", "json"])


@pytest.mark.parametrize("family,biases", [("llama", False), ("qwen2", True), ("gemma", False)])
def test_lossless_case_matches_source_logits(runner, tmp_path, family, biases):
    """MQA source, P = head_dim, full latent rank: nothing is lost; logits agree to 1e-4 in fp32."""
    src = _source(tmp_path, family, biases, num_key_value_heads=1, head_dim=8)
    out = tmp_path / "out"
    result = _convert(runner, src, out, "--kv-lora-rank", "17", "--rope-dim", "8", "--device", "cpu")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["first_k_dense_replace"] == 2
    assert (config["q_lora_rank"] is not None) == biases  # a q bias needs the q_lora path
    ids = torch.randint(3, 100, (2, 48), generator=torch.Generator().manual_seed(0))
    diff = (_logits(src, ids) - _logits(out, ids)).abs().max().item()
    assert diff < 1e-4, diff


def test_gqa_converts_loads_in_stock_deepseek_and_caches_the_latent(runner, tmp_path):
    from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

    from attnkit.commands.convert.mla import cache_check

    src = _source(tmp_path, "llama_gqa")  # 8 heads, 2 KV heads, D = 8: 32 cached values per token and layer
    before = _digest(src)
    out = tmp_path / "out"
    result = _convert(runner, src, out, "--kv-budget", "0.5", "--device", "cpu", "--eval", HELDOUT,
                      "--eval-tokens", "256", "--eval-seq-len", "128")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["kv_lora_rank"], report["rope_dim"]) == (12, 4)  # 16 = 12 + 4: P = even(16 // 3)
    assert report["kv_bytes_per_token"]["elements_after"] == 16
    assert len(report["layers"]) == 2 and all(0 < r["k_err"] < 1 and 0 < r["v_err"] < 1 for r in report["layers"])
    assert all(0 < r["position_free"] < 1 for r in report["layers"])  # P = 4 < D = 8: slow pairs lose RoPE
    assert report["eval"]["cache"]["values_per_token_layer"] == 16
    assert report["eval"]["kl_mean"] > 0 and report["eval"]["perplexity"] > 1
    assert _digest(src) == before  # input untouched
    assert json.loads((out / "attnkit.json").read_text())["conversion"] == "mla"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is DeepseekV3ForCausalLM
    assert not any("expert" in n or "gate.weight" in n for n, _ in model.named_parameters())
    check = cache_check(model)
    assert check["key_shape"][-1] == 12 and check["value_shape"][-1] == 4
    assert check["values_per_token_layer"] == 16


def test_dry_run_writes_nothing(runner, tmp_path):
    src = _source(tmp_path, "llama_gqa")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "mla", str(src), str(out), "--kv-budget", "0.25", "--dry-run",
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kv_lora_rank"] + json.loads(result.stdout)["rope_dim"] == 8
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (["--kv-lora-rank", "1", "--rope-dim", "4"], "--kv-lora-rank must be between 2"),
    (["--kv-lora-rank", "34", "--rope-dim", "4"], "and 33"),
    (["--kv-lora-rank", "8", "--rope-dim", "3"], "--rope-dim must be even"),
    (["--kv-lora-rank", "8", "--rope-dim", "10"], "head dim 8"),
    (["--kv-lora-rank", "8"], "give --kv-lora-rank and --rope-dim"),
    (["--kv-budget", "1.5"], "between 0 and 1"),
    (["--kv-budget", "0.5", "--rope-dim", "4"], "not both"),
])
def test_rank_errors_are_one_line_usage_errors(runner, tmp_path, args, needle):
    src = _source(tmp_path, "llama_gqa")
    result = runner.invoke(app, ["convert", "mla", str(src), str(tmp_path / "out"), *FAST, *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,needle", [("qwen3", "QK-norm"), ("gpt2", "cannot be converted to MLA"),
                                           ("gemma2", "soft-capping")])
def test_unsupported_families_are_refused_in_one_line(runner, tmp_path, family, needle):
    folder = tmp_path / family
    save_model(build_model(family), folder)
    result = runner.invoke(app, ["convert", "mla", str(folder), str(tmp_path / "out"), *FAST, "--kv-budget", "0.5"])
    assert result.exit_code == 1, result.output
    assert needle in result.output and len(result.output.strip().splitlines()) == 1


def test_needs_calibration_text(runner, tmp_path):
    src = _source(tmp_path, "llama_gqa")
    result = runner.invoke(app, ["convert", "mla", str(src), str(tmp_path / "out"), "--kv-budget", "0.5"])
    assert result.exit_code == 2 and "--calib" in result.output
