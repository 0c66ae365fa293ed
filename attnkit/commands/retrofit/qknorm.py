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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from attnkit.archs import get_arch
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.retrofit.common import check_source, load, scorer, stream_weights
from attnkit.commands.rewrite import RewriteRequest, calib_info, calib_windows
from attnkit.commands.write import write_checkpoint
from attnkit.engines.targets import vllm_cpu_head_size_ok
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.checkpoint import safetensors_files
from attnkit.io.reader import LazyReader
from attnkit.ops.anchor import anchor_row, fold_o_bias, scale_error, substitute_constant
from attnkit.ops.qknorm import (
    METHODS,
    anchor_norm_weight,
    anchor_slots,
    fit_layer,
    pad_columns,
    pad_norm_weight,
    pad_rows,
    unit_fit,
    weakest_pair,
    widen_columns,
    widen_rows,
)
from attnkit.runtime.calibrate import OutputCapture, attention_module_name, calibrate, token_rows
from attnkit.runtime.streaming import load_for_calibration
from attnkit.units import check_bounds

SOURCES = ("llama", "mistral", "qwen2")
#: What the result is: its new tensors' names come from the registry (attnkit/archs/data/qwen3.json).
QWEN3 = get_arch("qwen3")
#: Most --steps of the kl fit per layer (its default is 150).
MAX_STEPS = 100_000
#: Bias of the pad dims, in units of the largest possible |q| (or |k|) of a head.
PAD_RATIO = 1000.0
FP16_MAX_PAD = 3.0e4
#: Source config keys that Qwen3 does not have (or that the conversion rewrites).
DROP_KEYS = (
    "pretraining_tp",
    "mlp_bias",
    "architectures",
    "model_type",
    "auto_map",
    "_name_or_path",
    "transformers_version",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
)


@dataclass(kw_only=True)
class QKNormRequest(RewriteRequest):
    """retrofit qknorm: how the norm is made (attnkit.ops.qknorm.METHODS) and the anchor method's head size."""

    method: str = "anchor"
    steps: int = 150
    head_dim: int | None = None  # anchor: the new head size (default: default_head_dim)


def default_head_dim(dim: int) -> int:
    """The anchor method's head size: D when vLLM's CPU attention kernels run it (the anchor takes the weakest
    RoPE pair's place and the KV cache keeps its size), else the smallest >= D + 2 that they run."""

    if vllm_cpu_head_size_ok(dim):
        return dim
    new = dim + 2
    while not vllm_cpu_head_size_ok(new):
        new += 2
    return new


def check_request(req: QKNormRequest):
    if req.method not in METHODS:
        raise UsageError(f"unknown --method {req.method!r}; choose from {', '.join(METHODS)}")
    if req.method in ("anchor", "kl", "lsq", "scalar") and not req.calib:
        raise UsageError(f"--method {req.method} fits the norm weights on activations: pass --calib FILE")
    if req.head_dim is not None and req.method != "anchor":
        raise UsageError("--head-dim applies to --method anchor")
    check_bounds("--steps", req.steps, 0, MAX_STEPS)

    def check(arch, spec, config) -> None:
        mt = spec.model_type
        if spec.mla is not None:
            raise AttnkitError(f"{mt}: MLA attention has no per-head q/k to normalise; retrofit qknorm does not apply")
        if spec.qk_norm != "none":
            raise UsageError(f"{mt} already has QK-norm ({spec.qk_norm}); nothing to retrofit")
        if arch.family not in SOURCES:
            raise AttnkitError(f"retrofit qknorm supports {', '.join(SOURCES)} checkpoints, not {mt}")
        if config.get("mlp_bias"):
            raise AttnkitError(f"{mt}: MLP biases (mlp_bias) have no Qwen3 equivalent")
        if spec.partial_rotary_factor != 1.0:
            raise AttnkitError(f"{mt}: partial RoPE ({spec.partial_rotary_factor}) has no Qwen3 equivalent")
        if spec.head_dim % 2:
            raise AttnkitError(f"{mt}: odd head_dim {spec.head_dim}")
        if req.head_dim is not None and (req.head_dim % 2 or not spec.head_dim <= req.head_dim <= 4 * spec.head_dim):
            raise UsageError(
                f"--head-dim must be even and between the source's {spec.head_dim} and "
                f"{4 * spec.head_dim}, got {req.head_dim}"
            )

    return check_source(req, check)


