"""`attnkit convert ...`: rewrite checkpoints into other attention variants (gqa, mqa; more converters add commands here)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import List

import typer

from attnkit.cli.common import (FORMAT_OPTION, SAMPLE_OPTION, OutputFormat, examples, handle_errors,
                                sample_prompts_or_default, stderr)
from attnkit.cli.output import Column, render, render_samples

app = typer.Typer(name="convert", help="Rewrite a checkpoint into another attention variant.", no_args_is_help=True)

MODEL_ARG = typer.Argument(..., help="Source: folder, .safetensors, .gguf (materialized first) or hub id[@revision].")
OUT_ARG = typer.Argument(..., help="Output folder (must be empty or absent unless --overwrite).")


def _err(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _gqa(model: str, out: Path, kv_heads: int, method: str, calib: List[str], calib_tokens: int, calib_seq_len: int,
         eval_files: List[str], eval_tokens: int, eval_seq_len: int, sample_prompts: List[str], sequential: bool,
         value_weight: str, key_weight: str, o_refit: float, max_shard_size: str, device: str, overwrite: bool,
         dry_run: bool, fmt: OutputFormat) -> None:
    from attnkit.commands.convert.gqa import ConvertRequest, convert_gqa
    from attnkit.errors import UsageError
    from attnkit.ops.gqa import MergeOptions
    from attnkit.units import parse_bytes

    if value_weight not in ("o_proj", "none"):
        raise UsageError(f"--value-weight must be o_proj or none, got {value_weight!r}")
    if key_weight not in ("query", "uniform", "attention"):
        raise UsageError(f"--key-weight must be query, uniform or attention, got {key_weight!r}")
    if o_refit < 0:
        raise UsageError(f"--o-refit must be >= 0 (0 turns the refit off), got {o_refit}")
    req = ConvertRequest(
        model=model, out=out, kv_heads=kv_heads, method=method, calib=list(calib), calib_tokens=calib_tokens,
        calib_seq_len=calib_seq_len, eval=list(eval_files), eval_tokens=eval_tokens, eval_seq_len=eval_seq_len,
        sample_prompts=sample_prompts_or_default(sample_prompts), sequential=sequential, options=MergeOptions(value_weight=value_weight, key_weight=key_weight, o_refit=o_refit or None),
        overwrite=overwrite, dry_run=dry_run, device=device,
        max_shard_bytes=parse_bytes(max_shard_size, "--max-shard-size"), command=shlex.join(["attnkit", *sys.argv[1:]]),
    )
    report = convert_gqa(req, log=lambda msg: stderr.print(msg, style="dim", soft_wrap=True))
    kv = report["kv_bytes_per_token"]
    caption = (f"{report['model_type']}: {report['kv_heads_before']} -> {report['kv_heads_after']} KV heads; "
               f"KV cache {kv['before']:,.0f} -> {kv['after']:,.0f} bytes/token ({kv['dtype']})")
    if report["dry_run"]:
        caption += "; dry run, nothing written"
    else:
        caption += f"; errors on {report['error_basis']}; wrote {report['output']} in {report['seconds']:.1f}s"
    if report["eval"]:
        caption += _eval_caption(report["eval"])
    columns = [Column("layer", "layer"), Column("key_path", "keys", justify="left"),
               Column("value_path", "values", justify="left"), Column("k_err", "K rel. error", _err),
               Column("v_err", "V rel. error", _err)]
    render(report["layers"], columns, fmt, title=f"convert gqa: {model}", json_obj=report, caption=caption)
    render_samples(report["eval"], fmt)


def _eval_caption(e: dict) -> str:
    """The quality part of a convert caption: perplexity of source and result, KL, top-1 agreement."""
    return (f"; perplexity {e['source_perplexity']:.3f} -> {e['perplexity']:.3f}, KL {e['kl_mean']:.4f}, "
            f"top-1 agreement {e['top1_agreement']:.3f}")


def _options():
    """Shared options of `convert gqa` and `convert mqa` (typer declares them per command)."""
    return dict(
        method=typer.Option("mean", "--method", "-m", help="mean (GQA paper), first, or merge (calibrated)."),
        calib=typer.Option([], "--calib", help="Calibration text file(s) (.txt, .jsonl); needed by --method merge."),
        calib_tokens=typer.Option(2048, "--calib-tokens", min=2, help="Calibration tokens (whole windows)."),
        calib_seq_len=typer.Option(512, "--calib-seq-len", min=2, help="Tokens per calibration window."),
        eval_files=typer.Option([], "--eval", help="Held-out text file(s): perplexity of source and result, KL."),
        eval_tokens=typer.Option(4096, "--eval-tokens", min=2, help="At most this many evaluation tokens."),
        eval_seq_len=typer.Option(512, "--eval-seq-len", min=2, help="Tokens per evaluation window."),
        sample_prompts=SAMPLE_OPTION,
        sequential=typer.Option(False, "--sequential/--no-sequential",
                                help="Calibrate each layer on the converted layers' outputs (measured worse; see docs)."),
        value_weight=typer.Option("o_proj", "--value-weight", help="merge: value error measured after o_proj (o_proj) or not (none)."),
        key_weight=typer.Option("attention", "--key-weight",
                                help="merge: weight heads by query energy (query), uniformly, or also tokens by attention."),
        o_refit=typer.Option(0.1, "--o-refit", min=0.0,
                             help="merge: ridge of the o_proj least-squares refit to the source attention output; 0 = off."),
        max_shard_size=typer.Option("1GiB", "--max-shard-size", help="Largest output shard (also the write buffer)."),
        device=typer.Option("auto", "--device", help="Calibration/eval device: auto, cpu, cuda, cuda:N, mps."),
        overwrite=typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
        dry_run=typer.Option(False, "--dry-run", help="Check and print the plan; write nothing."),
    )


_O = _options()


@app.command("gqa", epilog=examples(
    "attnkit convert gqa ./my-model ./gqa2 --kv-heads 2",
    "attnkit convert gqa ./my-model ./gqa2 --kv-heads 2 --method merge --calib calib.txt --eval heldout.txt"))
@handle_errors
def gqa(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    kv_heads: int = typer.Option(..., "--kv-heads", "-g", help="KV heads after conversion; must divide the current count."),
    method: str = _O["method"], calib: List[str] = _O["calib"], calib_tokens: int = _O["calib_tokens"],
    calib_seq_len: int = _O["calib_seq_len"], eval_files: List[str] = _O["eval_files"],
    eval_tokens: int = _O["eval_tokens"], eval_seq_len: int = _O["eval_seq_len"],
    sample_prompts: List[str] = _O["sample_prompts"], sequential: bool = _O["sequential"],
    value_weight: str = _O["value_weight"], key_weight: str = _O["key_weight"], o_refit: float = _O["o_refit"],
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"], overwrite: bool = _O["overwrite"],
    dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """Merge KV heads into --kv-heads groups (GQA); writes the source architecture with fewer KV heads."""
    _gqa(model, out, kv_heads, method, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens, eval_seq_len,
         sample_prompts, sequential, value_weight, key_weight, o_refit, max_shard_size, device, overwrite, dry_run, fmt)


@app.command("mqa", epilog=examples(
    "attnkit convert mqa ./my-model ./mqa-model",
    "attnkit convert mqa ./my-model ./mqa-model --method merge --calib calib.txt --eval heldout.txt"))
@handle_errors
def mqa(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    method: str = _O["method"], calib: List[str] = _O["calib"], calib_tokens: int = _O["calib_tokens"],
    calib_seq_len: int = _O["calib_seq_len"], eval_files: List[str] = _O["eval_files"],
    eval_tokens: int = _O["eval_tokens"], eval_seq_len: int = _O["eval_seq_len"],
    sample_prompts: List[str] = _O["sample_prompts"], sequential: bool = _O["sequential"],
    value_weight: str = _O["value_weight"], key_weight: str = _O["key_weight"], o_refit: float = _O["o_refit"],
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"], overwrite: bool = _O["overwrite"],
    dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """Merge all KV heads into one (MQA): `convert gqa --kv-heads 1`."""
    _gqa(model, out, 1, method, calib, calib_tokens, calib_seq_len, eval_files, eval_tokens, eval_seq_len,
         sample_prompts, sequential, value_weight, key_weight, o_refit, max_shard_size, device, overwrite, dry_run, fmt)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="convert")


@app.command("mla", epilog=examples(
    "attnkit convert mla ./my-model ./mla-model --kv-budget 0.5 --calib calib.txt --eval heldout.txt",
    "attnkit convert mla ./my-model ./mla-model -R 512 -P 64 --engine vllm --calib calib.txt"))
@handle_errors
def mla(
    model: str = MODEL_ARG,
    out: Path = OUT_ARG,
    kv_lora_rank: int = typer.Option(None, "--kv-lora-rank", "-R",
                                     help="R: latent values cached per token and layer (one is the norm constant)."),
    rope_dim: int = typer.Option(None, "--rope-dim", "-P", help="P: dims of the shared RoPE key (even, <= head dim)."),
    old_r: int = typer.Option(None, "-r", hidden=True, help="Old spelling of -R (eval's -r is --reference)."),
    old_p: int = typer.Option(None, "-p", hidden=True, help="Old spelling of -P."),
    kv_budget: float = typer.Option(None, "--kv-budget", help="Fraction of the source's KV values per token; picks R and P."),
    calib: List[str] = typer.Option([], "--calib", help="Calibration text file(s) (.txt, .jsonl); required."),
    calib_tokens: int = _O["calib_tokens"], calib_seq_len: int = _O["calib_seq_len"],
    eval_files: List[str] = _O["eval_files"], eval_tokens: int = _O["eval_tokens"],
    eval_seq_len: int = _O["eval_seq_len"], sample_prompts: List[str] = _O["sample_prompts"],
    sequential: bool = typer.Option(True, "--sequential/--no-sequential",
                                    help="Fit each layer on the converted layers' outputs (as docs/benchmarks.md "
                                         "measured)."),
    key_weight: str = typer.Option("query", "--key-weight", help="Key error as logit error (query) or plain (uniform)."),
    value_weight: str = typer.Option("o_proj", "--value-weight",
                                     help="Value error measured after o_proj (o_proj) or not (none)."),
    residual: str = typer.Option("keep", "--residual",
                                 help="Key parts that lose RoPE: keep them position-free, fade them by E[cos] or drop them."),
    o_refit: float = typer.Option(0.1, "--o-refit", min=0.0,
                                  help="Ridge of the o_proj refit to the source attention output (0: off)."),
    shrink: float = typer.Option(0.5, "--shrink", min=0.0, max=1.0,
                                 help="Shrink the calibration covariance toward its diagonal by this much (0-1); "
                                      "0.5 generalizes best to text unlike --calib (docs/convert-mla.md)."),
    weight_only: bool = typer.Option(False, "--weight-only",
                                     help="Ablation: plain SVD of the weights, no activations or read-out weights."),
    latent_norm: str = typer.Option("auto", "--latent-norm",
                                    help="How kv_a_layernorm stays linear: auto (per layer, the better of anchor "
                                         "and span; no bias tensors), anchor, span, or bias (exact, but engines "
                                         "drop the bias: transformers only)."),
    engine: str = typer.Option("any", "--engine",
                               help="Engines the output must load in: any (llama.cpp, vllm, sglang), llama.cpp, "
                                    "vllm, sglang or transformers; naming one snaps --kv-budget to a shape its "
                                    "kernels take (vllm: 512+64)."),
    max_shard_size: str = _O["max_shard_size"], device: str = _O["device"], overwrite: bool = _O["overwrite"],
    dry_run: bool = _O["dry_run"], fmt: OutputFormat = FORMAT_OPTION,
) -> None:
    """Rewrite an MHA/GQA model as a stock DeepseekV3 (MLA) checkpoint: a calibrated KV latent plus a shared RoPE key."""
    from attnkit.commands.convert.mla import MLARequest, convert_mla
    from attnkit.ops.mla import MLAOptions
    from attnkit.units import parse_bytes

    for old, value, new in (("-r", old_r, "-R/--kv-lora-rank"), ("-p", old_p, "-P/--rope-dim")):
        if value is not None:
            stderr.print(f"note: {old} is now {new} (-r is --reference in eval)", style="yellow")
    kv_lora_rank = old_r if kv_lora_rank is None else kv_lora_rank
    rope_dim = old_p if rope_dim is None else rope_dim

    options = MLAOptions(key_weight="uniform" if weight_only else key_weight,
                         value_weight="none" if weight_only else value_weight, residual=residual,
                         window=calib_seq_len, whiten=not weight_only, o_refit=0.0 if weight_only else o_refit,
                         shrink=shrink)
    req = MLARequest(model=model, out=out, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, kv_budget=kv_budget,
                     calib=list(calib), calib_tokens=calib_tokens, calib_seq_len=calib_seq_len, eval=list(eval_files),
                     eval_tokens=eval_tokens, eval_seq_len=eval_seq_len,
                     sample_prompts=sample_prompts_or_default(sample_prompts), sequential=sequential, options=options,
                     overwrite=overwrite, dry_run=dry_run, device=device, latent_norm=latent_norm, engine=engine,
                     max_shard_bytes=parse_bytes(max_shard_size, "--max-shard-size"),
                     command=shlex.join(["attnkit", *sys.argv[1:]]))
    report = convert_mla(req, log=lambda message: stderr.print(message, style="dim"))
    kv = report["kv_bytes_per_token"]
    caption = (f"{report['model_type']} -> deepseek_v3: R={report['kv_lora_rank']} + P={report['rope_dim']} = "
               f"{kv['elements_after']} cached values per token and layer (source {kv['elements_before']}); "
               f"KV cache {kv['before']:,.0f} -> {kv['after']:,.0f} bytes/token ({kv['dtype']})")
    if report["dry_run"]:
        caption += "; dry run, nothing written"
    else:
        caption += f"; wrote {report['output']} in {report['seconds']:.1f}s, peak RSS {report['peak_rss_bytes'] / 2**20:,.0f} MiB"
    if report["eval"]:
        e = report["eval"]
        caption += (_eval_caption(e) + f"; cache holds {e['cache']['values_per_token_layer']} "
                    "values per token and layer")
    for note in report["notes"]:
        stderr.print(f"note: {note}", style="yellow")
    for warning in report["warnings"]:
        stderr.print(f"warning: {warning}", style="bold yellow")
    columns = [Column("layer", "layer"), Column("k_err", "K rel. error", _err), Column("v_err", "V rel. error", _err),
               Column("position_free", "K energy w/o RoPE", _err),
               Column("latent_norm", "latent norm", justify="left"), Column("norm_error", "norm scale error", _err)]
    render(report["layers"], columns, fmt, title=f"convert mla: {model}", json_obj=report, caption=caption)
    render_samples(report["eval"], fmt)
