"""FLOPs per training token of `attnkit heal`, counted by torch (torch.utils.flop_counter) on models built on the
meta device (no memory, no weights): the teacher's forward pass and the student's forward and backward passes, with
the attention trained (`--train rewritten`) or everything (`--train all`), for presets of any size.

Usage: python benchmarks/heal_flops.py [--presets smollm2-135m,llama-3.1-8b] [--seq-len 256]
Prints a markdown table: per token, teacher forward, student forward + backward, heal's total with the live teacher
and with --teacher-logits top-k (the student alone; the targets cost one teacher forward per token, once).
The student is the preset's own architecture (a rewrite changes the attention's FLOPs by a few percent at most).
"""

from __future__ import annotations

import argparse


def count(preset: str, seq_len: int, train: str) -> tuple[float, float, int]:
    """(teacher forward FLOPs, student forward + backward FLOPs) per token, and the parameter count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnkit.presets import find_preset

    cfg = AutoConfig.for_model(**dict(find_preset(preset).config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(train == "all" or "self_attn" in name)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")  # [1, T]
    with FlopCounterMode(display=False) as forward, torch.no_grad():
        model(input_ids=ids)
    with FlopCounterMode(display=False) as both:
        model(input_ids=ids).logits.sum().backward()
    params = sum(p.numel() for p in model.parameters())
    return forward.get_total_flops() / seq_len, both.get_total_flops() / seq_len, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="smollm2-135m,llama-3.1-8b")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    print("| preset | parameters | --train | teacher forward | student forward + backward | live | top-k |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for train in ("rewritten", "all"):
            teacher, student, params = count(preset, args.seq_len, train)
            print(
                f"| {preset} | {params / 1e9:.2f}B | {train} | {teacher / 1e9:.2f} GFLOP | {student / 1e9:.2f} GFLOP | "
                f"{(teacher + student) / 1e9:.2f} GFLOP | {student / 1e9:.2f} GFLOP |"
            )


if __name__ == "__main__":
    main()
