"""`convert mla`'s request and what is checked before any tensor is read: the family (SUPPORTED, or REFUSED with the
reason), the RoPE type, the ranks (R and P from --kv-budget snapped to a shape the --engine kernels take, or
--kv-lora-rank/--rope-dim), the route (--latent-norm, --engine) and what the engine target needs of the source.
`check_request` returns the MLASource the conversion runs on."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

from attnkit.commands.convert.mla_target import DEFAULT_TARGET, SUPPORTED, TARGETS, MLATarget
from attnkit.commands.rewrite import MLA_CALIB_TOKENS, RewriteRequest, check_rewrite, check_texts
from attnkit.engines.targets import TARGETS as ENGINE_TARGETS
from attnkit.engines.targets import engine_safe, mla_shapes, needs_q_lora
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.source import Source, open_source
from attnkit.kvcache import layer_tokens
from attnkit.ops.mla import KEY_WEIGHTS, RESIDUALS, ROPE_PAIRS, VALUE_WEIGHTS, MLAOptions, MLAShape
from attnkit.units import check_bounds

#: Families outside SUPPORTED (attnkit.commands.convert.mla_target) are refused with the reason in REFUSED.
#: What a refused family can do instead: convert gqa|mqa keeps the family's own stock architecture.
INSTEAD = "`attnkit convert gqa|mqa` shrinks its cache in its own stock architecture"
REFUSED = {
    "olmo2": "QK-norm over the full projection width is not linear in the input and DeepseekV3 has no such norm",
    "gemma2": "attention logit soft-capping and post-attention/post-MLP norms have no DeepseekV3 counterpart",
    "gemma3": "per-head QK-norm and post-attention/post-MLP norms have no DeepseekV3 counterpart (pass --target "
    "gemma3-mla for attnkit's Gemma 3 layout with MLA attention, which only transformers runs)",
    "phi3": "partial rotary and a fused qkv/gate_up layout are not converted",
}
ROPE_TYPES = ("default", "linear", "llama3")  # frequency rules that depend only on the frequency value
ATTN_ROLES = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")


@dataclass(kw_only=True)
class MLARequest(RewriteRequest):
    """convert mla: the cache budget (R and P, or a fraction) and the factorization options."""

    calib_tokens: int = MLA_CALIB_TOKENS
    kv_lora_rank: int | None = None  # R: cached latent values per token per layer (incl. the norm channel)
    rope_dim: int | None = None  # P
    kv_budget: float | None = None  # fraction of the source's KV elements per token
    sequential: bool = True
    options: MLAOptions = field(default_factory=MLAOptions)
    latent_norm: str = "auto"  # auto | anchor | span (engine-safe, attnkit.ops.latent_norm) | bias (transformers)
    engine: str = "any"  # serving engines the output must run in (attnkit.engines.targets)
    target: str = DEFAULT_TARGET  # the output's layout (attnkit.commands.convert.mla_target.TARGETS)
    sliding_layers: str = "auto"  # keep | convert | auto (keep where the target keeps windows): SLIDING_LAYERS
    layer_shapes: dict[int, tuple[int, int]] = field(default_factory=dict)  # --layer-shape: layer -> its own (R, P)
    layer_budget: str = "auto"  # auto | even: how --kv-budget is shared (attnkit.commands.convert.mla_layer_budget)


#: --sliding-layers: `keep` writes a source's sliding-window layers unchanged (their cache is bounded by the window)
#: and spends --kv-budget on its global layers; `convert` converts every layer; `auto` keeps them where the target
#: keeps windows and the source has global layers too.
SLIDING_LAYERS = ("auto", "keep", "convert")


#: --layer-budget: `auto` measures each converted layer and trades shares (attnkit.commands.convert.mla_layer_budget),
#: `even` gives every converted layer the same share.
LAYER_BUDGETS = ("auto", "even")

LATENT_NORMS = ("auto", "anchor", "span", "bias")  # and "none", which a target no engine serves sets


@dataclass(frozen=True)
class Route:
    """How the output is written, chosen once from the request (and, where `why` says so, from measuring this
    model): the engines it must load in (attnkit.engines.targets) and its latent norm (LATENT_NORMS, or none for
    a target no engine serves, which has none)."""

    engine: str
    latent_norm: str
    why: str | None = None

    @property
    def bias(self) -> bool:
        """The bias route: exact constants through bias tensors, transformers only."""
        return self.latent_norm == "bias"

    @property
    def folds_input_norm(self) -> bool:
        """The engine route: no bias tensors, input_layernorm's weight folded into the projections."""
        return self.latent_norm not in ("bias", "none")


