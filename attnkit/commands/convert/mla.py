"""`convert mla`: rewrite an MHA/GQA checkpoint as a stock DeepseekV3 (MLA) checkpoint, layer by layer.

Flow: check the source and the ranks -> load it once (fp32) and run the calibration text through it;
when the pass reaches layer l, l's input covariance gives its MLA tensors (attnkit.ops.mla), which
go straight to the output shards; with sequential calibration layer l is then run as the converted
DeepseekV3Attention, so later layers are fitted on the converted model's activations -> copy the
other tensors -> config, side files, manifest -> check names/shapes/finiteness -> (--eval) score
and check what the cache holds -> rename the temp folder into place. The source is only read.

The default output is engine-safe (attnkit.ops.mla_deepseek.engine_tensors: no bias tensors, a config
llama.cpp, vLLM and SGLang load); `--latent-norm bias` keeps the exact constant-channel route that only
transformers runs.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field

from attnkit.commands.convert.layer_spill import LayerSpill
from attnkit.commands.convert.mla_layer import convert_one, refit_o_proj, without_o_bias
from attnkit.commands.convert.mla_target import TARGET, expected_shapes, target_attention_names, target_config
from attnkit.commands.quality import score_rewrite
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.rewrite import RewriteRequest, calib_info, calib_windows, check_rewrite
from attnkit.commands.source import Source, open_source
from attnkit.commands.write import write_checkpoint
from attnkit.engines.targets import TARGETS, engine_safe, mla_shapes, needs_q_lora
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.reader import LazyReader
from attnkit.kvcache import apply_variant, bytes_per_token, cache_dtype
from attnkit.ops.mla import KEY_WEIGHTS, RESIDUALS, VALUE_WEIGHTS, MLAOptions, MLAShape
from attnkit.ops.qknorm_fold import fit_fold, folded_weights
from attnkit.runtime.attention import replace_output_once
from attnkit.runtime.calibrate import attention_module_name, calibrate
from attnkit.runtime.generate import cache_check
from attnkit.runtime.streaming import load_for_calibration
from attnkit.units import check_bounds

#: Families whose attention maps onto DeepseekV3 (the rest are refused with the reason in REFUSED).
SUPPORTED = ("llama", "mistral", "qwen2", "gemma", "qwen3")
#: What a refused family can do instead: convert gqa|mqa keeps the family's own stock architecture.
INSTEAD = "`attnkit convert gqa|mqa` shrinks its cache in its own stock architecture"
REFUSED = {
    "olmo2": "QK-norm over the full projection width is not linear in the input and DeepseekV3 has no such norm",
    "gemma2": "attention logit soft-capping and post-attention/post-MLP norms have no DeepseekV3 counterpart",
    "gemma3": "per-head QK-norm and post-attention/post-MLP norms have no DeepseekV3 counterpart",
    "phi3": "partial rotary and a fused qkv/gate_up layout are not converted",
}
ROPE_TYPES = ("default", "linear", "llama3")  # frequency rules that depend only on the frequency value
ATTN_ROLES = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")


@dataclass(kw_only=True)
class MLARequest(RewriteRequest):
    """convert mla: the cache budget (R and P, or a fraction) and the factorization options."""

    kv_lora_rank: int | None = None  # R: cached latent values per token per layer (incl. the norm channel)
    rope_dim: int | None = None  # P
    kv_budget: float | None = None  # fraction of the source's KV elements per token
    sequential: bool = True
    options: MLAOptions = field(default_factory=MLAOptions)
    latent_norm: str = "auto"  # auto | anchor | span (engine-safe, attnkit.ops.latent_norm) | bias (transformers)
    engine: str = "any"  # serving engines the output must run in (attnkit.engines.targets)


LATENT_NORMS = ("auto", "anchor", "span", "bias")


@dataclass
class MLASource(Source):
    """The checked source, its layer shape and RoPE parameters, and the route the conversion takes."""

    shape: MLAShape  # latent_rank = R - 1 (R cached latent values per token and layer), rope_dim = P
    layer_names: list[dict]  # per layer: role -> tensor name
    rope: dict  # the source's rope_parameters (rope_type, rope_theta, ...)
    q_lora: bool  # the query goes through q_a_proj / q_b_proj
    warnings: list[str]

    @property
    def rank(self) -> int:
        return self.shape.latent_rank + 1

    @property
    def augmented(self) -> bool:
        """Whether q, k or v carry a bias (rows then act on [x; 1])."""
        return any(r in self.layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))


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
    """(R, P) from --kv-budget (snapped to a shape the --engine kernels take) or --kv-lora-rank/--rope-dim."""

    d = spec.head_dim
    source = 2 * spec.num_kv_heads * d
    shapes = mla_shapes(req.engine)
    if req.kv_budget is not None:
        if req.kv_lora_rank is not None or req.rope_dim is not None:
            raise UsageError("give either --kv-budget or --kv-lora-rank with --rope-dim, not both")
        if not 0 < req.kv_budget < 1:
            raise UsageError(f"--kv-budget must be a fraction between 0 and 1, got {req.kv_budget}")
        total = int(round(req.kv_budget * source))
        if total < 4:
            raise UsageError(f"--kv-budget {req.kv_budget} leaves {total} cached values per token; need at least 4")
        if shapes is None:
            rank, rope = budget_split(total, d)
        else:
            fitting = [s for s in shapes if sum(s) <= total]
            if not fitting:
                smallest = min(shapes, key=sum)
                raise UsageError(
                    f"--engine {req.engine}: its MLA kernels take only "
                    f"{', '.join(f'{r}+{p}' for r, p in shapes)} cached values per token, and "
                    f"--kv-budget {req.kv_budget} allows {total} of the source's {source}; the "
                    f"smallest needs --kv-budget {sum(smallest) / source:.3g}"
                )
            rank, rope = max(fitting, key=sum)
    else:
        if req.kv_lora_rank is None or req.rope_dim is None:
            raise UsageError("give --kv-lora-rank and --rope-dim, or --kv-budget")
        rank, rope = req.kv_lora_rank, req.rope_dim
        if shapes is not None and (rank, rope) not in shapes:
            raise UsageError(
                f"--engine {req.engine}: its MLA kernels take "
                f"{', '.join(f'--kv-lora-rank {r} --rope-dim {p}' for r, p in shapes)}, "
                f"not {rank}+{rope}"
            )
    bias_route = req.latent_norm == "bias"
    top_rope = d if bias_route else max(d, 64)
    if rope < 2 or rope % 2 or rope > top_rope:
        raise UsageError(
            f"--rope-dim must be even and between 2 and {top_rope} (head dim {d}"
            f"{'' if bias_route else '; more pads the RoPE key up to 64'}), got {rope}"
        )
    top = max_rank(spec, augmented) if bias_route else 8192
    if rank < 2 or rank > top:
        raise UsageError(
            f"--kv-lora-rank must be between 2 and {top}"
            f"{' (rank of the stacked keys and values + 1)' if bias_route else ''}, got {rank}"
        )
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


def source_freqs(src: MLASource):
    """The source's rotary frequencies [D/2] (radians per token), as its transformers class computes them."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = src.shape.head_dim
    if src.rope["rope_type"] == "default":
        return float(src.rope["rope_theta"]) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cfg = AutoConfig.from_pretrained(str(src.root))
    cfg.head_dim = d
    inv_freq, _ = ROPE_INIT_FUNCTIONS[src.rope["rope_type"]](cfg, "cpu")
    return inv_freq.to(torch.float64)


