"""`convert mla`: rewrite an MHA/GQA checkpoint as a stock DeepseekV3 (MLA) checkpoint, layer by layer.

Flow: check the source and the ranks -> load it once (fp32) and run the calibration text through it;
when the pass reaches layer l, l's input covariance gives its MLA tensors (attnkit.ops.mla), which
go straight to the output shards; with sequential calibration layer l is then run as the converted
DeepseekV3Attention, so later layers are fitted on the converted model's activations -> copy the
other tensors -> config, side files, manifest -> check names/shapes/finiteness -> (--eval) score
and check what the cache holds -> rename the temp folder into place. The source is only read.
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from attnkit import __version__
from attnkit.commands.rewrite import CheckedSource, RewriteRequest, check_rewrite
from attnkit.errors import AttnkitError, UsageError
from attnkit.ops.mla import KEY_WEIGHTS, RESIDUALS, VALUE_WEIGHTS, MLAOptions, MLAShape

#: Families whose attention maps onto DeepseekV3 (the rest are refused with the reason in REFUSED).
SUPPORTED = ("llama", "mistral", "qwen2", "gemma")
REFUSED = {
    "qwen3": "per-head QK-norm (RMSNorm of each head's q and k before RoPE) is not linear in the input and "
             "DeepseekV3 has no per-head norm: its gains could be folded into the weights, its 1/rms(q), "
             "1/rms(k) per token cannot",
    "olmo2": "QK-norm over the full projection width is not linear in the input and DeepseekV3 has no such norm",
    "gemma2": "attention logit soft-capping and post-attention/post-MLP norms have no DeepseekV3 counterpart",
    "gemma3": "per-head QK-norm and post-attention/post-MLP norms have no DeepseekV3 counterpart",
    "phi3": "partial rotary and a fused qkv/gate_up layout are not converted",
}
ROPE_TYPES = ("default", "linear", "llama3")  # frequency rules that depend only on the frequency value
ATTN_ROLES = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias")


@dataclass(kw_only=True)
class MLARequest(RewriteRequest):
    """convert mla: the cache budget (R and P, or a fraction) and the factorization options."""

    kv_lora_rank: int | None = None  # R: cached latent values per token per layer (incl. the norm channel)
    rope_dim: int | None = None  # P
    kv_budget: float | None = None  # fraction of the source's KV elements per token
    sequential: bool = True
    options: MLAOptions = field(default_factory=MLAOptions)


@dataclass
class Source(CheckedSource):
    """The checked source, its layer shape and RoPE parameters."""

    shape: MLAShape
    layer_names: list[dict]  # per layer: role -> tensor name
    rope: dict  # the source's rope_parameters (rope_type, rope_theta, ...)


def budget_split(total: int, head_dim: int) -> tuple[int, int]:
    """(R, P) for `total` cached values per token per layer: P = the largest power of two <= total / 3 and
    <= D (at least 2), R = total - P (measured on SmolLM2, docs/benchmarks.md: RoPE dims help while the
    latent keeps about two thirds of the budget)."""
    rope = 2
    while rope * 2 <= min(head_dim, total // 3):
        rope *= 2
    return total - rope, rope


def max_rank(spec, augmented: bool) -> int:
    """Largest useful R: the rank of the stacked keys and values (2*Hkv*D, at most the input width) + 1."""
    return min(2 * spec.num_kv_heads * spec.head_dim, spec.hidden_size + int(augmented)) + 1


def _ranks(req: MLARequest, spec, augmented: bool) -> tuple[int, int]:
    d = spec.head_dim
    source = 2 * spec.num_kv_heads * d
    if req.kv_budget is not None:
        if req.kv_lora_rank is not None or req.rope_dim is not None:
            raise UsageError("give either --kv-budget or --kv-lora-rank with --rope-dim, not both")
        if not 0 < req.kv_budget < 1:
            raise UsageError(f"--kv-budget must be a fraction between 0 and 1, got {req.kv_budget}")
        total = int(round(req.kv_budget * source))
        if total < 4:
            raise UsageError(f"--kv-budget {req.kv_budget} leaves {total} cached values per token; need at least 4")
        rank, rope = budget_split(total, d)
    else:
        if req.kv_lora_rank is None or req.rope_dim is None:
            raise UsageError("give --kv-lora-rank and --rope-dim, or --kv-budget")
        rank, rope = req.kv_lora_rank, req.rope_dim
    if rope < 2 or rope % 2 or rope > d:
        raise UsageError(f"--rope-dim must be even and between 2 and the head dim {d}, got {rope}")
    top = max_rank(spec, augmented)
    if rank < 2 or rank > top:
        raise UsageError(f"--kv-lora-rank must be between 2 (one channel is the norm constant) and {top} "
                         f"(rank of the stacked keys and values + 1), got {rank}")
    return rank, rope


def _rope_parameters(ckpt) -> dict:
    """The source's rope parameters as transformers reads them (rope_theta, rope_type, scaling keys)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(ckpt.root))
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        raise AttnkitError(f"{ckpt.ref}: no rope_theta in the config")
    return params