def new_head_dim(req: QKNormRequest, dim: int) -> int:
    if req.method == "pad":
        return dim + 2
    if req.method == "anchor":
        return req.head_dim or default_head_dim(dim)
    return dim


def _qwen3_config(src, method: str, bias: bool, dim: int) -> dict:
    """The Qwen3 config.json: source keys plus head_dim `dim`, attention_bias, sliding layers and a RoPE base
    that keeps the source's frequencies at the new head size."""
    spec, raw = src.spec, src.raw_config()
    config = {k: v for k, v in raw.items() if k not in DROP_KEYS}
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", spec.rope_type or "default")
    rope["rope_theta"] = spec.rope_theta
    config.pop("rope_scaling", None)
    config.pop("rope_theta", None)
    rope["rope_theta"] = float(spec.rope_theta) ** (dim / spec.head_dim)  # pair i keeps frequency theta^(-2i/D)
    windows_ = [w for w in spec.layer_windows if w is not None]
    config.update(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        head_dim=dim,
        attention_bias=bias,
        rope_parameters=rope,
        use_sliding_window=bool(windows_),
        sliding_window=windows_[0] if windows_ else None,
        max_window_layers=spec.num_layers,
        layer_types=["sliding_attention" if w else "full_attention" for w in spec.layer_windows],
    )
    if len(set(windows_)) > 1:
        raise AttnkitError(f"{spec.model_type}: several sliding window sizes; Qwen3 has one")
    return config


