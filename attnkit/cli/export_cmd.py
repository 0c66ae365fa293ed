"""`attnkit export MODEL.gguf OUT`: a GGUF file as a safetensors folder."""

from __future__ import annotations

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors
from attnkit.cli.options import Format, request_fields, writes
from attnkit.cli.output import Column, render
from attnkit.units import human_bytes

EXAMPLES = examples(
    "attnkit export SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2",
    "attnkit export model.gguf ./model-bf16 --dtype bf16 --overwrite",
)


def register(app: typer.Typer) -> None:
    @app.command("export", epilog=EXAMPLES)
    @handle_errors
    @writes(model_help="A .gguf file (or a folder holding one).")
    def export_(
        dtype: str = typer.Option(
            "float32", "--dtype", help="Weights dtype: float32, bfloat16 or float16 (or fp32, bf16, fp16)."
        ),
        fmt: Format = OutputFormat.table,
        shared: dict = None,
    ) -> None:
        """Dequantize a GGUF file into a Hugging Face safetensors folder (config, weights, tokenizer) that every
        other command reads; the fp32 copy stays in attnkit's cache for eval and probe."""
        from attnkit.commands.export import ExportRequest, export

        report = export(ExportRequest(**request_fields(shared), dtype=dtype))
        caption = (
            "dry run, nothing written"
            if report["dry_run"]
            else f"wrote {report['tensors']} tensors, {human_bytes(report['bytes'])}, in {report['seconds']:.1f}s"
        )
        columns = [
            Column("source", "source", justify="left"),
            Column("output", "output", justify="left"),
            Column("model_type", "model_type", justify="left"),
            Column("dtype", "dtype", justify="left"),
        ]
        render([report], columns, fmt, title="export", json_obj=report, caption=caption)