def source_freqs(src: Source):
    """The source's rotary frequencies [D/2] (radians per token), as its transformers class computes them."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = src.shape.head_dim
    if src.rope["rope_type"] == "default":
        return float(src.rope["rope_theta"]) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cfg = AutoConfig.from_pretrained(str(src.ckpt.root))
    cfg.head_dim = d
    inv_freq, _ = ROPE_INIT_FUNCTIONS[src.rope["rope_type"]](cfg, "cpu")
    return inv_freq.to(torch.float64)


def check_request(req: MLARequest) -> Source:
    """Validate family, ranks, files and target without reading tensors; one-line errors."""
    from attnkit.archs import get_arch
    from attnkit.archs.spec import attention_spec
    from attnkit.io.complete import checked_weights
    from attnkit.io.resolve import resolve
    from attnkit.io.writer import OutputDir

    if not req.calib and not req.dry_run:
        raise UsageError("convert mla needs calibration text: pass --calib FILE")
    check_rewrite(req)
    _check_options(req.options)
    ckpt = resolve(req.model)
    if ckpt.kind == "config":
        raise AttnkitError(f"{req.model}: a config file has no weights to convert")
    arch = get_arch(ckpt.model_type)
    if arch.family in REFUSED or arch.family not in SUPPORTED:
        why = REFUSED.get(arch.family) or (f"{arch.qkv_layout} attention with {arch.position} positions is not an "
                                           "MHA/GQA RoPE decoder this converter maps onto DeepseekV3")
        raise AttnkitError(f"{arch.family} cannot be converted to MLA: {why}; supported: {', '.join(SUPPORTED)}")
    if ckpt.gguf_file is not None:
        from attnkit.io.gguf_load import gguf_cache_folder, materialize_gguf

        ckpt = resolve(str(materialize_gguf(ckpt.gguf_file, gguf_cache_folder(ckpt.gguf_file))))
    spec = attention_spec(ckpt.config)
    if spec.partial_rotary_factor != 1.0:
        raise AttnkitError(f"{req.model}: partial rotary embeddings are not converted")
    rope = _rope_parameters(ckpt)
    if rope["rope_type"] not in ROPE_TYPES:
        raise AttnkitError(f"{req.model}: rope_type {rope['rope_type']!r} depends on the rotary width; "
                           f"convertible: {', '.join(ROPE_TYPES)}")
    infos, prefix = checked_weights(ckpt, arch, spec)
    names = set(infos)
    layer_names = []
    for layer in range(spec.num_layers):
        roles = {r: arch.tensor_name(r, layer, prefix) for r in ATTN_ROLES}
        roles = {r: n for r, n in roles.items() if n in names}
        missing = [r for r in ("q", "k", "v", "o") if r not in roles]
        if missing:
            raise AttnkitError(f"{req.model}: tensor {arch.tensor_name(missing[0], layer, prefix)!r} not found")
        layer_names.append(roles)
    augmented = any(r in layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))
    rank, rope_dim = _ranks(req, spec, augmented)
    OutputDir(Path(req.out), overwrite=req.overwrite, sources=[Path(ckpt.root)])  # checks only; creates nothing
    shape = MLAShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, rank - 1, rope_dim)
    return Source(ckpt, arch, spec, prefix, shape, layer_names, rope)


def _check_options(o: MLAOptions) -> None:
    for value, allowed, flag in ((o.key_weight, KEY_WEIGHTS, "--key-weight"),
                                 (o.value_weight, VALUE_WEIGHTS, "--value-weight"),
                                 (o.residual, RESIDUALS, "--residual")):
        if value not in allowed:
            raise UsageError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if not o.key_balance > 0:
        raise UsageError(f"--key-balance must be positive, got {o.key_balance}")


def _layer_weights(reader, roles: dict) -> dict:
    return {role: reader.get(name) for role, name in roles.items()}


def convert_one(src: Source, weights: dict, cov, freqs, options: MLAOptions, dtype,
                q_lora: bool) -> tuple[dict, dict]:
    """(DeepseekV3 attention tensors of one layer in `dtype`, report row) from its source tensors and cov."""
    from attnkit.ops.gqa import augmented_rows
    from attnkit.ops.mla import convert_layer
    from attnkit.ops.mla_deepseek import attention_tensors

    s = src.shape
    augmented = cov.shape[0] == src.spec.hidden_size + 1
    q, k, v = (augmented_rows(weights, r, augmented) for r in ("q", "k", "v"))
    layer = convert_layer(q, k, v, weights["o"], cov, s, freqs, options)
    n = src.spec.hidden_size
    tensors = attention_tensors(layer, s, q_scale=math.sqrt((s.head_dim + s.rope_dim) / s.head_dim),
                                augmented=augmented, q_bias=q_lora, o=weights["o"], o_bias=weights.get("o_bias"),
                                x_mean_sq=float(cov[:n, :n].diagonal().sum()))
    row = {"k_err": layer.k_err, "v_err": layer.v_err, "position_free": layer.position_free}
    return {name: t.to(dtype) for name, t in tensors.items()}, row


def _refit_o(config, layer: int, tensors: dict, weights: dict, hidden, rope, scaling, s: MLAShape, ridge: float,
             device):
    """o_proj refit (attnkit.ops.orefit) so the converted layer's output matches the source's on these tokens."""
    from attnkit.ops.orefit import refit_o
    from attnkit.runtime.attention import deepseek_attention, run_attention, source_attention_inputs

    attn, rotary = deepseek_attention(config, layer, tensors, device)
    _, z_new = run_attention(attn, rotary, hidden.detach().to(device).float())
    z_old = source_attention_inputs(weights, hidden.to(device), rope, scaling, s)
    o = weights["o"]
    return refit_o(z_new.cpu(), z_old.cpu(), o, o, ridge).to(tensors["o_proj.weight"].dtype)


def _calibrate_and_convert(req: MLARequest, src: Source, config, writer, expected: dict) -> tuple[list, dict]:
    """One pass over the calibration windows; each layer is converted (and written) when reached."""
    from attnkit.runtime.calibrate import attention_module_name, calibrate, input_covariance
    from attnkit.io.reader import LazyReader
    from attnkit.runtime import make_windows, read_texts
    from attnkit.runtime.attention import replace_output_once
    from attnkit.runtime.streaming import load_for_calibration

    loaded = load_for_calibration(str(src.ckpt.root), req.device)  # decoder layers streamed when possible
    windows = make_windows(loaded.tokenizer, read_texts(req.calib), req.calib_seq_len, req.calib_tokens,
                           flags=("--calib-seq-len", "--calib-tokens"))
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(src.spec.num_layers)]
    rows: list = [None] * src.spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:
        augmented = any(r in src.layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))
        dtype = reader.get(src.layer_names[0]["o"]).dtype
        freqs = source_freqs(src)

        def on_layer(layer: int, hidden, rope=None, scaling=None):
            cov = input_covariance(hidden, augmented)  # [n(+1), n(+1)]
            weights = _layer_weights(reader, src.layer_names[layer])
            tensors, rows[layer] = convert_one(src, weights, cov, freqs, req.options, dtype,
                                                  config.q_lora_rank is not None)
            if req.options.o_refit > 0:
                if rope is None or scaling is None:
                    raise AttnkitError("o_proj refit needs the source's rotary embedding and softmax scale")
                tensors["o_proj.weight"] = _refit_o(config, layer, tensors, weights, hidden, rope, scaling,
                                                    src.shape, req.options.o_refit, loaded.device)
            rows[layer]["layer"] = layer
            for name, t in tensors.items():
                full = f"model.layers.{layer}.self_attn.{name}"
                if full not in expected:
                    raise AttnkitError(f"internal: {full} is not a DeepseekV3 tensor")
                writer.add(full, t)
            if req.sequential:
                replace_output_once(loaded.model.get_submodule(modules[layer]), config, layer, tensors,
                                     loaded.device)
            return None

        calibrate(loaded.model, windows, modules, on_layer)
    info = {"tokens": int(windows.numel()), "windows": int(windows.shape[0]), "seq_len": req.calib_seq_len,
            "sequential": req.sequential, "files": list(req.calib)}
    return [{"layer": r.pop("layer"), **r} for r in rows], info


def _copy_rest(reader, src: Source, writer, expected: dict) -> None:
    """Every non-attention tensor under its DeepseekV3 name (Gemma: norms 1 + w, embeddings x sqrt(n) untied)."""
    import torch

    attention = {n for roles in src.layer_names for n in roles.values()}
    gemma = src.arch.family == "gemma"
    for name in reader.names():
        if name in attention:
            continue
        if name not in expected:
            raise AttnkitError(f"{src.ckpt.ref}: tensor {name!r} has no place in a DeepseekV3 checkpoint")
        t = reader.get(name)
        if gemma and name.endswith("norm.weight"):
            t = (t.to(torch.float32) + 1).to(t.dtype)
        if gemma and name == "model.embed_tokens.weight":
            scale = torch.tensor(src.spec.hidden_size ** 0.5, dtype=t.dtype)  # Gemma's normalizer, in its dtype
            writer.add("lm_head.weight", t)
            t = t * scale
        writer.add(name, t)


def _kv_bytes(src: Source, rank: int) -> dict:
    from attnkit.kvcache import apply_variant, bytes_per_token, cache_dtype

    dtype = cache_dtype(str(src.ckpt.config.get("torch_dtype") or src.ckpt.config.get("dtype") or "bfloat16"))
    after = apply_variant(src.spec, f"mla:{rank}+{src.shape.rope_dim}")
    return {"dtype": dtype.name, "before": bytes_per_token(src.spec, dtype), "after": bytes_per_token(after, dtype),
            "elements_before": 2 * src.spec.num_kv_heads * src.spec.head_dim,
            "elements_after": rank + src.shape.rope_dim}


def cache_check(model, prompt_len: int = 8, new_tokens: int = 4) -> dict:
    """Generate with the converted model and read what its DynamicCache holds per layer and token."""
    import torch

    ids = torch.arange(3, 3 + prompt_len, device=model.device)[None] % model.config.vocab_size
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             return_dict_in_generate=True, pad_token_id=model.config.pad_token_id)
    layer = out.past_key_values.layers[0]
    k, v = layer.keys, layer.values  # [B, 1, T, R] and [B, 1, T, P]
    tokens = k.shape[2]
    per_token = (k.numel() + v.numel()) // (k.shape[0] * tokens)
    return {"key_shape": list(k.shape), "value_shape": list(v.shape), "tokens": tokens,
            "values_per_token_layer": per_token}


def _evaluate(req: MLARequest, source_root: Path, result_root: Path) -> dict:
    from attnkit.commands.analyse.evaluate import evaluate
    from attnkit.runtime import load_model, make_windows, read_texts

    source = load_model(str(source_root), device=req.device, dtype="float32")
    result = load_model(str(result_root), device=req.device, dtype="float32")
    windows = make_windows(source.tokenizer, read_texts(req.eval), req.eval_seq_len, req.eval_tokens,
                           flags=("--eval-seq-len", "--eval-tokens"))
    res = evaluate(result, windows, reference=source)
    return {"files": list(req.eval), "tokens": res.tokens, "seq_len": req.eval_seq_len,
            "source_perplexity": res.reference_perplexity, "perplexity": res.perplexity,
            "kl_mean": res.kl_mean, "kl_max": res.kl_max, "top1_agreement": res.top1_agreement,
            "cache": cache_check(result.model)}


def _parameters(req: MLARequest, src: Source) -> dict:
    o = req.options
    return {"kv_lora_rank": src.shape.latent_rank + 1, "latent_rank": src.shape.latent_rank,
            "rope_dim": src.shape.rope_dim, "rope_pairs": src.shape.pairs, "kv_budget": req.kv_budget,
            "calib": list(req.calib), "calib_tokens": req.calib_tokens, "calib_seq_len": req.calib_seq_len,
            "sequential": req.sequential, "key_weight": o.key_weight, "value_weight": o.value_weight,
            "residual": o.residual, "fade_window": o.window, "key_balance": o.key_balance, "ridge": o.ridge,
            "o_refit": o.o_refit, "whiten": o.whiten,
            "max_shard_bytes": req.max_shard_bytes}


def convert_mla(req: MLARequest, log=lambda message: None) -> dict:
    """Run (or with dry_run, plan) the conversion; returns the report (see docs/convert-mla.md).
    `log(message)` hears progress once the request has been checked."""
    from attnkit.commands.convert.mla_target import expected_shapes, target_config
    from attnkit.io.reader import LazyReader
    from attnkit.io.writer import OutputDir, ShardedWriter, copy_side_files, verify_output

    started = time.perf_counter()
    src = check_request(req)
    rank = src.shape.latent_rank + 1
    report = {
        "source": req.model, "output": str(req.out), "dry_run": req.dry_run, "model_type": src.spec.model_type,
        "num_layers": src.spec.num_layers, "num_heads": src.spec.num_heads, "kv_heads": src.spec.num_kv_heads,
        "head_dim": src.spec.head_dim, "kv_lora_rank": rank, "rope_dim": src.shape.rope_dim,
        "kv_bytes_per_token": _kv_bytes(src, rank), "parameters": _parameters(req, src),
        "calibration": None, "layers": [], "eval": None, "peak_rss_bytes": None, "notes": _notes(src),
    }
    if req.dry_run:
        report["seconds"] = time.perf_counter() - started
        return report
    log("calibrating and converting layer by layer ...")
    with OutputDir(Path(req.out), overwrite=req.overwrite, sources=[Path(src.ckpt.root)]) as out:
        writer = ShardedWriter(lambda: out.path, req.max_shard_bytes)  # temp folder made at the first write
        q_lora = "q_bias" in src.layer_names[0]
        config = target_config(src, q_lora)
        expected = expected_shapes(config)
        report["layers"], report["calibration"] = _calibrate_and_convert(req, src, config, writer, expected)
        with LazyReader(src.ckpt.weight_files) as reader:
            _copy_rest(reader, src, writer, expected)
        writer.finish()
        config.save_pretrained(out.path)
        copy_side_files(Path(src.ckpt.root), out.path)
        verify_output(out.path, expected)
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if req.eval:
            log("scoring source and result on the --eval text ...")
            report["eval"] = _evaluate(req, Path(src.ckpt.root), out.path)
        manifest = {"attnkit_version": __version__, "command": req.command, "conversion": "mla",
                    "source": {"ref": req.model, "kind": src.ckpt.kind, "repo_id": src.ckpt.repo_id,
                               "revision": src.ckpt.revision, "model_type": src.spec.model_type},
                    **{k: report[k] for k in ("parameters", "calibration", "kv_bytes_per_token", "layers", "eval",
                                              "notes")}}
        (out.path / "attnkit.json").write_text(json.dumps(manifest, indent=2) + "\n")
        out.commit()
    report["seconds"] = time.perf_counter() - started
    return report


def _notes(src: Source) -> list[str]:
    notes = []
    if "q_bias" in src.layer_names[0]:
        notes.append("q bias carried through the q_lora path (q_lora_rank = hidden + 1, RMSNorm made linear "
                     "by a constant channel); all-zero q biases use a plain q_proj")
    if any(w is not None for w in src.spec.layer_windows):
        notes.append("the source's sliding window is dropped: DeepseekV3 attends to the full context "
                     "(identical up to the window length)")
    if src.arch.family == "gemma":
        notes.append("Gemma: norm weights stored as 1 + w, embeddings pre-multiplied by sqrt(hidden) and untied "
                     "from lm_head")
    return notes
