"""`attnkit convert gqa|mqa|mla`: rewrite checkpoints into other attention variants."""

from __future__ import annotations

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, log_sink, print_notes
from attnkit.cli.options import Format, request_fields, rewrite_groups, writes
from attnkit.cli.output import Column, eval_caption, finish_check, render, render_rewrite_scores
from attnkit.commands.rewrite import MLA_CALIB_TOKENS
from attnkit.units import human_bytes

app = typer.Typer(name="convert", help="Rewrite a checkpoint into another attention variant.", no_args_is_help=True)


def _err(v) -> str:
    return "-" if v is None else f"{v:.4f}"


#: Options of `convert gqa` and `convert mqa` beyond the shared ones.
_GQA = dict(
    method=typer.Option(
        "mean", "--method", "-m", help="mean (GQA paper), first, or merge (calibrated; needs --calib)."
    ),
    sequential=typer.Option(
        False,
        "--sequential/--no-sequential",
        help="Calibrate each layer on the converted layers' outputs (measured worse; see docs).",
    ),
    value_weight=typer.Option(
        "o_proj", "--value-weight", help="merge: value error measured after o_proj (o_proj) or not (none)."
    ),
    key_weight=typer.Option(
        "attention",
        "--key-weight",
        help="merge: weight heads by query energy (query), uniformly, or also tokens by attention.",
    ),
    o_refit=typer.Option(
        0.1, "--o-refit", help="merge: ridge of the o_proj least-squares refit to the source attention output; 0 = off."
    ),
)


def _gqa(
    kv_heads: int,
    method: str,
    sequential: bool,
    value_weight: str,
    key_weight: str,
    o_refit: float,
    fmt: OutputFormat,
    shared: dict,
) -> None:
    from attnkit.commands.convert.gqa import ConvertRequest, convert_gqa
    from attnkit.ops.gqa import MergeOptions

    req = ConvertRequest(
        **request_fields(shared),
        kv_heads=kv_heads,
        method=method,
        sequential=sequential,
        options=MergeOptions(value_weight=value_weight, key_weight=key_weight, o_refit=o_refit or None),
    )
    report = convert_gqa(req, log=log_sink)
    kv = report["kv_bytes_per_token"]
    caption = (
        f"{report['model_type']}: {report['kv_heads_before']} -> {report['kv_heads_after']} KV heads; "
        f"KV cache {kv['before']:,.0f} -> {kv['after']:,.0f} bytes/token ({kv['dtype']})"
    )
    if report["dry_run"]:
        caption += "; dry run, nothing written"
    else:
        caption += f"; errors on {report['error_basis']}; wrote {report['output']} in {report['seconds']:.1f}s"
    caption += eval_caption(report["eval"])
    columns = [
        Column("layer", "layer"),
        Column("key_path", "keys", justify="left"),
        Column("value_path", "values", justify="left"),
        Column("k_err", "K rel. error", _err),
        Column("v_err", "V rel. error", _err),
    ]
    render(report["layers"], columns, fmt, title=f"convert gqa: {shared['model']}", json_obj=report, caption=caption)
    render_rewrite_scores(report["eval"], fmt)
    finish_check(report, "convert gqa" if kv_heads > 1 else "convert mqa")


