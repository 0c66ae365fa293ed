"""`attnkit retrofit softcap|qknorm|qkclip`: stability features added to an existing checkpoint, cost measured."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from attnkit.cli.common import (FORMAT_OPTION, SAMPLE_OPTION, OutputFormat, examples, handle_errors,
                                sample_prompts_or_default, stderr)
from attnkit.cli.output import Column, render, render_samples

app = typer.Typer(name="retrofit", no_args_is_help=True,
                  help="Add soft-capping, QK-norm or QK-clip to an existing checkpoint and measure the cost.")

MODEL_ARG = typer.Argument(..., help="Source: folder, .safetensors, .gguf (materialized first) or hub id[@revision].")
OUT_ARG = typer.Argument(..., help="Output folder (must be empty or absent unless --overwrite).")


def _common():
    """Options every retrofit takes (typer declares them per command)."""
    return dict(
        calib=typer.Option([], "--calib", help="Calibration text file(s) (.txt, .jsonl)."),
        calib_tokens=typer.Option(2048, "--calib-tokens", min=2, help="Calibration tokens (whole windows)."),
        calib_seq_len=typer.Option(512, "--calib-seq-len", min=2, help="Tokens per calibration window."),
        eval_files=typer.Option([], "--eval", help="Held-out text: perplexity and KL vs the source, probe before/after."),
        eval_tokens=typer.Option(4096, "--eval-tokens", min=2, help="At most this many evaluation tokens."),
        eval_seq_len=typer.Option(512, "--eval-seq-len", min=2, help="Tokens per evaluation window."),
        sample_prompts=SAMPLE_OPTION,
        max_shard_size=typer.Option("1GiB", "--max-shard-size", help="Largest output shard."),
        device=typer.Option("auto", "--device", help="Calibration/eval device: auto, cpu, cuda, cuda:N, mps."),
        overwrite=typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
        dry_run=typer.Option(False, "--dry-run", help="Check and print the plan; write nothing."),
    )


_O = _common()


def _options(model, out, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens, eval_seq_len, sample_prompts,
             max_shard_size, device, overwrite, dry_run):
    from attnkit.commands.retrofit.common import RetrofitOptions
    from attnkit.units import parse_bytes

    return RetrofitOptions(model=model, out=out, calib=list(calib), calib_tokens=calib_tokens,
                           calib_seq_len=calib_seq_len, eval=list(eval_files), eval_tokens=eval_tokens,
                           eval_seq_len=eval_seq_len, sample_prompts=sample_prompts_or_default(sample_prompts),
                           overwrite=overwrite, dry_run=dry_run, device=device,
                           max_shard_bytes=parse_bytes(max_shard_size, "--max-shard-size"),
                           command=shlex.join(["attnkit", *sys.argv[1:]]))


def _num(v, fmt: str = "{:.4g}") -> str:
    return "-" if v is None else fmt.format(v)


def _eval_caption(report: dict) -> str:
    e = report.get("eval")
    if not e:
        return ""
    return (f"; perplexity {e['source_perplexity']:.3f} -> {e['perplexity']:.3f} on {e['tokens']} tokens, "
            f"KL {e['kl_mean']:.4g}, top-1 agreement {e['top1_agreement']:.3f}")


def _finish(report: dict, rows: list, columns: list, fmt: OutputFormat, title: str, caption: str) -> None:
    """Print the warnings (stderr), the main table and, outside JSON/CSV, the probe summary table."""
    for warning in report.get("warnings", []):
        stderr.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, markup=True)
    if report["dry_run"]:
        caption += " (dry run, nothing written)"
    else:
        caption += f"; wrote {report['output']}" if report["output"] else "; nothing written"
    render(rows, columns, fmt, title=title, json_obj=report, caption=caption + _eval_caption(report))
    render_samples(report.get("eval"), fmt)
    probe = report.get("probe")
    if probe and fmt in (OutputFormat.table, OutputFormat.markdown):
        cols = [Column("layer", "layer")] + [
            Column(f"{k}_{w}", f"{label} {w}", _num) for k, label in
            (("max_logit", "max logit"), ("logz_mean", "mean log Z"), ("logz_max", "max log Z"))
            for w in ("before", "after")]
        final = probe["final"]
        render(probe["layers"], cols, fmt, title="probe on --eval text: source (before) vs result (after)",
               caption="final logits: " + ", ".join(
                   f"{k} {_num(v['before'])} -> {_num(v['after'])}" for k, v in final.items()))


def _cap(text: Optional[str], name: str):
    if text is None or text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        from attnkit.errors import UsageError

        raise UsageError(f"{name} must be a positive number or 'auto', got {text!r}") from None


@app.command("softcap", epilog=examples(
    "attnkit retrofit softcap ./my-model ./capped --attn-cap 50 --eval heldout.txt",
    "attnkit retrofit softcap ./my-model ./capped --auto --calib calib.txt --final-cap 30"))
@handle_errors
def softcap(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    attn_cap: Optional[str] = typer.Option(None, "--attn-cap", help="Attention logit cap C (cap * tanh(z / cap)), or auto."),
    final_cap: Optional[str] = typer.Option(None, "--final-cap", help="Final (output) logit cap F, or auto."),
    auto: bool = typer.Option(False, "--auto", help="Pick the attention cap from --calib text (same as --attn-cap auto)."),
    affect_fraction: float = typer.Option(1e-4, "--affect-fraction", help="auto: fraction of logits the cap may affect."),
    affect_rel: float = typer.Option(0.01, "--affect-rel", help="A logit is affected when the cap moves it by more than this fraction."),
    calib: List[str] = _O["calib"], calib_tokens: int = _O["calib_tokens"], calib_seq_len: int = _O["calib_seq_len"],
    eval_files: List[str] = _O["eval_files"], eval_tokens: int = _O["eval_tokens"],
    eval_seq_len: int = _O["eval_seq_len"], sample_prompts: List[str] = _O["sample_prompts"],
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"],
    overwrite: bool = _O["overwrite"], dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """Write attn_logit_softcapping / final_logit_softcapping into the config (weights unchanged)."""
    from attnkit.commands.retrofit.softcap import SoftcapRequest, retrofit_softcap
    from attnkit.errors import UsageError

    if auto and attn_cap is not None:
        raise UsageError("give either --attn-cap or --auto, not both")
    if not 0.0 < affect_rel < 1.0:
        raise UsageError(f"--affect-rel must be in (0, 1), got {affect_rel}")
    req = SoftcapRequest(
        opts=_options(model, out, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens, eval_seq_len,
                      sample_prompts, max_shard_size, device, overwrite, dry_run),
        attn_cap="auto" if auto else _cap(attn_cap, "--attn-cap"), final_cap=_cap(final_cap, "--final-cap"),
        affect_fraction=affect_fraction, affect_rel=affect_rel)
    report = retrofit_softcap(req)
    auto_info = report["auto"] or {}
    rows = [{"logits": which, "before": report["before"][f"{key}_cap"], "after": report[f"{key}_cap"],
             "affected": (auto_info.get(key) or {}).get("affected_fraction"),
             "max_abs": (auto_info.get(key) or {}).get("max_abs_logit")}
            for which, key in (("attention", "attn"), ("final", "final"))]
    columns = [Column("logits", "logits", justify="left"), Column("before", "cap before"),
               Column("after", "cap after"), Column("affected", "affected (calib)"),
               Column("max_abs", "max |logit| (calib)")]
    _finish(report, rows, columns, fmt, f"retrofit softcap: {model}", f"{report['model_type']}")


@app.command("qknorm", epilog=examples(
    "attnkit retrofit qknorm ./my-model ./qknormed --calib calib.txt --eval heldout.txt"))
@handle_errors
def qknorm(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    method: str = typer.Option("anchor", "--method", "-m",
                               help="anchor (no bias tensors, a head size engines run; needs --calib), pad (exact, "
                                    "head_dim + 2, bias tensors: transformers only), kl, lsq, scalar or unit "
                                    "(keep head_dim, fitted on --calib)."),
    head_dim: int = typer.Option(None, "--head-dim",
                                 help="anchor: new head size (default: the source's, giving up its weakest RoPE pair, "
                                      "when vLLM's CPU kernels run it; else the smallest >= head_dim + 2 they run)."),
    steps: int = typer.Option(150, "--steps", min=0, help="kl: gradient steps per layer."),
    calib: List[str] = _O["calib"], calib_tokens: int = _O["calib_tokens"], calib_seq_len: int = _O["calib_seq_len"],
    eval_files: List[str] = _O["eval_files"], eval_tokens: int = _O["eval_tokens"],
    eval_seq_len: int = _O["eval_seq_len"], sample_prompts: List[str] = _O["sample_prompts"],
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"],
    overwrite: bool = _O["overwrite"], dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """Turn a Llama, Mistral or Qwen2 checkpoint into a stock Qwen3 checkpoint with per-head QK-norm."""
    from attnkit.commands.retrofit.qknorm import QKNormRequest, retrofit_qknorm

    req = QKNormRequest(opts=_options(model, out, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens,
                                      eval_seq_len, sample_prompts, max_shard_size, device, overwrite, dry_run),
                        method=method, steps=steps, head_dim=head_dim)
    report = retrofit_qknorm(req)
    columns = [Column("layer", "layer"), Column("pad_bias_q", "pad bias q", _num), Column("pad_bias_k", "pad bias k", _num),
               Column("max_rel_error", "max rel. error", _num), Column("attention_kl", "attention KL (calib)", _num)]
    caption = (f"{report['model_type']} -> qwen3, method {report['method']}, head_dim {report['head_dim_before']} -> "
               f"{report['head_dim_after']}, attention_bias {report['attention_bias']}")
    _finish(report, report["layers"], columns, fmt, f"retrofit qknorm: {model}", caption)


@app.command("qkclip", epilog=examples(
    "attnkit retrofit qkclip ./my-model ./clipped --tau 100 --calib calib.txt --eval heldout.txt"))
@handle_errors
def qkclip(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    tau: float = typer.Option(100.0, "--tau", help="Largest attention logit a head may reach on the --calib text."),
    calib: List[str] = _O["calib"], calib_tokens: int = _O["calib_tokens"], calib_seq_len: int = _O["calib_seq_len"],
    eval_files: List[str] = _O["eval_files"], eval_tokens: int = _O["eval_tokens"],
    eval_seq_len: int = _O["eval_seq_len"], sample_prompts: List[str] = _O["sample_prompts"],
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"],
    overwrite: bool = _O["overwrite"], dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """QK-Clip once: scale W_q of every head whose max logit on --calib text exceeds --tau by tau / max."""
    from attnkit.commands.retrofit.qkclip import QKClipRequest, retrofit_qkclip

    req = QKClipRequest(opts=_options(model, out, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens,
                                      eval_seq_len, sample_prompts, max_shard_size, device, overwrite, dry_run), tau=tau)
    report = retrofit_qkclip(req)
    rows = report["heads"] if fmt == OutputFormat.json else [r for r in report["heads"] if r["clipped"]]
    columns = [Column("layer", "layer"), Column("head", "head"), Column("max_logit_before", "max logit source", _num),
               Column("max_logit_seen", "max logit seen", _num), Column("factor", "W_q factor", _num),
               Column("max_logit_after", "max logit after", _num)]
    caption = f"{report['model_type']}, tau {report['tau']:g}: {report['clipped_heads']} head(s) clipped"
    _finish(report, rows, columns, fmt, f"retrofit qkclip: {model} (clipped heads)", caption)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="retrofit")