def check_request(req: MLARequest) -> MLASource:
    """Validate family, ranks, files and target without reading tensors; one-line errors."""
    if not req.calib and not req.dry_run:
        raise UsageError("convert mla needs calibration text: pass --calib FILE")
    _check_options(req.options)
    _check_route(req)
    check_rewrite(req)

    def check(arch, spec, _config) -> None:  # on a GGUF file's header config: before dequantizing
        if arch.family in REFUSED or arch.family not in SUPPORTED:
            why = REFUSED.get(arch.family) or _unsupported_reason(arch)
            raise AttnkitError(
                f"{arch.family} cannot be converted to MLA: {why}; supported: {', '.join(SUPPORTED)}; {INSTEAD}"
            )
        if spec.partial_rotary_factor != 1.0:
            raise AttnkitError(f"{req.model}: partial rotary embeddings are not converted")
        _ranks(req, spec, augmented=True)  # the loosest bounds; checked again below once the biases are known

    src = open_source(req.model, "convert", check)
    spec, arch, prefix = src.spec, src.arch, src.prefix
    rope = _rope_parameters(src.ckpt)
    if rope["rope_type"] not in ROPE_TYPES:
        raise AttnkitError(
            f"{req.model}: rope_type {rope['rope_type']!r} depends on the rotary width; "
            f"convertible: {', '.join(ROPE_TYPES)}"
        )
    layer_names = []
    for layer in range(spec.num_layers):
        roles = {r: arch.tensor_name(r, layer, prefix) for r in ATTN_ROLES}
        roles = {r: n for r, n in roles.items() if n in src.names}
        missing = [r for r in ("q", "k", "v", "o") if r not in roles]
        if missing:
            raise AttnkitError(f"{req.model}: tensor {arch.tensor_name(missing[0], layer, prefix)!r} not found")
        layer_names.append(roles)
    augmented = any(r in layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))
    rank, rope_dim = _ranks(req, spec, augmented)
    shape = MLAShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, rank - 1, rope_dim)
    mla_src = MLASource(**src.fields(), shape=shape, layer_names=layer_names, rope=rope, q_lora=False, warnings=[])
    _check_engine(req, mla_src)
    return mla_src


