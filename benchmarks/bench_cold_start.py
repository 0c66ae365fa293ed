"""Cold start of `attnkit kvmem <preset> --format json` against `python -c pass`, side by side.

Runs both commands alternately N times in fresh interpreters and reports medians and their ratio.
Usage: python benchmarks/bench_cold_start.py [--repeat 15] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "attnkit --version": [sys.executable, "-m", "attnkit", "--version"],
    "attnkit kvmem llama-3.1-8b --format json": [sys.executable, "-m", "attnkit", "kvmem", "llama-3.1-8b", "--format", "json"],
    "attnkit inspect llama-3.1-8b --format json": [sys.executable, "-m", "attnkit", "inspect", "llama-3.1-8b", "--format", "json"],
}


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for name, cmd in COMMANDS.items():  # warm the page cache once
        timed(cmd)
    for _ in range(args.repeat):
        for name, cmd in COMMANDS.items():  # interleaved, so drift hits all commands alike
            samples[name].append(timed(cmd))
    base = statistics.median(samples["python -c pass"])
    print("| command | median (s) | ratio to `python -c pass` |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        med = statistics.median(values)
        print(f"| `{name}` | {med:.3f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
