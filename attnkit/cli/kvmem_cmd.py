"""`attnkit kvmem MODEL`: KV-cache memory tables (no torch)."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors
from attnkit.cli.options import Format
from attnkit.cli.output import Column, render
from attnkit.units import human_bytes, human_tokens


def _bytes(v) -> str:
    return human_bytes(v)


class Paging(str, Enum):
    vllm = "vllm"
    llamacpp = "llama.cpp"
    exact = "exact"


def _paging_doc(pages) -> dict | None:
    """The report's `paging`: the engine and its settings, null for the tokens kept."""
    from attnkit.kvcache import LlamaCppPaging

    if pages is None:
        return None
    if isinstance(pages, LlamaCppPaging):
        return {"engine": "llama.cpp", "ubatch": pages.ubatch, "swa_full": pages.swa_full, "pad": 256}
    return {"engine": "vllm", "block_size": pages.block_size, "in_flight_tokens": pages.in_flight_tokens}


def _paging_caption(pages) -> str:
    from attnkit.kvcache import LlamaCppPaging

    if pages is None:
        return "; tokens kept (no paging)"
    if isinstance(pages, LlamaCppPaging):
        swa = "full-size sliding caches" if pages.swa_full else f"sliding caches of window + {pages.ubatch}"
        return f"; llama.cpp's allocation for -c CONTEXT (cells padded to 256, {swa}, MLA without V)"
    return f"; vLLM paging (blocks of {pages.block_size}, {pages.in_flight_tokens:,} tokens in flight)"


