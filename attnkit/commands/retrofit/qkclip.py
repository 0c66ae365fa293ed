"""`retrofit qkclip`: Kimi K2's QK-Clip applied once: heads whose max logit exceeds tau get W_q scaled by tau / max.

Per head h, S_max = max over the calibration text of q_i . k_j * scaling (before any soft-cap,
visible pairs only). If S_max > tau the head's W_q rows and q bias are multiplied by tau / S_max,
so its logits shrink by exactly that factor (a scalar commutes with RoPE) and no other head changes.
The whole factor goes on the query side: with GQA a key head serves several query heads, and
scaling W_k (Kimi's sqrt split) would also shrink the unclipped siblings' logits.

Layers are clipped in forward order in one batched pass: layer l is measured on inputs that already
went through the clipped layers before it, so the written model meets tau on the calibration text.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from attnkit.commands.analyse.probe import probe
from attnkit.commands.retrofit.common import check_source, load, scorer, stream_weights
from attnkit.commands.rewrite import RewriteRequest, calib_info, calib_windows
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime.calibrate import attention_module_name, calibrate


@dataclass(kw_only=True)
class QKClipRequest(RewriteRequest):
    """retrofit qkclip: the largest attention logit a head may reach on the --calib text."""

    tau: float = 100.0


def check_request(req: QKClipRequest):
    if not req.tau > 0 or req.tau == float("inf"):
        raise UsageError(f"--tau must be a positive finite number, got {req.tau}")
    if not req.calib:
        raise UsageError("qkclip measures max logits on text: pass --calib FILE")

    def check(arch, spec, _config) -> None:
        mt = spec.model_type
        if spec.mla is not None:
            raise AttnkitError(f"{mt}: MLA attention is not supported by retrofit qkclip")
        if spec.qk_norm == "per_head":
            raise AttnkitError(
                f"{mt}: its QK-norm cancels any scale of W_q, and the norm weight that survives it "
                "is shared by all heads of a layer, so one head cannot be clipped alone"
            )
        if spec.qk_norm != "none":
            raise AttnkitError(f"{mt}: QK-norm over the full projection is not supported by retrofit qkclip")
        if arch.qkv_layout != "separate" or "q" not in arch.tensors:
            raise AttnkitError(f"{mt}: retrofit qkclip needs separate q_proj weights ({arch.qkv_layout} layout)")
        if "sinks" in arch.tensors:
            raise AttnkitError(f"{mt}: attention sinks are not supported by retrofit qkclip")

    return check_source(req, check)


def _head_max(module, hidden, position_embeddings, window):
    """Per query head max of q.k * scaling over visible causal pairs of hidden [N, T, d] -> [H] float64."""
    import torch

    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    n, t, _ = hidden.shape
    dim = module.head_dim
    q = module.q_proj(hidden).view(n, t, -1, dim).transpose(1, 2)  # [N, H, T, D]
    k = module.k_proj(hidden).view(n, t, -1, dim).transpose(1, 2)  # [N, Hkv, T, D]
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * module.scaling  # [N, H, T, T]
    i = torch.arange(t, device=s.device)[:, None]
    j = torch.arange(t, device=s.device)[None, :]
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    return s.masked_fill(~visible, float("-inf")).amax((0, 2, 3)).double().cpu()


def _clip(req: QKClipRequest, src) -> tuple[list, dict]:
    """Sequential clipping on the calibration text (attnkit.runtime.calibrate: layer l is measured on the outputs of
    the clipped layers before it); returns per-layer (factors [H], max logits seen [H]) and calibration info."""
    import torch

    spec = src.spec
    loaded = load(src.root, req.device)
    model = loaded.model
    wins = calib_windows(loaded.tokenizer, req)
    modules = [attention_module_name(src.arch.tensors["q"], src.prefix, i) for i in range(spec.num_layers)]
    clipped: list = [None] * spec.num_layers

    def on_layer(layer: int, hidden, rope, _scaling) -> dict:
        module = model.get_submodule(modules[layer])
        smax = _head_max(module, hidden, rope, spec.layer_windows[layer])  # [H]
        f = torch.where(smax > req.tau, req.tau / smax, torch.ones_like(smax))  # [H]
        clipped[layer] = (f, smax)
        if not bool((f < 1).any()):
            return {}
        rows = f.repeat_interleave(spec.head_dim).to(module.q_proj.weight)  # [H * D]
        updates = {f"{modules[layer]}.q_proj.weight": module.q_proj.weight * rows[:, None]}
        if module.q_proj.bias is not None:
            updates[f"{modules[layer]}.q_proj.bias"] = module.q_proj.bias * rows
        return updates

    calibrate(model, wins, modules, on_layer)
    info = calib_info(req, wins)
    return clipped, info


def _rewriter(src, factors):
    import torch

    spec = src.spec
    targets = {}
    for i, (f, _) in enumerate(factors):
        if bool((f < 1).any()):
            for role in ("q", "q_bias"):
                if src.tensor(role, i):
                    targets[src.tensor(role, i)] = f.repeat_interleave(spec.head_dim)  # [H * D]

    def rewrite(name, t):
        rows = targets.get(name)
        if rows is None:
            return {name: t}
        keep = rows == 1  # unclipped heads' rows stay bit for bit
        scaled = (t.double() * (rows[:, None] if t.dim() == 2 else rows)).to(t.dtype)
        mask = keep[:, None] if t.dim() == 2 else keep
        return {name: torch.where(mask, t, scaled)}

    return rewrite


def _max_logits(ref, req, name: str) -> list:
    """Per-head rows of attnkit's probe of a model on the calibration text (max_logit_precap among them)."""
    loaded = load(ref, req.device)
    return probe(loaded, calib_windows(loaded.tokenizer, req), name=name).heads


