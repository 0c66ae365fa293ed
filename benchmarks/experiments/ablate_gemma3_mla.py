"""Ablations of `convert mla --target gemma3-mla` on Gemma 3 270M: perplexity of each converted folder over the
source's by distance of the predicted token, on the first 4096 tokens (one window, BOS first) of the two held-out
texts of bench_long_context.py (prose_heldout.jsonl and technical_pyref.txt in its --work folder).

Usage: python benchmarks/experiments/ablate_gemma3_mla.py --work DIR SRC MODEL [MODEL ...]
  SRC: Gemma 3's fp32 folder (attnkit/realmodels.py gemma3_folder); MODEL: folders written by `attnkit convert mla SRC
  MODEL --target gemma3-mla ...` (the commands are in docs/convert-mla.md). Prints one line per model and text:
  the ratio in the buckets 0-128, 128-256, 256-512, 512-1k, 1k-2k, 2k-4k. One fp32 forward per model and text,
  logits 512 positions at a time (Gemma's 262k vocabulary).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

EDGES = [0, 128, 256, 512, 1024, 2048, 4095]


def texts(work: Path) -> dict[str, str]:
    prose = "\n".join(json.loads(line)["text"] for line in (work / "prose_heldout.jsonl").read_text().splitlines())
    return {"prose": prose, "technical": (work / "technical_pyref.txt").read_text()}


def nll(model, ids):
    """Per-position next-token NLL of one window ids [1, T].  -> [T-1]"""
    import torch

    t = ids.shape[1]
    with torch.no_grad():
        h = model.model(ids).last_hidden_state  # [1, T, n]
        out = []
        for s in range(0, t - 1, 512):
            logits = model.lm_head(h[:, s : min(s + 512, t - 1)]).float()  # [1, <=512, vocab]
            target = ids[0, s + 1 : s + 1 + logits.shape[1]]
            out.append(torch.nn.functional.cross_entropy(logits[0], target, reduction="none"))
    return torch.cat(out)


def buckets(losses) -> list[float]:
    return [float(losses[a:b].mean().exp()) for a, b in zip(EDGES[:-1], EDGES[1:])]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import attnkit.modeling  # noqa: F401  (attnkit_gemma3_mla)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("source")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.source)
    ids = {name: tok(text, return_tensors="pt").input_ids[:, :4096] for name, text in texts(args.work).items()}
    source = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    base = {name: buckets(nll(source, x)) for name, x in ids.items()}
    del source
    for path in args.models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for name, x in ids.items():
            ratios = [a / b for a, b in zip(buckets(nll(model, x)), base[name])]
            print(path, name, " ".join(f"{r:.2f}" for r in ratios), flush=True)
        del model


if __name__ == "__main__":
    main()
