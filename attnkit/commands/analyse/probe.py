"""`attnkit probe`: attention statistics of models on text windows, per layer and head (`probe`), the command's
orchestration (`run_probe`: checks before any model loads, then each model in turn, output files, --fail-if
rules of attnkit.commands.analyse.probe_rules) and the before/after summary rewrite reports print."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.commands.analyse.probe_report import PLOT_SUFFIXES, TABLE_SUFFIXES, check_output_path, plot, write_table
from attnkit.commands.analyse.probe_rules import max_logit_limit, parse_rule
from attnkit.errors import UsageError
from attnkit.ops.attnstats import LayerStats, Moments, accumulate_attention
from attnkit.progress import phase
from attnkit.runtime import make_windows
from attnkit.runtime.hook import attention_hook, layer_index
from attnkit.runtime.layerwise import check_run_options, open_model
from attnkit.runtime.lm import batch_hidden, head_module, logit_chunks
from attnkit.runtime.loader import check_models, unwrap
from attnkit.runtime.texts import check_text_files, check_window_options, read_texts
from attnkit.units import MAX_COUNT, check_bounds


@dataclass
class ProbeResult:
    """Per-head rows (see docs/probe.md for the field names) and final-logit statistics of one model."""

    model: str
    tokens: int
    windows: int
    seq_len: int
    threshold: float
    z_lambda: float
    heads: list[dict] = field(default_factory=list)
    final: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "tokens": self.tokens,
            "windows": self.windows,
            "seq_len": self.seq_len,
            "threshold": self.threshold,
            "z_lambda": self.z_lambda,
            "final": self.final,
            "heads": self.heads,
        }


def _f(x) -> float | None:
    x = float(x)
    return None if math.isinf(x) or math.isnan(x) else x


def _head_rows(name: str, layers: dict) -> list[dict]:
    rows = []
    for layer in sorted(layers):
        st = layers[layer]
        groups = st.heads // st.kv_heads
        for h in range(st.heads):
            n = float(st.logits.n[h])
            kv = h // groups
            rows.append(
                {
                    "model": name,
                    "layer": layer,
                    "head": h,
                    "kv_head": kv,
                    "window": st.window,
                    "scores": int(n),
                    "max_logit": _f(st.logits.max[h]),
                    "max_logit_precap": _f(st.precap_max[h]),
                    "min_logit": _f(st.logits.min[h]),
                    "mean_logit": _f(st.logits.mean[h]),
                    "std_logit": _f(st.logits.std[h]),
                    "frac_above": float(st.above[h]) / n if n else None,
                    "logz_mean": _f(st.logz.mean[h]),
                    "logz_std": _f(st.logz.std[h]),
                    "logz_min": _f(st.logz.min[h]),
                    "logz_max": _f(st.logz.max[h]),
                    "entropy_mean": _f(st.entropy.mean[h]),
                    "max_prob_mean": _f(st.max_prob.mean[h]),
                    "q_rms_mean": _f(st.q_rms.mean[h]),
                    "q_rms_max": _f(st.q_rms.max[h]),
                    "k_rms_mean": _f(st.k_rms.mean[kv]),
                    "k_rms_max": _f(st.k_rms.max[kv]),
                }
            )
    return rows


def probe(
    model,
    windows,
    *,
    threshold: float = 100.0,
    z_lambda: float = 1e-4,
    batch_size: int = 1,
    progress: Callable[[int], None] | None = None,
    name: str = "model",
) -> ProbeResult:
    """Run `model` (LoadedModel, nn.Module or LayerStreamed) over windows [N, T] and collect per-head attention
    statistics."""
    import torch

    runner = unwrap(model)
    model = head_module(runner)
    layers: dict[int, LayerStats] = {}
    index = layer_index(model)

    def on_attention(module, query, key, mask, kwargs):
        layer = index(module)
        st = layers.get(layer)
        if st is None:
            st = layers[layer] = LayerStats(query.shape[1], key.shape[1], threshold, kwargs.get("sliding_window"))
        scaling = kwargs.get("scaling")
        causal = kwargs.get("is_causal")
        accumulate_attention(
            st,
            query.detach(),
            key.detach(),
            mask,
            scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
            cap=kwargs.get("softcap"),
            sinks=getattr(module, "sinks", None),
            causal=getattr(module, "is_causal", True) if causal is None else causal,
        )

    final_logz, final_max = Moments(1), -math.inf
    sum_sq = 0.0
    label = f"probing {name}: {windows.shape[0]} window(s) x {windows.shape[1]} tokens"
    with torch.no_grad(), attention_hook(model, on_attention), phase(label, windows.shape[0], "windows") as advance:
        for ids, hidden in batch_hidden(runner, windows, batch_size):  # ids [B, T], hidden [B, T, d]
            for _, logits in logit_chunks(model, hidden):  # [B, c, V]
                logz = torch.logsumexp(logits, -1)  # [B, c]
                final_logz.add(logz.reshape(1, 1, -1))
                sum_sq += logz.double().pow(2).sum().item()
                final_max = max(final_max, logits.max().item())
            advance(ids.shape[0])
            if progress is not None:
                progress(ids.shape[0])
    positions = int(final_logz.n[0])
    final = {
        "positions": positions,
        "final_logit_max": _f(final_max),
        "final_logz_mean": _f(final_logz.mean[0]),
        "final_logz_std": _f(final_logz.std[0]),
        "final_logz_max": _f(final_logz.max[0]),
        "z_loss": z_lambda * sum_sq / positions,
    }
    return ProbeResult(
        model=name,
        tokens=int(windows.numel()),
        windows=int(windows.shape[0]),
        seq_len=int(windows.shape[1]),
        threshold=threshold,
        z_lambda=z_lambda,
        heads=_head_rows(name, layers),
        final=final,
    )


def _layer_summary(heads: list[dict]) -> dict[int, dict]:
    layers: dict[int, dict] = {}
    for row in heads:
        s = layers.setdefault(row["layer"], {"max_logit": None, "logz_mean": [], "logz_max": None})
        s["max_logit"] = _max(s["max_logit"], row["max_logit"])
        s["logz_max"] = _max(s["logz_max"], row["logz_max"])
        if row["logz_mean"] is not None:
            s["logz_mean"].append(row["logz_mean"])
    for s in layers.values():
        s["logz_mean"] = sum(s["logz_mean"]) / len(s["logz_mean"]) if s["logz_mean"] else None
    return layers


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


def probe_summary(before: ProbeResult, after: ProbeResult) -> dict:
    """Per layer: max attention logit (over heads), mean and max log Z, before vs after; final-logit stats."""
    b, a = _layer_summary(before.heads), _layer_summary(after.heads)
    rows = [
        {
            "layer": layer,
            "max_logit_before": b[layer]["max_logit"],
            "max_logit_after": a[layer]["max_logit"],
            "logz_mean_before": b[layer]["logz_mean"],
            "logz_mean_after": a[layer]["logz_mean"],
            "logz_max_before": b[layer]["logz_max"],
            "logz_max_after": a[layer]["logz_max"],
        }
        for layer in sorted(set(b) & set(a))
    ]
    keys = ("final_logit_max", "final_logz_mean", "final_logz_max", "z_loss")
    return {"layers": rows, "final": {k: {"before": before.final.get(k), "after": after.final.get(k)} for k in keys}}


@dataclass(kw_only=True)
class ProbeRequest:
    """attnkit probe: the models, the text, how it is cut and run, the thresholds and output files."""

    models: list[str]
    texts: list[str] = field(default_factory=list)
    text: str | None = None
    seq_len: int = 512
    max_tokens: int | None = None
    batch_size: int = 1
    threshold: float = 100.0
    z_lambda: float = 1e-4
    fail_if: list[str] = field(default_factory=list)
    out: str | None = None
    plot: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    layer_stream: str = "auto"  # auto | always | never (attnkit.runtime.layerwise)
    device_map: str | None = None  # auto: accelerate places the model over the GPUs


def check_request(req: ProbeRequest):
    """Options, rules, output paths, text files and every model, before the first model loads; returns
    (rules, text inputs, the models' opened Sources)."""

    if not req.models:
        raise UsageError("give at least one model")
    rules = [parse_rule(r) for r in req.fail_if]
    check_window_options(req.seq_len, req.max_tokens)
    check_bounds("--batch-size", req.batch_size, 1, MAX_COUNT)
    check_bounds("--threshold", req.threshold)
    check_bounds("--z-lambda", req.z_lambda, 0)
    check_run_options(req.layer_stream, req.device_map)
    for path, option, suffixes in ((req.out, "--out", TABLE_SUFFIXES), (req.plot, "--plot", PLOT_SUFFIXES)):
        if path:
            check_output_path(path, option, suffixes)
    check_text_files(req.texts)
    texts = read_texts(req.texts, req.text)
    sources = check_models(req.models, req.device, req.dtype, req.layer_stream)
    return rules, texts, sources


def run_probe(req: ProbeRequest, log: Callable[[str], None] = lambda message: None) -> tuple[list[ProbeResult], list]:
    """Probe every model on the same text (one loaded at a time), write --out and --plot; returns the results and
    the --fail-if rules, which the caller checks once the results are shown (check_rules)."""

    rules, texts, sources = check_request(req)
    results = []
    for ref, source in zip(req.models, sources):
        loaded = open_model(
            source, device=req.device, dtype=req.dtype, layer_stream=req.layer_stream, device_map=req.device_map
        )
        windows = make_windows(loaded.tokenizer, texts, req.seq_len, req.max_tokens)
        log(f"probing {ref}: {windows.shape[0]} window(s) of {req.seq_len} tokens")
        results.append(
            probe(loaded, windows, threshold=req.threshold, z_lambda=req.z_lambda, batch_size=req.batch_size, name=ref)
        )
        del loaded
    if req.out:
        write_table(results, req.out)
    if req.plot:
        plot(results, req.plot, limit=max_logit_limit(rules))
    return results, rules
