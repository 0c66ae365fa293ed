"""`convert mla`: rewrite an MHA/GQA checkpoint as a stock DeepseekV3 (MLA) checkpoint, layer by layer (or in
another layout --target names: attnkit.commands.convert.mla_target.TARGETS; --target gemma3-mla writes a Gemma 3
as attnkit's Gemma 3 MLA layout, attnkit.modeling.gemma3_mla).

Flow: check the source and the ranks (mla_request.py) -> load it once (fp32); where --layer-budget auto applies,
measure each converted layer alone and share the budget (mla_layer_budget.py) -> run the calibration text through
it; when the pass reaches layer l, l's input covariance gives its MLA tensors (mla_layer.py, attnkit.ops.mla),
which wait in the layer spill; with sequential calibration layer l is then run as the converted
DeepseekV3Attention, so later layers are fitted on the converted model's activations -> the converted layers and
the other tensors (mla_copy.py) to the output shards -> config (mla_target.py), side files, manifest -> check
names/shapes/finiteness -> (--eval) score and check what the cache holds -> rename the temp folder into place.
The source is only read. The report's parts besides the layers: mla_report.py.

The default output is engine-safe (attnkit.ops.mla_deepseek.engine_tensors: no bias tensors, a config
llama.cpp, vLLM and SGLang load); `--latent-norm bias` keeps the exact constant-channel route that only
transformers runs.
"""

from __future__ import annotations

import resource
import time

from attnkit.commands.convert.layer_spill import LayerSpill
from attnkit.commands.convert.mla_copy import copy_rest
from attnkit.commands.convert.mla_layer import fit_layer
from attnkit.commands.convert.mla_layer_budget import choose_layer_budget
from attnkit.commands.convert.mla_report import cache_at_context, kv_bytes, notes, parameters, serving
from attnkit.commands.convert.mla_request import (
    MLARequest,
    MLASource,
    Route,
    check_request,
    max_rank,
    with_route,
)
from attnkit.commands.convert.mla_target import expected_shapes, target_attention_names, target_config
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.rewrite import Rejected, calib_info, calib_windows, self_check
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError
from attnkit.io.reader import LazyReader
from attnkit.ops.anchor import ANCHOR_HELDOUT_MAX, heldout_error
from attnkit.runtime.attention import replace_output_once
from attnkit.runtime.calibrate import attention_module_name, calibrate, token_rows
from attnkit.runtime.generate import cache_check
from attnkit.runtime.streaming import load_for_calibration
from attnkit.scoring.comparison import compare_checkpoints

#: Calibration windows the anchor of a biased source is measured on before its route is chosen.
ROUTE_WINDOWS = 8


def convert_mla(req: MLARequest, log=lambda message: None) -> dict:
    """Run (or with dry_run, plan) the conversion; returns the report (see docs/convert-mla.md).
    `log(message)` hears progress once the request has been checked."""

    started = time.perf_counter()
    src = check_request(req)
    loaded = windows = None
    if not req.dry_run:
        loaded = load_for_calibration(src, req.device)  # decoder layers streamed when possible
        windows = calib_windows(loaded.tokenizer, req)
        src = choose_route(req, src, loaded, windows, log)
        src = choose_layer_budget(req, src, loaded, windows, log)
    report = _report(req, src)
    if req.dry_run:
        return timed(report, started)
    try:
        _write(req, src, (loaded, windows), report, log, reject=_bias_route_left(req, src))
    except Rejected as rejected:
        problems = "; ".join(rejected.check["problems"])
        why = (
            "bias route chosen: the engine route's output, which carries the source's q/k/v biases on the anchor "
            f"a.x ~ 1, failed its self-check ({problems}), so the biases are written as bias tensors "
            "(transformers only)"
        )
        log("the engine route failed its self-check; converting again by the bias route ...")
        src = with_route(req, src, Route("transformers", "bias", why))
        report = _report(req, src)
        report["tried"] = [{"route": "engine", "verdict": rejected.check["verdict"], "why": problems}]
        _write(req, src, (loaded, windows), report, log, reject=False)
    return timed(report, started)


