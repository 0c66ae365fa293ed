"""What `retrofit qknorm` fits before it writes: the pad biases bounded from the weights (pad, anchor), the anchor
row of each layer's attention input (anchor), or the norm weights and row scales of the fitted methods (kl, lsq,
scalar, unit) on the source's own activations of the calibration text."""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.commands.retrofit.common import load
from attnkit.commands.retrofit.qknorm_request import QKNormRequest
from attnkit.commands.rewrite import calib_info, calib_windows
from attnkit.io.reader import LazyReader
from attnkit.ops.anchor import ANCHOR_HELDOUT_MAX, anchor_row, heldout_error, scale_error
from attnkit.ops.qknorm import fit_layer, weakest_pair
from attnkit.runtime.calibrate import OutputCapture, attention_module_name, calibrate, token_rows
from attnkit.runtime.streaming import load_for_calibration

#: Bias of the pad dims, in units of the largest possible |q| (or |k|) of a head.
PAD_RATIO = 1000.0
FP16_MAX_PAD = 3.0e4


def calibrate_fits(req: QKNormRequest, src) -> tuple[list, dict]:
    """Per-layer LayerFit from the calibration text (the source model's own activations)."""
    import torch

    spec = src.spec
    loaded = load(src, req.device)
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


def pad_biases(src, reader_get) -> list[tuple[float, float, float]]:
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
    """One layer's anchor: a.x ~ 1 on its attention input, the read-out gain that undoes 1/|a.x| on average, the
    relative mean-square scale error left on the calibration tokens, how the anchor holds on calibration tokens it
    was not fitted on (attnkit.ops.anchor.heldout_error: RMS of a.x - 1, smallest a.x), and the RoPE pair with the
    least logit energy (what a head that keeps its size gives up: the anchor and bias methods)."""

    anchor: object  # torch.Tensor [n]
    gain: float
    scale_error: float
    heldout_error: float
    heldout_min: float
    dropped_pair: int


def anchor_fits(req: QKNormRequest, src) -> tuple[list[AnchorFit], dict]:
    """Per-layer AnchorFit from one pass of the calibration text (decoder layers streamed when possible)."""

    spec = src.spec
    loaded = load_for_calibration(src, req.device)
    wins = calib_windows(loaded.tokenizer, req)
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(spec.num_layers)]
    fits: list = [None] * spec.num_layers
    with LazyReader(src.ckpt.weight_files) as reader:

        def on_layer(layer: int, hidden, *_):
            x = token_rows(hidden, augment=False)  # [N, n] float64
            a = anchor_row(x)
            gain, err = scale_error(1.0 / (x @ a).abs().clamp_min(1e-12))
            held, low = heldout_error(x)
            pair = weakest_pair(
                reader.get(src.tensor("q", layer)),
                reader.get(src.tensor("k", layer)),
                x.T @ x / x.shape[0],
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
            )
            fits[layer] = AnchorFit(a, gain, err, held, low, pair)

        calibrate(loaded.model, wins, modules, on_layer)
    return fits, calib_info(req, wins)


def anchor_holds(fits: list[AnchorFit]) -> tuple[bool, str]:
    """(whether the anchor's assumption holds on held-out calibration tokens, what was measured)."""
    worst = max(range(len(fits)), key=lambda i: fits[i].heldout_error)
    low = min(range(len(fits)), key=lambda i: fits[i].heldout_min)
    said = (
        f"the anchor a.x ~ 1 is off by {fits[worst].heldout_error:.1%} (RMS, layer {worst}) on held-out calibration "
        f"tokens, its smallest value {fits[low].heldout_min:.2f} (layer {low})"
    )
    holds = fits[worst].heldout_error <= ANCHOR_HELDOUT_MAX and fits[low].heldout_min > 0
    return holds, said
