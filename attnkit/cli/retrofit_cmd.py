"""`attnkit retrofit softcap|qknorm|qkclip`: stability features added to an existing checkpoint, cost measured."""

from __future__ import annotations

from typing import Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, print_notes
from attnkit.cli.options import Format, request_fields, rewrite_groups, writes
from attnkit.cli.output import Column, eval_caption, finish_check, render, render_rewrite_scores

app = typer.Typer(
    name="retrofit",
    no_args_is_help=True,
    help="Add soft-capping, QK-norm or QK-clip to an existing checkpoint and measure the cost.",
)


def _num(v, fmt: str = "{:.4g}") -> str:
    return "-" if v is None else fmt.format(v)


def _finish(report: dict, rows: list, columns: list, fmt: OutputFormat, title: str, caption: str) -> None:
    """Print the warnings (stderr), the main table and, outside JSON/CSV, the probe summary table; the self-check's
    verdict last."""
    print_notes(warnings=report.get("warnings", []))
    if report["dry_run"]:
        caption += " (dry run, nothing written)"
    else:
        caption += f"; wrote {report['output']}" if report["output"] else "; nothing written"
    render(rows, columns, fmt, title=title, json_obj=report, caption=caption + eval_caption(report.get("eval")))
    render_rewrite_scores(report.get("eval"), fmt)
    probe = report.get("probe")
    if probe and fmt in (OutputFormat.table, OutputFormat.markdown):
        cols = [Column("layer", "layer")] + [
            Column(f"{k}_{w}", f"{label} {w}", _num)
            for k, label in (("max_logit", "max logit"), ("logz_mean", "mean log Z"), ("logz_max", "max log Z"))
            for w in ("before", "after")
        ]
        final = probe["final"]
        render(
            probe["layers"],
            cols,
            fmt,
            title="probe on --eval text: source (before) vs result (after)",
            caption="final logits: "
            + ", ".join(f"{k} {_num(v['before'])} -> {_num(v['after'])}" for k, v in final.items()),
        )
    finish_check(report, f"retrofit {report['retrofit']}")


def _cap(text: Optional[str], name: str):
    if text is None or text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        from attnkit.errors import UsageError

        raise UsageError(f"{name} must be a positive number or 'auto', got {text!r}") from None


