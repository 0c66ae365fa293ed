"""Memory and time of attnkit's rewrites at real sizes, on checkpoints of real geometry (benchmarks/make_geometry.py).

Usage: python benchmarks/bench_geometry.py run --work DIR [--only NAME ...] [--commands PART ...]   (rows replace
       their geometry's and command's earlier ones)
       python benchmarks/bench_geometry.py render [--write]
Geometries (GEOMETRIES): Llama-3.1-8B (all 32 layers) and Llama-3.1-70B at 2, 8 and 16 layers, bf16, ~5 GB
shards; each is built in DIR, measured, and removed. Per geometry: `cp -r` of the folder, then `convert gqa
--method mean`, `convert mqa --method merge` and `convert mla --kv-budget 0.25` (2048 calibration tokens of
tests/data/prose/calib.txt, windows of 512) and `probe --layer-stream always` (2048 tokens), each under
benchlib.measure: `/usr/bin/time -v` (maximum RSS) while a poller reads the process's anonymous RSS (RssAnon,
/proc/PID/status, every 0.2 s): the peak of what the process itself holds, page cache of the memory-mapped
weights excluded. Rows in benchmarks/results/geometry.json; render writes "## big checkpoints" in
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import ROOT, measure

RESULTS = ROOT / "benchmarks" / "results" / "geometry.json"
CALIB = ["--calib", str(ROOT / "tests/data/prose/calib.txt"), "--calib-tokens", "2048", "--calib-seq-len", "512"]
#: probe: 2048 tokens of held-out prose in windows of 512, layer by layer (the whole 8B model in fp32 needs 32 GB)
PROBE = [
    str(ROOT / "tests/data/prose/heldout.txt"),
    "--max-tokens",
    "2048",
    "--seq-len",
    "512",
    "--layer-stream",
    "always",
]
#: name -> (preset, layers or None for all)
#: 70b@2: the calibrated converts' peak at the 70B width (one layer is live at a time) in minutes, not hours
GEOMETRIES = {
    "llama-3.1-8b": ("llama-3.1-8b", None),
    "70b@2": ("llama-3.1-70b", 2),
    "70b@8": ("llama-3.1-70b", 8),
    "70b@16": ("llama-3.1-70b", 16),
}
#: command name -> attnkit arguments after SRC OUT
COMMANDS = {
    "convert gqa --method mean": ["convert", "gqa", "{src}", "{out}", "--kv-heads", "2", "--method", "mean"],
    "convert mqa --method merge": ["convert", "mqa", "{src}", "{out}", "--method", "merge", *CALIB],
    # Llama 3.1's llama3 RoPE scaling has no DeepSeek-V3 form the engines read: the transformers route
    "convert mla --kv-budget 0.25 --engine transformers": [
        "convert",
        "mla",
        "{src}",
        "{out}",
        "--kv-budget",
        "0.25",
        "--engine",
        "transformers",
        *CALIB,
    ],
    "probe --layer-stream always": ["probe", "{src}", *PROBE],
}


def run(work: Path, only: list[str], commands: list[str]) -> None:
    rows = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    for name, (preset, layers) in GEOMETRIES.items():
        if only and name not in only:
            continue
        src = work / name
        if not (src / "model.safetensors.index.json").is_file():  # make_geometry renames a whole folder in place
            shutil.rmtree(src, ignore_errors=True)
            make = [sys.executable, str(ROOT / "benchmarks/make_geometry.py"), preset, str(src)]
            subprocess.run(make + (["--layers", str(layers)] if layers else []), check=True)
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        copy = work / f"{name}-copy"
        shutil.rmtree(copy, ignore_errors=True)
        cp_seconds = None  # no baseline where the disk cannot hold a second copy (70b@16 needs 2 x 32 GB)
        if shutil.disk_usage(work).free > 1.1 * size:
            cp_seconds = measure(["cp", "-r", str(src), str(copy)])["seconds"]
            shutil.rmtree(copy)
        config = json.loads((src / "config.json").read_text())
        for command, args in COMMANDS.items():
            if commands and not any(c in command for c in commands):
                continue
            out = work / f"{name}-out"
            shutil.rmtree(out, ignore_errors=True)
            argv = [sys.executable, "-m", "attnkit", *[a.format(src=src, out=out) for a in args]]
            result = measure(argv)
            shutil.rmtree(out, ignore_errors=True)  # probe writes no folder
            row = {
                "geometry": name,
                "layers": config["num_hidden_layers"],
                "weights_bytes": size,
                "command": command,
                **result,
                "seconds_per_layer": result["seconds"] / config["num_hidden_layers"],
                "cp_seconds": cp_seconds,
            }
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows = [r for r in rows if (r["geometry"], r["command"]) != (name, command)] + [row]
            RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
        shutil.rmtree(src)


def _times_cp(row: dict) -> str:
    return f"{row['seconds'] / row['cp_seconds']:.2f}" if row.get("cp_seconds") else "-"


def render() -> str:
    rows = json.loads(RESULTS.read_text())
    lines = [
        "## big checkpoints",
        "",
        "`python benchmarks/bench_geometry.py run --work DIR`, then `render --write`: random-weight checkpoints of "
        "the real geometry (benchmarks/make_geometry.py: the preset's config and tensor shapes, bf16, ~5 GB shards) "
        "on this 2-core, 24 GB machine, CPU. Calibration: 2048 tokens of tests/data/prose/calib.txt in windows of "
        "512. Peak anon RSS: the largest RssAnon of the process (polled every 0.2 s), what it holds itself; max RSS "
        "(`/usr/bin/time -v`) also counts the page cache of the memory-mapped weights it has touched. x cp: the "
        "command's wall time over `cp -r` of the same folder in the same run (-: the disk had no room for the "
        "copy). Load: the 1-minute load average when the command ended (2 cores; above 2, other work shared them "
        "and stretched the seconds, not the memory).",
        "",
        "| geometry | layers | weights | command | seconds | x cp | s/layer | peak anon RSS | max RSS | load |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    order = {(g, c): i for i, (g, c) in enumerate((g, c) for g in GEOMETRIES for c in COMMANDS)}
    for r in sorted(rows, key=lambda r: order.get((r["geometry"], r["command"]), len(order))):
        lines.append(
            f"| {r['geometry']} | {r['layers']} | {r['weights_bytes'] / 2**30:.1f} GiB | `{r['command']}` | "
            f"{r['seconds']:.0f} | {_times_cp(r)} | {r['seconds_per_layer']:.1f} | "
            f"{r['peak_anon_bytes'] / 2**30:.2f} GiB | {r['max_rss_bytes'] / 2**30:.2f} GiB | "
            f"{r.get('load_after', '-')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap, r = benchlib.run_render_parser(__doc__.split("\n")[0])
    r.add_argument("--commands", nargs="*", default=[], help="run the COMMANDS whose name contains one of these")
    args = ap.parse_args()
    if args.cmd == "run":
        args.work.mkdir(parents=True, exist_ok=True)
        run(args.work, args.only, args.commands)
        return
    benchlib.publish(render(), args.write)


if __name__ == "__main__":
    main()
