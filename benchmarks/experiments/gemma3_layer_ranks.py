"""Which global layer of a Gemma 3 MLA output holds the pass keys, and what a per-layer split of the same cache
would give (issue 43). Loads Gemma 3's fp32 folder and one `convert mla --target gemma3-mla` output (BASE), then
scores mixes of it: each mix names, per layer, where that layer's attention comes from, `source` (the source's own
attention swapped back) or another gemma3-mla output of the same source (say one written with `--kv-lora-rank 300
--rope-dim 64`), the other layers BASE's. Scoring: the first 4096 tokens of each held-out text of
bench_long_context.py (ablate_gemma3_mla.py's windows), perplexity over the source's by distance, and pass keys as
bench_families.py asks them (1k/2k/4k x 3 depths x 2 keys, both variants, seed 0).

Usage: python benchmarks/experiments/gemma3_layer_ranks.py --work DIR SRC BASE NAME=LAYER:PATH[,LAYER:PATH...] ...
(an empty mix, `base=`, scores BASE itself). Prints one JSON line per mix: its ratios per bucket (0-128, 128-256,
256-512, 512-1k, 1k-2k, 2k-4k) per text and the keys found of 18 per variant.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ablate_gemma3_mla import buckets, nll, texts

VARIANTS = ("repeat", "distractors")


def mixes(specs: list[str]) -> dict[str, dict[int, str]]:
    """NAME=LAYER:PATH,... -> {name: {layer: path or 'source'}}."""
    out = {}
    for spec in specs:
        name, _, parts = spec.partition("=")
        out[name] = {int(layer): path for layer, path in (p.split(":", 1) for p in parts.split(",") if p)}
    return out


def main() -> None:
    import attnkit.modeling  # noqa: F401  (attnkit_gemma3_mla)
    from attnkit.runtime.loader import load_model
    from attnkit.scoring.passkey import PasskeySpec, run_passkey

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("source")
    parser.add_argument("base")
    parser.add_argument("mixes", nargs="+")
    args = parser.parse_args()
    source = load_model(args.source, device="cpu", dtype="float32")
    model = load_model(args.base, device="cpu", dtype="float32")
    ids = {n: source.tokenizer(t, return_tensors="pt").input_ids[:, :4096] for n, t in texts(args.work).items()}
    reference = {n: buckets(nll(source.model, x)) for n, x in ids.items()}
    layers = model.model.model.layers
    own = [layer.self_attn for layer in layers]
    donors = {"source": source.model}
    for name, mix in mixes(args.mixes).items():
        for i, layer in enumerate(layers):
            path = mix.get(i)
            if path is not None and path not in donors:
                donors[path] = load_model(path, device="cpu", dtype="float32").model
            layer.self_attn = own[i] if path is None else donors[path].model.layers[i].self_attn
        row = {"mix": name, "layers": {str(i): p for i, p in sorted(mix.items())}}
        for text, x in ids.items():
            row[text] = [round(a / b, 3) for a, b in zip(buckets(nll(model.model, x)), reference[text])]
        for variant in VARIANTS:
            spec = PasskeySpec(lengths=(1024, 2048, 4096), depths=3, trials=2, seed=0, variant=variant)
            row[variant] = round(run_passkey(model, spec, name)["accuracy"] * 18)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
