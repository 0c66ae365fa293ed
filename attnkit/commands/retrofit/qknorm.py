"""`retrofit qknorm`: turn a Llama, Mistral or Qwen2 checkpoint into a stock Qwen3 checkpoint (per-head QK-norm).

Qwen3 = the Llama layout plus RMSNorm over head_dim on q and k before RoPE (one weight shared by
all heads), biases on q/k/v/o when attention_bias is set. Methods (attnkit.ops.qknorm):
- auto (default): anchor where its assumption holds on held-out calibration tokens and its output passes the
  self-check, else bias (each written and checked in turn; the report's `tried` says what and why).
- anchor: no bias tensors, a head size serving kernels take (--head-dim; default D itself when
  vLLM's CPU attention runs it, giving up the weakest RoPE pair for the anchor, else the smallest size
  >= D + 2 that it runs).
  One pad dim of each q/k head is pad * a.x, where a.x ~ 1 is fitted on calibration activations
  (attnkit.ops.anchor); it dominates the RMS, so the norm divides each head by ~|a.x|, a per-token scale
  error of a few percent where the hidden states have a near-constant direction (none on some models:
  Qwen2.5-Coder); source biases ride on a.x as well. Runs in llama.cpp and vLLM.
- bias: head size D, the weakest RoPE pair given up; one of its dims carries the pad bias B through q/k bias
  tensors (exact but for that pair). q/k/v/o biases (o zero): vLLM and transformers, not llama.cpp.
- pad: head_dim D -> D + 2; the two extra dims of each q/k head carry a constant bias B
  that dominates the RMS, so the norm becomes a known scale folded into its weight, which is zero on
  the extra dims (v/o get zero rows/columns there). Exact up to |q|^2/(4 B^2); RoPE keeps the source
  frequencies through rope_theta' = theta^((D+2)/D). KV cache grows by 2/D. No calibration needed. Needs
  bias tensors (all-zero v and o biases included) and a head size of D + 2: transformers only.
- kl, lsq, scalar, unit: keep head_dim; fit the norm weights (and pre-norm scales of W_q/W_k rows)
  on calibration activations. Lossy: the per-token RMS of q and k cannot be expressed.

Modules: qknorm_request.py (request, checks, head size), qknorm_target.py (the Qwen3 config, names and load check),
qknorm_fit.py (pad biases, anchors, fitted norm weights), qknorm_rewrite.py (the tensor rewrites); this one is the
flow: check -> (dry run: the plan) -> fit -> per candidate method: config -> write through attnkit.commands.write,
self-checked before the rename (auto moves on to the next candidate when the check rejects one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from attnkit.commands.report_head import report_head, timed
from attnkit.commands.retrofit.common import scorer, stream_weights
from attnkit.commands.retrofit.qknorm_fit import anchor_fits, anchor_holds, calibrate_fits, pad_biases
from attnkit.commands.retrofit.qknorm_request import QKNormRequest, check_request, new_head_dim
from attnkit.commands.retrofit.qknorm_rewrite import anchor_rewriter, bias_rewriter, read_biases, rewriter
from attnkit.commands.retrofit.qknorm_target import attention_bias, check_loads, check_rope, qwen3_config
from attnkit.commands.rewrite import Rejected
from attnkit.commands.write import write_checkpoint
from attnkit.io.reader import LazyReader
from attnkit.ops.qknorm import unit_fit

OPERATION = "retrofit qknorm"


def retrofit_qknorm(req: QKNormRequest) -> dict:
    """Run (or with dry_run, plan) the QK-norm retrofit; returns the report (see docs/retrofit.md)."""
    started = time.perf_counter()
    src = check_request(req)
    spec = src.spec
    first = "anchor" if req.method == "auto" else req.method
    report = {
        **report_head(req, spec.model_type, lead={"retrofit": "qknorm"}),
        "method": req.method,
        "head_dim_before": spec.head_dim,
        "head_dim_after": new_head_dim(req, first, spec.head_dim),
        "attention_bias": attention_bias(src, first),
        "tried": [],
        "calibration": None,
        "layers": [],
        "warnings": _warnings(first, spec.head_dim, new_head_dim(req, first, spec.head_dim)),
        "eval": None,
        "probe": None,
        "check": None,
    }
    if req.dry_run:
        return timed(report, started)
    fits, report["calibration"] = (None, None)
    if req.method in ("auto", "anchor", "bias"):
        fits, report["calibration"] = anchor_fits(req, src)
    candidates = _candidates(req, fits, report)
    for n, method in enumerate(candidates):
        last = n == len(candidates) - 1
        try:
            _write(req, src, method, fits, report, reject=not last and req.check.enabled)
        except Rejected as rejected:
            report["tried"].append(_tried(method, rejected.check))
            continue
        report["tried"].append(_tried(method, report["check"]))
        break
    return timed(report, started)


def _candidates(req: QKNormRequest, fits, report: dict) -> list[str]:
    """The methods to write, in order: auto tries the anchor where it holds on held-out tokens, then bias."""
    if req.method != "auto":
        return [req.method]
    holds, said = anchor_holds(fits)
    if holds:
        return ["anchor", "bias"]
    report["tried"].append({"method": "anchor", "verdict": "not tried", "worst": None, "why": said})
    return ["bias"]


def _tried(method: str, check: dict | None) -> dict:
    """The report's row of a written candidate: its self-check's verdict and worst ratio."""
    if check is None:
        return {"method": method, "verdict": "not checked", "worst": None, "why": None}
    worst = check["worst"]["ratio"] if check["worst"] else None
    return {"method": method, "verdict": check["verdict"], "worst": worst, "why": "; ".join(check["problems"]) or None}


def _write(req: QKNormRequest, src, method: str, fits, report: dict, reject: bool) -> None:
    """Write OUT by `method`; with `reject`, raise Rejected (nothing written) when its self-check fails."""
    spec = src.spec
    bias, dim = attention_bias(src, method), new_head_dim(req, method, spec.head_dim)
    config = qwen3_config(src, bias, dim)
    if dim != spec.head_dim:
        check_rope(src, config)
    report.update(
        method=method,
        head_dim_after=dim,
        attention_bias=bias,
        warnings=_warnings(method, spec.head_dim, dim),
    )
    rewrite, report["layers"] = _fitted_rewrite(req, src, method, fits, report, dim, bias)
    score = scorer(req, src, report, OPERATION, report["calibration"])

    def checked(folder) -> dict:
        scores = score(folder)
        if reject and scores["check"]["verdict"] == "worse than its limit":
            raise Rejected(scores["check"])
        return scores

    write_checkpoint(
        req,
        src,
        OPERATION,
        config=config,
        weights=lambda writer: stream_weights(src, writer, rewrite),
        body=lambda: _manifest_body(req, src, report, bias, dim),
        check=check_loads,
        score=checked if score else None,
    )


def _warnings(method: str, dim: int, new_dim: int) -> list[str]:
    """What the result costs or where it does not run: a larger KV cache, pad's and bias's bias tensors."""
    warnings = []
    if new_dim > dim:
        warnings.append(f"head_dim {dim} -> {new_dim}: the KV cache grows by {100 * (new_dim - dim) / dim:.1f}%")
    if method == "pad":
        warnings.append(
            "--method pad writes q/k/v/o bias tensors (zero where the source has none) and "
            f"head_dim {new_dim}: llama.cpp has no o_proj bias slot and vLLM's CPU attention "
            "no such head size; --method anchor runs in both"
        )
    if method == "bias":
        warnings.append(
            "--method bias writes q/k/v/o bias tensors (o_proj's zero): vLLM reads the q/k/v ones and no o_proj "
            "bias, llama.cpp's qwen3 has no o_proj bias slot, so the output runs in transformers and vLLM only"
        )
    return warnings


def _fitted_rewrite(req: QKNormRequest, src, method: str, fits, report, dim: int, bias: bool) -> tuple[Callable, list]:
    """The method's fit as (rewrite(name, tensor) for stream_weights, the report's layer rows)."""
    spec = src.spec
    if method in ("pad", "anchor", "bias"):
        with LazyReader(src.ckpt.weight_files) as reader:
            pads, biases = pad_biases(src, reader.get), read_biases(src, reader.get)
    if method == "pad":
        rows = [
            {"layer": i, "pad_bias_q": bq, "pad_bias_k": bk, "max_rel_error": err, "attention_kl": None}
            for i, (bq, bk, err) in enumerate(pads)
        ]
        return rewriter(src, method, None, pads, bias), rows
    if method in ("anchor", "bias"):
        rows = [
            {
                "layer": i,
                "pad_bias_q": bq,
                "pad_bias_k": bk,
                "max_rel_error": a.scale_error**0.5 if method == "anchor" else err,
                "attention_kl": None,
                "dropped_pair": a.dropped_pair if dim == spec.head_dim else None,
                "anchor_heldout_error": a.heldout_error,
            }
            for i, ((bq, bk, err), a) in enumerate(zip(pads, fits))
        ]
        if method == "bias":
            return bias_rewriter(src, [a.dropped_pair for a in fits], pads, biases), rows
        return anchor_rewriter(src, fits, pads, biases, dim), rows
    if method == "unit" and not req.calib:
        layer_fits = [unit_fit(spec.num_heads, spec.num_kv_heads, spec.head_dim)] * spec.num_layers
    else:
        layer_fits, report["calibration"] = calibrate_fits(req, src)
    rows = [
        {"layer": i, "pad_bias_q": None, "pad_bias_k": None, "max_rel_error": None, "attention_kl": f.kl}
        for i, f in enumerate(layer_fits)
    ]
    return rewriter(src, method, layer_fits, None, bias), rows


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
        "parameters": {
            "method": report["method"],
            "requested": req.method,
            "steps": req.steps if report["method"] == "kl" else None,
            "head_dim": dim,
        },
        "tried": report["tried"],
        "calibration": report["calibration"],
        "layers": report["layers"],
        "warnings": report["warnings"],
    }