def _rope_frequencies(config: dict):
    """(inv_freq [D/2], attention scaling) that transformers computes for a config dict."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model(**config)
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        import torch

        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        theta = cfg.rope_parameters["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv.double(), float(scale)


def check_rope(src, config: dict) -> None:
    """Refuse a pad conversion whose RoPE (type, scaling) would not keep the source frequencies."""
    source_inv, source_scale = _rope_frequencies(src.raw_config())
    new_inv, new_scale = _rope_frequencies(config)
    half = source_inv.shape[0]
    rel = float(((new_inv[:half] - source_inv) / source_inv).abs().max())
    if rel > 1e-6 or abs(new_scale - source_scale) > 1e-6:
        raise AttnkitError(
            f"RoPE type {config['rope_parameters'].get('rope_type')!r} does not keep its frequencies "
            f"when head_dim grows (relative change {rel:.2g}); use --method kl or lsq"
        )


def _calibrate(req: QKNormRequest, src) -> tuple[list, dict]:
    """Per-layer LayerFit from the calibration text (the source model's own activations)."""
    import torch

    spec = src.spec
    loaded = load(src.root, req.device)
    model = loaded.model
    wins = calib_windows(loaded.tokenizer, req)
    attention = [
        model.get_submodule(attention_module_name(src.arch.tensors["q"], src.prefix, i)) for i in range(spec.num_layers)
    ]
    projections = {f"{role}{i}": getattr(attn, f"{role}_proj") for i, attn in enumerate(attention) for role in "qk"}
    with torch.no_grad(), OutputCapture(projections, keep=lambda t: t.detach().float().cpu()) as capture:
        for n in range(wins.shape[0]):
            model(input_ids=wins[n : n + 1].to(loaded.device), use_cache=False)
        outputs = capture.take()  # "q3" -> [N x [1, T, H*D]]
    t = wins.shape[1]
    positions = torch.arange(t)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)  # [1, T, D]
    cos, sin = cos[0].cpu(), sin[0].cpu()
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
    fits = []
    for i in range(spec.num_layers):
        q = torch.cat(outputs.pop(f"q{i}")).view(-1, t, spec.num_heads, spec.head_dim).transpose(1, 2)  # [N, H, T, D]
        k = (
            torch.cat(outputs.pop(f"k{i}")).view(-1, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        )  # [N, Hkv, T, D]
        fits.append(
            fit_layer(
                q, k, cos, sin, spec.head_dim**-0.5, eps, req.method, window=spec.layer_windows[i], steps=req.steps
            )
        )
    info = calib_info(req, wins)
    return fits, info


def _pad_biases(src, reader_get) -> list[tuple[float, float, float]]:
    """Per layer (B_q, B_k, worst relative error) from a bound on |q_h| and |k_h| that holds for every token.

    The attention input is RMSNorm(h) * gamma, so |x| <= max|gamma| sqrt(d); |q_h| <= ||W_qh||_2 |x| + |b_h|.
    """
    import torch

    spec = src.spec
    dtype_name = str(src.config.get("torch_dtype") or src.config.get("dtype") or "float32")
    out = []
    for i in range(spec.num_layers):
        gamma = reader_get(src.tensor("input_norm", i)).double()
        x_max = float(gamma.abs().max()) * spec.hidden_size**0.5
        bounds = []
        for role, heads in (("q", spec.num_heads), ("k", spec.num_kv_heads)):
            w = reader_get(src.tensor(role, i)).double().view(heads, spec.head_dim, -1)  # [heads, D, d]
            norms = torch.linalg.eigvalsh(w @ w.transpose(1, 2))[:, -1].clamp_min(0).sqrt() * x_max  # [heads] ||W_h||_2
            bias_name = src.tensor(f"{role}_bias", i)
            if bias_name:
                norms = norms + reader_get(bias_name).double().view(heads, -1).norm(dim=-1)
            bounds.append(float(norms.max()))
        b = [PAD_RATIO * max(x, 1e-6) for x in bounds]
        if dtype_name == "float16":
            b = [min(x, FP16_MAX_PAD) for x in b]
        b = [float(torch.tensor(x, dtype=getattr(torch, dtype_name)).double()) for x in b]  # as stored
        out.append((b[0], b[1], max(bounds[0] ** 2 / (4 * b[0] ** 2), bounds[1] ** 2 / (4 * b[1] ** 2))))
    return out


@dataclass
class AnchorFit:
    """One layer's anchor: a.x ~ 1 on its attention input, the read-out gain that undoes 1/|a.x| on average,
    the relative mean-square scale error left, and (a head that keeps its size) the RoPE pair it replaces."""

    anchor: object  # torch.Tensor [n]
    gain: float
    scale_error: float
    dropped_pair: int | None


def _anchor_fits(req: QKNormRequest, src, new_dim: int) -> tuple[list[AnchorFit], dict]:
    """Per-layer AnchorFit from one pass of the calibration text (decoder layers streamed when possible)."""

    spec = src.spec
    loaded = load_for_calibration(str(src.root), req.device)
    wins = calib_windows(loaded.tokenizer, req)
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(spec.num_layers)]
    fits: list = [None] * spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:

        def on_layer(layer: int, hidden, *_):
            x = token_rows(hidden, augment=False)  # [N, n] float64
            a = anchor_row(x)
            gain, err = scale_error(1.0 / (x @ a).abs().clamp_min(1e-12))
            pair = None
            if new_dim == spec.head_dim:
                pair = weakest_pair(
                    reader.get(src.tensor("q", layer)),
                    reader.get(src.tensor("k", layer)),
                    x.T @ x / x.shape[0],
                    spec.num_heads,
                    spec.num_kv_heads,
                    spec.head_dim,
                )
            fits[layer] = AnchorFit(a, gain, err, pair)

        calibrate(loaded.model, wins, modules, on_layer)
    return fits, calib_info(req, wins)


def _unbiased_rows(src, layer: int, role: str, t, biases: dict, anchor):
    """role's weight [rows, n] with its bias folded in as b a^T (the constant 1 ~ a.x); v takes o_proj's bias
    too (attention weights sum to 1), when o_proj's range holds it."""
    import torch

    spec = src.spec
    w = t.to(torch.float64)
    bias = biases.get((layer, role))
    if role == "v" and (layer, "o") in biases:
        delta, residual = fold_o_bias(
            biases[(layer, "o_weight")], biases[(layer, "o")], spec.num_heads, spec.num_kv_heads, spec.head_dim
        )
        if residual > 1e-4:
            raise AttnkitError(f"{src.ref}: o_proj's bias is not in the range of o_proj; use --method pad")
        bias = delta if bias is None else bias.to(torch.float64) + delta
    if bias is None:
        return w
    return substitute_constant(torch.cat([w, bias.to(torch.float64)[:, None]], dim=1), anchor)


def _qwen3_name(src, role: str, layer: int) -> str:
    """The name of a tensor the source lacks and Qwen3 has (q_norm, o_bias, ...), by role from the registry."""
    return QWEN3.tensor_name(role, layer, src.prefix)


