"""`convert gqa`: rewrite a checkpoint with fewer KV heads (mean, first or calibrated merge), streaming.

Flow: resolve and check the source -> (merge, or --calib) calibrate layer by layer -> stream every
tensor from the source shards to new shards, rewriting one layer's attention at a time -> config,
side files, manifest -> check names/shapes/finiteness -> (--eval) score source and result -> rename
the temp folder into place. The source is only read; a failure leaves no output folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.archs.tensors import role_shape
from attnkit.commands.convert.gqa_layer import attention_key_covariance, reference_attention_ok, refit_output
from attnkit.commands.convert.layer_spill import LayerSpill
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.rewrite import (
    RewriteRequest,
    calib_info,
    calib_windows,
    check_rewrite,
    check_texts,
    self_check,
)
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.reader import LazyReader
from attnkit.io.source import Source, open_source
from attnkit.kvcache import bytes_per_token, cache_dtype
from attnkit.ops.gqa import (
    KEY_WEIGHTS,
    KV_ROLES,
    METHODS,
    VALUE_WEIGHTS,
    LayerPlan,
    LayerShape,
    MergeOptions,
    apply_plan,
    expand_layer,
    is_biased,
    plan_layer,
)
from attnkit.progress import phase
from attnkit.runtime.calibrate import attention_module_name, calibrate, input_covariance
from attnkit.runtime.streaming import load_for_calibration
from attnkit.scoring.comparison import compare_checkpoints

ROLE_ORDER = ("q", "q_bias", "k", "k_bias", "v", "v_bias", "qkv", "qkv_bias", "o", "k_norm")


@dataclass(kw_only=True)
class ConvertRequest(RewriteRequest):
    """convert gqa|mqa: the target KV head count and the pooling method."""

    kv_heads: int
    method: str = "mean"
    sequential: bool = False
    options: MergeOptions = field(default_factory=MergeOptions)


@dataclass
class GQASource(Source):
    """The checked source, its layer shape and the tensors the conversion reads."""

    shape: LayerShape
    layer_names: list[dict]  # per layer: role -> tensor name (roles the conversion reads)


def check_request(req: ConvertRequest) -> GQASource:
    """Validate everything that can be checked without reading tensors; one-line errors."""
    if req.method not in METHODS:
        raise UsageError(f"unknown --method {req.method!r}; choose from {', '.join(METHODS)}")
    if req.method == "merge" and not req.calib:
        raise UsageError("--method merge needs calibration text: pass --calib FILE")
    _check_options(req.options)
    if req.kv_heads < 1:
        raise UsageError(f"--kv-heads must be at least 1, got {req.kv_heads}")
    check_rewrite(req)

    def check(arch, spec, _config) -> None:  # on a GGUF file's header config: before dequantizing
        _check_family(arch)
        _check_heads(spec, req.kv_heads)

    src = open_source(req.model, "convert", check)
    check_texts(req, src, calibrates=bool(req.calib))
    spec, arch, prefix = src.spec, src.arch, src.prefix
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    shape = LayerShape(
        spec.num_heads, spec.num_kv_heads, req.kv_heads, spec.head_dim, rotary - rotary % 2, spec.qk_norm
    )
    layer_names = []
    for layer in range(spec.num_layers):
        roles = {r: arch.tensor_name(r, layer, prefix) for r in arch.tensors if r in KV_ROLES or r == "qkv_bias"}
        roles = {r: n for r, n in roles.items() if n in src.names}
        if spec.qk_norm != "full":
            roles.pop("k_norm", None)
        need = {"qkv", "o"} if arch.qkv_layout == "fused_concat" else {"q", "k", "v", "o"}
        if need - set(roles):
            missing = arch.tensor_name(sorted(need - set(roles))[0], layer, prefix)
            raise AttnkitError(f"{req.model}: tensor {missing!r} not found")
        layer_names.append(roles)
    return GQASource(**src.fields(), shape=shape, layer_names=layer_names)


def _check_options(o: MergeOptions) -> None:
    if o.value_weight not in VALUE_WEIGHTS:
        raise UsageError(f"--value-weight must be {' or '.join(VALUE_WEIGHTS)}, got {o.value_weight!r}")
    if o.key_weight not in KEY_WEIGHTS:
        raise UsageError(
            f"--key-weight must be {', '.join(KEY_WEIGHTS[:-1])} or {KEY_WEIGHTS[-1]}, got {o.key_weight!r}"
        )
    if o.o_refit is not None and not o.o_refit >= 0:
        raise UsageError(f"--o-refit must be >= 0 (0 turns the refit off), got {o.o_refit}")


def _check_family(arch) -> None:
    if not arch.kv_heads_configurable or arch.qkv_layout not in ("separate", "fused_concat") or arch.position != "rope":
        why = {"absolute": "absolute position embeddings", "none": "no positional encoding"}.get(arch.position, "")
        layout = {
            "conv1d_concat": "fused Conv1D qkv",
            "fused_per_head": "per-head interleaved qkv",
            "mla": "MLA latent attention",
        }.get(arch.qkv_layout, "")
        detail = ", ".join(x for x in (layout, why) if x)
        raise AttnkitError(
            f"{arch.family} ({arch.transformers_class}) cannot be converted: its transformers class has no "
            f"num_key_value_heads setting{f' ({detail})' if detail else ''}, so fewer KV heads would not load"
        )


def _check_heads(spec, groups: int) -> None:
    if spec.mla is not None:
        raise AttnkitError("MLA checkpoints have no KV heads to merge")
    valid = ", ".join(str(g) for g in range(1, spec.num_kv_heads) if spec.num_kv_heads % g == 0)
    valid = valid or "none: it has one KV head (MQA) already"
    plural = "s" if spec.num_kv_heads > 1 else ""
    if groups == spec.num_kv_heads:
        raise UsageError(
            f"the model already has {groups} KV head{plural}: --kv-heads {groups} would write an "
            f"unchanged copy; valid: {valid}"
        )
    if groups > spec.num_kv_heads:
        raise UsageError(
            f"--kv-heads {groups} is more than the model's {spec.num_kv_heads} KV head{plural}; "
            f"converting can only merge heads (valid: {valid})"
        )
    if spec.num_kv_heads % groups:
        raise UsageError(
            f"--kv-heads {groups} does not divide the model's {spec.num_kv_heads} KV heads; valid: {valid}"
        )


def kv_bytes(spec, config: dict, groups: int) -> dict:
    """KV-cache bytes per token over all layers, in the checkpoint's dtype, before and after."""
    import dataclasses

    dtype = cache_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    after = dataclasses.replace(spec, num_kv_heads=groups)
    return {"dtype": dtype.name, "before": bytes_per_token(spec, dtype), "after": bytes_per_token(after, dtype)}


