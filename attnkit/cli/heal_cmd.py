"""`attnkit heal STUDENT OUT --teacher SOURCE`: distil a rewritten model back toward its source."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from attnkit.cli.common import FORMAT_OPTION, OutputFormat, examples, handle_errors, log_sink, print_notes
from attnkit.cli.output import Column, finish_check, render, render_capability, render_rewrite_scores
from attnkit.cli.shared import CAPABILITY, CHECK, DEVICE, EVAL, SAMPLES, request_fields, writes
from attnkit.units import human_bytes


def _num(v, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _caption(report: dict) -> str:
    if report["dry_run"]:
        return "dry run: every check passed, nothing loaded or written"
    t, v = report["training"], report["validation"]
    text = (
        f"{t['steps']} steps, {t['tokens']:,} tokens in {t['seconds']:.0f}s ({t['tokens_per_second']:.0f} tok/s, "
        f"{t['processes']} process(es), {t['precision']}), stopped by {t['stopped']}, best step {t['best_step']}; "
        f"validation KL {v['before']['kl_mean']:.4f} -> {v['after']['kl_mean']:.4f}"
    )
    e = report.get("eval")
    if e and e.get("perplexity") is not None:
        text += (
            f"; --eval perplexity {e['before']['perplexity']:.3f} -> {e['perplexity']:.3f} "
            f"(teacher {e['source_perplexity']:.3f}), KL {e['before']['kl_mean']:.4f} -> {e['kl_mean']:.4f}"
        )
    return text + f"; wrote {report['output']}"


def register(app: typer.Typer) -> None:
    @app.command(
        "heal",
        epilog=examples(
            "attnkit heal ./mqa-model ./mqa-healed --teacher ./my-model --data corpus.jsonl --max-time 30m "
            "--eval heldout.txt",
            "attnkit heal ./mla-model ./mla-healed --teacher ./my-model --tokens 256k --lora-rank 16 --dry-run",
        ),
    )
    @handle_errors
    @writes(
        EVAL,
        SAMPLES,
        CAPABILITY,
        CHECK,
        DEVICE,
        model_help="The rewritten model (e.g. a convert or retrofit output folder).",
    )
    def heal_(
        teacher: str = typer.Option(..., "--teacher", "-t", help="The source model the student was rewritten from."),
        data: List[str] = typer.Option(
            [],
            "--data",
            help="Training text: .txt, .jsonl, .parquet or a datasets folder "
            "(repeatable); none: the teacher writes its own.",
        ),
        tokens: Optional[str] = typer.Option(None, "--tokens", help="Token budget (e.g. 256k); default 256k."),
        max_time: Optional[str] = typer.Option(
            None, "--max-time", help="Wall-clock budget of the whole run: loading, data, training, scoring (e.g. 30m)."
        ),
        eval_curve: bool = typer.Option(
            False, "--eval-curve", help="Also score --eval at every validation (reported, never used to stop)."
        ),
        train: str = typer.Option(
            "rewritten", "--train", help="rewritten (attention tensors the rewrite changed) or all."
        ),
        lora_rank: int = typer.Option(0, "--lora-rank", help="Train LoRA adapters of this rank (merged back); 0: off."),
        lr: Optional[float] = typer.Option(
            None, "--lr", show_default=False, help="Peak learning rate of AdamW (default 3e-4; 1e-4 for MLA students)."
        ),
        warmup_steps: int = typer.Option(5, "--warmup-steps", help="Linear warmup steps."),
        min_lr_ratio: float = typer.Option(0.1, "--min-lr-ratio", help="Cosine decays to lr x this."),
        weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
        max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Gradient clipping norm; 0: off."),
        batch_size: int = typer.Option(4, "--batch-size", help="Windows per optimizer step, over all processes."),
        micro_batch_size: int = typer.Option(4, "--micro-batch-size", help="Windows per forward pass (accumulated)."),
        seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training window."),
        attn_loss: float = typer.Option(
            0.0, "--attn-loss", help="Weight of the attention-output matching term; 0: off."
        ),
        precision: str = typer.Option(
            "auto",
            "--precision",
            help="auto (bf16 autocast on a CUDA GPU, fp32 elsewhere), fp32, or bf16 (autocast on the CPU too, where "
            "it has bf16 instructions).",
        ),
        teacher_logits: str = typer.Option(
            "live",
            "--teacher-logits",
            help="live: the teacher runs beside the student; top-k: its top-k log-probabilities computed once and "
            "cached on disk, the teacher out of memory while training.",
        ),
        top_k: int = typer.Option(64, "--top-k", help="Tokens per position kept by --teacher-logits top-k."),
        fsdp: bool = typer.Option(
            False,
            "--fsdp",
            help="Shard the student's weights, gradients and optimizer state over the processes (FSDP2; "
            "launch with torchrun or accelerate launch).",
        ),
        val_tokens: int = typer.Option(2048, "--val-tokens", help="Training text held out for validation."),
        eval_every: int = typer.Option(25, "--eval-every", help="Validate every N steps."),
        patience: int = typer.Option(4, "--patience", help="Stop after N validations without improvement; 0: never."),
        checkpoint_every: int = typer.Option(
            50, "--checkpoint-every", help="Save a resumable checkpoint every N steps."
        ),
        checkpoint_dir: Optional[Path] = typer.Option(
            None, "--checkpoint-dir", help="Checkpoint folder (OUT.checkpoint)."
        ),
        resume: bool = typer.Option(False, "--resume", help="Continue the run saved in the checkpoint folder."),
        teacher_tokens: Optional[str] = typer.Option(
            None, "--teacher-tokens", help="Teacher-written training tokens when no --data (default: the budget)."
        ),
        retrieval_mix: Optional[float] = typer.Option(
            None,
            "--retrieval-mix",
            help="Share (above 0, at most 1) of the training windows made long-range retrieval tasks (a number said "
            "once and asked at the end, a table looked up, a passage repeated), built offline from the data.",
        ),
        old_teacher_tokens: Optional[str] = typer.Option(
            None, "--sample-tokens", hidden=True, help="Deprecated name of --teacher-tokens."
        ),
        sample_cache: Optional[Path] = typer.Option(
            None, "--sample-cache", help="Where teacher-written text is cached."
        ),
        gradient_checkpointing: bool = typer.Option(
            False,
            "--gradient-checkpointing/--no-gradient-checkpointing",
            help="Recompute activations in backward (less memory).",
        ),
        seed: int = typer.Option(0, "--seed", help="Seed of data order and teacher sampling."),
        fmt: OutputFormat = FORMAT_OPTION,
        shared: dict = None,
    ) -> None:
        """Distil STUDENT (a rewrite of --teacher) toward the teacher: KL on next-token distributions."""
        from attnkit.commands.heal.heal import heal
        from attnkit.commands.heal.request import HealRequest, parse_duration
        from attnkit.units import parse_tokens

        teacher_tokens = _teacher_tokens(teacher_tokens, old_teacher_tokens)

        req = HealRequest(
            **request_fields(shared),
            teacher=teacher,
            data=list(data),
            tokens=parse_tokens(tokens) if tokens is not None else None,
            max_time=parse_duration(max_time) if max_time is not None else None,
            eval_curve=eval_curve,
            train=train,
            lora_rank=lora_rank,
            lr=lr,
            warmup_steps=warmup_steps,
            min_lr_ratio=min_lr_ratio,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            attn_loss=attn_loss,
            precision=precision,
            teacher_logits=teacher_logits,
            top_k=top_k,
            fsdp=fsdp,
            val_tokens=val_tokens,
            eval_every=eval_every,
            patience=patience,
            checkpoint_every=checkpoint_every,
            checkpoint_dir=checkpoint_dir,
            resume=resume,
            teacher_tokens=parse_tokens(teacher_tokens) if teacher_tokens is not None else None,
            retrieval_mix=retrieval_mix,
            sample_cache=sample_cache,
            gradient_checkpointing=gradient_checkpointing,
            seed=seed,
        )
        report = heal(req, log=log_sink)
        if report is None:
            return  # not the main process of a multi-process run: the main one prints and writes
        print_notes(warnings=report.get("warnings", []))
        if report["dry_run"]:  # the plan: one row per setting
            plan = {**report["budget"], **report["settings"], "data": report["data"]["source"], "seed": report["seed"]}
            memory = report["memory"]
            plan.update({f"memory: {k}": human_bytes(v) for k, v in memory["items"].items()})
            plan[f"memory: total on {memory['device']}"] = human_bytes(memory["total"])
            plan["memory: attention kernel"] = memory["attention_kernel"]
            plan["memory: free"] = "-" if memory["available"] is None else human_bytes(memory["available"])
            render(
                [{"setting": k, "value": v} for k, v in plan.items()],
                [Column("setting", "setting", justify="left"), Column("value", "value", justify="left")],
                fmt,
                title=f"heal: {req.model} (plan)",
                json_obj=report,
                caption=_caption(report),
            )
            return
        columns = [
            Column("step", "step"),
            Column("tokens", "tokens"),
            Column("seconds", "seconds", _num_s),
            Column("kl_mean", "validation KL", _num),
            Column("perplexity", "validation perplexity", _num),
        ]
        if req.eval_curve:
            columns += [Column("eval_perplexity", "--eval perplexity", _num), Column("eval_kl_mean", "--eval KL", _num)]
        render(
            report["validation"]["curve"],
            columns,
            fmt,
            title=f"heal: {req.model}",
            json_obj=report,
            caption=_caption(report),
        )
        if report["eval"]:  # greedy samples, tasks and pass keys against the teacher; what training changed
            render_rewrite_scores(report["eval"], fmt)
            render_capability(report["eval"]["change"], fmt, ("after", "before"))
        finish_check(report, "heal")


def _teacher_tokens(given: str | None, old: str | None) -> str | None:
    """--teacher-tokens, or its deprecated name --sample-tokens (said so on stderr; kept for one release)."""
    from attnkit.errors import UsageError

    if old is None:
        return given
    if given is not None:
        raise UsageError("give --teacher-tokens (--sample-tokens is its deprecated name), not both")
    print_notes(notes=["--sample-tokens is deprecated: it is called --teacher-tokens now"])
    return old


def _num_s(v) -> str:
    return f"{v:.0f}"
