"""`retrofit qkclip` on QK-norm models: Gemma 3 270M and the Qwen3 that `retrofit qknorm` makes of SmolLM2-135M.

Usage: python benchmarks/bench_qkclip_qknorm.py --work DIR [--write]
Per model: its largest attention logit on tests/data/prose/calib.txt (2048 tokens, windows of 512, attnkit's probe),
then `attnkit retrofit qkclip MODEL OUT --tau T --calib tests/data/prose/calib.txt` at T = 0.8 and 0.6 of that
maximum (the layer-wise clip: the q-norm weight of each layer whose worst head exceeds T); per result the clipped
layers, the largest logit after on the calibration text (the report's max_logit_after) and on held-out prose, and
perplexity against the model on the first 2048 tokens of tests/data/prose/heldout.txt (prose) and
benchmarks/data/technical.txt (technical). Rows in benchmarks/results/qkclip_qknorm.json; --write renders
"## qkclip on QK-norm models" in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "qkclip_qknorm.json"
CALIB = ROOT / "tests/data/prose/calib.txt"
TEXTS = {"prose": ROOT / "tests/data/prose/heldout.txt", "technical": ROOT / "benchmarks/data/technical.txt"}
FRACTIONS = (0.8, 0.6)
TOKENS = 2048


def sources(work: Path) -> dict[str, Path]:
    from attnkit.realmodels import gemma3_folder, smollm2_folder

    qwen3 = work / "qwen3"
    if not (qwen3 / "attnkit.json").is_file():
        benchlib.attnkit("retrofit", "qknorm", str(smollm2_folder()), str(qwen3), "--calib", str(CALIB), log=True)
    return {"Gemma 3 270M": gemma3_folder(), "Qwen3 (retrofit qknorm of SmolLM2)": qwen3}


def max_logit(model: Path, text: Path) -> float:
    """The largest pre-cap attention logit over layers and heads on the first TOKENS tokens of text."""
    from attnkit.runtime.texts import make_windows, read_texts
    from attnkit.scoring.attention_stats import probe

    loaded = benchlib.load(model)
    windows = make_windows(loaded.tokenizer, read_texts([str(text)]), 512, TOKENS)
    return max(r["max_logit_precap"] for r in probe(loaded, windows).heads)


def perplexities(source: Path, model: Path) -> dict:
    src = benchlib.load(source)
    scores = benchlib.score_texts(benchlib.load(model), src, TEXTS, TOKENS)
    return {t: {"ppl": r.perplexity, "src": r.reference_perplexity, "kl": r.kl_mean} for t, r in scores.items()}


def run(work: Path) -> list[dict]:
    rows = []
    for name, source in sources(work).items():
        top = max_logit(source, CALIB)
        held = max_logit(source, TEXTS["prose"])
        for fraction in FRACTIONS:
            tau = round(top * fraction, 2)
            out = work / f"{name.split()[0].lower()}-{fraction}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            report = benchlib.attnkit(
                "retrofit", "qkclip", str(source), str(out), "--tau", str(tau), "--calib", str(CALIB), "-f", "json"
            )
            row = {
                "model": name,
                "max_logit_calib": top,
                "max_logit_prose": held,
                "tau": tau,
                "scope": report["scope"],
                "clipped_layers": report["clipped_layers"],
                "layers": 1 + max(h["layer"] for h in report["heads"]),
                "max_logit_after_calib": max(h["max_logit_after"] for h in report["heads"]),
                "max_logit_after_prose": max_logit(out, TEXTS["prose"]),
                "texts": perplexities(source, out),
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    lines = [
        "## qkclip on QK-norm models",
        "",
        "`python benchmarks/bench_qkclip_qknorm.py --work DIR --write`: `attnkit retrofit qkclip MODEL OUT --tau T "
        "--calib tests/data/prose/calib.txt` (2048 tokens, windows of 512) with T = 0.8 and 0.6 of the model's "
        "largest attention logit on that text. Per-head QK-norm: each layer whose worst head exceeds T has its "
        "q-norm weight scaled, so every head of that layer shrinks. Max logit: the largest over layers and heads "
        "(attnkit's probe) on the calibration text and on the first 2048 tokens of tests/data/prose/heldout.txt; "
        "perplexity (x the model) on the first 2048 tokens of heldout.txt (prose) and benchmarks/data/technical.txt "
        "(technical); fp32, CPU.",
        "",
        "| model | tau | clipped layers | max logit, calib: before -> after | max logit, held-out prose | "
        "prose | technical |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for r in rows:
        t = r["texts"]
        cells = [f"{t[k]['ppl']:.2f} ({t[k]['ppl'] / t[k]['src']:.3f}x)" for k in TEXTS]
        lines.append(
            f"| {r['model']} | {r['tau']:g} | {r['clipped_layers']} of {r['layers']} | "
            f"{r['max_logit_calib']:.2f} -> {r['max_logit_after_calib']:.2f} | "
            f"{r['max_logit_prose']:.2f} -> {r['max_logit_after_prose']:.2f} | {cells[0]} | {cells[1]} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    benchlib.run_or_render(__doc__.split("\n")[0], RESULTS, run, render)


if __name__ == "__main__":
    main()
