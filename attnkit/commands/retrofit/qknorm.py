"""`retrofit qknorm`: turn a Llama, Mistral or Qwen2 checkpoint into a stock Qwen3 checkpoint (per-head QK-norm).

Qwen3 = the Llama layout plus RMSNorm over head_dim on q and k before RoPE (one weight shared by
all heads), biases on q/k/v/o when attention_bias is set. Methods (attnkit.ops.qknorm):
- anchor (default): no bias tensors, a head size serving kernels take (--head-dim; default D itself when
  vLLM's CPU attention runs it, giving up the weakest RoPE pair for the anchor, else the smallest size
  >= D + 2 that it runs).
  One pad dim of each q/k head is pad * a.x, where a.x ~ 1 is fitted on calibration activations
  (attnkit.ops.anchor); it dominates the RMS, so the norm divides each head by ~|a.x|, a per-token scale
  error of a few percent; source biases ride on a.x as well. Runs in llama.cpp and vLLM.
- pad: head_dim D -> D + 2; the two extra dims of each q/k head carry a constant bias B
  that dominates the RMS, so the norm becomes a known scale folded into its weight, which is zero on
  the extra dims (v/o get zero rows/columns there). Exact up to |q|^2/(4 B^2); RoPE keeps the source
  frequencies through rope_theta' = theta^((D+2)/D). KV cache grows by 2/D. No calibration needed. Needs
  bias tensors (all-zero v and o biases included) and a head size of D + 2: transformers only.
- kl, lsq, scalar, unit: keep head_dim; fit the norm weights (and pre-norm scales of W_q/W_k rows)
  on calibration activations. Lossy: the per-token RMS of q and k cannot be expressed.

Modules: qknorm_request.py (request, checks, head size), qknorm_target.py (the Qwen3 config, names and load check),
qknorm_fit.py (pad biases, anchors, fitted norm weights), qknorm_rewrite.py (the tensor rewrites); this one is the
flow: check -> config -> (dry run: the plan) -> fit -> write through attnkit.commands.write.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from attnkit.commands.report_head import report_head, timed
from attnkit.commands.retrofit.common import scorer, stream_weights
from attnkit.commands.retrofit.qknorm_fit import anchor_fits, calibrate_fits, pad_biases
from attnkit.commands.retrofit.qknorm_request import QKNormRequest, check_request, new_head_dim
from attnkit.commands.retrofit.qknorm_rewrite import anchor_rewriter, read_biases, rewriter
from attnkit.commands.retrofit.qknorm_target import attention_bias, check_loads, check_rope, qwen3_config
from attnkit.commands.write import write_checkpoint
from attnkit.io.reader import LazyReader
from attnkit.ops.qknorm import unit_fit


def retrofit_qknorm(req: QKNormRequest) -> dict:
    """Run (or with dry_run, plan) the QK-norm retrofit; returns the report (see docs/retrofit.md)."""
    started = time.perf_counter()
    src = check_request(req)
    spec = src.spec
    bias, dim = attention_bias(src, req.method), new_head_dim(req, spec.head_dim)
    config = qwen3_config(src, bias, dim)
    if dim != spec.head_dim:
        check_rope(src, config)
    report = {
        **report_head(req, spec.model_type, lead={"retrofit": "qknorm"}),
        "method": req.method,
        "head_dim_before": spec.head_dim,
        "head_dim_after": dim,
        "attention_bias": bias,
        "calibration": None,
        "layers": [],
        "warnings": _warnings(req.method, spec.head_dim, dim),
        "eval": None,
        "probe": None,
    }
    if req.dry_run:
        return timed(report, started)
    rewrite, report["layers"], report["calibration"] = _fitted_rewrite(req, src, dim, bias)
    write_checkpoint(
        req,
        src,
        "retrofit qknorm",
        config=config,
        weights=lambda writer: stream_weights(src, writer, rewrite),
        body=lambda: _manifest_body(req, src, report, bias, dim),
        check=check_loads,
        score=scorer(req, src, report),
    )
    return timed(report, started)


def _warnings(method: str, dim: int, new_dim: int) -> list[str]:
    """What the result costs or where it does not run: a larger KV cache, pad's bias tensors and head size."""
    warnings = []
    if new_dim > dim:
        warnings.append(f"head_dim {dim} -> {new_dim}: the KV cache grows by {100 * (new_dim - dim) / dim:.1f}%")
    if method == "pad":
        warnings.append(
            "--method pad writes q/k/v/o bias tensors (zero where the source has none) and "
            f"head_dim {new_dim}: llama.cpp has no o_proj bias slot and vLLM's CPU attention "
            "no such head size; --method anchor runs in both"
        )
    return warnings


def _fitted_rewrite(req: QKNormRequest, src, dim: int, bias: bool) -> tuple[Callable, list[dict], dict | None]:
    """The method's fit as (rewrite(name, tensor) for stream_weights, the report's layer rows, calibration info)."""
    spec = src.spec
    if req.method in ("pad", "anchor"):
        with LazyReader(src.ckpt.weight_files) as reader:
            pads, biases = pad_biases(src, reader.get), read_biases(src, reader.get)
    if req.method == "pad":
        rows = [
            {"layer": i, "pad_bias_q": bq, "pad_bias_k": bk, "max_rel_error": err, "attention_kl": None}
            for i, (bq, bk, err) in enumerate(pads)
        ]
        return rewriter(src, req.method, None, pads, bias), rows, None
    if req.method == "anchor":
        anchors, calibration = anchor_fits(req, src, dim)
        rows = [
            {
                "layer": i,
                "pad_bias_q": bq,
                "pad_bias_k": bk,
                "max_rel_error": a.scale_error**0.5,
                "attention_kl": None,
                "dropped_pair": a.dropped_pair,
            }
            for i, ((bq, bk, _), a) in enumerate(zip(pads, anchors))
        ]
        return anchor_rewriter(src, anchors, pads, biases, dim), rows, calibration
    if req.method == "unit" and not req.calib:
        fits, calibration = [unit_fit(spec.num_heads, spec.num_kv_heads, spec.head_dim)] * spec.num_layers, None
    else:
        fits, calibration = calibrate_fits(req, src)
    rows = [
        {"layer": i, "pad_bias_q": None, "pad_bias_k": None, "max_rel_error": None, "attention_kl": f.kl}
        for i, f in enumerate(fits)
    ]
    return rewriter(src, req.method, fits, None, bias), rows, calibration


def _manifest_body(req: QKNormRequest, src, report: dict, bias: bool, dim: int) -> dict:
    """attnkit.json's entries of the retrofit: what changed and why, the parameters, calibration and layer rows."""
    spec = src.spec
    added = "q_norm/k_norm weights per layer"
    if bias and not src.tensor("o_bias", 0):
        added += ", zero o_proj bias"
    return {
        "changes": {
            "model_type": f"{spec.model_type} -> qwen3",
            "head_dim": [spec.head_dim, dim],
            "attention_bias": bias,
            "added": added,
        },
        "why": "per-head RMSNorm on q and k (Qwen3 QK-norm) bounds attention logits",
        "parameters": {"method": req.method, "steps": req.steps if req.method == "kl" else None, "head_dim": dim},
        "calibration": report["calibration"],
        "layers": report["layers"],
        "warnings": report["warnings"],
    }
