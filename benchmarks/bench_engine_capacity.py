"""The KV cache a rewrite saves where it is served: llama.cpp's own allocation for the source and each output.

Usage: python benchmarks/bench_engine_capacity.py run --work DIR --model NAME=FOLDER ... [--contexts 1024,4096,8192]
       python benchmarks/bench_engine_capacity.py render [--write]
  run: each checkpoint folder (the first is the source the others are compared with) is converted to an f32 GGUF
       by llama.cpp's convert_hf_to_gguf.py (kept in DIR, reused), and llama.cpp (llama-completion -lv 4, nothing
       generated; attnkit.engines.llamacpp.kv_allocation) allocates its cache at each context (its default f16
       cache); beside it what `attnkit kvmem --paging llama.cpp` predicts, and whether vLLM and SGLang serve an MLA
       output as written (attnkit.engines.targets.mla_serving); then decode tokens/s at each --decode-depths
       (llama-bench, the models side by side in --rounds rounds). Needs the engine tier (`source .ci/engines.sh`).
       A minute or two per model on 2 cores for the cache, several per model and round for the decode speed.
       Rows: benchmarks/results/engine_capacity.jsonl.
  render: "## What the rewrites save in the engines" of docs/serving.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "engine_capacity.jsonl"
MIB = 1 << 20


def measure(name: str, folder: Path, work: Path, contexts: list[int], tools) -> dict:
    """One checkpoint: llama.cpp's cache at each context beside kvmem's prediction."""
    from attnkit.archs.spec import attention_spec
    from attnkit.engines import llamacpp
    from attnkit.engines.targets import mla_serving
    from attnkit.io.config import read_config
    from attnkit.kvcache import LlamaCppPaging, cache_dtype, kv_bytes

    gguf = work / f"{name}-f32.gguf"
    if not gguf.is_file():
        llamacpp.convert(tools, folder, gguf)
    config = read_config(folder / "config.json")
    spec = attention_spec(config)
    rows = []
    for n_ctx in contexts:
        allocated = llamacpp.kv_allocation(tools, gguf, n_ctx)
        predicted = kv_bytes(spec, cache_dtype("f16"), n_ctx, 1, paging=LlamaCppPaging()) / MIB
        rows.append({"n_ctx": n_ctx, "mib": allocated["mib"], "kvmem_mib": predicted, "caches": allocated["caches"]})
    served = None
    if spec.mla is not None:
        served = mla_serving(
            spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, spec.num_heads, spec.mla.qk_nope_head_dim
        )
    return {"model": name, "model_type": spec.model_type, "layout": spec.variant, "contexts": rows, "serving": served}


def decode(work: Path, names: list[str], depths: list[int], rounds: int, tools) -> dict[str, dict[int, float]]:
    """Decode tokens/s of each model's GGUF at each depth, the models side by side (verify's measurement:
    attnkit.commands.analyse.verify_saving.decode)."""
    from attnkit.commands.analyse.verify_saving import decode as side_by_side

    models = {name: work / f"{name}-f32.gguf" for name in names}
    return side_by_side(tools, models, depths, rounds)["tokens_per_second"]


def run(work: Path, models: list[str], contexts: list[int], depths: list[int], rounds: int) -> None:
    from attnkit.engines.llamacpp import find_llama_cpp

    tools = find_llama_cpp(None, os.environ.get("ATTNKIT_CONVERT_PYTHON") or sys.executable)
    if isinstance(tools, str):
        raise SystemExit(f"llama.cpp: {tools} (source .ci/engines.sh)")
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, pair in enumerate(models):
        name, folder = pair.split("=", 1)
        rows.append({"source": i == 0, **measure(name, Path(folder), work, contexts, tools)})
        print(f"{name}: cache measured", file=sys.stderr)
    speeds = decode(work, [r["model"] for r in rows], depths, rounds, tools) if depths else {}
    benchlib.append_jsonl(RESULTS, [{**row, "decode": speeds.get(row["model"])} for row in rows])


def render(write: bool) -> None:
    rows = benchlib.latest(benchlib.read_jsonl(RESULTS), lambda row: row["model"])
    for row in rows.values():
        row["decode"] = {int(d): v for d, v in (row.get("decode") or {}).items()}  # JSON keys are strings
    source = next(r for r in rows.values() if r["source"])
    contexts = [c["n_ctx"] for c in source["contexts"]]
    depths = sorted({d for r in rows.values() for d in r["decode"]})
    lines = [
        "## What the rewrites save in the engines",
        "",
        "`python benchmarks/bench_engine_capacity.py run --work DIR --model source=SRC NAME=OUT ...`, then `render "
        "--write`: the KV cache llama.cpp allocates (llama-completion's own log at `-c N`, its default f16 cache, "
        "f32 GGUFs from its converter; each cache printed to 0.01 MiB) for SmolLM2-135M-Instruct and attnkit's "
        'rewrites of it at their defaults (the families benchmark\'s outputs, docs/benchmarks.md "## families"), '
        "beside `attnkit kvmem --paging llama.cpp`. x source: the output's cache over the source's at the same "
        "context (what the rewrite frees for more tokens or requests). vLLM and SGLang: whether they serve the "
        "layout as written (an MLA shape other than 512 + 64 runs in vLLM over expanded keys and values: "
        "[kvmem.md](kvmem.md); the values are per token and layer, the source caches 384).",
        "",
        "| model | layout | " + " | ".join(f"llama.cpp at {n:,} (MiB)" for n in contexts) + " | x source | kvmem "
        "(MiB, last) | vLLM / SGLang |",
        "|---|---|" + "---:|" * len(contexts) + "---:|---:|---|",
    ]
    for name, row in rows.items():
        cells = " | ".join(f"{c['mib']:.2f}" for c in row["contexts"])
        ratio = row["contexts"][-1]["mib"] / source["contexts"][-1]["mib"]
        served = "as written (GQA/MQA)"
        if row["serving"]:
            served = " / ".join(
                "as written" if row["serving"][e]["as_written"] else f"fallback, {row['serving'][e]['values']:,} values"
                for e in ("vllm", "sglang")
            )
        lines.append(
            f"| {name} | {row['layout']} | {cells} | {ratio:.3f} | {row['contexts'][-1]['kvmem_mib']:.2f} | {served} |"
        )
    if depths:
        lines += [
            "",
            "**Decode speed in llama.cpp** (`llama-bench -p 0 -n 32 -d DEPTH -t 2`: 32 tokens generated after DEPTH "
            "tokens in the cache; f32 weights, f16 cache; the median of the rounds, one run per model a round, the "
            "order reversed every other round), tokens/s over the source's at the same depth (the source's own "
            "tokens/s in its row; absolute figures from this 2-core machine are noisy, the ratios are the result):",
            "",
            "| model | " + " | ".join(f"depth {d:,}" for d in depths) + " |",
            "|---|" + "---:|" * len(depths),
        ]
        base = source["decode"]
        for name, row in rows.items():
            if row is source:
                cells = [f"{base[d]:.1f} tok/s" for d in depths]
            else:
                cells = [f"{row['decode'][d] / base[d]:.2f}x" for d in depths]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    benchlib.publish("\n".join(lines) + "\n", write, benchlib.SERVING)


def main() -> None:
    parser, r = benchlib.run_render_parser(__doc__)
    r.add_argument("--model", nargs="+", required=True, help="NAME=FOLDER, the source first")
    r.add_argument("--contexts", default="1024,4096,8192")
    r.add_argument("--decode-depths", default="1024,4096,8192", help="llama-bench -d; empty: no decode speed")
    r.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.cmd == "run":
        depths = [int(x) for x in args.decode_depths.split(",") if x]
        run(args.work, args.model, [int(x) for x in args.contexts.split(",")], depths, args.rounds)
    else:
        render(args.write)


if __name__ == "__main__":
    main()
