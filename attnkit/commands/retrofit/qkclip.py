"""`retrofit qkclip`: Kimi K2's QK-Clip applied once: heads whose max logit exceeds tau get their queries scaled by
tau / max.

Per head h, S_max = max over the calibration text of q_i . k_j * scaling (after any QK-norm, before any
soft-cap, visible pairs only). If S_max > tau the head's query is multiplied by tau / S_max, so its logits
shrink by exactly that factor (a scalar commutes with RoPE). Where the factor goes:
- no QK-norm: the head's W_q rows and q bias; no other head changes;
- QK-norm over the whole projection (OLMo 2): the head's slice of the q-norm weight; no other head changes;
- per-head QK-norm (Qwen3, Gemma 3): the norm cancels any scale of W_q and its weight is shared by every
  head of the layer, so the layer is clipped as one: the q-norm weight's scale is multiplied by
  tau / (the layer's worst S_max), and every head of that layer shrinks by the same factor.
The whole factor goes on the query side: with GQA a key head serves several query heads, and
scaling W_k (Kimi's sqrt split) would also shrink the unclipped siblings' logits.

Layers are clipped in forward order in one batched pass: layer l is measured on inputs that already
went through the clipped layers before it, so the written model meets tau on the calibration text.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from attnkit.commands.report_head import report_head, timed
from attnkit.commands.retrofit.common import check_source, load, scorer, stream_weights
from attnkit.commands.rewrite import RewriteRequest, calib_info, calib_windows
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime.calibrate import attention_module_name, calibrate
from attnkit.scoring.attention_stats import probe


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
        if arch.qkv_layout != "separate" or "q" not in arch.tensors:
            raise AttnkitError(f"{mt}: retrofit qkclip needs separate q_proj weights ({arch.qkv_layout} layout)")
        if "sinks" in arch.tensors:
            raise AttnkitError(f"{mt}: attention sinks are not supported by retrofit qkclip")

    return check_source(req, True, check)


def _head_max(module, hidden, position_embeddings, window, qk_norm: str):
    """Per query head max of q.k * scaling over visible causal pairs of hidden [N, T, d] -> [H] float64,
    with the module's QK-norm applied as its forward applies it (per head, or over the whole projection)."""
    import torch

    rope = sys.modules[type(module).__module__].apply_rotary_pos_emb
    n, t, _ = hidden.shape
    dim = module.head_dim
    q, k = module.q_proj(hidden), module.k_proj(hidden)  # [N, T, H*D], [N, T, Hkv*D]
    if qk_norm == "full":
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = q.view(n, t, -1, dim), k.view(n, t, -1, dim)  # [N, T, H, D], [N, T, Hkv, D]
    if qk_norm == "per_head":
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [N, H, T, D], [N, Hkv, T, D]
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * module.scaling  # [N, H, T, T]
    i = torch.arange(t, device=s.device)[:, None]
    j = torch.arange(t, device=s.device)[None, :]
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    return s.masked_fill(~visible, float("-inf")).amax((0, 2, 3)).double().cpu()


def head_factors(smax, tau: float, qk_norm: str):
    """Per-head query factors [H] for max logits smax [H]: tau / max where it exceeds tau, else 1; with per-head
    QK-norm one factor for the whole layer (its worst head's)."""
    import torch

    if qk_norm == "per_head":
        worst = float(smax.max())
        return torch.full_like(smax, tau / worst if worst > tau else 1.0)
    return torch.where(smax > tau, tau / smax, torch.ones_like(smax))


def _scaled(t, f, head_dim: int, qk_norm: str, offset: float):
    """Tensor t (q_proj weight [H*D, d] or bias [H*D]; a q-norm weight [D] or [H*D]) with the query of head h
    scaled by f[h]; rows of unscaled heads stay bit for bit. A norm's scale is offset + weight."""
    import torch

    if qk_norm == "per_head":  # a weight [D] shared by the heads; f is one value
        return (((t.double() + offset) * float(f[0])) - offset).to(t.dtype)
    rows = f.repeat_interleave(head_dim).to(torch.float64)  # [H * D]
    shape = (-1, 1) if t.dim() == 2 else (-1,)
    base = t.double() + (offset if qk_norm == "full" else 0.0)
    scaled = (base * rows.view(shape) - (offset if qk_norm == "full" else 0.0)).to(t.dtype)
    return torch.where((rows == 1).view(shape), t, scaled)


def _query_roles(spec) -> tuple[str, ...]:
    """The tensors that carry a head's query scale: the q-norm weight under QK-norm, else W_q and its bias."""
    return ("q_norm",) if spec.qk_norm != "none" else ("q", "q_bias")


def _clip(req: QKClipRequest, src) -> tuple[list, dict]:
    """Sequential clipping on the calibration text (attnkit.runtime.calibrate: layer l is measured on the outputs of
    the clipped layers before it); returns per-layer (factors [H], max logits seen [H]) and calibration info."""
    spec = src.spec
    loaded = load(src, req.device)
    model = loaded.model
    wins = calib_windows(loaded.tokenizer, req)
    modules = [attention_module_name(src.arch.tensors["q"], src.prefix, i) for i in range(spec.num_layers)]
    clipped: list = [None] * spec.num_layers

    def on_layer(layer: int, hidden, rope, _scaling) -> dict:
        module = model.get_submodule(modules[layer])
        smax = _head_max(module, hidden, rope, spec.layer_windows[layer], spec.qk_norm)  # [H]
        f = head_factors(smax, req.tau, spec.qk_norm)  # [H]
        clipped[layer] = (f, smax)
        if not bool((f < 1).any()):
            return {}
        updates = {}
        for role in _query_roles(spec):
            param = _module_param(module, role)
            if param is not None:
                name = f"{modules[layer]}.{_PARAMS[role]}"
                updates[name] = _scaled(param, f, spec.head_dim, spec.qk_norm, src.arch.norm_offset)
        return updates

    calibrate(model, wins, modules, on_layer)
    info = calib_info(req, wins)
    return clipped, info


