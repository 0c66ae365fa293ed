"""`convert gqa`: rewrite a checkpoint with fewer KV heads (mean, first or calibrated merge), streaming.

Flow: resolve and check the source -> (merge, or --calib) calibrate layer by layer -> stream every
tensor from the source shards to new shards, rewriting one layer's attention at a time -> config,
side files, manifest -> check names/shapes/finiteness -> (--eval) score source and result -> rename
the temp folder into place. The source is only read; a failure leaves no output folder.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from attnkit import __version__
from attnkit.commands.rewrite import CheckedSource, RewriteRequest, check_rewrite, source_record
from attnkit.errors import AttnkitError, UsageError
from attnkit.ops.gqa import KV_ROLES, METHODS, LayerShape, MergeOptions

ROLE_ORDER = ("q", "q_bias", "k", "k_bias", "v", "v_bias", "qkv", "qkv_bias", "o", "k_norm")


@dataclass(kw_only=True)
class ConvertRequest(RewriteRequest):
    """convert gqa|mqa: the target KV head count and the pooling method."""

    kv_heads: int
    method: str = "mean"
    sequential: bool = False
    options: MergeOptions = field(default_factory=MergeOptions)


@dataclass
class Source(CheckedSource):
    """The checked source and its layer shape."""

    shape: LayerShape
    layer_names: list[dict]  # per layer: role -> tensor name (roles the conversion reads)


def check_request(req: ConvertRequest) -> Source:
    """Validate everything that can be checked without reading tensors; one-line errors."""
    from attnkit.archs import get_arch
    from attnkit.archs.spec import attention_spec
    from attnkit.io.complete import checked_weights
    from attnkit.io.gguf_load import dequantized
    from attnkit.io.resolve import resolve

    if req.method not in METHODS:
        raise UsageError(f"unknown --method {req.method!r}; choose from {', '.join(METHODS)}")
    if req.method == "merge" and not req.calib:
        raise UsageError("--method merge needs calibration text: pass --calib FILE")
    check_rewrite(req)
    if req.kv_heads < 1:
        raise UsageError(f"--kv-heads must be at least 1, got {req.kv_heads}")
    ckpt = resolve(req.model)
    if ckpt.kind == "config":
        raise AttnkitError(f"{req.model}: a config file has no weights to convert")
    arch = get_arch(ckpt.model_type)
    _check_family(arch)
    _check_heads(attention_spec(ckpt.config), req.kv_heads)  # a GGUF header's config: before dequantizing
    ckpt = dequantized(ckpt)
    spec = attention_spec(ckpt.config)
    _output_dir(req, Path(ckpt.root))
    infos, prefix = checked_weights(ckpt, arch, spec)
    names = set(infos)
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    shape = LayerShape(spec.num_heads, spec.num_kv_heads, req.kv_heads, spec.head_dim, rotary - rotary % 2,
                       spec.qk_norm)
    layer_names = []
    for layer in range(spec.num_layers):
        roles = {r: arch.tensor_name(r, layer, prefix) for r in arch.tensors if r in KV_ROLES or r == "qkv_bias"}
        roles = {r: n for r, n in roles.items() if n in names}
        if spec.qk_norm != "full":
            roles.pop("k_norm", None)
        need = {"qkv", "o"} if arch.qkv_layout == "fused_concat" else {"q", "k", "v", "o"}
        if need - set(roles):
            missing = arch.tensor_name(sorted(need - set(roles))[0], layer, prefix)
            raise AttnkitError(f"{req.model}: tensor {missing!r} not found")
        layer_names.append(roles)
    return Source(ckpt, arch, spec, prefix, shape, layer_names)


def _check_family(arch) -> None:
    if not arch.kv_heads_configurable or arch.qkv_layout not in ("separate", "fused_concat") or arch.position != "rope":
        why = {"absolute": "absolute position embeddings", "none": "no positional encoding"}.get(arch.position, "")
        layout = {"conv1d_concat": "fused Conv1D qkv", "fused_per_head": "per-head interleaved qkv",
                  "mla": "MLA latent attention"}.get(arch.qkv_layout, "")
        detail = ", ".join(x for x in (layout, why) if x)
        raise AttnkitError(
            f"{arch.family} ({arch.transformers_class}) cannot be converted: its transformers class has no "
            f"num_key_value_heads setting{f' ({detail})' if detail else ''}, so fewer KV heads would not load")


def _check_heads(spec, groups: int) -> None:
    if spec.mla is not None:
        raise AttnkitError("MLA checkpoints have no KV heads to merge")
    valid = [g for g in range(1, spec.num_kv_heads) if spec.num_kv_heads % g == 0]
    if groups == spec.num_kv_heads:
        raise UsageError(f"the model already has {groups} KV head{'s' if groups > 1 else ''}: --kv-heads {groups} would "
                         f"write an unchanged copy; valid: {', '.join(map(str, valid)) or 'none (it is MQA)'}")
    if groups > spec.num_kv_heads:
        raise UsageError(f"--kv-heads {groups} is more than the model's {spec.num_kv_heads} KV heads; "
                         f"converting can only merge heads (valid: {', '.join(map(str, valid))})")
    if spec.num_kv_heads % groups:
        raise UsageError(f"--kv-heads {groups} does not divide the model's {spec.num_kv_heads} KV heads; "
                         f"valid: {', '.join(map(str, valid))}")


def _output_dir(req: ConvertRequest, src_root: Path):
    """The OutputDir for req.out; constructing it checks the target (non-empty, inside the input)."""
    from attnkit.io.writer import OutputDir

    return OutputDir(Path(req.out), overwrite=req.overwrite, sources=[src_root])


def kv_bytes(spec, config: dict, groups: int) -> dict:
    """KV-cache bytes per token over all layers, in the checkpoint's dtype, before and after."""
    import dataclasses

    from attnkit.kvcache import bytes_per_token, cache_dtype

    dtype = cache_dtype(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"))
    after = dataclasses.replace(spec, num_kv_heads=groups)
    return {"dtype": dtype.name, "before": bytes_per_token(spec, dtype), "after": bytes_per_token(after, dtype)}


def _read_layer(reader, roles: dict) -> dict:
    return {role: reader.get(name) for role, name in roles.items()}


def _calibrate(req: ConvertRequest, src: Source) -> tuple[list, dict]:
    """Per-layer plans from calibration (sequential: each layer sees the converted layers before it)."""
    from attnkit.commands.convert.gqa_layer import attention_key_covariance, reference_attention_ok, refit_output
    from attnkit.runtime.calibrate import attention_module_name, calibrate, input_covariance
    from attnkit.io.reader import LazyReader
    from attnkit.ops.gqa import apply_plan, expand_layer, is_biased, plan_layer
    from attnkit.runtime import make_windows, read_texts
    from attnkit.runtime.streaming import load_for_calibration

    loaded = load_for_calibration(str(src.ckpt.root), req.device)  # decoder layers streamed when possible
    windows = make_windows(loaded.tokenizer, read_texts(req.calib), req.calib_seq_len, req.calib_tokens,
                           flags=("--calib-seq-len", "--calib-tokens"))
    template = src.arch.tensors.get("k") or src.arch.tensors["qkv"]
    modules = [attention_module_name(template, src.prefix, i) for i in range(src.spec.num_layers)]
    plans: list = [None] * src.spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:
        augment = is_biased(_read_layer(reader, src.layer_names[0]))

        def on_layer(layer: int, hidden, rope, scaling):
            weights = _read_layer(reader, src.layer_names[layer])
            plain = req.method == "merge" and reference_attention_ok(
                src.spec, layer, req.calib_seq_len, rope, scaling, "sinks" in src.arch.tensors)
            key_cov = None
            if plain and req.options.key_weight == "attention":
                key_cov = attention_key_covariance(weights, hidden, rope, scaling, src.shape, augment)
            plans[layer] = plan_layer(weights, src.shape, req.method, input_covariance(hidden, augment), req.options,
                                      key_cov)
            if plain and req.options.o_refit:
                plans[layer].o = refit_output(weights, plans[layer], hidden, rope, scaling, src.shape, req.options.o_refit)
                plans[layer].value_path = "merge + o refit"
            if not req.sequential:
                return None
            expanded = expand_layer(apply_plan(weights, plans[layer], src.shape), src.shape)
            return {src.layer_names[layer][role]: t for role, t in expanded.items()}

        calibrate(loaded.model, windows, modules, on_layer)
    info = {"tokens": int(windows.numel()), "windows": int(windows.shape[0]), "seq_len": req.calib_seq_len,
            "sequential": req.sequential, "files": list(req.calib)}
    return plans, info


def _stream(reader, src: Source, req: ConvertRequest, plans: list, folder: Path) -> dict:
    """Copy every tensor to new shards, rewriting a layer's attention when its first tensor comes up.

    Holds one layer's attention tensors (plus the writer's shard buffer) at a time; layers without
    a plan (streaming mean/first) are planned from their weights alone. Returns name -> expected shape.
    """
    import dataclasses

    import torch

    from attnkit.archs.tensors import role_shape
    from attnkit.io.writer import ShardedWriter
    from attnkit.ops.gqa import apply_plan, plan_layer
    from attnkit.progress import phase

    owner = {name: layer for layer, roles in enumerate(src.layer_names) for name in roles.values()}
    new_spec = dataclasses.replace(src.spec, num_kv_heads=req.kv_heads)
    expected: dict[str, tuple] = {}
    written: set[int] = set()
    writer = ShardedWriter(folder, req.max_shard_bytes)
    names = reader.names()
    with phase(f"writing {req.out}", len(names), "tensors") as advance:
        for name in names:
            advance(1)
            layer = owner.get(name)
            if layer is None:
                writer.add(name, reader.get(name))
                expected[name] = tuple(reader.info(name).shape)
                continue
            if layer in written:
                continue
            roles = src.layer_names[layer]
            weights = _read_layer(reader, roles)
            if plans[layer] is None:
                plans[layer] = plan_layer(weights, src.shape, req.method)
            converted = apply_plan(weights, plans[layer], src.shape)
            for role, tensor in converted.items():
                if not torch.isfinite(tensor).all():
                    raise AttnkitError(f"layer {layer}: the converted {role} tensor has NaN or Inf")
            for role in sorted(roles, key=ROLE_ORDER.index):
                writer.add(roles[role], converted.get(role, weights[role]))
                expected[roles[role]] = role_shape(src.arch, new_spec, role)
            written.add(layer)
        writer.finish()
    return expected


def _verify(folder: Path, expected: dict) -> None:
    """Names and shapes of the written shards (headers only) against the new config's. Copied tensors
    are the source's bytes; rewritten ones were checked for NaN/Inf before writing."""
    from attnkit.io.checkpoint import safetensors_files
    from attnkit.io.safetensors_header import read_headers

    written = {name: tuple(info.shape) for name, info in read_headers(safetensors_files(folder)).items()}
    if written != {name: tuple(shape) for name, shape in expected.items()}:
        bad = sorted(set(written) ^ set(expected)) or sorted(n for n in written if written[n] != tuple(expected[n]))
        raise AttnkitError(f"{folder}: written tensors do not match the converted config (e.g. {bad[0]!r})")


def _write_config(src: Source, groups: int, folder: Path) -> None:
    """The source config.json with num_key_value_heads = G (inside text_config for multimodal configs)."""
    raw = json.loads((Path(src.ckpt.root) / "config.json").read_text(encoding="utf-8"))
    target = raw["text_config"] if isinstance(raw.get("text_config"), dict) and "num_key_value_heads" in raw["text_config"] else raw
    target["num_key_value_heads"] = groups
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def _layer_rows(plans: list) -> list[dict]:
    return [{"layer": i, "key_path": p.key_path, "value_path": p.value_path, "k_err": p.k_err, "v_err": p.v_err}
            for i, p in enumerate(plans)]


def _evaluate(req: ConvertRequest, source_root: Path, result_root: Path) -> dict:
    """Perplexity of source and result on --eval text, KL(source || result) per token, greedy samples."""
    from attnkit.commands.quality import quality
    from attnkit.runtime import load_model

    source = load_model(str(source_root), device=req.device, dtype="float32")
    result = load_model(str(result_root), device=req.device, dtype="float32")
    if result.model.config.num_key_value_heads != req.kv_heads:
        raise AttnkitError(f"the written model loads with {result.model.config.num_key_value_heads} KV heads, "
                           f"expected {req.kv_heads}")
    return quality(source, result, req)


def _parameters(req: ConvertRequest, src: Source) -> dict:
    params = {"kv_heads_before": src.spec.num_kv_heads, "kv_heads": req.kv_heads, "method": req.method,
              "max_shard_bytes": req.max_shard_bytes}
    if req.calib:
        params.update(calib=list(req.calib), calib_tokens=req.calib_tokens, calib_seq_len=req.calib_seq_len,
                      sequential=req.sequential)
    if req.method == "merge":
        params.update(value_weight=req.options.value_weight, key_weight=req.options.key_weight,
                      ridge=req.options.ridge, o_refit=req.options.o_refit)
    return params


def convert_gqa(req: ConvertRequest, log: Callable[[str], None] | None = None) -> dict:
    """Run (or with dry_run, plan) the conversion; returns the report (see docs/convert-gqa.md).
    `log` receives one line per phase, after the request has been checked."""
    from attnkit.io.reader import LazyReader
    from attnkit.io.writer import copy_side_files

    started = time.perf_counter()
    src = check_request(req)
    report = {
        "source": req.model, "output": str(req.out), "dry_run": req.dry_run, "model_type": src.spec.model_type,
        "method": req.method, "num_heads": src.spec.num_heads, "kv_heads_before": src.spec.num_kv_heads,
        "kv_heads_after": req.kv_heads, "num_layers": src.spec.num_layers,
        "kv_bytes_per_token": kv_bytes(src.spec, src.ckpt.config, req.kv_heads),
        "parameters": _parameters(req, src), "error_basis": None, "calibration": None, "layers": [], "eval": None,
    }
    if req.dry_run:
        report["seconds"] = time.perf_counter() - started
        return report
    log = log or (lambda _msg: None)
    plans: list = [None] * src.spec.num_layers
    if req.calib:
        log(f"calibrating {src.spec.num_layers} layers on {req.calib_tokens} tokens ({req.method})")
        plans, report["calibration"] = _calibrate(req, src)
    log(f"writing {req.out}: {src.spec.num_kv_heads} -> {req.kv_heads} KV heads ({req.method})")
    with _output_dir(req, Path(src.ckpt.root)) as out:
        with LazyReader(src.ckpt.weight_files) as reader:
            expected = _stream(reader, src, req, plans, out.path)
        _write_config(src, req.kv_heads, out.path)
        copy_side_files(Path(src.ckpt.root), out.path)
        _verify(out.path, expected)
        report["error_basis"] = "activations" if req.calib else "weights"
        report["layers"] = _layer_rows(plans)
        if req.eval:
            log("evaluating source and result")
            report["eval"] = _evaluate(req, Path(src.ckpt.root), out.path)
        manifest = {"attnkit_version": __version__, "command": req.command, "conversion": "gqa",
                    "source": source_record(req.model, src),
                    "method": req.method, "parameters": report["parameters"],
                    "calibration": report["calibration"], "error_basis": report["error_basis"],
                    "layers": report["layers"], "eval": report["eval"]}
        (out.path / "attnkit.json").write_text(json.dumps(manifest, indent=2) + "\n")
        out.commit()
    report["seconds"] = time.perf_counter() - started
    return report