def _read_layer(reader, roles: dict) -> dict:
    return {role: reader.get(name) for role, name in roles.items()}


def _calibrate(req: ConvertRequest, src: GQASource, spill: LayerSpill) -> tuple[list, dict]:
    """Per-layer plans from calibration (sequential: each layer sees the converted layers before it). Each layer's
    converted tensors go to `spill` as soon as they are known; the plans returned keep only their summary."""

    loaded = load_for_calibration(src, req.device)  # decoder layers streamed when possible
    windows = calib_windows(loaded.tokenizer, req)
    template = src.arch.tensors.get("k") or src.arch.tensors["qkv"]
    modules = [attention_module_name(template, src.prefix, i) for i in range(src.spec.num_layers)]
    plans: list = [None] * src.spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:
        augment = is_biased(_read_layer(reader, src.layer_names[0]))

        def on_layer(layer: int, hidden, rope, scaling):
            weights = _read_layer(reader, src.layer_names[layer])
            plain = req.method == "merge" and reference_attention_ok(
                src.spec, layer, rope, scaling, "sinks" in src.arch.tensors
            )
            window = src.spec.layer_windows[layer]
            attention_weighted = plain and req.options.key_weight == "attention"
            plans[layer] = plan_layer(  # the covariances (0.5 GiB each at a 70B width) are freed on return
                weights,
                src.shape,
                req.method,
                input_covariance(hidden, augment),
                req.options,
                attention_key_covariance(weights, hidden, rope, scaling, src.shape, augment, window)
                if attention_weighted
                else None,
            )
            converted = apply_plan(weights, plans[layer], src.shape)
            if plain and req.options.o_refit:
                refit = refit_output(weights, converted, hidden, rope, scaling, src.shape, req.options.o_refit, window)
                converted["o"] = refit.to(weights["o"].dtype)
                plans[layer].value_path = "merge + o refit"
            spill.put(layer, converted)
            plans[layer] = _summary(plans[layer])
            if not req.sequential:
                return None
            expanded = expand_layer(converted, src.shape)
            return {src.layer_names[layer][role]: t for role, t in expanded.items()}

        calibrate(loaded.model, windows, modules, on_layer)
    info = calib_info(req, windows, sequential=req.sequential)
    return plans, info


def _summary(plan: LayerPlan) -> LayerPlan:
    """The plan without its tensors (paths and errors for the report)."""
    return dataclasses.replace(plan, k=None, v=None, coef=None, k_mix=None, v_mix=None, k_norm=None)


def _stream(reader, src: GQASource, req: ConvertRequest, plans: list, writer, spill: LayerSpill | None) -> dict:
    """Copy every tensor to new shards, rewriting a layer's attention when its first tensor comes up.

    Holds one layer's attention tensors (plus the writer's shard buffer) at a time: calibrated layers come from
    `spill`, layers without a plan (streaming mean/first) are planned from their weights alone. Returns name ->
    expected shape.
    """

    owner = {name: layer for layer, roles in enumerate(src.layer_names) for name in roles.values()}
    new_spec = dataclasses.replace(src.spec, num_kv_heads=req.kv_heads)
    expected: dict[str, tuple] = {}
    written: set[int] = set()
    names = reader.names()
    with phase(f"writing {req.out}", len(names), "tensors") as advance:
        for name in names:
            advance(1)
            layer = owner.get(name)
            if layer is None:
                writer.add(name, reader.get(name), scanned=True)  # a copy of the source, scanned when opened
                expected[name] = tuple(reader.info(name).shape)
                continue
            if layer in written:
                continue
            roles = src.layer_names[layer]
            weights = _read_layer(reader, roles)
            converted = spill.take(layer) if spill is not None else None
            if converted is None:
                if plans[layer] is None:
                    plans[layer] = plan_layer(weights, src.shape, req.method)
                converted = apply_plan(weights, plans[layer], src.shape)
            for role in sorted(roles, key=ROLE_ORDER.index):
                writer.add(roles[role], converted.get(role, weights[role]), scanned=role not in converted)
                expected[roles[role]] = role_shape(src.arch, new_spec, role)
            written.add(layer)
    return expected


