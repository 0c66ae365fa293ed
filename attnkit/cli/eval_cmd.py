"""`attnkit eval MODEL TEXT...`: perplexity, and KL / top-1 agreement against a reference model."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import DEVICE_OPTION, DTYPE_OPTION, FORMAT_OPTION, OutputFormat, examples, handle_errors, stderr
from attnkit.cli.output import Column, render


def register(app: typer.Typer) -> None:
    @app.command(
        "eval",
        epilog=examples(
            "attnkit eval ./my-model heldout.txt --seq-len 512",
            "attnkit eval ./mqa-model heldout.txt --reference ./my-model --max-tokens 8192 --format json",
            "cat notes.jsonl | attnkit eval HuggingFaceTB/SmolLM2-135M - --device cuda --dtype bf16",
        ),
    )
    @handle_errors
    def eval_(
        model: str = typer.Argument(..., help="Model: folder, .safetensors, .gguf or hub id."),
        texts: Optional[List[str]] = typer.Argument(
            None, help="Text files (.txt, .jsonl with a 'text' field; '-' = stdin)."
        ),
        reference: Optional[str] = typer.Option(
            None, "--reference", "-r", help="Reference model for KL and top-1 agreement."
        ),
        text: Optional[str] = typer.Option(None, "--text", help="Literal text to score (besides any files)."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
        max_tokens: Optional[int] = typer.Option(
            None, "--max-tokens", help="At most this many tokens in all (whole windows)."
        ),
        batch_size: int = typer.Option(1, "--batch-size", help="Windows per forward pass."),
        device: str = DEVICE_OPTION,
        dtype: str = DTYPE_OPTION,
        fmt: OutputFormat = FORMAT_OPTION,
    ) -> None:
        """Token-level perplexity on text windows; with --reference also KL(ref || model) and top-1 agreement."""
        from attnkit.commands.analyse.evaluate import EvalRequest, run_eval

        doc = run_eval(
            EvalRequest(
                model=model,
                reference=reference,
                texts=list(texts or []),
                text=text,
                seq_len=seq_len,
                max_tokens=max_tokens,
                batch_size=batch_size,
                device=device,
                dtype=dtype,
            ),
            log=lambda message: stderr.print(message, style="dim", markup=False),
        )
        columns = [Column("tokens", "tokens"), Column("nll_mean", "NLL"), Column("perplexity", "perplexity")]
        if reference is not None:
            columns += [
                Column("reference_perplexity", "ref perplexity"),
                Column("kl_mean", "KL mean"),
                Column("kl_max", "KL max"),
                Column("top1_agreement", "top-1 agree"),
            ]
        render(
            [doc],
            columns,
            fmt,
            title=f"eval: {model}",
            json_obj=doc,
            caption=f"{doc['windows']} window(s) x {seq_len} tokens, {doc['dtype']}",
        )