#: The attention module's parameter for each role the clip writes.
_PARAMS = {"q": "q_proj.weight", "q_bias": "q_proj.bias", "q_norm": "q_norm.weight"}


def _module_param(module, role: str):
    owner, attr = _PARAMS[role].split(".")
    return getattr(getattr(module, owner), attr, None)


def _rewriter(src, factors):
    spec = src.spec
    targets = {}
    for i, (f, _) in enumerate(factors):
        if bool((f < 1).any()):
            for role in _query_roles(spec):
                if src.tensor(role, i):
                    targets[src.tensor(role, i)] = f

    def rewrite(name, t):
        f = targets.get(name)
        if f is None:
            return {name: t}
        return {name: _scaled(t, f, spec.head_dim, spec.qk_norm, src.arch.norm_offset)}

    return rewrite


def _scaled_tensor(spec) -> str:
    return {
        "none": "q_proj rows (and q bias)",
        "full": "the q-norm weight's slices",
        "per_head": "the q-norm weight (the scale 1 + w where the family stores w)",
    }[spec.qk_norm]


def _scope_notes(spec) -> list[str]:
    if spec.qk_norm != "per_head":
        return []
    return [
        "per-head QK-norm: the q-norm weight is shared by every head of a layer, so a layer is clipped as one: "
        "every head of a clipped layer is scaled by tau / (its worst head's max logit)"
    ]


def _max_logits(ref, req, name: str) -> dict:
    """(layer, head) -> the head's row of attnkit's probe of a model on the calibration text (max_logit_precap
    among them)."""
    loaded = load(ref, req.device)
    return {(r["layer"], r["head"]): r for r in probe(loaded, calib_windows(loaded.tokenizer, req), name=name).heads}


def retrofit_qkclip(req: QKClipRequest) -> dict:
    """Run (or with dry_run, plan) QK-Clip; returns the report (see docs/retrofit.md)."""
    started = time.perf_counter()
    src = check_request(req)
    report = {
        **report_head(req, src.spec.model_type, lead={"retrofit": "qkclip"}),
        "tau": req.tau,
        "scope": "layer" if src.spec.qk_norm == "per_head" else "head",
        "scaled": _scaled_tensor(src.spec),
        "clipped_heads": None,
        "clipped_layers": None,
        "calibration": None,
        "heads": [],
        "notes": _scope_notes(src.spec),
        "warnings": [],
        "eval": None,
        "probe": None,
        "check": None,
    }
    if req.dry_run:
        return timed(report, started)
    before = _max_logits(src, req, "source")
    factors, report["calibration"] = _clip(req, src)
    rows = report["heads"] = _head_rows(factors, before)
    report["clipped_heads"] = sum(r["clipped"] for r in rows)
    report["clipped_layers"] = len({r["layer"] for r in rows if r["clipped"]})
    if not report["clipped_heads"]:  # an unchanged copy would be all the output holds
        report["output"] = None
        report["warnings"].append(_nothing_to_clip(req, rows))
        return timed(report, started)
    write_checkpoint(
        req,
        src,
        "retrofit qkclip",
        config=src.raw_config(),
        weights=lambda writer: stream_weights(src, writer, _rewriter(src, factors)),
        body=lambda: _manifest_body(req, report),
        check=lambda folder: _measure_after(folder, req, rows),
        score=scorer(req, src, report, "retrofit qkclip", report["calibration"]),
    )
    return timed(report, started)


def _head_rows(factors: list, before: dict) -> list[dict]:
    """The report's row of every head: its max logit in the source (probe) and as the clip saw it, its factor."""
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
    return rows


def _nothing_to_clip(req: QKClipRequest, rows: list[dict]) -> str:
    top = max(rows, key=lambda r: r["max_logit_seen"])
    return (
        f"no head's max logit on the calibration text exceeds --tau {req.tau:g} (highest: "
        f"{top['max_logit_seen']:.4g}, layer {top['layer']} head {top['head']}): nothing "
        f"to clip, {req.out} not written"
    )


def _measure_after(folder, req: QKClipRequest, rows: list[dict]) -> None:
    """The written model's max logit per head on the calibration text, into the rows (write_checkpoint's check)."""
    after = _max_logits(folder, req, "result")
    for r in rows:
        r["max_logit_after"] = after[(r["layer"], r["head"])]["max_logit_precap"]


def _manifest_body(req: QKClipRequest, report: dict) -> dict:
    """attnkit.json's entries of the clip: what changed and why, the parameters, calibration and head rows."""
    return {
        "changes": {
            "weights": f"{report['scaled']} of the {report['clipped_heads']} clipped head(s) "
            f"({report['clipped_layers']} layer(s)) scaled by tau / max logit; every other tensor copied unchanged"
        },
        "why": "QK-Clip (Kimi K2): bound each head's max attention logit by tau",
        "parameters": {"tau": req.tau, "scope": report["scope"]},
        "notes": report["notes"],
        "calibration": report["calibration"],
        "heads": report["heads"],
    }
