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
        source: Optional[str] = typer.Option(
            None,
            "--source",
            help="The model MODEL was rewritten from: each engine's KV cache (and decode speed) of both, side by side.",
        ),
        decode_depths: Optional[str] = typer.Option(
            None,
            "--decode-depths",
            help="Decode tokens/s in each engine after this many cached tokens, e.g. 1k,4k,8k (with --source: beside "
            "the source's).",
        ),
        decode_rounds: int = typer.Option(3, "--decode-rounds", help="Engine runs per model and depth (median)."),
        flash_attn: str = typer.Option(
            "auto",
            "--flash-attn",
            help="llama-bench -fa for --decode-depths: auto (llama.cpp's default: on, on a CPU-only build), on or off.",
        ),
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Greedy tokens and perplexity in llama.cpp and vLLM against transformers; exit 3 on a mismatch."""
        from attnkit.commands.analyse.verify import VerifyRequest, verify
        from attnkit.errors import EXIT_THRESHOLD
        from attnkit.units import parse_list, parse_tokens

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
            source=source,
            decode_depths=parse_list(decode_depths, parse_tokens) if decode_depths is not None else [],
            decode_rounds=decode_rounds,
            decode_flash_attn=flash_attn,
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
            _render_speed(row, fmt)
        if report["mismatch"]:
            raise typer.Exit(EXIT_THRESHOLD)


def _render_speed(row: dict, fmt: OutputFormat) -> None:
    """An engine's KV cache and decode tokens/s of the output beside its source's (--source, --decode-depths); in
    the table format only (json carries them in the engine's row)."""
    if fmt != OutputFormat.table or (row["decode"] is None and row["source_cache"] is None):
        return
    blank = {"source": "-", "ratio": "-", "kvmem": "-"}
    pool, source = row["kv_pool"], row["source_cache"]
    if row["engine"] == "vllm":  # the tokens one pool holds: the output's cache over the source's is their inverse
        what = f"tokens in a {pool['pool_bytes'] / (1 << 20):,.0f} MiB pool"
        size = lambda cache: f"{cache['capacity_tokens']:,}"  # noqa: E731
    else:
        what, size = f"KV cache at -c {pool['n_ctx']:,} (MiB)", lambda cache: f"{cache['mib']:.2f}"  # noqa: E731
    rows = [{**blank, "what": what, "output": size(pool)}]
    if source is not None:
        rows[0].update(source=size(source), ratio=f"{row['cache_ratio']:.3f}", kvmem=f"{row['kvmem_ratio']:.3f}")
    decode = row["decode"]
    for depth in decode["depths"] if decode else []:
        speeds = decode["tokens_per_second"]
        line = {**blank, "what": f"decode tok/s at depth {depth:,}", "output": f"{speeds['output'][depth]:.2f}"}
        if decode["ratio"] is not None:
            line.update(source=f"{speeds['source'][depth]:.2f}", ratio=f"{decode['ratio'][depth]:.2f}")
        rows.append(line)
    columns = [
        Column("what", row["engine"], justify="left"),
        Column("output", "output"),
        Column("source", "source"),
        Column("ratio", "x source"),
        Column("kvmem", "kvmem's x source"),
    ]
    cache = "f16 cache"
    if row["engine"] == "vllm":
        cache = "fp32 cache; x source: the output's cache over the source's (its capacity inverted)"
    rounds = ""
    if decode:
        how = f"-fa {decode['flash_attn']}, " if "flash_attn" in decode else ""
        rounds = f"; decode: {how}median of {decode['rounds']} round(s), the models side by side"
    render(rows, columns, fmt, title=f"verify: what the output saves in {row['engine']}", caption=cache + rounds)
