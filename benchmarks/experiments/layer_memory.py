"""Anonymous memory layer by layer of an attnkit command run in this process: what it holds after each layer and
its peak during it (RssAnon, /proc/self/status, sampled every 5 ms). Linux only.

Usage: python benchmarks/experiments/layer_memory.py --at put|drop [--stop-after N] -- ATTNKIT ARGS
  --at put:  after each calibrated layer's tensors go to the layer spill (convert gqa|mqa|mla)
  --at drop: after each streamed layer is dropped (probe or eval --layer-stream)
  --stop-after N: exit after layer N (a calibration measured without the write, where the disk has no room)
docs/benchmarks.md "big checkpoints, what the rows show" quotes its lines.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from pathlib import Path


def _anon_gib() -> float:
    return int(re.search(r"^RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 2**20


def main() -> None:
    cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--at", choices=("put", "drop"), required=True)
    ap.add_argument("--stop-after", type=int, default=None)
    args, attnkit_args = ap.parse_args(sys.argv[1:cut]), sys.argv[cut + 1 :]
    peak = [0.0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], _anon_gib())
            time.sleep(0.005)

    threading.Thread(target=sample, daemon=True).start()
    import attnkit.cli
    import attnkit.runtime.streaming as streaming
    from attnkit.commands.convert.layer_spill import LayerSpill

    count = [0]

    def report() -> None:
        print(f"layer {count[0]}: holds {_anon_gib():.3f} GiB, peak {peak[0]:.3f} GiB", file=sys.stderr, flush=True)
        peak[0] = 0.0
        if count[0] == args.stop_after:
            raise SystemExit(f"stopped after layer {count[0]}")
        count[0] += 1

    if args.at == "put":
        put = LayerSpill.put

        def counted_put(self, layer, tensors):
            put(self, layer, tensors)
            report()

        LayerSpill.put = counted_put
    else:
        drop = streaming.drop_layer

        def counted_drop(layer):
            drop(layer)
            report()

        streaming.drop_layer = counted_drop
    attnkit.cli.app(attnkit_args, standalone_mode=False)


if __name__ == "__main__":
    main()
