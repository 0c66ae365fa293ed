"""`attnkit eval MODEL [TEXT...]`: perplexity (KL and top-1 agreement against a reference model), task accuracy
through lm-eval and pass-key retrieval, the reference beside the model."""

from __future__ import annotations

from typing import List, Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, log_sink
from attnkit.cli.options import (
    BatchSize,
    Device,
    DeviceMap,
    Dtype,
    Format,
    LayerStream,
    MaxTokens,
    SeqLen,
    Text,
    capability_spec,
)
from attnkit.cli.output import Column, render, render_capability, render_distance


def register(app: typer.Typer) -> None:
    @app.command(
        "eval",
        epilog=examples(
            "attnkit eval ./my-model heldout.txt --seq-len 512",
            "attnkit eval ./mqa-model heldout.txt --reference ./my-model --max-tokens 8192 --format json",
            "cat notes.jsonl | attnkit eval HuggingFaceTB/SmolLM2-135M - --device cuda --dtype bf16",
            "attnkit eval ./mla-model --reference ./my-model --tasks hellaswag,arc_easy --limit 500",
            "attnkit eval ./mla-model --reference ./my-model --passkey 1k,2k,4k --plot passkey.png",
            "attnkit eval ./mla-model heldout.txt --reference ./my-model --seq-len 4096 --plot distance.png",
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
        text: Text = None,
        seq_len: SeqLen = 512,
        max_tokens: MaxTokens = None,
        batch_size: BatchSize = 1,
        tasks: Optional[str] = typer.Option(
            None,
            "--tasks",
            help="lm-eval tasks, comma-separated (the tasks extra installs lm-eval); with --reference the "
            "paired difference on the same items.",
        ),
        tasks_dir: Optional[str] = typer.Option(
            None, "--tasks-dir", help="A folder of local lm-eval YAML tasks (their data read from local files)."
        ),
        num_fewshot: Optional[int] = typer.Option(None, "--num-fewshot", help="Few-shot examples (lm-eval's)."),
        limit: Optional[int] = typer.Option(None, "--limit", help="At most this many items per task."),
        passkey: Optional[str] = typer.Option(
            None, "--passkey", help="Pass-key retrieval at these context lengths in tokens, e.g. 1k,2k,4k,8k."
        ),
        depths: int = typer.Option(5, "--depths", help="Depths of the key per length (0% to 100%)."),
        trials: int = typer.Option(3, "--trials", help="Pass keys per length and depth."),
        seed: int = typer.Option(0, "--seed", help="Seed of the pass keys."),
        passkey_variant: str = typer.Option(
            "repeat",
            "--passkey-variant",
            help="repeat (one key, said twice), distractors (one key among other numbers) or named (several "
            "keys; one asked by name).",
        ),
        by_distance: Optional[bool] = typer.Option(
            None,
            "--by-distance/--no-by-distance",
            help="Also score the text per distance bucket of the predicted token (0-128, 128-256, ... up to "
            "--seq-len); default: whenever --seq-len is longer than 128.",
        ),
        plot: Optional[str] = typer.Option(
            None,
            "--plot",
            help="Write a .png/.pdf/.svg figure: pass-key accuracy heat maps and the scores by distance.",
        ),
        device: Device = "auto",
        dtype: Dtype = "auto",
        layer_stream: LayerStream = "auto",
        device_map: DeviceMap = None,
        fmt: Format = OutputFormat.table,
    ) -> None:
        """Perplexity on text windows (with --reference: KL(ref || model) and top-1 agreement), task accuracy
        through lm-eval (--tasks) and pass-key retrieval (--passkey), the reference beside the model."""
        from attnkit.commands.analyse.eval import EvalRequest, run_eval

        spec = capability_spec(
            tasks, tasks_dir, num_fewshot, limit, passkey, depths, trials, seed, passkey_variant, batch_size
        )
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
                layer_stream=layer_stream,
                device_map=device_map,
                by_distance=by_distance,
                capability=spec,
                plot=plot,
            ),
            log=log_sink,
        )
        if doc["windows"] is not None or fmt in (OutputFormat.json, OutputFormat.csv):
            columns = [Column("tokens", "tokens"), Column("nll_mean", "NLL"), Column("perplexity", "perplexity")]
            if reference is not None:
                columns += [
                    Column("reference_perplexity", "ref perplexity"),
                    Column("kl_mean", "KL mean"),
                    Column("kl_max", "KL max"),
                    Column("top1_agreement", "top-1 agree"),
                ]
            caption = f"{doc['windows']} window(s) x {seq_len} tokens, {doc['dtype']}" if doc["windows"] else None
            render([doc], columns, fmt, title=f"eval: {model}", json_obj=doc, caption=caption)
        render_distance(doc["by_distance"], fmt, ("model", "reference"))
        render_capability(doc, fmt, ("model", "reference"))
