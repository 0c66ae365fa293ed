"""`attnkit probe MODEL... TEXT...`: attention-logit, log Z and entropy statistics per layer and head."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, log_sink
from attnkit.cli.options import BatchSize, Device, DeviceMap, Dtype, Format, LayerStream, MaxTokens, SeqLen, Text
from attnkit.cli.output import Column, render

TEXT_SUFFIXES = (".txt", ".jsonl")


def _split(args: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments ending in .txt/.jsonl (or '-') are text inputs, the others are models."""
    texts = [a for a in args if a == "-" or a.lower().endswith(TEXT_SUFFIXES)]
    return [a for a in args if a not in texts], texts


def _num(v) -> str:
    return f"{v:.4g}"


def register(app: typer.Typer) -> None:
    @app.command(
        "probe",
        epilog=examples(
            "attnkit probe ./my-model prose.txt --fail-if 'max_logit>100' --plot heads.png",
            "attnkit probe ./my-model ./clipped heldout.txt --out heads.parquet --format json",
        ),
    )
    @handle_errors
    def probe_(
        args: List[str] = typer.Argument(
            ...,
            help="Models (folder, .safetensors, .gguf, hub id), then text files "
            "(.txt, .jsonl with 'text'; '-' = stdin).",
        ),
        text: Text = None,
        seq_len: SeqLen = 512,
        max_tokens: MaxTokens = None,
        batch_size: BatchSize = 1,
        threshold: float = typer.Option(100.0, "--threshold", help="Count attention logits above this value."),
        z_lambda: float = typer.Option(1e-4, "--z-lambda", help="z-loss weight: lambda * mean((log Z)^2)."),
        fail_if: Optional[List[str]] = typer.Option(
            None,
            "--fail-if",
            help="Exit 3 when crossed, e.g. 'max_logit>100' (also logz_max, entropy_min, z_loss, ...); repeatable.",
        ),
        out: Optional[str] = typer.Option(None, "--out", help="Write per-head rows to FILE.parquet or FILE.csv."),
        plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG: max-logit heatmap and log Z per layer."),
        top: int = typer.Option(20, "--top", min=0, help="Heads shown in the table (worst max logit first); 0 = all."),
        device: Device = "auto",
        dtype: Dtype = "auto",
        layer_stream: LayerStream = "auto",
        device_map: DeviceMap = None,
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Attention logits (max, min, mean, std, share above --threshold), log Z, entropy and q/k norms per head."""
        from attnkit.commands.analyse.probe import ProbeRequest, run_probe
        from attnkit.commands.analyse.probe_rules import check_rules

        models, text_files = _split(args)
        req = ProbeRequest(
            models=models,
            texts=text_files,
            text=text,
            seq_len=seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            threshold=threshold,
            z_lambda=z_lambda,
            fail_if=list(fail_if or []),
            out=out,
            plot=plot,
            device=device,
            dtype=dtype,
            layer_stream=layer_stream,
            device_map=device_map,
        )
        results, rules = run_probe(req, log=log_sink)
        _render(results, fmt, top, threshold)
        check_rules(results, rules)


def _render(results, fmt: OutputFormat, top: int, threshold: float) -> None:
    rows = [row for res in results for row in res.heads]
    columns = [
        Column("model", "model", justify="left"),
        Column("layer", "layer"),
        Column("head", "head"),
        Column("max_logit", "max logit", _num),
        Column("max_logit_precap", "pre-cap max", _num),
        Column("mean_logit", "mean", _num),
        Column("std_logit", "std", _num),
        Column("frac_above", f"> {threshold:g}", _num),
        Column("logz_mean", "logZ mean", _num),
        Column("logz_max", "logZ max", _num),
        Column("entropy_mean", "entropy", _num),
        Column("max_prob_mean", "max p", _num),
        Column("q_rms_max", "|q| rms max", _num),
        Column("k_rms_max", "|k| rms max", _num),
    ]
    doc = {"models": [res.to_dict() for res in results]}
    if fmt in (OutputFormat.table, OutputFormat.markdown):
        rows = sorted(rows, key=lambda r: -(r["max_logit"] if r["max_logit"] is not None else -float("inf")))
        rows = rows[:top] if top else rows
        if len(results) == 1:
            columns = columns[1:]
        if all(r["max_logit"] == r["max_logit_precap"] for r in rows):
            columns = [c for c in columns if c.key != "max_logit_precap"]
    caption = "; ".join(
        f"{res.model}: final logits max {_num(res.final['final_logit_max'])}, "
        f"logZ mean {_num(res.final['final_logz_mean'])} std {_num(res.final['final_logz_std'])} "
        f"max {_num(res.final['final_logz_max'])}, z-loss {_num(res.final['z_loss'])} "
        f"({res.tokens} tokens)"
        for res in results
    )
    render(rows, columns, fmt, title="attention probe (worst heads first)", json_obj=doc, caption=caption)