def _unsupported_reason(arch) -> str:
    """Why a family outside SUPPORTED and REFUSED is not converted, from its architecture data."""
    if arch.qkv_layout == "mla":
        return "its attention is MLA already"
    if arch.mlp == "moe":
        return "its mixture-of-experts MLPs are not mapped onto DeepseekV3's experts (dense MLPs only)"
    if "sinks" in arch.tensors:
        return "attention sinks have no DeepseekV3 counterpart"
    return (
        f"{arch.qkv_layout} attention with {arch.position} positions is not an MHA/GQA RoPE decoder this "
        "converter maps onto DeepseekV3"
    )


def _check_route(req: MLARequest) -> None:

    if req.engine not in TARGETS:
        raise UsageError(f"--engine must be one of {', '.join(TARGETS)}, got {req.engine!r}")
    if req.latent_norm not in LATENT_NORMS:
        raise UsageError(f"--latent-norm must be one of {', '.join(LATENT_NORMS)}, got {req.latent_norm!r}")
    if req.latent_norm == "bias" and req.engine not in ("any", "transformers"):
        raise UsageError(
            f"--latent-norm bias writes bias tensors that {req.engine} has no slot for; use --latent-norm auto"
        )


def _check_engine(req: MLARequest, src: MLASource) -> None:
    """What the --engine target needs of the source (one-line refusals), its q_lora choice and its warnings."""

    spec = src.spec
    if req.latent_norm == "bias":
        src.q_lora = "q_bias" in src.layer_names[0]
        src.warnings.append(
            "--latent-norm bias: kv_a_proj_with_mqa and o_proj get bias tensors that llama.cpp, "
            "vLLM and SGLang drop (vLLM without a word): this output is right in transformers only"
        )
        return
    src.q_lora = needs_q_lora(req.engine, spec.num_layers)
    if engine_safe(req.engine):
        act = _activation(src.config)
        if act != "silu":
            raise AttnkitError(
                f"{req.model}: MLP activation {act!r}; the engines' DeepSeek MLPs are silu only "
                "(pass --engine transformers for an output that only transformers runs)"
            )
        if src.rope["rope_type"] != "default":
            raise AttnkitError(
                f"{req.model}: rope_type {src.rope['rope_type']!r}; vLLM and SGLang read any "
                "non-default DeepSeek RoPE as YaRN (pass --engine transformers for an output that "
                "only transformers runs)"
            )
    values = src.rank + src.shape.rope_dim
    source = 2 * spec.num_kv_heads * spec.head_dim
    if values > source:
        src.warnings.append(f"the cache grows: {values} values per token and layer against the source's {source}")
    if src.shape.rope_dim > spec.head_dim:
        src.warnings.append(
            f"RoPE key padded from the head dim {spec.head_dim} to {src.shape.rope_dim} dims (zero rows)"
        )
    if src.rank > max_rank(spec, src.augmented):
        src.warnings.append(
            f"latent padded: the source's keys and values have rank "
            f"{max_rank(spec, src.augmented) - 1}; the extra channels steady the latent norm"
        )


