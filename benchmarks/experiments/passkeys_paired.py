"""Pass keys with enough keys per cell to test a 10-point goal (issue 43): each model answers the same seeded keys
(`attnkit eval MODEL --passkey LENGTHS --seed SEED`), both variants, and the rows go to one JSONL file. The
families table asks 6 keys per length and variant, where one key moves a cell by 17 points; this asks
DEPTHS x TRIALS per length and variant.

Usage: python benchmarks/experiments/passkeys_paired.py --out FILE --lengths 2k,4k --depths 3 --trials 6
       --seed 1 [--variants repeat,distractors] source=SRC mla-50=OUT ...
Prints, per model: keys found per variant and length, and in all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("repeat", "distractors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", default="2k,4k")
    parser.add_argument("--depths", type=int, default=3)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--family", default="", help="a label every row carries (e.g. smollm2)")
    parser.add_argument("models", nargs="+", help="NAME=PATH")
    args = parser.parse_args()
    for spec in args.models:
        name, path = spec.split("=", 1)
        for variant in args.variants.split(","):
            start = time.monotonic()
            argv = [path, "--passkey", args.lengths, "--passkey-variant", variant, "--depths", str(args.depths)]
            argv += ["--trials", str(args.trials), "--seed", str(args.seed), "--device", "cpu", "--dtype", args.dtype]
            done = subprocess.run(
                [sys.executable, "-m", "attnkit", "eval", *argv, "--format", "json"],
                stdout=subprocess.PIPE,
                text=True,
                check=True,
            )
            doc = json.loads(done.stdout)
            cells = doc["passkey"]["model"]["cells"]
            row = {
                "family": args.family,
                "model": name,
                "variant": variant,
                "seed": args.seed,
                "by_length": {
                    str(n): sum(c["correct"] for c in cells if c["length"] == n)
                    for n in sorted({c["length"] for c in cells})
                },
                "keys": sum(c["trials"] for c in cells),
                "found": sum(c["correct"] for c in cells),
                "cells": cells,
                "seconds": round(time.monotonic() - start),
                "command": "attnkit eval " + " ".join(argv),
            }
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")
            print(f"{name} {variant}: {row['found']}/{row['keys']} {row['by_length']} ({row['seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
