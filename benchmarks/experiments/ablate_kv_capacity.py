"""Ablation (issue 29, docs/convert-mla.md "## Long context"): a Llama checkpoint whose K or V projections (or
both, jointly) are replaced by the whitened low-rank fit `convert mla` uses for its latent, applied BEFORE RoPE, so
every KV head keeps exact positions: it isolates what the latent's capacity costs from what the shared RoPE key
costs. Not a converter: the result keeps the Llama layout and saves no cache.

python benchmarks/experiments/ablate_kv_capacity.py SRC OUT --which v|k|kv --rank R [--key-weight output|query]
    [--calib FILE...] [--calib-seq-len 512 --calib-tokens 2048]
then score it with `attnkit eval OUT TEXT --reference SRC --seq-len 4096`.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from attnkit.ops.headmerge import head_gram
from attnkit.ops.mla import MLAShape, _block_roots, factor_latent, value_spread
from attnkit.runtime import load_model, make_windows, read_texts
from attnkit.runtime.calibrate import calibrate, input_moments

ROOT = Path(__file__).resolve().parents[2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--which", choices=["v", "k", "kv"], required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--key-weight", choices=["output", "query"], default="output")
    p.add_argument("--calib", nargs="+", default=[str(ROOT / "tests/data/prose/calib.txt")])
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--shrink", type=float, default=0.5)
    a = p.parse_args()
    m = load_model(a.src, device="cpu", dtype="float32")
    model = m.model
    cfg = model.config
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = cfg.hidden_size // H
    win = make_windows(m.tokenizer, read_texts(a.calib), a.calib_seq_len, a.calib_tokens)
    names = [f"model.layers.{i}.self_attn" for i in range(cfg.num_hidden_layers)]

    def on_layer(layer, hidden, rope=None, scaling=None):
        attn = model.get_submodule(names[layer])
        cov, mean = input_moments(hidden, False)  # [n, n], [n]
        fit = cov * (1 - a.shrink)
        fit.diagonal().add_(cov.diagonal() * a.shrink)
        q = attn.q_proj.weight.detach().double()
        k = attn.k_proj.weight.detach().double()
        v = attn.v_proj.weight.detach().double()
        o = attn.o_proj.weight.detach().double()
        shape = MLAShape(num_heads=H, num_kv=Hkv, head_dim=D, rope_dim=0, latent_rank=a.rank)
        spread = value_spread(v, o, cov, mean, shape) if a.key_weight == "output" else None  # [H]
        k_roots = _block_roots(head_gram(q, H, Hkv, fit, spread) / D, 1e-6)
        v_roots = _block_roots(head_gram(o, H, Hkv), 1e-6)
        out = {}
        if a.which == "kv":
            rows = torch.cat([k, v])
            down, up, _ = factor_latent(rows, fit, a.rank, torch.block_diag(k_roots, v_roots), 1e-6)
            rec = up @ down
            out[f"{names[layer]}.k_proj.weight"] = rec[: Hkv * D].float()
            out[f"{names[layer]}.v_proj.weight"] = rec[Hkv * D :].float()
        else:
            rows, roots = (k, k_roots) if a.which == "k" else (v, v_roots)
            down, up, _ = factor_latent(rows, fit, a.rank, roots, 1e-6)
            out[f"{names[layer]}.{a.which}_proj.weight"] = (up @ down).float()
        return out  # sequential: later layers calibrate on the changed model

    calibrate(model, win, names, on_layer)
    out = Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in Path(a.src).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, out / f.name)
    print("wrote", out)


if __name__ == "__main__":
    main()
