"""Which layers a `convert mla` option matters in: one output with the attention tensors of some layers taken from
another output of the same source and split (issue 43: key balance 0.5 in the first half of the layers, 0.25 in
the rest). The layers were calibrated sequentially on their own earlier layers, so a hybrid is close to, not the
same as, a conversion with that option per layer.

Usage: python benchmarks/experiments/mla_layer_hybrid.py BASE OTHER OUT --layers LO:HI
  OUT: BASE's files, with every model.layers.N.self_attn.* tensor for LO <= N < HI taken from OTHER (single or
  sharded safetensors; both outputs must have the same config).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

ATTENTION = re.compile(r"model\.layers\.(\d+)\.self_attn\.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", required=True, help="LO:HI, the layers taken from OTHER")
    args = parser.parse_args()
    lo, hi = (int(v) for v in args.layers.split(":"))
    if json.loads((args.base / "config.json").read_text()) != json.loads((args.other / "config.json").read_text()):
        raise SystemExit("the two outputs' configs differ: their layers do not swap")
    shutil.copytree(args.base, args.out)
    taken = 0
    for shard in sorted(args.base.glob("*.safetensors")):
        tensors, other = load_file(shard), load_file(args.other / shard.name)
        for name in tensors:
            match = ATTENTION.match(name)
            if match and lo <= int(match.group(1)) < hi:
                tensors[name] = other[name]
                taken += 1
        save_file(tensors, args.out / shard.name, metadata={"format": "pt"})
    print(f"{taken} attention tensors of layers {lo}-{hi - 1} from {args.other}")


if __name__ == "__main__":
    main()
