"""`attnkit diff A B [TEXT...]`: what changed between two checkpoints, and how their attention differs."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors
from attnkit.cli.options import Device, Dtype, Format, MaxTokens, SeqLen
from attnkit.cli.output import Column, render

EXAMPLES = examples(
    "attnkit diff ./my-model ./mqa-model",
    "attnkit diff ./my-model ./clipped heldout.txt --max-tokens 2048 --format json",
)


def _num(v) -> str:
    return f"{v:.4g}"


def _shape(v) -> str:
    return "x".join(map(str, v))


def register(app: typer.Typer) -> None:
    @app.command("diff", epilog=EXAMPLES)
    @handle_errors
    def diff_(
        a: str = typer.Argument(..., metavar="A", help="The model before: folder, .safetensors, .gguf or hub id."),
        b: str = typer.Argument(..., metavar="B", help="The model after (e.g. what attnkit convert wrote)."),
        texts: Optional[List[str]] = typer.Argument(
            None, metavar="[TEXT]...", help="Text files: per-head probe statistics of A and B."
        ),
        seq_len: SeqLen = 512,
        max_tokens: MaxTokens = None,
        values: bool = typer.Option(
            True,
            "--values/--no-values",
            help="Compare tensor values (reads both models), or only names, shapes, dtypes.",
        ),
        top: int = typer.Option(20, "--top", min=0, help="Rows per table (largest changes first); 0 = all."),
        device: Device = "auto",
        dtype: Dtype = "auto",
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Config keys and tensors that changed, attention layout and KV bytes per token of both; with TEXT, per-head
        max logit, log Z and entropy of A and B on the same windows."""
        from attnkit.commands.analyse.diff import DiffRequest, diff_models, largest_first

        report = diff_models(
            DiffRequest(
                a=a,
                b=b,
                texts=list(texts or []),
                seq_len=seq_len,
                max_tokens=max_tokens,
                values=values,
                device=device,
                dtype=dtype,
            )
        )
        tensor_columns = [
            Column("name", "tensor", justify="left"),
            Column("change", "change", justify="left"),
            Column("shape_a", "shape A", _shape),
            Column("shape_b", "shape B", _shape),
            Column("dtype_a", "dtype A", justify="left"),
            Column("dtype_b", "dtype B", justify="left"),
            Column("rel_change", "|B-A|/|A|", _num),
        ]
        if fmt in (OutputFormat.json, OutputFormat.csv):
            render(report["tensors"], tensor_columns, fmt, json_obj=report)
            return
        la, lb = report["layout"]["a"], report["layout"]["b"]
        render(
            [{"field": k, "a": la[k], "b": lb[k]} for k in la],
            [Column("field", "", justify="left"), Column("a", "A", justify="left"), Column("b", "B", justify="left")],
            fmt,
            title=f"diff: A = {a}, B = {b}",
        )
        if report["config"]:
            render(
                report["config"][:top] if top else report["config"],
                [
                    Column("key", "config key", justify="left"),
                    Column("change", "change", justify="left"),
                    Column("a", "A", justify="left"),
                    Column("b", "B", justify="left"),
                ],
                fmt,
                title=f"config: {len(report['config'])} key(s) differ",
            )
        rows = largest_first(report["tensors"], "rel_change", top)
        render(
            rows,
            tensor_columns,
            fmt,
            title=f"tensors: {len(report['tensors'])} differ",
            caption=f"{report['tensors_unchanged']} tensor(s) unchanged"
            + ("" if report["values_compared"] else " in name, shape and dtype (values not compared)"),
        )
        probe = report["probe"]
        if probe:
            columns = [Column("layer", "layer"), Column("head", "head")] + [
                Column(f"{key}_{side}", f"{label} {side}", _num)
                for key, label in (("max_logit", "max logit"), ("logz_mean", "logZ mean"), ("entropy_mean", "entropy"))
                for side in ("a", "b", "delta")
            ]
            render(
                largest_first(probe["heads"], "max_logit_delta", top),
                columns,
                fmt,
                title="attention per head: A, B and B - A (largest max-logit change first)",
                caption=f"{probe['windows']} window(s) x {probe['seq_len']} tokens ({probe['tokens']} tokens)",
            )
