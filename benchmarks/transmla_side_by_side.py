"""Run TransMLA (github fxmeng/TransMLA, training-free) on SmolLM2-135M with bench_convert_mla.py's text.

This script is NOT run with attnkit's environment: TransMLA needs transformers 4.52, so give it a venv of
its own and a TransMLA checkout (its code is imported from there, never copied into this repository):

    python -m venv /tmp/tm && /tmp/tm/bin/pip install torch==2.13.0 transformers==4.52.4 accelerate==1.3.0 \
        datasets tqdm
    git clone https://github.com/fxmeng/TransMLA /tmp/TransMLA
    /tmp/tm/bin/python benchmarks/transmla_side_by_side.py --transmla /tmp/TransMLA \
        --model .cache/smollm2-135m-instruct-f32 > transmla.jsonl
    python benchmarks/bench_convert_mla.py --from-json rows.json --transmla transmla.jsonl --write

Same tokens as bench_convert_mla.py: calibration = the first 2048 tokens of tests/data/prose/calib.txt in
4 windows of 512; evaluation = the first 4096 tokens of tests/data/prose/heldout.txt in 8 windows of 512
(no BOS, the way attnkit cuts windows), fp32 on CPU, perplexity = exp(mean token NLL).
Grid: TransMLA's rope dim (qk_mqa_dim) 64 / 32 / 16 x every freqfold it accepts x budgets of 192 / 128 / 96
cached values per token and layer (kv_lora_rank = budget - rope dim); TransMLA's defaults otherwise
(no q low rank, balance_kv_ratio 1, no kv norm). One JSON row per line on stdout.
--swap calibrates on heldout.txt and evaluates on calib.txt (5 windows); --settings 64:2,32:4 limits the grid.
--eval NAME=FILE (repeatable) scores every result on these texts as well (4096 tokens each), in "texts".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROSE = ROOT / "tests" / "data" / "prose"
BUDGETS = (192, 128, 96)
ROPE_DIMS = (64, 32, 16)


def legacy_folder(model: Path, tmp: str) -> str:
    """A copy of `model` (weights linked) whose config.json transformers 4.52 reads: `rope_theta` at top level."""
    config = json.loads((model / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    Path(tmp, "config.json").write_text(json.dumps(config))
    for name in os.listdir(model):
        if name != "config.json":
            os.symlink(model / name, Path(tmp, name))
    return tmp


def windows(tokenizer, path: Path, max_tokens: int, seq_len: int = 512) -> torch.Tensor:
    """LongTensor [N, seq_len]: the first full windows of the file's tokens, at most max_tokens."""
    ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    n = min(len(ids) // seq_len, max_tokens // seq_len)
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over all windows of ids [N, T]."""
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [N, T, V]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return float(torch.exp(nll))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--transmla", required=True, type=Path, help="a TransMLA checkout")
    ap.add_argument("--model", required=True, type=Path, help="SmolLM2 fp32 folder (attnkit.realmodels.smollm2_folder)")
    ap.add_argument(
        "--swap",
        action="store_true",
        help="calibrate on heldout.txt and evaluate on calib.txt (a second split, for robustness)",
    )
    ap.add_argument(
        "--settings", default=None, help="only these rope-dim:freqfold pairs, e.g. 64:2,32:4 (default: the whole grid)"
    )
    ap.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="more held-out texts, each scored on its first 4096 tokens",
    )
    args = ap.parse_args()
    only = {tuple(int(v) for v in pair.split(":")) for pair in args.settings.split(",")} if args.settings else None
    sys.path.insert(0, str(args.transmla / "transmla" / "transmla"))
    from lora_qkv import low_rank_qkv  # TransMLA's code, from its checkout
    from partial_rope import PartialRope
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from utils import get_qkv_calibrate_outputs

    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = legacy_folder(args.model.resolve(), tmp)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json")
        source = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa")
    source.eval()
    calib_file, heldout_file = ("heldout.txt", "calib.txt") if args.swap else ("calib.txt", "heldout.txt")
    calib, heldout = windows(tokenizer, PROSE / calib_file, 2048), windows(tokenizer, PROSE / heldout_file, 4096)
    loader = [{"input_ids": calib, "attention_mask": torch.ones_like(calib), "labels": calib}]
    extra = {name: windows(tokenizer, Path(path), 4096) for name, path in (e.split("=", 1) for e in args.eval)}

    def texts(model) -> dict:
        return {name: perplexity(model, ids) for name, ids in extra.items()}

    source_ppl = perplexity(source, heldout)
    print(json.dumps({"variant": "source", "ppl": source_ppl, "texts": texts(source)}), flush=True)

    keys = get_qkv_calibrate_outputs(source, loader, "calibration")["key"]
    head_dim = source.config.hidden_size // source.config.num_attention_heads
    source.config.head_dim = head_dim
    for rope in ROPE_DIMS:
        collapse = head_dim // rope
        freqfold = collapse
        while freqfold <= head_dim // 2:
            if only is not None and (rope, freqfold) not in only:
                freqfold *= 2
                continue
            started = time.perf_counter()
            partial = deepcopy(source)
            for i, layer in enumerate(partial.model.layers):
                layer.self_attn = PartialRope(layer.self_attn, keys[i], freqfold=freqfold, collapse=collapse)
            print(
                json.dumps(
                    {"variant": "partial-rope", "rope": rope, "freqfold": freqfold, "ppl": perplexity(partial, heldout)}
                ),
                flush=True,
            )
            for budget in BUDGETS:
                mla = low_rank_qkv(
                    deepcopy(partial),
                    tokenizer,
                    loader,
                    None,
                    q_lora_rank=None,
                    qk_mqa_dim=rope,
                    collapse=collapse,
                    kv_lora_rank=budget - rope,
                    use_qkv_norm=False,
                    balance_kv_ratio=1,
                )
                print(
                    json.dumps(
                        {
                            "variant": "transmla",
                            "values": budget,
                            "R": budget - rope,
                            "P": rope,
                            "freqfold": freqfold,
                            "ppl": perplexity(mla, heldout),
                            "source_ppl": source_ppl,
                            "texts": texts(mla),
                            "seconds": round(time.perf_counter() - started, 1),
                        }
                    ),
                    flush=True,
                )
            freqfold *= 2


if __name__ == "__main__":
    main()