def _activation(config: dict) -> str | None:
    """The MLP activation transformers runs: the config's, else its config class's default (a config may leave
    it out, as it may any field with a default)."""
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act is None and config.get("model_type"):
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**config)
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    return act


def _check_options(o: MLAOptions) -> None:
    for value, allowed, flag in (
        (o.key_weight, KEY_WEIGHTS, "--key-weight"),
        (o.value_weight, VALUE_WEIGHTS, "--value-weight"),
        (o.residual, RESIDUALS, "--residual"),
    ):
        if value not in allowed:
            raise UsageError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if not o.key_balance > 0:
        raise UsageError(f"--key-balance must be positive, got {o.key_balance}")
    check_bounds("--o-refit", o.o_refit, 0)
    check_bounds("--shrink", o.shrink, 0, 1)


def _layer_weights(reader, roles: dict) -> dict:
    return {role: reader.get(name) for role, name in roles.items()}


def input_gamma(src: MLASource, weight):
    """The scale input_layernorm applies (Gemma stores w and applies 1 + w), float64 [n]."""
    import torch

    gamma = weight.to(torch.float64) + src.arch.norm_offset
    if bool((gamma.abs() < 1e-12).any()):
        raise AttnkitError(
            f"{src.ref}: input_layernorm has zero weights, which cannot be folded into the "
            "projections; use --latent-norm bias (transformers only)"
        )
    return gamma


def _calibrate_and_convert(req: MLARequest, src: MLASource, config, spill, expected: dict) -> tuple[list, dict]:
    """One pass over the calibration windows; each layer is converted when reached, its tensors put in `spill`
    (attnkit.commands.convert.layer_spill) under their full names."""
    import torch

    loaded = load_for_calibration(str(src.root), req.device)  # decoder layers streamed when possible
    windows = calib_windows(loaded.tokenizer, req)
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(src.spec.num_layers)]
    written = target_attention_names(expected, src.spec.num_layers)  # model.layers.{i}.self_attn of the target
    rows: list = [None] * src.spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:
        dtype = reader.get(src.layer_names[0]["o"]).dtype
        freqs = source_freqs(src)

        def on_layer(layer: int, hidden, rope=None, scaling=None):
            weights = _layer_weights(reader, src.layer_names[layer])
            gamma = scale = None
            if req.latent_norm != "bias":
                weights = without_o_bias(src, weights)
                gamma = input_gamma(src, reader.get(src.tensor("input_norm", layer)))
                scale = (1.0 / gamma).to(torch.float32)
            plain, fold = weights, None
            if "q_norm" in weights:  # per-head QK-norm: the fold's constants, fitted on this layer's inputs
                if rope is None or scaling is None:
                    raise AttnkitError("folding QK-norm needs the source's rotary embedding and softmax scale")
                weights = {**weights, **_norm_gains(src, weights)}
                gains = (weights["q_norm"], weights["k_norm"])
                fold = fit_fold(hidden, weights, gains, config.rms_norm_eps, rope, scaling, src.shape.head_dim)
                plain = folded_weights(weights, fold, gains, src.shape.head_dim)
            tensors, rows[layer] = convert_one(
                src, plain, hidden, gamma, freqs, req.options, dtype, req.latent_norm, config.rms_norm_eps
            )
            if fold is not None:
                rows[layer].update(_fold_row(fold))
            if req.options.o_refit > 0:
                if rope is None or scaling is None:
                    raise AttnkitError("o_proj refit needs the source's rotary embedding and softmax scale")
                tensors["o_proj.weight"] = refit_o_proj(
                    config,
                    layer,
                    tensors,
                    weights,
                    hidden,
                    rope,
                    scaling,
                    src.shape,
                    req.options.o_refit,
                    loaded.device,
                    scale,
                    norm_eps=config.rms_norm_eps,
                )
            rows[layer]["layer"] = layer
            named = {f"{written[layer]}.{name}": t for name, t in tensors.items()}
            unknown = [full for full in named if full not in expected]
            if unknown:
                raise AttnkitError(f"internal: {unknown[0]} is not a DeepseekV3 tensor")
            spill.put(layer, named)
            if req.sequential:
                replace_output_once(
                    loaded.model.get_submodule(modules[layer]), config, layer, tensors, loaded.device, scale
                )
            return None

        calibrate(loaded.model, windows, modules, on_layer)
    info = calib_info(req, windows, sequential=req.sequential)
    return [{"layer": r.pop("layer"), **r} for r in rows], info