def register(app: typer.Typer) -> None:
    @app.command(
        "kvmem",
        epilog=examples(
            "attnkit kvmem llama-3.1-8b --context 4k,32k,128k --batch 1,8 --gpu-mem 80GiB",
            "attnkit kvmem llama-3.1-70b --context 8k,128k --dtype bf16,fp8,int4 --gpu-mem 80GiB --tp 8",
            "attnkit kvmem llama-2-7b --variant native,gqa:4,mqa,mla:512+64 --format markdown",
            "attnkit kvmem gemma-3-27b --context 32k --paging exact",
            "attnkit kvmem ./gemma-3-270m.gguf --context 4k --dtype f16 --paging llama.cpp",
        ),
    )
    @handle_errors
    def kvmem(
        model: str = typer.Argument(
            ..., help="Preset name (see `attnkit presets`), folder, file, config.json or hub id."
        ),
        context: str = typer.Option(
            "4k,32k,128k", "--context", "-c", help="Context lengths, e.g. 4k,32k,128k (k = 1024)."
        ),
        batch: str = typer.Option("1", "--batch", "-b", help="Batch sizes, e.g. 1,8,32."),
        dtype: str = typer.Option(
            "bf16",
            "--dtype",
            help="Cache dtypes: fp32,bf16,fp16,fp8,fp8-token,int8,int4,int2, llama.cpp's q8_0,q4_0 (bfloat16, f16 "
            "etc. also accepted).",
        ),
        variant: str = typer.Option("native", "--variant", help="What-if variants: native,mha,gqa:G,mqa,mla:R+P."),
        gpu_mem: Optional[str] = typer.Option(
            None, "--gpu-mem", help="Memory of one GPU, e.g. 80GiB; adds fit columns."
        ),
        tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel degree (GPUs sharing the model)."),
        reserve: str = typer.Option("0", "--reserve", help="Memory per GPU kept for activations etc., e.g. 4GiB."),
        weight_dtype: Optional[str] = typer.Option(
            None, "--weight-dtype", help="Weights dtype for the fit (fp32,bf16,fp16,fp8,int8,int4); default: as stored."
        ),
        paging: Paging = typer.Option(
            Paging.vllm,
            "--paging",
            help="vllm: what vLLM reserves (whole blocks; a sliding layer its window + the tokens in flight + a "
            "block); llama.cpp: what llama.cpp allocates for -c CONTEXT (cells padded to 256; a sliding layer its "
            "window + a micro-batch, all cells with --swa-full; MLA caches no V); exact: the tokens each layer keeps.",
        ),
        swa_full: bool = typer.Option(
            False, "--swa-full", help="llama.cpp: full-size sliding-window caches (llama-cpp-python's default)."
        ),
        ubatch: int = typer.Option(512, "--ubatch", min=1, max=1 << 20, help="llama.cpp's -ub (micro-batch)."),
        block_size: int = typer.Option(16, "--block-size", min=1, max=1 << 20, help="vLLM's tokens per block."),
        in_flight: str = typer.Option(
            "16k",
            "--in-flight-tokens",
            help="vLLM's tokens in flight per request: concurrent batches x max_num_batched_tokens "
            "(16k: vllm serve on an H100/H200, 2 x 8192).",
        ),
        fmt: Format = OutputFormat.table,
    ) -> None:
        """KV-cache bytes per token and in total, and with --gpu-mem what fits on each GPU.

        A what-if variant is the model `attnkit convert` would write: gqa:G and mqa keep the source's sliding
        windows, mla:R+P (DeepSeek-V3) attends to the whole context on every layer.
        """
        from attnkit.commands.analyse.kvmem import (
            GpuBudget,
            kvmem_rows,
            larger_than_native,
            variant_serving,
        )
        from attnkit.commands.analyse.modelinfo import model_info, weight_dtype_name
        from attnkit.errors import UsageError
        from attnkit.kvcache import LlamaCppPaging, VllmPaging, cache_dtype, check_variant
        from attnkit.units import parse_bytes, parse_list, parse_positive_int, parse_tokens

        contexts = parse_list(context, parse_tokens)
        batches = parse_list(batch, parse_positive_int)
        dtypes = parse_list(dtype, lambda name: cache_dtype(name).name)  # checked before the model is read
        variants = parse_list(variant, check_variant)
        pages = None
        if paging == Paging.vllm:
            pages = VllmPaging(block_size, parse_tokens(in_flight))
        elif paging == Paging.llamacpp:
            if tp != 1:
                raise UsageError("--paging llama.cpp has no tensor parallelism: leave --tp out")
            pages = LlamaCppPaging(ubatch=ubatch, swa_full=swa_full)
        if weight_dtype is not None:
            weight_dtype = weight_dtype_name(weight_dtype)
        gpu = (
            GpuBudget(parse_bytes(gpu_mem, "--gpu-mem"), tp, parse_bytes(reserve, "--reserve") if reserve != "0" else 0)
            if gpu_mem
            else None
        )
        if gpu is None and tp != 1:
            raise UsageError("--tp needs --gpu-mem")
        info = model_info(model)
        rows = kvmem_rows(info, variants, dtypes, contexts, batches, gpu, weight_dtype, pages)
        windowed = any(r["sliding"] != "none" for r in rows)

        columns = [
            Column("variant", "variant", justify="left"),
            Column("attention", "attention", justify="left"),
            Column("dtype", "dtype", justify="left"),
            Column("context", "context", human_tokens),
            Column("batch", "batch"),
            Column("bytes_per_token", "bytes/token", lambda v: f"{v:,.0f}"),
            Column("kv_bytes", "KV total", _bytes),
        ]
        if windowed:
            columns.insert(2, Column("sliding", "sliding windows", justify="left"))
        if variants != ["native"]:
            columns.append(Column("vs_native", "x native", lambda v: f"{v:.3g}"))
        if gpu is not None:
            columns += [
                Column("weights_per_gpu", "weights/GPU", _bytes),
                Column("kv_per_gpu", "KV/GPU", _bytes),
                Column("total_per_gpu", "total/GPU", _bytes),
                Column("fits", "fits"),
                Column("max_context", "max context", lambda v: f"{v:,}"),
                Column("max_batch", "max batch"),
            ]
        weights = info.weights_bytes_as(weight_dtype)
        doc = {
            "model": model,
            "kind": info.kind,
            "source": info.source,
            "spec": info.spec.to_dict(),
            "parameters": info.parameters,
            "parameters_origin": info.parameters_origin,
            "weight_bytes": weights,
            "paging": _paging_doc(pages),
            "gpu": None
            if gpu is None
            else {"mem_bytes": gpu.mem_bytes, "tp": gpu.tp, "reserve_bytes": gpu.reserve_bytes},
            "rows": rows,
            "serving": variant_serving(info.spec, variants),
        }
        caption = (
            f"{info.spec.variant}, {info.spec.num_layers} layers; weights {human_bytes(weights)} "
            f"({info.parameters_origin})"
        )
        if info.source:
            caption += f"; source: {info.source}"
        caption += _paging_caption(pages)
        if info.spec.mla is not None:  # engines.targets for MLA models only: kvmem's cold start stays small
            from attnkit.engines.targets import TRANSFORMERS_ONLY

            if info.spec.model_type in TRANSFORMERS_ONLY:
                caption += f"; {info.spec.model_type} runs in transformers only (no engine loads it)"
        if any(r["exceeds_max_positions"] for r in rows):
            caption += "; some contexts exceed the model's max_position_embeddings"
        larger = larger_than_native(rows)
        if larger:
            caption += f"; larger than native: {', '.join(larger)} (full attention on every layer)"
        for name, engines in doc["serving"].items():
            fallbacks = [
                f"{engine} {row['values']:,} values/token/layer"
                for engine, row in engines.items()
                if not row["as_written"]
            ]
            if fallbacks:
                caption += f"; {name} falls back to expanded keys and values in " + ", ".join(fallbacks)
        render(rows, columns, fmt, title=f"KV cache: {model}", json_obj=doc, caption=caption)
