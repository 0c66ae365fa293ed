"""Ablation (issue 29, docs/convert-gqa.md "## Long context"): where the MQA merge loses pass-key retrieval.

python benchmarks/experiments/ablate_merge_retrieval.py heads SRC
    induction and previous-token scores of every (layer, head) of the source, on repeated random tokens
python benchmarks/experiments/ablate_merge_retrieval.py hybrid SRC MERGED --layers 16-22 [--roles qkvo] [--lengths 1024,2048]
    pass keys (both variants, 3 depths, 1 trial) of the source with MERGED's attention in the layers named: its
    q/o as folded, its k/v heads repeated to the source's KV heads (the same function as MERGED's layer), the
    rest of the model the source's. `--roles qk` takes only the key side, `vo` only the value side.
Rows go to benchmarks/results/merge_retrieval.jsonl.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from attnkit.ops.headmerge import expand_heads
from attnkit.runtime import load_model
from attnkit.scoring.passkey import PasskeySpec, run_passkey

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "merge_retrieval.jsonl"
RUN, COPIES, SEED = 200, 4, 0


def head_scores(src: str) -> dict:
    """Per layer and head: induction (attention from a token of the second copy of a random run to the token after
    its first occurrence) and previous-token (attention to the token before) scores.  -> {kind: [L][H]}"""
    loaded = load_model(src, device="cpu", dtype="float32", attn_implementation="eager")
    g = torch.Generator().manual_seed(SEED)
    run = torch.randint(1000, loaded.tokenizer.vocab_size - 1000, (COPIES, RUN), generator=g)  # [B, n]
    bos = loaded.tokenizer.bos_token_id
    start = [] if bos is None else [torch.full((COPIES, 1), bos)]
    ids = torch.cat([*start, run, run], dim=1)  # [B, T]: (BOS) run run
    off = len(start)
    with torch.no_grad():
        attentions = loaded.model(ids, output_attentions=True).attentions  # per layer [B, H, T, T]
    second = torch.arange(off + RUN, off + 2 * RUN)  # positions of the second copy
    later = torch.arange(off + 1, off + 2 * RUN)
    return {
        "induction": [a[:, :, second, second - RUN + 1].mean(dim=(0, 2)).tolist() for a in attentions],
        "previous_token": [a[:, :, later, later - 1].mean(dim=(0, 2)).tolist() for a in attentions],
    }


def parse_layers(text: str) -> list[int]:
    """'16-22,25' -> [16, ..., 22, 25]."""
    layers: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        layers |= set(range(int(first), int(last or first) + 1))
    return sorted(layers)


def graft(model, merged: dict, layers: list[int], roles: str) -> None:
    """Copy MERGED's attention projections of `roles` into `model` at `layers`, k/v heads repeated."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in layers:
            prefix = f"model.layers.{layer}.self_attn."
            for role in roles:
                name = f"{prefix}{role}_proj.weight"
                w = merged[name]  # q, o: as the source's; k, v: [G*D, n]
                if role in "kv":
                    groups = w.shape[0] // head_dim
                    w = expand_heads(w, groups, cfg.num_key_value_heads // groups)  # [Hkv*D, n]
                params[name].copy_(w)


def hybrid(src: str, merged_dir: str, layers: list[int], roles: str, lengths: tuple[int, ...]) -> dict:
    loaded = load_model(src, device="cpu", dtype="float32")
    graft(loaded.model, load_file(str(Path(merged_dir) / "model.safetensors")), layers, roles)
    found = {}
    for variant in ("repeat", "distractors"):
        spec = PasskeySpec(lengths=lengths, depths=3, trials=1, variant=variant)
        result = run_passkey(loaded, spec)
        found[variant] = sum(c["correct"] for c in result["cells"])
    return {"keys_found": found, "keys": 3 * len(lengths)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heads")
    h.add_argument("src")
    y = sub.add_parser("hybrid")
    y.add_argument("src")
    y.add_argument("merged")
    y.add_argument("--layers", default="")
    y.add_argument("--roles", default="qkvo", choices=["qkvo", "qk", "vo"])
    y.add_argument("--lengths", default="1024,2048")
    a = p.parse_args()
    if a.cmd == "heads":
        scores = head_scores(a.src)
        row = {"kind": "heads", **scores}
        for kind, table in scores.items():
            top = sorted(((s, lay, hd) for lay, r in enumerate(table) for hd, s in enumerate(r)), reverse=True)[:8]
            print(kind, " ".join(f"L{lay}H{hd} {s:.2f}" for s, lay, hd in top))
    else:
        layers = parse_layers(a.layers) if a.layers else []
        lengths = tuple(int(x) for x in a.lengths.split(","))
        row = {"kind": "hybrid", "merged": Path(a.merged).name, "layers": a.layers or "none", "roles": a.roles}
        row.update(hybrid(a.src, a.merged, layers, a.roles, lengths))
        print(json.dumps(row))
    with RESULTS.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