def _norm_gains(src: MLASource, weights: dict) -> dict:
    """q_norm and k_norm as the scales they apply (offset + stored weight), float64 [D]."""
    import torch

    return {role: weights[role].to(torch.float64) + src.arch.norm_offset for role in ("q_norm", "k_norm")}


def _fold_row(fold) -> dict:
    """A layer's QK-norm fold in its report row (attnkit.ops.qknorm_fold)."""
    return {
        "qk_norm_fold_kl": float(fold.kl.mean()),
        "qk_norm_c_q": fold.c_q.tolist(),
        "qk_norm_c_k": fold.c_k.tolist(),
        "qk_norm_dropped_pairs": int(fold.dropped.sum()) // 2,
        "qk_norm_rms_spread": [fold.spread_q, fold.spread_k],
    }


def _copy_rest(reader, src: MLASource, writer, expected: dict, fold_input_norm: bool) -> None:
    """Every non-attention tensor under its DeepseekV3 name (norms of a family that stores w and applies
    offset + w, Gemma: offset + w; Gemma's embeddings x sqrt(n)), the output head written out whenever the target
    has one; fold_input_norm: input norm weights are ones (the engine route folds them into the attention
    projections). Names by role from the architecture registry (attnkit/archs/data)."""
    import torch

    attention = {n for roles in src.layer_names for n in roles.values()}
    input_norms = {src.tensor("input_norm", i) for i in range(src.spec.num_layers)}
    norms = src.arch.norm_names(src.spec.num_layers, src.prefix)
    gemma = src.arch.family == "gemma"
    embed_name, head = src.tensor("embed", None), TARGET.head_name
    for name in reader.names():
        if name in attention:
            continue
        if name not in expected:
            raise AttnkitError(f"{src.ref}: tensor {name!r} has no place in a DeepseekV3 checkpoint")
        t = reader.get(name)
        if fold_input_norm and name in input_norms:
            t = torch.ones_like(t)
        elif src.arch.norm_offset and name in norms:
            t = (t.to(torch.float32) + src.arch.norm_offset).to(t.dtype)
        if name == embed_name and head in expected and src.arch.head_name not in reader.names():
            writer.add(head, t)  # a tied source head, written out for engines that never tie
        if gemma and name == embed_name:
            t = t * torch.tensor(src.spec.hidden_size**0.5, dtype=t.dtype)  # Gemma's normalizer, in its dtype
        writer.add(name, t)


def _kv_bytes(src: MLASource, rank: int) -> dict:

    dtype = cache_dtype(str(src.config.get("torch_dtype") or src.config.get("dtype") or "bfloat16"))
    after = apply_variant(src.spec, f"mla:{rank}+{src.shape.rope_dim}")
    return {
        "dtype": dtype.name,
        "before": bytes_per_token(src.spec, dtype),
        "after": bytes_per_token(after, dtype),
        "elements_before": 2 * src.spec.num_kv_heads * src.spec.head_dim,
        "elements_after": rank + src.shape.rope_dim,
    }


def _parameters(req: MLARequest, src: MLASource) -> dict:
    o = req.options
    return {
        "kv_lora_rank": src.shape.latent_rank + 1,
        "latent_rank": src.shape.latent_rank,
        "rope_dim": src.shape.rope_dim,
        "rope_pairs": src.shape.pairs,
        "kv_budget": req.kv_budget,
        "calib": list(req.calib),
        "calib_tokens": req.calib_tokens,
        "calib_seq_len": req.calib_seq_len,
        "sequential": req.sequential,
        "key_weight": o.key_weight,
        "value_weight": o.value_weight,
        "residual": o.residual,
        "fade_window": o.window,
        "key_balance": o.key_balance,
        "ridge": o.ridge,
        "o_refit": o.o_refit,
        "whiten": o.whiten,
        "shrink": o.shrink,
        "latent_norm": req.latent_norm,
        "engine": req.engine,
        "q_lora_rank": (src.spec.hidden_size + int(req.latent_norm == "bias")) if src.q_lora else None,
        "max_shard_bytes": req.max_shard_bytes,
    }


