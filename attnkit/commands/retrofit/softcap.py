"""`retrofit softcap`: write attention and/or final-logit soft-caps into a checkpoint's config.

Weights are copied byte for byte; only config.json changes (attn_logit_softcapping,
final_logit_softcapping). Stock transformers honours the attention cap only for Gemma 2 and the
final cap only for Gemma 2/3 (see attnkit.runtime.capped_attention); elsewhere only attnkit applies them.
`auto` picks a cap from the calibration text so that a chosen fraction of logits is affected
(attnkit.ops.logit_cap defines "affected").
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from attnkit.commands.report_head import report_head, timed
from attnkit.commands.retrofit.common import check_source, load, scorer
from attnkit.commands.rewrite import RewriteRequest, calib_info, calib_windows
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.checkpoint import INDEX_NAME
from attnkit.io.safetensors_header import read_headers
from attnkit.ops.logit_cap import AbsHistogram, cap_for_fraction
from attnkit.progress import phase
from attnkit.runtime.capped_attention import native_support
from attnkit.runtime.hook import attention_hook
from attnkit.runtime.lm import final_hidden

AUTO = "auto"


@dataclass(kw_only=True)
class SoftcapRequest(RewriteRequest):
    """retrofit softcap: the caps to write (a number, "auto" to pick one from --calib text, or None to leave it)."""

    attn_cap: float | str | None = None
    final_cap: float | str | None = None
    affect_fraction: float = 1e-4
    affect_rel: float = 0.01


def _check_cap(name: str, value) -> None:
    if value is None or value == AUTO:
        return
    if not isinstance(value, (int, float)) or not value > 0 or value != value or value == float("inf"):
        raise UsageError(f"{name} must be a positive finite number or 'auto', got {value!r}")


def check_request(req: SoftcapRequest):
    _check_cap("--attn-cap", req.attn_cap)
    _check_cap("--final-cap", req.final_cap)
    if req.attn_cap is None and req.final_cap is None:
        raise UsageError("nothing to do: give --attn-cap C, --auto, or --final-cap F")
    for flag, value in (("--affect-fraction", req.affect_fraction), ("--affect-rel", req.affect_rel)):
        if not 0.0 < value < 1.0:
            raise UsageError(f"{flag} must be in (0, 1), got {value}")
    if AUTO in (req.attn_cap, req.final_cap) and not req.calib:
        raise UsageError("an automatic cap needs calibration text: pass --calib FILE")

    def check(arch, spec, _config) -> None:
        if "sinks" in arch.tensors:
            raise AttnkitError(
                f"{spec.model_type}: attention sinks are not supported by attnkit's soft-capped attention"
            )
        asked = [
            (key, want, have)
            for key, want, have in (
                ("attn_logit_softcapping", req.attn_cap, spec.attn_softcap),
                ("final_logit_softcapping", req.final_cap, spec.final_softcap),
            )
            if want is not None
        ]
        if all(want == have for _, want, have in asked):
            raise UsageError(
                "nothing to change: the model already has "
                + " and ".join(f"{key} = {have:g}" for key, _, have in asked)
            )

    return check_source(req, AUTO in (req.attn_cap, req.final_cap), check)


def _attention_histogram(model, wins):
    """|attention logit| histogram (q.k * scaling before any cap, visible pairs only) over all layers and heads."""
    import torch

    hist = AbsHistogram()

    def on_attention(module, query, key, mask, kwargs):
        groups = query.shape[1] // key.shape[1]
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        k = key.repeat_interleave(groups, dim=1)  # [B, H, Tk, D]
        scores = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling  # [B, H, Tq, Tk]
        hist.add(scores[_visible(mask, scores)])

    label = "attention logits of the calibration text"
    with torch.no_grad(), attention_hook(model, on_attention), phase(label, wins.shape[0], "windows") as advance:
        for i in range(wins.shape[0]):
            model(input_ids=wins[i : i + 1].to(model.device), use_cache=False)
            advance(1)
    return hist


def _visible(mask, scores):
    """Bool [B, H, Tq, Tk] of the pairs a row may attend to (mask None: causal, bottom-right aligned)."""
    import torch

    tq, tk = scores.shape[-2:]
    if mask is None:
        rows = torch.arange(tq, device=scores.device)[:, None] + (tk - tq)
        return (torch.arange(tk, device=scores.device)[None, :] <= rows).expand(scores.shape)
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[..., :tk].expand(scores.shape)


def _final_histogram(model, wins):
    """|final logit| histogram before any final cap, over every position and vocabulary entry."""
    import torch

    hist = AbsHistogram()
    head = model.get_output_embeddings()
    with torch.no_grad(), phase("final logits of the calibration text", wins.shape[0], "windows") as advance:
        for i in range(wins.shape[0]):
            hidden = final_hidden(model, wins[i : i + 1])  # [1, T, d]
            hist.add(head(hidden))  # [1, T, V]
            advance(1)
    return hist


def _auto_caps(req: SoftcapRequest, src) -> dict:
    """Pick the `auto` caps from the calibration text; returns {"attn": {...}, "final": {...}} for those chosen."""

    loaded = load(src, req.device)
    model = loaded.model  # as the source runs (any caps it already has applied); logits are counted before a cap
    wins = calib_windows(loaded.tokenizer, req)
    chosen = {}
    for which, wanted, histogram in (
        ("attn", req.attn_cap, _attention_histogram),
        ("final", req.final_cap, _final_histogram),
    ):
        if wanted != AUTO:
            continue
        hist = histogram(model, wins)
        cap, fraction = cap_for_fraction(hist, req.affect_fraction, req.affect_rel)
        chosen[which] = {
            "cap": cap,
            "affected_fraction": fraction,
            "target_fraction": req.affect_fraction,
            "logits": int(hist.total),
            "max_abs_logit": hist.max,
        }
    chosen["calibration"] = calib_info(req, wins)
    return chosen


def _copy_weights(src, writer) -> dict:
    """Copy the source's safetensors files (and index) unchanged into the writer's folder; name -> shape."""

    folder = writer.folder
    for f in src.ckpt.weight_files:
        shutil.copyfile(f, folder / Path(f).name)
    index = Path(src.ckpt.weight_files[0]).parent / INDEX_NAME
    if index.is_file() and len(src.ckpt.weight_files) > 1:
        shutil.copyfile(index, folder / INDEX_NAME)
    return {name: tuple(info.shape) for name, info in read_headers(src.ckpt.weight_files).items()}


def _patched_config(src, attn_cap, final_cap) -> dict:
    config = src.raw_config()
    target = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    if attn_cap is not None:
        target["attn_logit_softcapping"] = attn_cap
    if final_cap is not None:
        target["final_logit_softcapping"] = final_cap
    return config


#: Families whose llama.cpp converter refuses a written cap (convert_hf_to_gguf.py asserts it is absent), per cap.
LLAMA_CPP_REFUSES = {"gemma3": ("attn_logit_softcapping",), "gemma3_text": ("attn_logit_softcapping",)}


def warnings_for(model_type: str, attn_cap, final_cap) -> list[str]:
    """Plain statements about who honours the written caps: stock transformers, vLLM, llama.cpp (their code; the
    engine behaviour is in docs/serving.md)."""

    native_attn, native_final = native_support(model_type)
    out = []
    ignored = [
        k
        for k, v, n in (
            ("attn_logit_softcapping", attn_cap, native_attn),
            ("final_logit_softcapping", final_cap, native_final),
        )
        if v is not None and not n
    ]
    refused = [k for k in LLAMA_CPP_REFUSES.get(model_type, ()) if k in ignored]
    dropped = [k for k in ignored if k not in refused]
    if ignored:
        it = "it" if len(ignored) == 1 else "them"
        out.append(
            f"{model_type}: stock transformers, vLLM and SGLang ignore {' and '.join(ignored)}; only attnkit "
            f"commands and attnkit.load_model apply {it}"
        )
    if refused:
        out.append(
            f"{model_type}: llama.cpp's converter (convert_hf_to_gguf.py) refuses a config with "
            f"{' and '.join(refused)}: this output does not convert to GGUF"
        )
    if dropped:
        out.append(
            f"{model_type}: llama.cpp's converter writes a GGUF without {' and '.join(dropped)}, which llama.cpp "
            "then does not apply"
        )
    if attn_cap is not None:
        out.append(
            "SDPA cannot soft-cap attention: run the capped model with eager attention "
            "(attnkit does this itself), flex attention or a FlashAttention kernel with softcap"
        )
    return out


def retrofit_softcap(req: SoftcapRequest) -> dict:
    """Run (or with dry_run, plan) the soft-cap retrofit; returns the report (see docs/retrofit.md)."""
    started = time.perf_counter()
    src = check_request(req)
    report = {
        **report_head(req, src.spec.model_type, lead={"retrofit": "softcap"}),
        "before": {"attn_cap": src.spec.attn_softcap, "final_cap": src.spec.final_softcap},
        "attn_cap": req.attn_cap,
        "final_cap": req.final_cap,
        "auto": None,
        "warnings": [],
        "eval": None,
        "probe": None,
        "check": None,
    }
    if req.dry_run:
        report["warnings"] = warnings_for(src.spec.model_type, req.attn_cap, req.final_cap)
        return timed(report, started)
    if AUTO in (req.attn_cap, req.final_cap):
        auto = _auto_caps(req, src)
        report["auto"] = auto
        report["attn_cap"] = auto["attn"]["cap"] if req.attn_cap == AUTO else req.attn_cap
        report["final_cap"] = auto["final"]["cap"] if req.final_cap == AUTO else req.final_cap
    attn_cap, final_cap = report["attn_cap"], report["final_cap"]
    report["warnings"] = warnings_for(src.spec.model_type, attn_cap, final_cap)
    body = {
        "changes": {
            "config": {"attn_logit_softcapping": attn_cap, "final_logit_softcapping": final_cap},
            "weights": "unchanged (copied byte for byte)",
        },
        "why": "soft-capping bounds attention / output logits by cap * tanh(z / cap)",
        "parameters": {
            "attn_cap": req.attn_cap,
            "final_cap": req.final_cap,
            "affect_fraction": req.affect_fraction,
            "affect_rel": req.affect_rel,
        },
        "auto": report["auto"],
        "warnings": report["warnings"],
    }
    write_checkpoint(
        req,
        src,
        "retrofit softcap",
        config=_patched_config(src, attn_cap, final_cap),
        weights=lambda writer: _copy_weights(src, writer),
        body=lambda: body,
        score=scorer(req, src, report, "retrofit softcap", (report["auto"] or {}).get("calibration")),
    )
    return timed(report, started)
