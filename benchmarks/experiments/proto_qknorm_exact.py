"""Prototype of the exact QK-norm route for `convert mla` (docs/convert-mla.md, "QK-norm sources"), through
transformers' attention interface.

The shipped route folds a Qwen3's per-head QK-norm into W_q and W_k by constants (attnkit/ops/qknorm_fold.py):
the written DeepSeek-V3 scores q_h . k_h * c_q c_k r_q r_k / (r_q r_k) instead of the source's q_h . k_h / (r_q r_k),
r = the per-token RMS of a head's projection. The exact route puts the per-token factors back:
- query: 1 / (c_q r_q(x)), computed at decode time from the query itself (no cache, no new weights);
- key: 1 / (c_k r_k(x)), one scalar per token and KV group, computed when the token is cached (it needs the
  source's W_k to compute r_k exactly) and cached beside the latent: R + P + Hkv values per token and layer;
  a scalar per (token, group) multiplies that group's whole logit, so it applies to the shared RoPE key too.
This script runs a `convert mla` output of the Qwen3 with both factors applied (a pre-hook computes them from the
layer's input with the source's W_q, W_k; an attention function registered in transformers' AttentionInterface
multiplies query and key by them before eager attention) and scores it, the output as written and the source on
the first 4096 tokens of two texts.

Usage: python benchmarks/experiments/proto_qknorm_exact.py SOURCE CONVERTED [CONVERTED ...]
(SOURCE: the Qwen3 folder; CONVERTED: `convert mla` outputs of it, whose attnkit.json holds the fold's constants.)
Prints one JSON row per converted model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

TEXTS = {"prose": ROOT / "tests/data/prose/heldout.txt", "technical": ROOT / "benchmarks/data/technical.txt"}
NAME = "attnkit_qknorm_exact"


def exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with the per-token QK-norm factors the module's pre-hook left on it.
    query [B, H, T, Dq], key [B, H, T, Dq]; module.qk_factors: ([B, H, T], [B, H, T])."""
    from transformers.integrations.sdpa_attention import repeat_kv

    fq, fk = module.qk_factors
    query = query * fq[..., None].to(query)
    key = repeat_kv(key, query.shape[1] // key.shape[1]) * fk[..., None].to(key)
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, T, T]
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = scores + mask if mask.dtype != torch.bool else scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = scores.float().softmax(-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def install(model, source_dir: Path, layers: list[dict]) -> None:
    """Pre-hooks computing 1 / (c r) per head and token from the layer input with the source's W_q, W_k."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    from attnkit.io.checkpoint import safetensors_files
    from attnkit.io.reader import LazyReader

    AttentionInterface.register(NAME, exact_attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    model.set_attn_implementation(NAME)
    config = json.loads((source_dir / "config.json").read_text())
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps = config["rms_norm_eps"]
    with LazyReader(safetensors_files(source_dir)) as reader:
        for row in layers:
            i = row["layer"]
            prefix = f"model.layers.{i}."
            wq = reader.get(prefix + "self_attn.q_proj.weight").float()  # [H*D, n]
            wk = reader.get(prefix + "self_attn.k_proj.weight").float()  # [Hkv*D, n]
            # the source's x from the module's input: the converted model's input norm scale is ones (folded)
            own = model.model.layers[i].input_layernorm.weight.detach().float()
            gamma = reader.get(prefix + "input_layernorm.weight").float() / own
            c_q, c_k = torch.tensor(row["qk_norm_c_q"]), torch.tensor(row["qk_norm_c_k"])

            def hook(module, args, kwargs, wq=wq, wk=wk, gamma=gamma, c_q=c_q, c_k=c_k):
                x = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).float() * gamma  # [B, T, n]
                b, t, _ = x.shape
                r_q = ((x @ wq.T).view(b, t, heads, d).square().mean(-1) + eps).sqrt()  # [B, T, H]
                r_k = ((x @ wk.T).view(b, t, kv, d).square().mean(-1) + eps).sqrt()  # [B, T, Hkv]
                fq = 1.0 / (c_q * r_q)
                fk = (1.0 / (c_k * r_k)).repeat_interleave(heads // kv, dim=-1)  # [B, T, H]: group g to its heads
                module.qk_factors = (fq.transpose(1, 2), fk.transpose(1, 2))

            model.model.layers[i].self_attn.register_forward_pre_hook(hook, with_kwargs=True)


def score(source: Path, converted: Path) -> dict:
    from attnkit.runtime import load_model
    from attnkit.runtime.texts import make_windows, read_texts
    from attnkit.scoring.perplexity import evaluate

    manifest = json.loads((converted / "attnkit.json").read_text())
    src = load_model(str(source), device="cpu", dtype="float32")
    written = load_model(str(converted), device="cpu", dtype="float32")
    exact = load_model(str(converted), device="cpu", dtype="float32")
    install(exact.model, source, manifest["layers"])
    rows = {}
    for name, path in TEXTS.items():
        windows = make_windows(src.tokenizer, read_texts([str(path)]), 512, 4096)
        a = evaluate(written, windows, reference=src)
        b = evaluate(exact, windows, reference=src)
        rows[name] = {
            "source": a.reference_perplexity,
            "fold": a.perplexity,
            "fold_kl": a.kl_mean,
            "exact": b.perplexity,
            "exact_kl": b.kl_mean,
        }
    config = json.loads((converted / "config.json").read_text())
    cached = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    kv = json.loads((source / "config.json").read_text())["num_key_value_heads"]
    return {"model": str(converted), "cached_fold": cached, "cached_exact": cached + kv, "texts": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("converted", type=Path, nargs="+")
    args = ap.parse_args()
    source, converted = args.source, args.converted
    for folder in converted:
        print(json.dumps(score(source, folder)), flush=True)


if __name__ == "__main__":
    main()