@dataclass
class MLASource(Source):
    """The checked source, its layer shape and RoPE parameters, and the route the conversion takes."""

    shape: MLAShape  # latent_rank = R - target.besides_latent (R: cached latent values per token), rope_dim = P
    layer_names: list[dict]  # per layer: role -> tensor name
    rope: dict  # the source's rope_parameters (rope_type, rope_theta, ...), or per layer type (Gemma 3)
    q_lora: bool  # the query goes through q_a_proj / q_b_proj
    warnings: list[str]
    route: Route
    target: MLATarget = TARGETS[DEFAULT_TARGET]
    hf_config: object = None  # the source's transformers config, read once (check_request)
    layer_types: list[str] | None = None  # per layer (sliding_attention / full_attention) where the config has them
    plain_layers: tuple[int, ...] = ()  # layers written unchanged (--sliding-layers keep)
    layer_shapes: dict[int, MLAShape] = field(default_factory=dict)  # converted layers of their own shape
    layer_budget: dict | None = None  # what --layer-budget auto measured and chose (mla_layer_budget)

    def for_layer(self, layer: int) -> MLASource:
        """This source as one layer converts: at its own shape (--layer-shape, --layer-budget auto) where it has
        one."""
        own = self.layer_shapes.get(layer)
        return self if own is None else dataclasses.replace(self, shape=own)

    def own_shapes(self) -> dict[str, list[int]]:
        """The report's layer_shapes: layer -> [R, P] of the layers of their own shape."""
        return {str(i): [self.for_layer(i).rank, own.rope_dim] for i, own in sorted(self.layer_shapes.items())}

    @property
    def converted_layers(self) -> list[int]:
        """The layers converted to MLA."""
        return [i for i in range(self.spec.num_layers) if i not in self.plain_layers]

    @property
    def rank(self) -> int:
        """Cached latent values per token and layer: the latent and what the target caches beside it (its norm
        channel, or one key RMS factor per KV head)."""
        return self.shape.latent_rank + self.target.besides_latent(self.spec)

    @property
    def augmented(self) -> bool:
        """Whether q, k or v carry a bias (rows then act on [x; 1])."""
        return any(r in self.layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))


#: A RoPE pair that turns by at least ROTATION_RADIANS within ROTATION_CONTEXT tokens keeps its rotation in the
#: shared RoPE key where the budget allows (budget_split): made position-free, it would be wrong at the distances the
#: self-check and the long-context benchmarks hold a rewrite to (docs/convert-mla.md, "RoPE dims for slow bases").
ROTATION_RADIANS = 1.0
ROTATION_CONTEXT = 4096
#: budget_split rounds the RoPE key of the rotating pairs up to a multiple of this.
ROPE_STEP = 16


def rope_pair_choice(options: MLAOptions, target: MLATarget) -> str:
    """--rope-pairs with auto resolved by the target: rotation where its RoPE key turns at any of the source's
    frequencies (the pairs whose lost rotation would cost most, attnkit.ops.mla.rotation_cost), else fastest."""
    if options.rope_pairs != "auto":
        return options.rope_pairs
    return "rotation" if target.any_rope_pairs else "fastest"


def key_balance_choice(options: MLAOptions, target: MLATarget) -> float:
    """--key-balance, or the target's default where it was not given."""
    return target.key_balance if options.key_balance is None else options.key_balance


def center_keys_choice(options: MLAOptions, target: MLATarget) -> bool:
    """--center-keys / --no-center-keys, or the target's default where neither was given."""
    return target.center_keys if options.center_keys is None else options.center_keys


def layer_options(options: MLAOptions, target: MLATarget, window: int | None) -> MLAOptions:
    """The options one layer converts with: the RoPE pair choice (rope_pair_choice), the key balance
    (key_balance_choice), whether its keys are centered (center_keys_choice) and the distances its rotation cost
    counts: ROTATION_CONTEXT tokens, or the layer's sliding window where it is shorter."""
    context = min(ROTATION_CONTEXT, window) if window else ROTATION_CONTEXT
    return dataclasses.replace(
        options,
        rope_pairs=rope_pair_choice(options, target),
        key_balance=key_balance_choice(options, target),
        center_keys=center_keys_choice(options, target),
        rotation_context=context,
    )


