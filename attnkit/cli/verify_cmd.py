"""`attnkit verify OUT`: run a checkpoint in the installed serving engines and diff it against transformers."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, log_sink
from attnkit.cli.options import Format
from attnkit.cli.output import Column, render


def _num(fmt: str):
    return lambda v: format(v, fmt)


def register(app: typer.Typer) -> None:
    @app.command(
        "verify",
        epilog=examples(
            "attnkit verify ./mla-model",
            "attnkit verify ./mqa-model --engine llama.cpp --text heldout.txt --format json",
        ),
    )
    @handle_errors
    def verify_(
        model: str = typer.Argument(..., help="A Hugging Face folder (e.g. what attnkit convert wrote)."),
        engines: Optional[List[str]] = typer.Option(
            None, "--engine", "-e", help="llama.cpp or vllm (repeat for both); default: every engine found."
        ),
        texts: Optional[List[str]] = typer.Option(
            None, "--text", help="English text for prompts and perplexity (default: attnkit's sample)."
        ),
        llama_cpp: Optional[str] = typer.Option(
            None,
            "--llama-cpp",
            help="llama.cpp tree with convert_hf_to_gguf.py and build/bin (default: $ATTNKIT_LLAMA_CPP, else PATH).",
        ),
        convert_python: Optional[str] = typer.Option(
            None,
            "--convert-python",
            help="Python that runs convert_hf_to_gguf.py (torch, "
            "transformers, sentencepiece); default: "
            "$ATTNKIT_CONVERT_PYTHON, else this one.",
        ),
        vllm_python: Optional[str] = typer.Option(
            None, "--vllm-python", help="Python with vLLM (default: $ATTNKIT_VLLM_PYTHON, else this one)."
        ),
        prompts: int = typer.Option(4, "--prompts", help="Greedy prompts (sentences of the text)."),
        new_tokens: int = typer.Option(32, "--new-tokens", help="Greedy tokens per prompt."),
        ppl_tokens: int = typer.Option(2048, "--ppl-tokens", help="Tokens scored for perplexity (whole windows)."),
        ctx: int = typer.Option(512, "--ctx", help="Window length."),
        ppl_tolerance: float = typer.Option(0.01, "--ppl-tolerance", help="Relative perplexity difference allowed."),
        tie_margin: float = typer.Option(
            1e-2, "--tie-margin", help="A greedy difference where transformers' top-2 logits are this close is a tie."
        ),
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Greedy tokens and perplexity in llama.cpp and vLLM against transformers; exit 3 on a mismatch."""
        from attnkit.commands.analyse.verify import VerifyRequest, verify
        from attnkit.errors import EXIT_THRESHOLD

        req = VerifyRequest(
            model=model,
            engines=list(engines) if engines else None,
            texts=list(texts or []),
            llama_cpp=llama_cpp,
            convert_python=convert_python,
            vllm_python=vllm_python,
            prompts=prompts,
            new_tokens=new_tokens,
            ppl_tokens=ppl_tokens,
            ctx=ctx,
            ppl_tolerance=ppl_tolerance,
            tie_margin=tie_margin,
        )
        report = verify(req, log=log_sink)
        columns = [
            Column("engine", "engine", justify="left"),
            Column("status", "status", justify="left"),
            Column("greedy_equal", "greedy equal"),
            Column("greedy_ties", "ties"),
            Column("perplexity_transformers", "ppl transformers", _num(".4f")),
            Column("perplexity_engine", "ppl engine", _num(".4f")),
            Column("ppl_rel_diff", "rel. diff", _num(".2e")),
            Column("kl_mean", "KL", _num(".2e")),
            Column("kv_bytes_per_token", "KV bytes/token", _num(",.0f")),
            Column("detail", "detail", justify="left"),
        ]
        render(
            report["engines"],
            columns,
            fmt,
            title=f"verify: {model}",
            json_obj=report,
            caption=f"{len(report['prompts'])} prompts x {report['new_tokens']} greedy tokens; perplexity on "
            f"{report['windows']} window(s) of {report['ctx']} tokens, fp32",
        )
        for row in report["engines"]:
            for note in row["notes"]:
                log_sink(f"{row['engine']}: {note}")
        if report["mismatch"]:
            raise typer.Exit(EXIT_THRESHOLD)