def retrofit_qkclip(req: QKClipRequest) -> dict:
    """Run (or with dry_run, plan) QK-Clip; returns the report (see docs/retrofit.md)."""
    started = time.perf_counter()
    src = check_request(req)
    report = {
        "retrofit": "qkclip",
        "source": req.model,
        "output": str(req.out),
        "dry_run": req.dry_run,
        "model_type": src.spec.model_type,
        "tau": req.tau,
        "clipped_heads": None,
        "calibration": None,
        "heads": [],
        "warnings": [],
        "eval": None,
        "probe": None,
    }
    if req.dry_run:
        report["seconds"] = time.perf_counter() - started
        return report
    before = {(r["layer"], r["head"]): r for r in _max_logits(src.root, req, "source")}
    factors, report["calibration"] = _clip(req, src)
    rows = []
    for layer, (f, smax) in enumerate(factors):
        for h in range(f.shape[0]):
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "max_logit_before": before[(layer, h)]["max_logit_precap"],
                    "max_logit_seen": float(smax[h]),
                    "factor": float(f[h]),
                    "clipped": bool(f[h] < 1),
                    "max_logit_after": None,
                }
            )
    report["heads"] = rows
    report["clipped_heads"] = sum(r["clipped"] for r in rows)
    if not report["clipped_heads"]:  # an unchanged copy would be all the output holds
        top = max(rows, key=lambda r: r["max_logit_seen"])
        report["output"] = None
        report["warnings"].append(
            f"no head's max logit on the calibration text exceeds --tau {req.tau:g} (highest: "
            f"{top['max_logit_seen']:.4g}, layer {top['layer']} head {top['head']}): nothing "
            f"to clip, {req.out} not written"
        )
        report["seconds"] = time.perf_counter() - started
        return report

    def check(folder):
        after = {(r["layer"], r["head"]): r["max_logit_precap"] for r in _max_logits(folder, req, "result")}
        for r in rows:
            r["max_logit_after"] = after[(r["layer"], r["head"])]

    body = {
        "changes": {
            "weights": f"q_proj rows (and q bias) of the {report['clipped_heads']} clipped head(s) "
            "scaled by tau / max logit; every other tensor copied unchanged"
        },
        "why": "QK-Clip (Kimi K2): bound each head's max attention logit by tau",
        "parameters": {"tau": req.tau},
        "calibration": report["calibration"],
        "heads": rows,
    }
    write_checkpoint(
        req,
        src,
        "retrofit qkclip",
        config=src.raw_config(),
        weights=lambda writer: stream_weights(src, writer, _rewriter(src, factors)),
        body=lambda: body,
        check=check,
        score=scorer(req, src, report),
    )
    report["seconds"] = time.perf_counter() - started
    return report
