"""Layer-streamed probe with the decoder layers' linear weights kept as stored and widened a slice at a time
(attnkit.runtime.sliced_linear) against the same layers widened to float32 whole as each is read (how layers were
read before), side by side on one real-geometry checkpoint (benchmarks/make_geometry.py, bf16).

Usage: python benchmarks/bench_sliced_layers.py --work DIR [--layers 2] [--rounds 2] [--write]
Each run is a fresh `attnkit probe --layer-stream always` (2048 tokens of held-out prose in windows of 512) under
benchlib.measure (peak anonymous RSS, wall time); the two modes alternate so both see the same
load. "whole" replaces slice_linears by a no-op in the child, so read_layer widens every weight up front.
Rows in benchmarks/results/sliced_layers.json; --write puts "## layer streaming: sliced against whole layers" in
docs/ablations.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import benchlib
from bench_geometry import PROBE
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "sliced_layers.json"
PRESET = "llama-3.1-70b"
#: the child: "whole" turns slicing off before attnkit's command line runs
CHILD = (
    "import sys, attnkit.runtime.sliced_linear as s\n"
    "if sys.argv[1] == 'whole':\n"
    "    s.slice_linears = lambda module, dtype: None\n"
    "sys.argv = ['attnkit', *sys.argv[2:]]\n"
    "from attnkit.cli import main\n"
    "main()\n"
)


def run(work: Path, layers: int, rounds: int) -> list[dict]:
    src = work / f"70b@{layers}"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        make = [sys.executable, str(ROOT / "benchmarks/make_geometry.py"), PRESET, str(src), "--layers", str(layers)]
        subprocess.run(make, check=True)
    rows = []
    try:
        for round_ in range(1, rounds + 1):
            for mode in ("whole", "sliced"):
                result = benchlib.measure([sys.executable, "-c", CHILD, mode, "probe", str(src), *PROBE])
                row = {"mode": mode, "round": round_, "geometry": f"70b@{layers}", **result}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
    finally:
        shutil.rmtree(src)
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def render(rows: list[dict]) -> str:
    geometry = rows[0]["geometry"]
    lines = [
        "## layer streaming: sliced against whole layers",
        "",
        f"`python benchmarks/bench_sliced_layers.py --work DIR --write`: `probe --layer-stream always` (2048 tokens of "
        f"heldout.txt, windows of 512) on the {geometry} geometry (Llama-3.1-70B shapes, bf16, random weights), each "
        "run a fresh process, the two modes alternating. *whole*: each decoder layer's weights widened to float32 as "
        "the layer is read (3.19 GiB for one 70B layer); *sliced*: its linear weights kept as stored (memory-mapped) "
        "and widened 2^24 elements of rows at a time as they are used (attnkit/runtime/sliced_linear.py). Peak anon "
        'RSS as in docs/benchmarks.md "## big checkpoints"; load: the 1-minute load average when the run ended.',
        "",
        "| mode | round | seconds | peak anon RSS | max RSS | load |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['round']} | {r['seconds']:.0f} | {r['peak_anon_bytes'] / 2**30:.2f} GiB | "
            f"{r['max_rss_bytes'] / 2**30:.2f} GiB | {r['load_after']} |"
        )

    def mean(mode: str, key: str) -> float:
        values = [r[key] for r in rows if r["mode"] == mode]
        return sum(values) / len(values)

    lines += [
        "",
        f"sliced / whole (means over the rounds): time {mean('sliced', 'seconds') / mean('whole', 'seconds'):.2f}x, "
        f"peak anonymous memory {mean('sliced', 'peak_anon_bytes') / mean('whole', 'peak_anon_bytes'):.2f}x.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="render benchmarks/results/sliced_layers.json into the docs")
    args = ap.parse_args()
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        rows = run(args.work, args.layers, args.rounds)
    else:
        rows = json.loads(RESULTS.read_text())
    benchlib.publish(render(rows), args.write, benchlib.ABLATIONS)


if __name__ == "__main__":
    main()
