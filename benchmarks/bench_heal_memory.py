"""heal's memory plan against the measured peak, at long windows: SmolLM2-135M's 50% MLA and MQA merge students.

Usage: python benchmarks/bench_heal_memory.py run --work DIR [--only NAME ...]
       python benchmarks/bench_heal_memory.py render [--write]
  run: for each entry of RUNS, the plan (`attnkit heal --dry-run --format json`: its total) and a short real run
       of the same options (one or two optimizer steps; /usr/bin/time's maximum RSS and the polled peak anonymous
       RSS, benchlib.measure). Students are written first with `attnkit convert` when DIR
       lacks them (calibration: tests/data/prose/calib.txt); training data: the Wikipedia excerpt of
       benchmarks/wiki_corpus.py (built in DIR). Rows are appended to
       benchmarks/results/heal_memory.jsonl, each with the commit it ran on.
  render: "## heal memory plan at long windows" of docs/benchmarks.md from the newest row of each entry.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "heal_memory.jsonl"
CALIB = str(ROOT / "tests/data/prose/calib.txt")
STUDENTS = {
    "mla-50": ["convert", "mla", "{src}", "{out}", "--kv-budget", "0.5", "--calib", CALIB],
    "mqa-merge": ["convert", "mqa", "{src}", "{out}", "--method", "merge", "--calib", CALIB],
}
#: name -> (student, heal options); every run: --micro-batch-size 1, validation of one window, two steps.
RUNS = {
    "mla-50 512": ("mla-50", ["--seq-len", "512", "--batch-size", "1"]),
    "mla-50 1024": ("mla-50", ["--seq-len", "1024", "--batch-size", "1"]),
    "mla-50 2048": ("mla-50", ["--seq-len", "2048", "--batch-size", "1"]),
    "mla-50 2048 checkpointing": ("mla-50", ["--seq-len", "2048", "--batch-size", "1", "--gradient-checkpointing"]),
    "mqa-merge 2048": ("mqa-merge", ["--seq-len", "2048", "--batch-size", "1"]),
    "mla-50 2048 batch 4, retrieval": (
        "mla-50",
        ["--seq-len", "2048", "--batch-size", "4", "--retrieval-mix", "0.25"],
    ),
}


def heal_args(student: Path, source: Path, data: Path, out: Path, options: list[str]) -> list[str]:
    seq_len = int(options[options.index("--seq-len") + 1])
    batch = int(options[options.index("--batch-size") + 1])
    return [
        "heal", str(student), str(out), "--teacher", str(source), "--data", str(data), *options,
        "--micro-batch-size", "1", "--val-tokens", str(seq_len), "--tokens", str(2 * batch * seq_len),
        "--device", "cpu", "--overwrite",
    ]  # fmt: skip


def run(work: Path, only: list[str]) -> None:
    from wiki_corpus import wiki_corpus

    from attnkit.realmodels import smollm2_folder

    source = smollm2_folder()
    work.mkdir(parents=True, exist_ok=True)
    data = wiki_corpus(work)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    for name in only or list(RUNS):
        student, options = RUNS[name]
        path = work / student
        if not (path / "attnkit.json").is_file():
            benchlib.attnkit(*[a.format(src=source, out=path) for a in STUDENTS[student]], log=True)
        args = heal_args(path, source, data, work / "healed", options)
        plan = benchlib.attnkit(*args, "--dry-run")["memory"]
        measured = benchlib.measure([sys.executable, "-m", "attnkit", *args])
        row = {
            "name": name,
            "commit": commit.stdout.strip(),
            "plan_total": plan["total"],
            "plan_items": plan["items"],
            **measured,
            "command": "attnkit " + " ".join(args).replace(str(work), "DIR").replace(str(source), "SRC"),
        }
        benchlib.append_jsonl(RESULTS, [row])
        print(f"{name}: plan {plan['total'] / 2**30:.2f} GiB, peak {measured['max_rss_bytes'] / 2**30:.2f} GiB")


def render(write: bool) -> None:
    rows = benchlib.latest(benchlib.read_jsonl(RESULTS), lambda row: row["name"])
    lines = [
        "## heal memory plan at long windows",
        "",
        "`python benchmarks/bench_heal_memory.py run --work DIR`, then `render --write`: heal's memory plan "
        "(`--dry-run`) against the measured peak of the same options run for two optimizer steps (SmolLM2-135M "
        "teacher, fp32, CPU, micro-batch 1, Wikipedia text). Both students take sdpa's fused kernel (the MLA "
        "student's 64-wide values padded to its 128-wide keys, attnkit/runtime/padded_attention.py; rows of "
        "12a9d77 ran it on the math path, which kept every layer's probabilities, and counted the loss's logits "
        "as 3 [T, V] buffers, 7 since 607a3bd; the 557034f row ran on 607a3bd's plan). The plan is compared with "
        "the peak of anonymous memory (polled every 0.2 s: what the plan counts); the maximum RSS "
        "(/usr/bin/time) adds the models' files mapped in memory, about 1.2 GiB here, page cache the kernel can "
        "reclaim.",
        "",
        "| run | commit | plan GiB | activations GiB | attention GiB | logits GiB | peak anonymous GiB | "
        "max RSS GiB | anonymous / plan |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gib = 2**30
    for name, r in rows.items():
        items = r["plan_items"]
        cells = [r["plan_total"], items["activations"], items.get("attention", 0), items["logits"]]
        cells += [r["peak_anon_bytes"], r["max_rss_bytes"]]
        lines.append(
            f"| {name} | {r['commit']} | "
            + " | ".join(f"{c / gib:.2f}" for c in cells)
            + f" | {r['peak_anon_bytes'] / r['plan_total']:.2f} |"
        )
    benchlib.publish("\n".join(lines) + "\n", write)


def main() -> None:
    parser, _ = benchlib.run_render_parser(__doc__)
    args = parser.parse_args()
    run(args.work, args.only) if args.cmd == "run" else render(args.write)


if __name__ == "__main__":
    main()
