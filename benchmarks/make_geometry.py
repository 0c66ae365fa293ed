"""Write a random-weight checkpoint with the exact config and tensor shapes of a preset, for memory and time
benchmarks at sizes whose real weights cannot be downloaded here (memory and time depend on shapes, not values).

Usage: python benchmarks/make_geometry.py PRESET OUT [--layers N] [--dtype bf16] [--shard-size 5GB] [--seed 0]
           [--tokenizer DIR]
  PRESET: an attnkit preset (llama-3.1-8b, qwen2.5-7b, llama-3.1-70b, ...); --layers keeps the first N decoder
  layers (at most the preset's); the names and shapes come from the transformers class built on the meta
  device, so they are the published checkpoint's. Shards of --shard-size (the published ones are ~5 GB) with
  model.safetensors.index.json; weights N(0, 0.02) (norm weights 1), seeded; SmolLM2's tokenizer (its ids are
  a subset of every preset's vocabulary): attnkit.realmodels' folder, or the one in --tokenizer DIR. OUT must be absent or empty; written into OUT.partial and renamed; the
  free disk space is checked before anything is written. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def fail(message: str, code: int = 2) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def geometry_config(preset: str, layers: int | None) -> dict:
    from attnkit.presets import find_preset

    found = find_preset(preset)
    if found is None:
        fail(f"no preset {preset!r}; `attnkit presets` lists them")
    config = dict(found.config)
    total = config["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= total:
            fail(f"--layers {layers}: {found.name} has {total} layers; give 1 to {total}")
        config["num_hidden_layers"] = layers
        for key in ("layer_types",):
            if isinstance(config.get(key), list):
                config[key] = config[key][:layers]
    return config


def meta_state(config: dict, dtype: str) -> dict:
    """{name: (shape, dtype)} of the transformers model of `config`, built on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, DTYPES[dtype]))
    state = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _nbytes(shape, dt) -> int:
    import torch

    return torch.Size(shape).numel() * dt.itemsize


def _random(name: str, shape, dt, g):
    """Ones for norm weights, N(0, 0.02) for the rest (drawn in float32, then cast)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dt)
    return (torch.randn(shape, generator=g) * 0.02).to(dt)


def write(config: dict, out: Path, dtype: str, shard_bytes: int, seed: int, tokenizer_dir: Path | None = None) -> int:
    """Write the checkpoint into OUT (via OUT.partial); returns the bytes of weights written."""
    import torch
    from safetensors.torch import save_file

    from attnkit.realmodels import smollm2_folder

    state = meta_state(config, dtype)
    total = sum(_nbytes(shape, dt) for shape, dt in state.values())
    free = shutil.disk_usage(out.parent).free
    if total * 1.01 > free:
        fail(f"{out.parent}: {total / 2**30:.1f} GiB of weights do not fit the {free / 2**30:.1f} GiB free", 1)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shards, current, size = [], [], 0  # the names of each shard, planned from the shapes
    for name, (shape, dt) in state.items():
        nbytes = _nbytes(shape, dt)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    g = torch.Generator().manual_seed(seed)
    index = {}
    for i, names in enumerate(shards, 1):  # one shard in memory at a time
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random(name, *state[name], g) for name in names}
        save_file(tensors, str(partial / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(names, file))
        del tensors
    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    (partial / "config.json").write_text(json.dumps({**config, "torch_dtype": DTYPES[dtype]}, indent=1))
    tokenizer = tokenizer_dir or smollm2_folder()
    for file in TOKENIZER_FILES:
        if (tokenizer / file).is_file():
            shutil.copy(tokenizer / file, partial / file)
    partial.rename(out)
    return total


def main() -> None:
    from attnkit.units import parse_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("preset")
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shard-size", default="5GB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer", type=Path, help="a folder with SmolLM2's tokenizer files (default: attnkit.realmodels' SmolLM2)"
    )
    args = ap.parse_args()
    config = geometry_config(args.preset, args.layers)
    if not args.out.parent.is_dir():
        fail(f"{args.out.parent}: no such folder", 1)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        fail(f"{args.out}: exists and is not an empty folder", 1)
    if args.out.is_dir():
        args.out.rmdir()
    total = write(config, args.out, args.dtype, parse_bytes(args.shard_size, "--shard-size"), args.seed, args.tokenizer)
    print(f"{args.out}: {config['num_hidden_layers']} layers, {total / 2**30:.2f} GiB of {args.dtype} weights")


if __name__ == "__main__":
    main()
