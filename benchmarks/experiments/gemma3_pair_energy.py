"""Where Gemma 3's global layers put their logit energy, by RoPE pair (issue 43): the source run on the first 1,024
tokens of tests/data/mixed/calib.txt, its normalized queries and keys (after q_norm / k_norm, before RoPE) taken
per global layer, and per frequency pair i the energy E|q_i|^2 E|k_i|^2 (queries averaged over heads) and its
rotation cost, that energy times E|1 - exp(1j w_i t)|^2 for t uniform over [0, 4096). Prints per layer the energy
share of the 32 fastest pairs, of pairs 32-76 (those that still turn a radian within 4,096 tokens at base 1e6)
and of the rest, and the rotation cost a 64-wide RoPE key leaves out when it keeps the 32 fastest pairs against
the 32 costliest (what `convert mla --rope-pairs rotation` keeps).

Usage: python benchmarks/experiments/gemma3_pair_energy.py SRC   (a Gemma 3 folder, e.g. the real tier's fp32 one)
"""

from __future__ import annotations

import argparse
from pathlib import Path

CONTEXT = 4096
KEPT = 32  # pairs a 64-wide RoPE key keeps


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.source)
    model = AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).eval()
    text = (Path(__file__).resolve().parents[2] / "tests/data/mixed/calib.txt").read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :1024]
    config, taken = model.config, {}
    for i, layer in enumerate(model.model.layers):
        if config.layer_types[i] == "full_attention":
            attn = layer.self_attn
            attn.q_norm.register_forward_hook(lambda m, a, out, i=i: taken.__setitem__(("q", i), out.detach()))
            attn.k_norm.register_forward_hook(lambda m, a, out, i=i: taken.__setitem__(("k", i), out.detach()))
    with torch.no_grad():
        model(ids)
    d = config.head_dim
    half = d // 2
    theta = config.rope_parameters["full_attention"]["rope_theta"]
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)  # [D/2], fastest first
    x = freqs * CONTEXT
    turned = 2 - 2 * torch.sin(x) / x  # E|1 - exp(1j w t)|^2, t uniform over [0, CONTEXT)
    for i in sorted({layer for _, layer in taken}):
        q = taken[("q", i)][0].double()  # [H, T, D]
        k = taken[("k", i)][0, 0].double()  # [T, D]: the one KV head
        energy = (q[..., :half] ** 2 + q[..., half:] ** 2).mean((0, 1)) * (k[:, :half] ** 2 + k[:, half:] ** 2).mean(0)
        cost = energy * turned
        costliest = torch.topk(cost, KEPT).indices
        left_fastest = cost[KEPT:].sum() / cost.sum()
        left_costliest = (cost.sum() - cost[costliest].sum()) / cost.sum()
        share = [energy[a:b].sum().item() / energy.sum().item() for a, b in ((0, KEPT), (KEPT, 77), (77, half))]
        print(
            f"layer {i}: energy share pairs 0-{KEPT - 1} {share[0]:.3f}, {KEPT}-76 {share[1]:.3f}, 77-{half - 1} "
            f"{share[2]:.3f}; rotation cost left out: {KEPT} fastest {left_fastest:.3f}, {KEPT} costliest "
            f"{left_costliest:.3f} (pairs {sorted(costliest.tolist())})"
        )


if __name__ == "__main__":
    main()
