"""`convert mla` of a QK-norm source: the Qwen3 that `retrofit qknorm` makes of SmolLM2-135M, to DeepSeek-V3 at
50% and 25% of its cache, on two held-out texts of different kinds, beside SmolLM2 itself converted the same way.

Usage: python benchmarks/bench_qknorm_mla.py --work DIR [--write]
  1. WORK/qwen3: `attnkit retrofit qknorm SMOLLM2 OUT --calib tests/data/prose/calib.txt` (skipped when present);
  2. each variant converted in this process (attnkit.commands.convert.mla.convert_mla, the CLI's defaults,
     calibration on tests/data/prose/calib.txt): the QK-norm fold as shipped (least attention KL), the fold with
     the geometric-mean constants only (SEARCH_SPAN = 0: no search), and SmolLM2 (no QK-norm) for reference;
  3. each scored against its own source on the first 4096 tokens (8 windows of 512) of tests/data/prose/heldout.txt
     (prose) and benchmarks/data/technical.txt (technical): perplexity, the source's, KL(source || result).
Rows go to benchmarks/results/qknorm_mla.json; --write renders "## convert mla of a QK-norm source" in
docs/benchmarks.md from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "qknorm_mla.json"
CALIB = ROOT / "tests/data/prose/calib.txt"
TEXTS = {"prose": ROOT / "tests/data/prose/heldout.txt", "technical": ROOT / "benchmarks/data/technical.txt"}
BUDGETS = (0.5, 0.25)
#: name -> (source: "qwen3" or "smollm2", fold search on)
VARIANTS = {"qwen3, fold (KL search)": ("qwen3", True), "qwen3, fold (geometric mean)": ("qwen3", False)}
REFERENCE = "smollm2 (no QK-norm)"


def make_qwen3(work: Path) -> Path:
    from attnkit.realmodels import smollm2_folder

    out = work / "qwen3"
    if not (out / "attnkit.json").is_file():
        benchlib.attnkit("retrofit", "qknorm", str(smollm2_folder()), str(out), "--calib", str(CALIB), log=True)
    return out


def convert(source: Path, out: Path, budget: float, search: bool) -> dict:
    import attnkit.ops.qknorm_fold as fold
    from attnkit.commands.convert.mla import MLARequest, convert_mla

    span = fold.SEARCH_SPAN
    fold.SEARCH_SPAN = span if search else 0.0
    try:
        started = time.perf_counter()
        report = convert_mla(MLARequest(model=str(source), out=out, calib=[str(CALIB)], kv_budget=budget))
        report["seconds"] = time.perf_counter() - started
    finally:
        fold.SEARCH_SPAN = span
    return report


def score(source: Path, model_dir: Path) -> dict:
    """{text: {ppl, src, kl}} against the source on the first 4096 tokens of each text."""
    src = benchlib.load(source)
    scores = benchlib.score_texts(benchlib.load(model_dir), src, TEXTS, 4096)
    return {t: {"ppl": r.perplexity, "src": r.reference_perplexity, "kl": r.kl_mean} for t, r in scores.items()}


def run(work: Path) -> list[dict]:
    from attnkit.realmodels import smollm2_folder

    sources = {"qwen3": make_qwen3(work), "smollm2": smollm2_folder()}
    rows = []
    for budget in BUDGETS:
        for name, (which, search) in {**VARIANTS, REFERENCE: ("smollm2", True)}.items():
            out = work / f"{which}-{'kl' if search else 'mean'}-{budget}"
            if out.exists():
                subprocess.run(["rm", "-rf", str(out)], check=True)
            report = convert(sources[which], out, budget, search)
            fold_kl = [r["qk_norm_fold_kl"] for r in report["layers"] if "qk_norm_fold_kl" in r]
            row = {
                "variant": name,
                "budget": budget,
                "R": report["kv_lora_rank"],
                "P": report["rope_dim"],
                "fold_kl_mean": sum(fold_kl) / len(fold_kl) if fold_kl else None,
                "seconds": report["seconds"],
                "texts": score(sources[which], out),
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "## convert mla of a QK-norm source",
        "",
        "`python benchmarks/bench_qknorm_mla.py --work DIR --write`. Source: the stock Qwen3 that `attnkit retrofit "
        "qknorm` (anchor method, calibration tests/data/prose/calib.txt) makes of SmolLM2-135M-Instruct; `convert "
        "mla --kv-budget B --calib tests/data/prose/calib.txt` with its defaults (fp32, CPU). Its per-head QK-norm "
        "is folded into W_q and W_k (attnkit/ops/qknorm_fold.py): one constant per head for 1/rms(q) and 1/rms(k); "
        "the key constant is the geometric mean over the calibration tokens, the query constant either the same "
        "(geometric mean) or the one that minimizes the attention KL (KL search, the default). SmolLM2 itself "
        "converted the same way for reference. Perplexity on the first 4096 tokens (8 windows of 512) of "
        "tests/data/prose/heldout.txt (prose) and benchmarks/data/technical.txt (technical), x its own source; "
        "fold KL: the mean attention KL of the fold alone on the calibration text.",
        "",
        "| budget | R + P | variant | prose | technical | KL prose | KL technical | fold KL |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["texts"]
        cells = [f"{t[k]['ppl']:.2f} ({t[k]['ppl'] / t[k]['src']:.2f}x)" for k in TEXTS]
        fold = "" if r["fold_kl_mean"] is None else f"{r['fold_kl_mean']:.4f}"
        lines.append(
            f"| {r['budget']:.0%} | {r['R']} + {r['P']} | {r['variant']} | {cells[0]} | {cells[1]} | "
            f"{t['prose']['kl']:.3f} | {t['technical']['kl']:.3f} | {fold} |"
        )
    sources = {r["variant"].split(",")[0].split(" ")[0]: r["texts"] for r in rows}
    lines += [
        "",
        "Source perplexity: "
        + "; ".join(f"{name}: " + ", ".join(f"{k} {v['src']:.2f}" for k, v in t.items()) for name, t in sources.items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    benchlib.run_or_render(__doc__.split("\n")[0], RESULTS, run, render)


if __name__ == "__main__":
    main()