def _config(src: GQASource, groups: int) -> dict:
    """The source config.json with num_key_value_heads = G (inside text_config for multimodal configs)."""
    raw = json.loads((src.root / "config.json").read_text(encoding="utf-8"))
    text = raw.get("text_config")
    target = text if isinstance(text, dict) and "num_key_value_heads" in text else raw
    target["num_key_value_heads"] = groups
    return raw


def _layer_rows(plans: list) -> list[dict]:
    return [
        {"layer": i, "key_path": p.key_path, "value_path": p.value_path, "k_err": p.k_err, "v_err": p.v_err}
        for i, p in enumerate(plans)
    ]


def _loads_with_kv_heads(groups: int):
    """extra(result) for compare_checkpoints: the written model loads with `groups` KV heads."""

    def check(result) -> dict:
        heads = result.model.config.num_key_value_heads
        if heads != groups:
            raise AttnkitError(f"the written model loads with {heads} KV heads, expected {groups}")
        return {}

    return check


def _parameters(req: ConvertRequest, src: GQASource) -> dict:
    params = {
        "kv_heads_before": src.spec.num_kv_heads,
        "kv_heads": req.kv_heads,
        "method": req.method,
        "max_shard_bytes": req.max_shard_bytes,
    }
    if req.calib:
        params.update(
            calib=list(req.calib),
            calib_tokens=req.calib_tokens,
            calib_seq_len=req.calib_seq_len,
            sequential=req.sequential,
        )
    if req.method == "merge":
        params.update(
            value_weight=req.options.value_weight,
            key_weight=req.options.key_weight,
            ridge=req.options.ridge,
            o_refit=req.options.o_refit,
        )
    return params


def convert_gqa(req: ConvertRequest, log: Callable[[str], None] | None = None) -> dict:
    """Run (or with dry_run, plan) the conversion; returns the report (see docs/convert-gqa.md).
    `log` receives one line per phase, after the request has been checked."""

    started = time.perf_counter()
    src = check_request(req)
    report = {
        **report_head(req, src.spec.model_type),
        "method": req.method,
        "num_heads": src.spec.num_heads,
        "kv_heads_before": src.spec.num_kv_heads,
        "kv_heads_after": req.kv_heads,
        "num_layers": src.spec.num_layers,
        "kv_bytes_per_token": kv_bytes(src.spec, src.config, req.kv_heads),
        "parameters": _parameters(req, src),
        "error_basis": None,
        "calibration": None,
        "layers": [],
        "eval": None,
        "check": None,
    }
    if req.dry_run:
        return timed(report, started)
    log = log or (lambda _msg: None)
    with LayerSpill(req.out) if req.calib else contextlib.nullcontext() as spill:
        _calibrate_and_write(req, src, report, spill, log)
    return timed(report, started)


def _calibrate_and_write(req: ConvertRequest, src: GQASource, report: dict, spill, log) -> None:
    plans: list = [None] * src.spec.num_layers
    if req.calib:
        log(f"calibrating {src.spec.num_layers} layers on {req.calib_tokens} tokens ({req.method})")
        plans, report["calibration"] = _calibrate(req, src, spill)
    log(f"writing {req.out}: {src.spec.num_kv_heads} -> {req.kv_heads} KV heads ({req.method})")

    def weights(writer) -> dict:
        with LazyReader(src.ckpt.weight_files) as reader:
            expected = _stream(reader, src, req, plans, writer, spill)
        report["error_basis"] = "activations" if req.calib else "weights"
        report["layers"] = _layer_rows(plans)
        return expected

    check = self_check(req, "convert gqa", report["calibration"])

    def score(folder) -> dict:
        log("checking the result against the source" + (" and scoring --eval" if req.scoring else ""))
        scores = compare_checkpoints(
            req.scoring, src, folder, req.device, check=check, extra=_loads_with_kv_heads(req.kv_heads)
        )
        report["eval"], report["check"] = scores["eval"], scores["check"]
        return {"eval": report["eval"], "check": report["check"]}

    write_checkpoint(
        req,
        src,
        "convert gqa",
        config=_config(src, req.kv_heads),
        weights=weights,
        body=lambda: {k: report[k] for k in ("method", "parameters", "calibration", "error_basis", "layers")},
        score=score if req.scoring or check is not None else None,
    )