def convert_mla(req: MLARequest, log=lambda message: None) -> dict:
    """Run (or with dry_run, plan) the conversion; returns the report (see docs/convert-mla.md).
    `log(message)` hears progress once the request has been checked."""

    started = time.perf_counter()
    src = check_request(req)
    rank = src.shape.latent_rank + 1
    report = {
        **report_head(req, src.spec.model_type),
        "num_layers": src.spec.num_layers,
        "num_heads": src.spec.num_heads,
        "kv_heads": src.spec.num_kv_heads,
        "head_dim": src.spec.head_dim,
        "kv_lora_rank": rank,
        "rope_dim": src.shape.rope_dim,
        "kv_bytes_per_token": _kv_bytes(src, rank),
        "parameters": _parameters(req, src),
        "calibration": None,
        "layers": [],
        "eval": None,
        "peak_rss_bytes": None,
        "notes": _notes(req, src),
        "warnings": list(src.warnings),
    }
    if req.dry_run:
        return timed(report, started)
    log("calibrating and converting layer by layer ...")
    config = target_config(src, bias_route=req.latent_norm == "bias")
    expected = expected_shapes(config)

    def weights(writer) -> dict:
        with LayerSpill(req.out) as spill:  # converted layers wait on disk, not in the writer's shard buffer
            report["layers"], report["calibration"] = _calibrate_and_convert(req, src, config, spill, expected)
            for layer in range(src.spec.num_layers):
                for name, t in spill.take(layer).items():
                    writer.add(name, t)
        with LazyReader(src.ckpt.weight_files) as reader:
            _copy_rest(reader, src, writer, expected, fold_input_norm=req.latent_norm != "bias")
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return expected

    def score(folder) -> dict:
        log("scoring source and result on the --eval text ...")
        report["eval"] = score_rewrite(
            req, src.root, folder, extra=lambda result: {"cache": cache_check(result.model)}
        )["eval"]
        return {"eval": report["eval"]}

    write_checkpoint(
        req,
        src,
        "convert mla",
        config=config,
        weights=weights,
        body=lambda: {
            k: report[k] for k in ("parameters", "calibration", "kv_bytes_per_token", "layers", "notes", "warnings")
        },
        score=score if req.scored else None,
    )
    return timed(report, started)


def _notes(req: MLARequest, src: MLASource) -> list[str]:
    notes = []
    if req.latent_norm == "bias":
        if src.q_lora:
            notes.append(
                "q bias carried through the q_lora path (q_lora_rank = hidden + 1, RMSNorm made linear "
                "by a constant channel); all-zero q biases use a plain q_proj"
            )
    else:
        if src.q_lora:
            notes.append(
                f"query through q_a_proj = identity (q_lora_rank = hidden = {src.spec.hidden_size}): "
                f"llama.cpp's deepseek2 reads q_lora unless a model has 26 or 27 layers"
            )
        if src.augmented:
            notes.append(
                "q and RoPE-key biases ride on the anchor a.x ~ 1 (engines have no bias slot); the "
                "latent's own constants come out exact"
            )
    if any(w is not None for w in src.spec.layer_windows):
        notes.append(
            "the source's sliding window is dropped: DeepseekV3 attends to the full context "
            "(identical up to the window length)"
        )
    if src.spec.qk_norm == "per_head":
        notes.append(
            "per-head QK-norm approximated: each head's 1/rms(q) and 1/rms(k) per token replaced by constants "
            "fitted on the calibration text (least attention KL; qk_norm_fold_kl per layer), the norm gains "
            "folded into the projections (docs/convert-mla.md)"
        )
    if src.arch.family == "gemma":
        notes.append(
            "Gemma: norm weights stored as 1 + w, embeddings pre-multiplied by sqrt(hidden) and untied from lm_head"
        )
    return notes