def rotating_pairs(freqs) -> int:
    """How many of the source's RoPE pairs (frequencies [D/2], radians per token, fastest first) turn by at least
    ROTATION_RADIANS within ROTATION_CONTEXT tokens."""
    return int((freqs * ROTATION_CONTEXT >= ROTATION_RADIANS).sum())


def budget_split(total: int, head_dim: int, rotating: int = 0) -> tuple[int, int]:
    """(R, P) for `total` cached values per token per layer: P = the largest power of two <= total / 3 and
    <= D (at least 2; measured on SmolLM2, docs/ablations.md: RoPE dims help while the latent keeps about two
    thirds of the budget), widened to hold the `rotating` fastest pairs (rotating_pairs; 2 dims each, rounded up to
    ROPE_STEP, at most total / 3) where total / 3 holds them all (a partial widening is not measured); R = total - P."""
    third = min(head_dim, total // 3)
    rope = 2
    while rope * 2 <= third:
        rope *= 2
    if 2 * rotating <= third:
        need = min(head_dim, -(-2 * rotating // ROPE_STEP) * ROPE_STEP)
        rope = max(rope, min(need, third - third % 2))
    return total - rope, rope


def max_rank(spec, augmented: bool) -> int:
    """Largest useful R: the rank of the stacked keys and values (2*Hkv*D, at most the input width) + 1."""
    return min(2 * spec.num_kv_heads * spec.head_dim, spec.hidden_size + int(augmented)) + 1


def plain_layers(req: MLARequest, target: MLATarget, spec, context: int) -> tuple[int, ...]:
    """The layers --sliding-layers keeps unchanged: the sliding-window ones, where the target keeps windows and the
    source has global layers too and a longest context (`context`, what --kv-budget is counted at) (`auto`,
    `keep`); none with `convert`."""
    if req.sliding_layers not in SLIDING_LAYERS:
        raise UsageError(f"--sliding-layers must be one of {', '.join(SLIDING_LAYERS)}, got {req.sliding_layers!r}")
    sliding = tuple(i for i, w in enumerate(spec.layer_windows) if w is not None)
    usable = target.keeps_windows and 0 < len(sliding) < spec.num_layers and context > 0
    if req.sliding_layers == "keep" and not usable:
        why = (
            f"--target {target.name} drops sliding windows"
            if not target.keeps_windows
            else "the source has no sliding-window layers beside global ones (and a longest context)"
        )
        raise UsageError(f"--sliding-layers keep: {why}")
    return sliding if usable and req.sliding_layers != "convert" else ()


def budget_values(budget: float, spec, plain: tuple[int, ...], context: int, named: dict | None = None) -> int:
    """Cached values per token in each converted layer for a whole cache of `budget` times the source's at
    `context` tokens: every layer at that share, or where `plain` layers stay as they are (sliding layers, whose
    cache the window bounds) the converted layers take what those leave; `named`: converted layers that cache
    their own values per token (layer -> values, --layer-shape), the others share what they leave."""
    named = named or {}
    width = 2 * spec.num_kv_heads * spec.head_dim  # a source layer's values per token
    slots = layer_tokens(spec, context) if plain else [1] * len(spec.layer_windows)  # a sliding layer: its window
    given = sum(slots[i] * values for i, values in named.items()) + sum(slots[i] for i in plain) * width
    rest = sum(slot for i, slot in enumerate(slots) if i not in plain and i not in named)
    if not plain:
        return int(round((budget * sum(slots) * width - given) / rest))
    return int((budget * sum(slots) * width - given) // rest)


def _ranks(
    req: MLARequest,
    target: MLATarget,
    route: Route,
    spec,
    augmented: bool,
    rotating: int = 0,
    plain: tuple[int, ...] = (),
    context: int = 0,
) -> tuple[int, int]:
    """(R, P) from --kv-budget (snapped to a shape the --engine kernels take; `rotating`: budget_split's; `plain`:
    the layers kept unchanged, the budget counted at `context` tokens then) or --kv-lora-rank/--rope-dim."""

    d = spec.head_dim
    source = 2 * spec.num_kv_heads * d
    shapes = mla_shapes(route.engine)
    if req.kv_budget is not None:
        if req.kv_lora_rank is not None or req.rope_dim is not None:
            raise UsageError("give either --kv-budget or --kv-lora-rank with --rope-dim, not both")
        if not 0 < req.kv_budget < 1:
            raise UsageError(f"--kv-budget must be a fraction between 0 and 1, got {req.kv_budget}")
        if req.layer_shapes and all(i in req.layer_shapes for i in range(spec.num_layers) if i not in plain):
            raise UsageError("--layer-shape names every converted layer: leave --kv-budget out, or leave a layer to it")
        named = {layer: rank + rope for layer, (rank, rope) in req.layer_shapes.items()}
        total = budget_values(req.kv_budget, spec, plain, context, named)
        if total < 4:
            kept = f" in each global layer once the sliding layers keep theirs at {context:,} tokens" if plain else ""
            kept += " and the --layer-shape layers theirs" if named else ""
            instead = "; give more, or --sliding-layers convert" if plain else ""
            raise UsageError(
                f"--kv-budget {req.kv_budget} leaves {total} cached values per token{kept}; need at least 4{instead}"
            )
        if shapes is None:
            rank, rope = budget_split(total, d, rotating)
        else:
            fitting = [s for s in shapes if sum(s) <= total]
            if not fitting:
                smallest = min(shapes, key=sum)
                raise UsageError(
                    f"--engine {route.engine}: its MLA kernels take only "
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
                f"--engine {route.engine}: its MLA kernels take "
                f"{', '.join(f'--kv-lora-rank {r} --rope-dim {p}' for r, p in shapes)}, "
                f"not {rank}+{rope}"
            )
    bias_route = route.bias
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


def _rope_parameters(ckpt, cfg) -> tuple[dict, list[str] | None]:
    """(the source's rope parameters as transformers reads them (rope_theta, rope_type, scaling keys; `cfg`: its
    transformers config), or a dict of them per layer type (Gemma 3); the config's layer types or None)."""
    params = copy.deepcopy(dict(getattr(cfg, "rope_parameters", None) or {}))  # cfg stays as read
    layer_types = list(getattr(cfg, "layer_types", None) or []) or None
    nested = bool(layer_types) and all(isinstance(params.get(t), dict) for t in set(layer_types))
    for part in [params[t] for t in set(layer_types)] if nested else [params]:
        part.setdefault("rope_type", "default")
        if "rope_theta" not in part:
            raise AttnkitError(f"{ckpt.ref}: no rope_theta in the config")
        if part["rope_type"] not in ROPE_TYPES:
            raise AttnkitError(
                f"{ckpt.ref}: rope_type {part['rope_type']!r} depends on the rotary width; "
                f"convertible: {', '.join(ROPE_TYPES)}"
            )
    return params, layer_types


def check_request(req: MLARequest) -> MLASource:
    """Validate family, ranks, files and target without reading tensors; one-line errors."""
    if not req.calib and not req.dry_run:
        raise UsageError("convert mla needs calibration text: pass --calib FILE")
    _check_options(req.options)
    target, route = _check_route(req)
    check_rewrite(req)

    def check(arch, spec, config) -> None:  # on a GGUF file's header config: before dequantizing
        if target.text_only and "text_config" in config:
            raise AttnkitError(f"{req.model}: a multimodal {arch.family}; --target {target.name} converts text models")
        if target is not TARGETS[DEFAULT_TARGET] and arch.family not in target.families:
            raise AttnkitError(
                f"--target {target.name} takes {', '.join(target.families)} sources, not {arch.family}; "
                "leave --target out for the stock DeepseekV3 output"
            )
        if arch.family not in target.families:
            why = REFUSED.get(arch.family) or _unsupported_reason(arch)
            raise AttnkitError(
                f"{arch.family} cannot be converted to MLA: {why}; supported: {', '.join(SUPPORTED)}; {INSTEAD}"
            )
        if spec.partial_rotary_factor != 1.0:
            raise AttnkitError(f"{req.model}: partial rotary embeddings are not converted")
        context = arch.config_value(config, "max_positions") or 0
        plain = plain_layers(req, target, spec, context)
        _check_layer_shapes(req, target, spec, plain)
        _ranks(req, target, route, spec, True, plain=plain, context=context)  # checked again once biases are known

    src = open_source(req.model, "convert", check)
    check_texts(req, src, calibrates=True)
    spec, arch, prefix = src.spec, src.arch, src.prefix
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(src.root))  # read once: the rope, the frequencies, the target's config
    rope, layer_types = _rope_parameters(src.ckpt, hf_config)
    layer_names = []
    for layer in range(spec.num_layers):
        roles = {r: arch.tensor_name(r, layer, prefix) for r in ATTN_ROLES}
        roles = {r: n for r, n in roles.items() if n in src.names}
        missing = [r for r in ("q", "k", "v", "o") if r not in roles]
        if missing:
            raise AttnkitError(f"{req.model}: tensor {arch.tensor_name(missing[0], layer, prefix)!r} not found")
        layer_names.append(roles)
    augmented = any(r in layer_names[0] for r in ("q_bias", "k_bias", "v_bias"))
    rotating = 0
    if target.widens_rope:
        from attnkit.commands.convert.mla_layer import pair_frequencies

        rotating = rotating_pairs(pair_frequencies(hf_config, rope, spec.head_dim))
    context = arch.config_value(src.config, "max_positions") or 0
    plain = plain_layers(req, target, spec, context)
    rank, rope_dim = _ranks(req, target, route, spec, augmented, rotating, plain, context)
    extra = target.besides_latent(spec)  # cached besides the latent proper
    if not target.engines:
        for layer_rank, layer_rope in [(rank, rope_dim), *req.layer_shapes.values()]:
            _check_plain_layout(target, spec, layer_rank, layer_rope, augmented, extra)

    def mla_shape(layer_rank: int, layer_rope: int) -> MLAShape:
        return MLAShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, layer_rank - extra, layer_rope)

    mla_src = MLASource(
        **src.fields(),
        shape=mla_shape(rank, rope_dim),
        layer_names=layer_names,
        rope=rope,
        q_lora=False,
        warnings=[],
        route=route,
        target=target,
        hf_config=hf_config,
        layer_types=layer_types,
        plain_layers=plain,
        layer_shapes={layer: mla_shape(*own) for layer, own in req.layer_shapes.items()},
    )
    _check_engine(req, mla_src)
    return mla_src


def with_route(req: MLARequest, src: MLASource, route: Route) -> MLASource:
    """The source converted by another route (chosen by measuring it: attnkit.commands.convert.mla), with that
    route's q_lora choice and warnings."""
    import dataclasses

    out = dataclasses.replace(src, route=route, q_lora=False, warnings=[])
    _check_engine(req, out)
    return out


def parse_layer_shapes(texts) -> dict[int, tuple[int, int]]:
    """--layer-shape values LAYER=R+P -> {layer: (R, P)}; a layer named twice is refused."""
    shapes: dict[int, tuple[int, int]] = {}
    for text in texts:
        try:
            layer, shape = text.split("=")
            rank, rope = shape.split("+")
            layer, rank, rope = int(layer), int(rank), int(rope)
        except ValueError:
            raise UsageError(f"--layer-shape takes LAYER=R+P (e.g. 11=140+256), got {text!r}") from None
        if layer in shapes:
            raise UsageError(f"--layer-shape names layer {layer} twice")
        shapes[layer] = (rank, rope)
    return shapes


def _check_layer_shapes(req: MLARequest, target: MLATarget, spec, plain: tuple[int, ...]) -> None:
    """--layer-shape: a layout whose layers may differ, converted layers of the model, shapes _ranks would take."""
    if not req.layer_shapes:
        return
    if not target.layer_shapes:
        raise UsageError(
            f"--layer-shape: --target {target.name} gives every layer one shape (the engines read one kv_lora_rank); "
            "--target gemma3-mla takes a shape per layer"
        )
    for layer, (rank, rope) in req.layer_shapes.items():
        if not 0 <= layer < spec.num_layers or layer in plain:
            what = "a layer kept as the source's" if layer in plain else f"not a layer of the {spec.num_layers}"
            raise UsageError(f"--layer-shape {layer}={rank}+{rope}: layer {layer} is {what}")
        if rope < 2 or rope % 2 or rope > spec.head_dim or rank < 2:
            raise UsageError(
                f"--layer-shape {layer}={rank}+{rope}: R must be at least 2 and P even, 2..{spec.head_dim}"
            )


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


def _check_route(req: MLARequest) -> tuple[MLATarget, Route]:
    """The MLATarget --target names and the Route of --engine and --latent-norm, and whether they go together (a
    target no engine serves runs in transformers only and has no latent norm)."""
    target = TARGETS.get(req.target)
    if target is None:
        raise UsageError(f"--target must be one of {', '.join(TARGETS)}, got {req.target!r}")
    if req.layer_budget not in LAYER_BUDGETS:
        raise UsageError(f"--layer-budget must be one of {', '.join(LAYER_BUDGETS)}, got {req.layer_budget!r}")
    if req.options.rope_pairs == "rotation" and not target.any_rope_pairs:
        raise UsageError(
            f"--rope-pairs rotation needs a layout whose RoPE key turns at any frequencies (--target gemma3-mla); "
            f"--target {target.name}'s stock rotary embedding turns at the fastest P/2 only"
        )
    if not target.engines:
        if req.engine not in ("any", "transformers"):
            raise UsageError(f"--target {target.name} runs in transformers only, not in {req.engine}")
        if req.latent_norm != "auto":
            raise UsageError(f"--target {target.name} has no latent norm; leave --latent-norm {req.latent_norm} out")
        return target, Route("transformers", "none")
    if req.engine not in ENGINE_TARGETS:
        raise UsageError(f"--engine must be one of {', '.join(ENGINE_TARGETS)}, got {req.engine!r}")
    if req.latent_norm not in LATENT_NORMS:
        raise UsageError(f"--latent-norm must be one of {', '.join(LATENT_NORMS)}, got {req.latent_norm!r}")
    if req.latent_norm == "bias" and req.engine not in ("any", "transformers"):
        raise UsageError(
            f"--latent-norm bias writes bias tensors that {req.engine} has no slot for; use --latent-norm auto"
        )
    return target, Route(req.engine, req.latent_norm)


def _check_plain_layout(target: MLATarget, spec, rank: int, rope_dim: int, augmented: bool, extra: int) -> None:
    """What a layout no engine serves cannot write: a RoPE key past the head dim (no padding), q/k/v biases (no
    bias route), a latent with no room beside the values cached besides it."""
    if rope_dim > spec.head_dim:
        raise UsageError(f"--target {target.name}: --rope-dim {rope_dim} is past the head dim {spec.head_dim}")
    if augmented:
        raise UsageError(f"--target {target.name}: q/k/v biases are not written")
    if rank <= extra:
        raise UsageError(
            f"--target {target.name}: --kv-lora-rank {rank} leaves no latent beside the {extra} key RMS factors"
        )


def _check_engine(req: MLARequest, src: MLASource) -> None:
    """What the --engine target needs of the source (one-line refusals), its q_lora choice and its warnings."""

    spec, route = src.spec, src.route
    if route.bias:
        src.q_lora = "q_bias" in src.layer_names[0]
        src.warnings.append(
            "--latent-norm bias: kv_a_proj_with_mqa and o_proj get bias tensors that llama.cpp, "
            "vLLM and SGLang drop (vLLM without a word): this output is right in transformers only"
        )
        return
    src.q_lora = needs_q_lora(route.engine, spec.num_layers)
    if engine_safe(route.engine):
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
    kv_rank = max_rank(spec, src.augmented) - 1  # of the stacked keys and values
    if src.shape.latent_rank > kv_rank:
        src.warnings.append(
            f"latent padded: the source's keys and values have rank {kv_rank}; extra channels "
            f"{src.target.padded_latent()}"
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
        (o.rope_pairs, ("auto", *ROPE_PAIRS), "--rope-pairs"),
    ):
        if value not in allowed:
            raise UsageError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if o.key_balance is not None and not (math.isfinite(o.key_balance) and o.key_balance > 0):
        raise UsageError(f"--key-balance must be a positive finite number, got {o.key_balance}")
    check_bounds("--o-refit", o.o_refit, 0)
    check_bounds("--shrink", o.shrink, 0, 1)