def _report(req: MLARequest, src: MLASource) -> dict:
    """The report of converting `src` by its route, before any layer is converted."""
    rank = src.rank
    return {
        **report_head(req, src.spec.model_type),
        "target_model_type": src.target.model_type,
        "num_layers": src.spec.num_layers,
        "num_heads": src.spec.num_heads,
        "kv_heads": src.spec.num_kv_heads,
        "head_dim": src.spec.head_dim,
        "kv_lora_rank": rank,
        "rope_dim": src.shape.rope_dim,
        "kv_bytes_per_token": kv_bytes(src, rank),
        "kv_cache_at_context": cache_at_context(src, rank),
        "kept_layers": list(src.plain_layers),
        "layer_shapes": src.own_shapes(),
        "layer_budget": src.layer_budget,
        "serving": serving(src),
        "parameters": parameters(req, src),
        "tried": [],
        "calibration": None,
        "layers": [],
        "eval": None,
        "check": None,
        "peak_rss_bytes": None,
        "notes": notes(req, src),
        "warnings": list(src.warnings),
    }


def _bias_route_left(req: MLARequest, src: MLASource) -> bool:
    """Whether the bias route is still open should the engine route's output fail its self-check: a biased source
    whose route attnkit chooses (no --engine, no --latent-norm) kept the engine route, and the bias route takes the
    rank."""
    return (
        req.check.enabled
        and src.augmented
        and src.target.engines
        and src.route.latent_norm == "auto"
        and req.engine == "any"
        and src.rank <= max_rank(src.spec, augmented=True)
    )


def _write(req: MLARequest, src: MLASource, calibration: tuple, report: dict, log, reject: bool) -> None:
    """Calibrate, convert and write OUT by `src`'s route, filling `report`; with `reject`, raise Rejected (nothing
    written) when the output fails its self-check."""
    log("calibrating and converting layer by layer ...")
    config = target_config(src, bias_route=src.route.bias)
    expected = expected_shapes(src.target, config)

    def weights(writer) -> dict:
        with LayerSpill(req.out) as spill:  # converted layers wait on disk, not in the writer's shard buffer
            converted = _calibrate_and_convert(req, src, calibration, config, spill, expected)
            report["layers"], report["calibration"] = converted
            for layer in range(src.spec.num_layers):
                for name, t in spill.take(layer).items():
                    writer.add(name, t)
        with LazyReader(src.ckpt.weight_files) as reader:
            fold_input_norm = src.route.folds_input_norm
            copy_rest(reader, src, writer, expected, fold_input_norm=fold_input_norm, config=config)
        report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return expected

    def score(folder) -> dict:
        log("checking the result against the source" + (" and scoring --eval" if req.scoring else "") + " ...")
        check = self_check(req, "convert mla", report["calibration"])
        scores = compare_checkpoints(
            req.scoring,
            src,
            folder,
            req.device,
            check=check,
            extra=lambda result: {"cache": cache_check(result.model, layer=src.converted_layers[0])},
        )
        if reject and scores["check"]["verdict"] == "worse than its limit":
            raise Rejected(scores["check"])
        report["eval"], report["check"] = scores["eval"], scores["check"]
        return {"eval": report["eval"], "check": report["check"]}

    write_checkpoint(
        req,
        src,
        "convert mla",
        config=config,
        weights=weights,
        body=lambda: {
            k: report[k]
            for k in (
                "parameters",
                "calibration",
                "kv_bytes_per_token",
                "kv_cache_at_context",
                "kept_layers",
                "layer_shapes",
                "layer_budget",
                "serving",
                "layers",
                "notes",
                "warnings",
            )
        },
        score=score if req.scoring or req.check.enabled else None,
    )


