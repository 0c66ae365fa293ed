"""`attnkit kvmem` and `attnkit inspect` end to end through the CLI."""

from __future__ import annotations

import json

import pytest

from attnkit.cli import app


def run_json(runner, args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_gpu_fit_columns(runner):
    doc = run_json(runner, ["kvmem", "llama-3.1-8b", "--context", "32k", "--batch", "16",
                            "--gpu-mem", "80GiB", "--format", "json"])
    row = doc["rows"][0]
    weights = 8030261248 * 2  # bf16 weights of the preset's published parameter count
    kv = 16 * 32768 * 131072
    assert row["weights_per_gpu"] == weights
    assert row["kv_per_gpu"] == kv
    assert row["fits"] is True
    free = 80 * 2**30 - weights
    assert row["max_batch"] == free // (32768 * 131072)
    assert row["max_context"] == free // (16 * 131072)


def test_tensor_parallel_fit(runner):
    doc = run_json(runner, ["kvmem", "llama-3.1-8b", "--context", "4k", "--gpu-mem", "24GiB",
                            "--tp", "2", "--format", "json"])
    row = doc["rows"][0]
    assert row["weights_per_gpu"] == 8030261248 * 2 / 2
    assert row["kv_per_gpu"] == 4096 * 131072 / 2  # 4 of 8 KV heads per GPU
    assert doc["gpu"] == {"mem_bytes": 24 * 2**30, "tp": 2, "reserve_bytes": 0}


def test_rows_cover_every_combination(runner):
    doc = run_json(runner, ["kvmem", "llama-3.1-8b", "--context", "4k,8k", "--batch", "1,2",
                            "--dtype", "bf16,int4", "--variant", "native,mqa", "--format", "json"])
    combos = {(r["variant"], r["dtype"], r["context"], r["batch"]) for r in doc["rows"]}
    assert len(combos) == 16
    mqa_bf16 = next(r for r in doc["rows"] if r["variant"] == "mqa" and r["dtype"] == "bf16")
    assert mqa_bf16["bytes_per_token"] == 131072 / 8


def test_tp_without_gpu_mem_is_usage_error(runner):
    result = runner.invoke(app, ["kvmem", "llama-3.1-8b", "--tp", "2"])
    assert result.exit_code == 2


def test_kvmem_on_checkpoint_uses_header_sizes(runner, tiny):
    import torch
    from safetensors.torch import load_file

    folder = tiny("llama_gqa")
    tensors = load_file(folder / "model.safetensors")
    doc = run_json(runner, ["kvmem", str(folder), "--context", "64", "--format", "json"])
    assert doc["parameters_origin"] == "headers"
    assert doc["parameters"] == sum(t.numel() for t in tensors.values())
    assert doc["weight_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # 2 layers x 2 KV heads x head_dim 8 x (K,V) x 2 bytes
    assert doc["rows"][0]["bytes_per_token"] == 2 * 2 * 8 * 2 * 2
    assert torch.is_tensor(next(iter(tensors.values())))


def test_kvmem_on_bare_config_estimates_parameters(runner, tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    doc = run_json(runner, ["kvmem", str(tmp_path / "config.json"), "--format", "json"])
    embed = 2 * 100 * 64
    attn = 64 * 64 + 64 * 2 * 16 * 2 + 64 * 64  # q, k+v (2 heads x 16 dims each), o
    mlp = 3 * 64 * 128
    assert doc["parameters_origin"] == "estimate"
    assert doc["parameters"] == embed + 2 * (attn + mlp)


def test_inspect_tiny_folder(runner, tiny):
    doc = run_json(runner, ["inspect", str(tiny("llama_gqa")), "--format", "json"])
    assert doc["spec"]["variant"] == "GQA-2"
    assert doc["spec"]["num_heads"] == 8 and doc["spec"]["head_dim"] == 8
    assert doc["kv_bytes_per_token_bf16"] == 2 * 2 * 8 * 2 * 2


def test_unknown_model_type_lists_supported(runner, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nosuchmodel"}))
    result = runner.invoke(app, ["inspect", str(tmp_path)])
    assert result.exit_code == 1
    assert "unsupported model_type 'nosuchmodel'" in result.output and "llama" in result.output


def test_offline_hub_id_not_cached(runner, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    result = runner.invoke(app, ["kvmem", "someorg/not-a-cached-model"])
    assert result.exit_code == 1
    assert "someorg/not-a-cached-model" in result.output and "not in the local cache" in result.output


@pytest.mark.real_model
def test_inspect_real_gguf(runner):
    from tests.realmodel import smollm2_gguf

    doc = run_json(runner, ["inspect", str(smollm2_gguf()), "--format", "json"])
    assert doc["kind"] == "gguf"
    spec = doc["spec"]
    assert (spec["num_layers"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]) == (30, 9, 3, 64)
    assert doc["kv_bytes_per_token_bf16"] == 30 * 3 * 64 * 2 * 2
    assert doc["parameters_origin"] == "gguf" and doc["parameters"] > 130_000_000