@app.command(
    "gqa",
    epilog=examples(
        "attnkit convert gqa ./my-model ./gqa2 --kv-heads 2",
        "attnkit convert gqa ./my-model ./gqa2 --kv-heads 2 --method merge --calib calib.txt --eval heldout.txt",
    ),
)
@handle_errors
@writes(*rewrite_groups())
def gqa(
    kv_heads: int = typer.Option(
        ..., "--kv-heads", "-g", help="KV heads after conversion; must divide the current count."
    ),
    method: str = _GQA["method"],
    sequential: bool = _GQA["sequential"],
    value_weight: str = _GQA["value_weight"],
    key_weight: str = _GQA["key_weight"],
    o_refit: float = _GQA["o_refit"],
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """Merge KV heads into --kv-heads groups (GQA); writes the source architecture with fewer KV heads."""
    _gqa(kv_heads, method, sequential, value_weight, key_weight, o_refit, fmt, shared)


@app.command(
    "mqa",
    epilog=examples(
        "attnkit convert mqa ./my-model ./mqa-model",
        "attnkit convert mqa ./my-model ./mqa-model --method merge --calib calib.txt --eval heldout.txt",
    ),
)
@handle_errors
@writes(*rewrite_groups())
def mqa(
    method: str = _GQA["method"],
    sequential: bool = _GQA["sequential"],
    value_weight: str = _GQA["value_weight"],
    key_weight: str = _GQA["key_weight"],
    o_refit: float = _GQA["o_refit"],
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """Merge all KV heads into one (MQA): `convert gqa --kv-heads 1`."""
    _gqa(1, method, sequential, value_weight, key_weight, o_refit, fmt, shared)


@app.command(
    "mla",
    epilog=examples(
        "attnkit convert mla ./my-model ./mla-model --kv-budget 0.5 --calib calib.txt --eval heldout.txt",
        "attnkit convert mla ./my-model ./mla-model -R 512 -P 64 --engine vllm --calib calib.txt",
    ),
)
@handle_errors
@writes(*rewrite_groups(MLA_CALIB_TOKENS))
def mla(
    kv_lora_rank: int = typer.Option(
        None, "--kv-lora-rank", "-R", help="R: latent values cached per token and layer (one is the norm constant)."
    ),
    rope_dim: int = typer.Option(None, "--rope-dim", "-P", help="P: dims of the shared RoPE key (even, <= head dim)."),
    kv_budget: float = typer.Option(
        None,
        "--kv-budget",
        help="Fraction of the source's KV cache (per token; with sliding layers kept, the whole cache at the "
        "longest context); picks R and P.",
    ),
    sequential: bool = typer.Option(
        True,
        "--sequential/--no-sequential",
        help="Fit each layer on the converted layers' outputs (as docs/benchmarks.md measured).",
    ),
    key_weight: str = typer.Option(
        "output",
        "--key-weight",
        help="Key error as logit error in output units (output: times the head's value spread), as logit error "
        "(query) or plain (uniform).",
    ),
    value_weight: str = typer.Option(
        "o_proj", "--value-weight", help="Value error measured after o_proj (o_proj) or not (none)."
    ),
    key_balance: float | None = typer.Option(
        None,
        "--key-balance",
        help="Weight of the keys' error against the values' in the latent's fit (above 1: keys fitted closer). "
        "Default: the target's (0.5 on deepseek-v3, 4 on gemma3-mla).",
    ),
    center_keys: bool | None = typer.Option(
        None,
        "--center-keys/--no-center-keys",
        help="Fit the keys that lose RoPE on centered inputs, their mean dropped (it moves every logit of a query "
        "alike). Default: the target's (on for deepseek-v3, off for gemma3-mla).",
    ),
    residual: str = typer.Option(
        "keep",
        "--residual",
        help="Key parts that lose RoPE: keep them position-free, fade them by E[cos] or drop them.",
    ),
    rope_pairs: str = typer.Option(
        "auto",
        "--rope-pairs",
        help="Which RoPE pairs the shared key keeps: fastest (what a stock rotary embedding turns at), rotation "
        "(those whose rotation would cost the most logit error lost; --target gemma3-mla) or auto (rotation where "
        "the target allows it).",
    ),
    o_refit: float = typer.Option(
        0.1, "--o-refit", help="Ridge of the o_proj refit to the source attention output (0: off)."
    ),
    shrink: float = typer.Option(
        0.5,
        "--shrink",
        help="Shrink the calibration covariance toward its diagonal by this much (0-1); "
        "0.5 generalizes best to text unlike --calib (docs/convert-mla.md).",
    ),
    weight_only: bool = typer.Option(
        False, "--weight-only", help="Ablation: plain SVD of the weights, no activations or read-out weights."
    ),
    latent_norm: str = typer.Option(
        "auto",
        "--latent-norm",
        help="How kv_a_layernorm stays linear: auto (per layer, the better of anchor "
        "and span; no bias tensors), anchor, span, or bias (exact, but engines "
        "drop the bias: transformers only).",
    ),
    engine: str = typer.Option(
        "any",
        "--engine",
        help="Engines the output must load in: any (llama.cpp, vllm, sglang), llama.cpp, "
        "vllm, sglang or transformers; naming one snaps --kv-budget to a shape its "
        "kernels take (vllm: 512+64).",
    ),
    target: str = typer.Option(
        "deepseek-v3",
        "--target",
        help="Output architecture: deepseek-v3 (stock, what the engines serve) or gemma3-mla (a Gemma 3 "
        "source as attnkit's Gemma 3 layout with MLA attention; transformers with attnkit.modeling imported).",
    ),
    sliding_layers: str = typer.Option(
        "auto",
        "--sliding-layers",
        help="keep: write sliding-window layers unchanged and spend --kv-budget on the global ones; convert: "
        "every layer; auto: keep where the target keeps windows (gemma3-mla).",
    ),
    layer_shape: list[str] = typer.Option(
        None,
        "--layer-shape",
        help="LAYER=R+P: that layer's own R and P (--target gemma3-mla; repeatable); with --kv-budget the other "
        "converted layers share what these leave.",
    ),
    layer_budget: str = typer.Option(
        "auto",
        "--layer-budget",
        help="How --kv-budget is shared among converted layers (--target gemma3-mla): auto measures each layer alone "
        "through the model and gives the costliest its keys exact from the cheapest's share where that costs less; "
        "even: the same share each.",
    ),
    fmt: Format = OutputFormat.table,
    shared: dict = None,
) -> None:
    """Rewrite an MHA/GQA model as MLA: a calibrated KV latent and a shared RoPE key, as a stock DeepseekV3
    checkpoint (or attnkit's Gemma 3 MLA layout, --target gemma3-mla)."""
    from attnkit.commands.convert.mla import MLARequest, convert_mla
    from attnkit.commands.convert.mla_request import parse_layer_shapes
    from attnkit.ops.mla import MLAOptions

    options = MLAOptions(
        key_weight="uniform" if weight_only else key_weight,
        value_weight="none" if weight_only else value_weight,
        key_balance=key_balance,
        center_keys=False if weight_only else center_keys,
        residual=residual,
        rope_pairs=rope_pairs,
        window=shared["calib_seq_len"],
        whiten=not weight_only,
        o_refit=0.0 if weight_only else o_refit,
        shrink=shrink,
    )
    req = MLARequest(
        **request_fields(shared),
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        kv_budget=kv_budget,
        sequential=sequential,
        options=options,
        latent_norm=latent_norm,
        engine=engine,
        target=target,
        sliding_layers=sliding_layers,
        layer_shapes=parse_layer_shapes(layer_shape or ()),
        layer_budget=layer_budget,
    )
    report = convert_mla(req, log=log_sink)
    kv = report["kv_bytes_per_token"]
    caption = (
        f"{report['model_type']} -> {report['target_model_type']}: "
        f"R={report['kv_lora_rank']} + P={report['rope_dim']} = "
        f"{kv['elements_after']} cached values per token and converted layer (source {kv['elements_before']}); "
        f"KV cache {kv['before']:,.0f} -> {kv['after']:,.0f} bytes/token ({kv['dtype']})"
    )
    if report["layer_shapes"]:
        caption += "; layers " + ", ".join(f"{i}: {r}+{p}" for i, (r, p) in report["layer_shapes"].items())
    if report["kept_layers"]:
        caption += f", {len(report['kept_layers'])} sliding layers kept; whole cache " + ", ".join(
            f"x{row['ratio']:.2f} at {row['context']:,} tokens" for row in report["kv_cache_at_context"]
        )
    if report["dry_run"]:
        caption += "; dry run, nothing written"
    else:
        caption += (
            f"; wrote {report['output']} in {report['seconds']:.1f}s, peak RSS {human_bytes(report['peak_rss_bytes'])}"
        )
    if report["eval"]:
        e = report["eval"]
        caption += eval_caption(e) + f"; cache holds {e['cache']['values_per_token_layer']} values per token and layer"
    print_notes(report["notes"], report["warnings"])
    columns = [
        Column("layer", "layer"),
        Column("k_err", "K rel. error", _err),
        Column("v_err", "V rel. error", _err),
        Column("position_free", "K energy w/o RoPE", _err),
        Column("latent_norm", "latent norm", justify="left"),
        Column("norm_error", "norm scale error", _err),
    ]
    render(report["layers"], columns, fmt, title=f"convert mla: {shared['model']}", json_obj=report, caption=caption)
    render_rewrite_scores(report["eval"], fmt)
    finish_check(report, "convert mla")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="convert")
