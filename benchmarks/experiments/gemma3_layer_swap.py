"""Where a Gemma 3 MLA output loses: the source's attention swapped back into its sliding or its global layers
(issue 43). Loads Gemma 3's fp32 folder and one `convert mla --target gemma3-mla --sliding-layers convert` output
(every layer MLA) and scores three models by distance on the first 4096 tokens of the two held-out texts of
bench_long_context.py (ablate_gemma3_mla.py's windows): every layer MLA; the global layers MLA, the sliding ones the
source's; the sliding layers MLA, the global ones the source's. Prints one line per model and text: the perplexity
ratio over the source's in the buckets 0-128, 128-256, 256-512, 512-1k, 1k-2k, 2k-4k.

Usage: python benchmarks/experiments/gemma3_layer_swap.py --work DIR SRC MODEL
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ablate_gemma3_mla import buckets, nll, texts


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import attnkit.modeling  # noqa: F401  (attnkit_gemma3_mla)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("source")
    parser.add_argument("model")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.source)
    ids = {name: tok(text, return_tensors="pt").input_ids[:, :4096] for name, text in texts(args.work).items()}
    source = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    base = {name: buckets(nll(source, x)) for name, x in ids.items()}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    types = source.config.layer_types
    converted = [layer.self_attn for layer in model.model.layers]
    theirs = [layer.self_attn for layer in source.model.layers]
    swaps = {
        "every layer MLA": set(),
        "global layers MLA, sliding the source's": {i for i, t in enumerate(types) if t == "sliding_attention"},
        "sliding layers MLA, global the source's": {i for i, t in enumerate(types) if t != "sliding_attention"},
    }
    for name, restored in swaps.items():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn = theirs[i] if i in restored else converted[i]
        for text, x in ids.items():
            ratios = [a / b for a, b in zip(buckets(nll(model, x)), base[text])]
            print(f"{name} | {text} | " + " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