def _attention_roles(src) -> dict:
    """Tensor name -> (layer, role) for every attention weight and bias the source has."""
    roles = {}
    for i in range(src.spec.num_layers):
        for role in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"):
            name = src.tensor(role, i)
            if name:
                roles[name] = (i, role)
    return roles


def _anchor_rewriter(src, fits: list[AnchorFit], pads: list, biases: dict, new_dim: int):
    """rewrite(name, tensor) for the anchor method: no bias tensors; q/k rows get an anchor row and (new_dim > D)
    zero pad rows, v/o zero pad rows/columns, and q_norm/k_norm weights that are 0 on every pad."""
    import torch

    spec = src.spec
    h, hkv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    roles = _attention_roles(src)

    def rewrite(name, t):
        if name not in roles:
            return {name: t}
        i, role = roles[name]
        if role.endswith("_bias"):
            return {}  # folded into the weights (_unbiased_rows)
        fit = fits[i]
        slot, zero = anchor_slots(dim, new_dim, fit.dropped_pair)
        if role == "o":
            w = t.to(torch.float64)
            out = {name: (widen_columns(w, h, dim, new_dim) if new_dim > dim else w).to(t.dtype)}
            for which, pad, scale in (("q", pads[i][0], (new_dim / dim) ** 0.5), ("k", pads[i][1], 1.0)):
                g = anchor_norm_weight(new_dim, zero, pad, fit.gain, scale)
                out[_qwen3_name(src, f"{which}_norm", i)] = g.to(t.dtype)
            return out
        heads = h if role == "q" else hkv
        w = _unbiased_rows(src, i, role, t, biases, fit.anchor)  # [heads * D, n]
        w = (widen_rows(w, heads, dim, new_dim) if new_dim > dim else w.clone()).view(heads, new_dim, -1)
        if role in ("q", "k"):
            w[:, zero] = 0.0
            w[:, slot] = (pads[i][0] if role == "q" else pads[i][1]) * fit.anchor
        return {name: w.reshape(heads * new_dim, -1).to(t.dtype)}

    return rewrite


def _read_biases(src, reader_get) -> dict:
    """(layer, role) -> bias [out] for every q/k/v/o bias, and (layer, "o_weight") where o_proj has a bias."""
    out = {}
    for i in range(src.spec.num_layers):
        for role in ("q", "k", "v", "o"):
            name = src.tensor(f"{role}_bias", i)
            if name:
                out[(i, role)] = reader_get(name)
        if (i, "o") in out:
            out[(i, "o_weight")] = reader_get(src.tensor("o", i))
    return out


def _rewriter(src, method: str, fits: list | None, pads: list | None, bias: bool):
    """rewrite(name, tensor) for stream_weights: per-layer q/k/v/o changes, new biases and norm weights."""
    import torch

    spec = src.spec
    h, hkv, dim, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    eps = float(src.config.get("rms_norm_eps", 1e-6))
    roles = _attention_roles(src)

    def rewrite(name, t):
        if name not in roles:
            return {name: t}
        i, role = roles[name]
        heads = h if role in ("q", "q_bias", "o") else hkv
        out: dict = {}
        if method == "pad":
            b_q, b_k, _ = pads[i]
            fill = {"q_bias": b_q, "k_bias": b_k}.get(role, 0.0)
            out[name] = pad_columns(t, h, dim) if role == "o" else pad_rows(t, heads, dim, fill)
        elif role in ("q", "q_bias", "k", "k_bias"):
            a = (fits[i].a_q if role.startswith("q") else fits[i].a_k).reshape(-1)  # [heads * D]
            out[name] = (t.double() * (a[:, None] if t.dim() == 2 else a)).to(t.dtype)
        else:
            out[name] = t
        if role == "o":  # the last tensor of the layer: add what Qwen3 needs and the source lacks
            new_dim = dim + 2 if method == "pad" else dim
            if bias:
                for r, n_heads, fill in (
                    ("q", h, pads[i][0] if pads else 0.0),
                    ("k", hkv, pads[i][1] if pads else 0.0),
                    ("v", hkv, 0.0),
                ):
                    if not src.tensor(f"{r}_bias", i):
                        z = torch.zeros(n_heads * dim, dtype=t.dtype)
                        zero_bias = pad_rows(z, n_heads, dim, fill) if method == "pad" else z
                        out[_qwen3_name(src, f"{r}_bias", i)] = zero_bias
                if not src.tensor("o_bias", i):
                    out[_qwen3_name(src, "o_bias", i)] = torch.zeros(hidden, dtype=t.dtype)
            for which in ("q", "k"):
                if method == "pad":
                    b = pads[i][0] if which == "q" else pads[i][1]
                    g = pad_norm_weight(dim, b, eps, ((dim + 2) / dim) ** 0.5 if which == "q" else 1.0)
                else:
                    g = fits[i].g_q if which == "q" else fits[i].g_k
                assert g.shape == (new_dim,)
                out[_qwen3_name(src, f"{which}_norm", i)] = g.to(t.dtype)
        return out

    return rewrite


