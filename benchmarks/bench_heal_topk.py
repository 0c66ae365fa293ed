"""heal with the teacher beside the student (live) against its cached top-k targets (`--teacher-logits top-k`), on
SmolLM2-135M's MQA merge student: training tokens per second and held-out perplexity after the same tokens.

Usage: python benchmarks/bench_heal_topk.py --work DIR [--rounds 2] [--tokens 16k] [--write]
The runs alternate (live, top-k, live, top-k, ...) so both see the same machine load; the top-k cache is built
by the first top-k run (its cost is reported apart: a cache serves every later run on the same windows) and
read by the others. Data: tests/data/prose/calib.txt; held-out scoring: 2048 tokens of
tests/data/prose/heldout.txt against the teacher (the same full KL for both kinds of run). Rows in
benchmarks/results/heal_topk.json; --write renders "## heal: live teacher against cached top-k" in
docs/ablations.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "heal_topk.json"
SETTINGS = [
    "--data", str(ROOT / "tests/data/prose/calib.txt"), "--seq-len", "256", "--batch-size", "4",
    "--micro-batch-size", "4", "--val-tokens", "1024", "--eval-every", "1000", "--lr", "3e-4", "--device", "cpu",
    "--eval", str(ROOT / "tests/data/prose/heldout.txt"), "--eval-tokens", "2048", "--eval-seq-len", "256",
]  # fmt: skip


def run(work: Path, rounds: int, tokens: str) -> list[dict]:
    from attnkit.realmodels import smollm2_folder

    teacher = smollm2_folder()
    student = work / "mqa-merge"
    if not (student / "attnkit.json").is_file():
        calib = ["--calib", str(ROOT / "tests/data/prose/calib.txt")]
        benchlib.attnkit("convert", "mqa", str(teacher), str(student), "--method", "merge", *calib)
    cache = work / "cache"
    rows = []
    for i in range(rounds):
        for mode in ("live", "top-k"):
            out = work / f"{mode}-{i}"
            args = ["heal", str(student), str(out), "--teacher", str(teacher), "--tokens", tokens, *SETTINGS]
            args += ["--teacher-logits", mode, "--sample-cache", str(cache), "--overwrite", "--format", "json"]
            report = benchlib.attnkit(*args)
            t, e = report["training"], report["eval"]
            row = {
                "mode": mode,
                "round": i,
                "tokens": t["tokens"],
                "train_seconds": t["seconds"],
                "tokens_per_second": t["tokens_per_second"],
                "seconds": report["seconds"],
                "bytes_per_token": (report.get("teacher_targets") or {}).get("bytes_per_token"),
                "eval_before": e["before"]["perplexity"],
                "eval_after": e["perplexity"],
                "kl_after": e["kl_mean"],
                "teacher_perplexity": e["source_perplexity"],
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    def mean(mode: str, key: str) -> float:
        values = [r[key] for r in rows if r["mode"] == mode]
        return sum(values) / len(values)

    live, topk = mean("live", "tokens_per_second"), mean("top-k", "tokens_per_second")
    first_topk = next(r for r in rows if r["mode"] == "top-k")
    lines = [
        "## heal: live teacher against cached top-k",
        "",
        "`python benchmarks/bench_heal_topk.py --work DIR --write`: the MQA merge student of SmolLM2-135M healed "
        f"for {rows[0]['tokens']:,} tokens (calib.txt, windows of 256, batch 4, lr 3e-4, fp32, CPU), with the "
        "teacher run beside the student (live) and with `--teacher-logits top-k` (k = 64, its targets cached on "
        "disk by the first top-k run and read by the others); runs alternate so both see the same load. --eval: "
        "2048 tokens of heldout.txt, full KL to the teacher.",
        "",
        "| run | training tok/s | whole run (s) | --eval perplexity before -> after | KL after | cache bytes/token |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} {r['round'] + 1} | {r['tokens_per_second']:.0f} | {r['seconds']:.0f} | "
            f"{r['eval_before']:.2f} -> {r['eval_after']:.2f} | {r['kl_after']:.4f} | "
            f"{r['bytes_per_token'] or '-'} |"
        )
    lines += [
        "",
        f"Training throughput top-k / live: {topk / live:.2f}x (means over the runs). The first top-k run "
        f"includes building the cache ({first_topk['seconds']:.0f} s whole run).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", default="16k")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(run(args.work, args.rounds, args.tokens), indent=1) + "\n")
    benchlib.publish(render(json.loads(RESULTS.read_text())), args.write, benchlib.ABLATIONS)


if __name__ == "__main__":
    main()
