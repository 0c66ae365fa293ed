"""`attnkit eval MODEL TEXT...`: perplexity, and KL / top-1 agreement against a reference model."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import (DEVICE_OPTION, DTYPE_OPTION, FORMAT_OPTION, OutputFormat, examples, handle_errors,
                                stderr)
from attnkit.cli.output import Column, render


def register(app: typer.Typer) -> None:
    @app.command("eval", epilog=examples(
        "attnkit eval ./my-model heldout.txt --seq-len 512",
        "attnkit eval ./mqa-model heldout.txt --reference ./my-model --max-tokens 8192 --format json",
        "cat notes.jsonl | attnkit eval HuggingFaceTB/SmolLM2-135M - --device cuda --dtype bf16"))
    @handle_errors
    def eval_(
        model: str = typer.Argument(..., help="Model: folder, .safetensors, .gguf or hub id."),
        texts: Optional[List[str]] = typer.Argument(None, help="Text files (.txt, .jsonl with a 'text' field; '-' = stdin)."),
        reference: Optional[str] = typer.Option(None, "--reference", "-r", help="Reference model for KL and top-1 agreement."),
        text: Optional[str] = typer.Option(None, "--text", help="Literal text to score (besides any files)."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
        max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="At most this many tokens in all (whole windows)."),
        batch_size: int = typer.Option(1, "--batch-size", help="Windows per forward pass."),
        device: str = DEVICE_OPTION,
        dtype: str = DTYPE_OPTION,
        fmt: OutputFormat = FORMAT_OPTION,
    ) -> None:
        """Token-level perplexity on text windows; with --reference also KL(ref || model) and top-1 agreement."""
        from attnkit.commands.analyse.evaluate import evaluate
        from attnkit.runtime import load_model, make_windows, read_texts
        from attnkit.runtime.loader import check_models
        from attnkit.runtime.texts import check_text_files

        check_text_files(texts or [])
        check_models([model, *([reference] if reference else [])], device, dtype)
        docs = read_texts(texts or [], text)
        loaded = load_model(model, device=device, dtype=dtype)
        windows = make_windows(loaded.tokenizer, docs, seq_len, max_tokens)
        ref = load_model(reference, device=device, dtype=dtype) if reference else None
        stderr.print(f"scoring {windows.shape[0]} window(s) of {seq_len} tokens", style="dim")
        result = evaluate(loaded, windows, reference=ref, batch_size=batch_size)
        doc = {"model": model, "reference": reference, "seq_len": seq_len, "windows": int(windows.shape[0]),
               "dtype": str(loaded.dtype).removeprefix("torch."), **result.to_dict()}
        columns = [Column("tokens", "tokens"), Column("nll_mean", "NLL"), Column("perplexity", "perplexity")]
        if ref is not None:
            columns += [Column("reference_perplexity", "ref perplexity"), Column("kl_mean", "KL mean"),
                        Column("kl_max", "KL max"), Column("top1_agreement", "top-1 agree")]
        render([doc], columns, fmt, title=f"eval: {model}", json_obj=doc,
               caption=f"{doc['windows']} window(s) x {seq_len} tokens, {doc['dtype']}")