def _check_loads(folder) -> None:
    """The written folder is a Qwen3 checkpoint whose tensors match what Qwen3ForCausalLM expects."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    if config.model_type != "qwen3":
        raise AttnkitError(f"{folder}: wrote a {config.model_type} config, expected qwen3")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    with LazyReader(safetensors_files(folder)) as reader:
        got = {n: tuple(reader.info(n).shape) for n in reader.names()}
    if config.tie_word_embeddings:
        want.pop(QWEN3.head_name, None)
        got.pop(QWEN3.head_name, None)
    if want != got:
        diff = sorted(set(want.items()) ^ set(got.items()))
        raise AttnkitError(f"{folder}: tensors do not match Qwen3ForCausalLM, e.g. {diff[0]}")


def retrofit_qknorm(req: QKNormRequest) -> dict:
    """Run (or with dry_run, plan) the QK-norm retrofit; returns the report (see docs/retrofit.md)."""

    started = time.perf_counter()
    src = check_request(req)
    spec = src.spec
    has_bias = any(src.tensor(r, 0) for r in ("q_bias", "k_bias", "v_bias", "o_bias"))
    bias = (has_bias and req.method != "anchor") or req.method == "pad"
    dim = new_head_dim(req, spec.head_dim)
    config = _qwen3_config(src, req.method, bias, dim)
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
        "warnings": [],
        "eval": None,
        "probe": None,
    }
    if dim > spec.head_dim:
        report["warnings"].append(
            f"head_dim {spec.head_dim} -> {dim}: the KV cache grows by "
            f"{100 * (dim - spec.head_dim) / spec.head_dim:.1f}%"
        )
    if req.method == "pad":
        report["warnings"].append(
            "--method pad writes q/k/v/o bias tensors (zero where the source has none) and "
            f"head_dim {dim}: llama.cpp has no o_proj bias slot and vLLM's CPU attention "
            "no such head size; --method anchor runs in both"
        )
    if req.dry_run:
        return timed(report, started)
    fits = pads = None
    if req.method in ("pad", "anchor"):
        with LazyReader(src.ckpt.weight_files) as reader:
            pads = _pad_biases(src, reader.get)
            biases = _read_biases(src, reader.get)
    if req.method == "pad":
        report["layers"] = [
            {"layer": i, "pad_bias_q": bq, "pad_bias_k": bk, "max_rel_error": err, "attention_kl": None}
            for i, (bq, bk, err) in enumerate(pads)
        ]
        rewrite = _rewriter(src, req.method, fits, pads, bias)
    elif req.method == "anchor":
        anchors, report["calibration"] = _anchor_fits(req, src, dim)
        report["layers"] = [
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
        rewrite = _anchor_rewriter(src, anchors, pads, biases, dim)
    else:
        if req.method == "unit" and not req.calib:
            fits = [unit_fit(spec.num_heads, spec.num_kv_heads, spec.head_dim)] * spec.num_layers
        else:
            fits, report["calibration"] = _calibrate(req, src)
        report["layers"] = [
            {"layer": i, "pad_bias_q": None, "pad_bias_k": None, "max_rel_error": None, "attention_kl": f.kl}
            for i, f in enumerate(fits)
        ]
        rewrite = _rewriter(src, req.method, fits, pads, bias)
    added = "q_norm/k_norm weights per layer"
    if bias and not src.tensor("o_bias", 0):
        added += ", zero o_proj bias"
    body = {
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
    write_checkpoint(
        req,
        src,
        "retrofit qknorm",
        config=config,
        weights=lambda writer: stream_weights(src, writer, rewrite),
        body=lambda: body,
        check=_check_loads,
        score=scorer(req, src, report),
    )
    return timed(report, started)