def choose_route(req: MLARequest, src: MLASource, loaded, windows, log) -> MLASource:
    """The engine route carries a source's q/k/v biases on the anchor a.u ~ 1 (engines have no bias slot): for a
    biased source it is measured first, on calibration tokens the fit does not see (attnkit.ops.anchor.heldout_error,
    on up to ROUTE_WINDOWS windows of the source's own activations). Where it does not hold and --engine and
    --latent-norm were left to attnkit, the output takes the bias route (exact biases, transformers only) and says
    why; where an engine was named, a warning says what to expect."""
    if not src.augmented or src.route.latent_norm != "auto" or not src.target.engines:
        return src
    log("measuring the anchor that carries the source's biases ...")
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(src.spec.num_layers)]
    errors: list = [None] * src.spec.num_layers
    calibrate(
        loaded.model,
        windows[:ROUTE_WINDOWS],
        modules,
        lambda layer, hidden, *_: errors.__setitem__(layer, heldout_error(token_rows(hidden, augment=False))),
    )
    worst = max(range(len(errors)), key=lambda i: errors[i][0])
    low = min(range(len(errors)), key=lambda i: errors[i][1])
    if errors[worst][0] <= ANCHOR_HELDOUT_MAX and errors[low][1] > 0:
        return src
    said = (
        f"the anchor a.x ~ 1 that would carry the source's q/k/v biases is off by {errors[worst][0]:.1%} (RMS, layer "
        f"{worst}) on held-out calibration tokens, smallest value {errors[low][1]:.2f} (layer {low})"
    )
    bias_most = max_rank(src.spec, augmented=True)
    kept = f"--engine {req.engine}" if req.engine != "any" else None
    if kept is None and src.rank > bias_most:
        kept = f"a latent of {src.rank} (the bias route takes at most {bias_most})"
    if kept is not None:
        src.warnings.append(f"{said}: the biases ride on it anyway for {kept}; expect a broken output")
        return src
    why = f"bias route chosen: {said}, so the biases are written as bias tensors (transformers only)"
    return with_route(req, src, Route("transformers", "bias", why))


def _calibrate_and_convert(
    req: MLARequest, src: MLASource, calibration: tuple, config, spill, expected: dict
) -> tuple[list, dict]:
    """One pass over the calibration windows (`calibration`: the model loaded for it and the windows); each layer
    is converted when reached, its tensors put in `spill` (attnkit.commands.convert.layer_spill) under their full
    names. Returns (report rows, calibration info)."""
    loaded, windows = calibration
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(src.spec.num_layers)]
    written = target_attention_names(config, expected)  # model.layers.{i}.self_attn of the target
    rows: list = [None] * src.spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:
        dtype = reader.get(src.layer_names[0]["o"]).dtype

        def on_layer(layer: int, hidden, rope=None, scaling=None):
            if layer in src.plain_layers:  # written as the source's, and run as it in the calibration model
                rows[layer] = {"layer": layer, "kept": "the source's attention"}
                spill.put(
                    layer, _kept_tensors(reader, src.layer_names[layer], modules[layer], written[layer], expected)
                )
                return None
            window = getattr(loaded.model.get_submodule(modules[layer]), "sliding_window", None)  # the source's
            inputs = (hidden, rope, scaling, window)
            tensors, row, scale = fit_layer(req.options, src, layer, reader, inputs, config, loaded.device, dtype)
            rows[layer] = {"layer": layer, **row}
            named = {f"{written[layer]}.{name}": t for name, t in tensors.items()}
            unknown = [full for full in named if full not in expected]
            if unknown:
                raise AttnkitError(f"internal: {unknown[0]} is not a {config.architectures[0]} tensor")
            spill.put(layer, named)
            if req.sequential:
                replace_output_once(
                    loaded.model.get_submodule(modules[layer]), config, layer, tensors, loaded.device, scale
                )
            return None

        calibrate(loaded.model, windows, modules, on_layer)
    return rows, calib_info(req, windows, sequential=req.sequential)


def _kept_tensors(reader, names: dict, module: str, written: str, expected: dict) -> dict:
    """A kept layer's attention tensors (`names`: role -> the source's name, under its attention `module`), as
    stored, under the target's attention module `written`."""
    kept = {written + name.removeprefix(module): reader.get(name) for name in names.values()}
    unknown = [name for name in kept if name not in expected]
    if unknown:
        raise AttnkitError(f"internal: {unknown[0]} is not a tensor of the target")
    return kept