@app.command(
    "softcap",
    epilog=examples(
        "attnkit retrofit softcap ./my-model ./capped --attn-cap 50 --eval heldout.txt",
        "attnkit retrofit softcap ./my-model ./capped --auto --calib calib.txt --final-cap 30",
    ),
)
@handle_errors
@writes(*rewrite_groups())
def softcap(
    attn_cap: Optional[str] = typer.Option(
        None, "--attn-cap", help="Attention logit cap C (cap * tanh(z / cap)), or auto."
    ),
    final_cap: Optional[str] = typer.Option(None, "--final-cap", help="Final (output) logit cap F, or auto."),
    auto: bool = typer.Option(
        False, "--auto", help="Pick the attention cap from --calib text (same as --attn-cap auto)."
    ),
    affect_fraction: float = typer.Option(
        1e-4, "--affect-fraction", help="auto: fraction of logits the cap may affect."
    ),
    affect_rel: float = typer.Option(
        0.01, "--affect-rel", help="A logit is affected when the cap moves it by more than this fraction."
    ),
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """Write attn_logit_softcapping / final_logit_softcapping into the config (weights unchanged)."""
    from attnkit.commands.retrofit.softcap import SoftcapRequest, retrofit_softcap
    from attnkit.errors import UsageError

    if auto and attn_cap is not None:
        raise UsageError("give either --attn-cap or --auto, not both")
    req = SoftcapRequest(
        **request_fields(shared),
        attn_cap="auto" if auto else _cap(attn_cap, "--attn-cap"),
        final_cap=_cap(final_cap, "--final-cap"),
        affect_fraction=affect_fraction,
        affect_rel=affect_rel,
    )
    report = retrofit_softcap(req)
    auto_info = report["auto"] or {}
    rows = [
        {
            "logits": which,
            "before": report["before"][f"{key}_cap"],
            "after": report[f"{key}_cap"],
            "affected": (auto_info.get(key) or {}).get("affected_fraction"),
            "max_abs": (auto_info.get(key) or {}).get("max_abs_logit"),
        }
        for which, key in (("attention", "attn"), ("final", "final"))
    ]
    columns = [
        Column("logits", "logits", justify="left"),
        Column("before", "cap before"),
        Column("after", "cap after"),
        Column("affected", "affected (calib)"),
        Column("max_abs", "max |logit| (calib)"),
    ]
    _finish(report, rows, columns, fmt, f"retrofit softcap: {shared['model']}", f"{report['model_type']}")


@app.command(
    "qknorm", epilog=examples("attnkit retrofit qknorm ./my-model ./qknormed --calib calib.txt --eval heldout.txt")
)
@handle_errors
@writes(*rewrite_groups())
def qknorm(
    method: str = typer.Option(
        "auto",
        "--method",
        "-m",
        help="auto (anchor where it holds and passes the self-check, else bias; needs --calib), anchor (no bias "
        "tensors, a head size engines run), bias (head_dim kept, q/k/v/o bias tensors: transformers and vLLM), "
        "pad (exact, head_dim + 2, bias tensors: transformers only), kl, lsq, scalar or unit "
        "(keep head_dim, fitted on --calib).",
    ),
    head_dim: int = typer.Option(
        None,
        "--head-dim",
        help="anchor: new head size (default: the source's, giving up its weakest RoPE pair, "
        "when vLLM's CPU kernels run it; else the smallest >= head_dim + 2 they run).",
    ),
    steps: int = typer.Option(150, "--steps", min=0, help="kl: gradient steps per layer."),
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """Turn a Llama, Mistral or Qwen2 checkpoint into a stock Qwen3 checkpoint with per-head QK-norm."""
    from attnkit.commands.retrofit.qknorm import QKNormRequest, retrofit_qknorm

    report = retrofit_qknorm(QKNormRequest(**request_fields(shared), method=method, steps=steps, head_dim=head_dim))
    columns = [
        Column("layer", "layer"),
        Column("pad_bias_q", "pad bias q", _num),
        Column("pad_bias_k", "pad bias k", _num),
        Column("max_rel_error", "max rel. error", _num),
        Column("attention_kl", "attention KL (calib)", _num),
        Column("anchor_heldout_error", "anchor held-out error", _num),
    ]
    caption = (
        f"{report['model_type']} -> qwen3, method {report['method']}, head_dim {report['head_dim_before']} -> "
        f"{report['head_dim_after']}, attention_bias {report['attention_bias']}"
    )
    passed_over = report["tried"][:-1]  # the last one tried is what was written
    print_notes(
        [f"--method auto passed over {t['method']}: {t['verdict']} ({t['why']})" for t in passed_over]
        + ([f"--method auto wrote {report['method']}"] if passed_over else [])
    )
    _finish(report, report["layers"], columns, fmt, f"retrofit qknorm: {shared['model']}", caption)


@app.command(
    "qkclip",
    epilog=examples("attnkit retrofit qkclip ./my-model ./clipped --tau 100 --calib calib.txt --eval heldout.txt"),
)
@handle_errors
@writes(*rewrite_groups())
def qkclip(
    tau: float = typer.Option(100.0, "--tau", help="Largest attention logit a head may reach on the --calib text."),
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """QK-Clip once: scale the query of every head whose max logit on --calib text exceeds --tau by tau / max.

    Without QK-norm W_q's rows are scaled; with per-head QK-norm (Qwen3, Gemma 3) the layer's shared q-norm weight,
    so every head of a clipped layer is scaled by the factor of its worst head.
    """
    from attnkit.commands.retrofit.qkclip import QKClipRequest, retrofit_qkclip

    report = retrofit_qkclip(QKClipRequest(**request_fields(shared), tau=tau))
    rows = report["heads"] if fmt == OutputFormat.json else [r for r in report["heads"] if r["clipped"]]
    columns = [
        Column("layer", "layer"),
        Column("head", "head"),
        Column("max_logit_before", "max logit source", _num),
        Column("max_logit_seen", "max logit seen", _num),
        Column("factor", "query factor", _num),
        Column("max_logit_after", "max logit after", _num),
    ]
    caption = f"{report['model_type']}, tau {report['tau']:g}: {report['clipped_heads']} head(s) clipped"
    if report["scope"] == "layer" and report["clipped_layers"] is not None:
        caption += f" in {report['clipped_layers']} layer(s), every head of a clipped layer scaled (per-head QK-norm)"
    print_notes(report["notes"])
    _finish(report, rows, columns, fmt, f"retrofit qkclip: {shared['model']} (clipped heads)", caption)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="retrofit")
