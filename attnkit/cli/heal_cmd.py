"""`attnkit heal STUDENT OUT --teacher SOURCE`: distil a rewritten model back toward its source."""

from __future__ import annotations

from typing import Optional

import typer

from attnkit.cli.common import OutputFormat, examples, handle_errors, log_sink, print_notes
from attnkit.cli.options import (
    CAPABILITY,
    CHECK,
    DEVICE,
    EVAL,
    SAMPLES,
    Format,
    request_fields,
    request_options,
    writes,
)
from attnkit.cli.output import Column, finish_check, render, render_capability, render_rewrite_scores
from attnkit.commands.heal.request import HealRequest
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
    @request_options(HealRequest)
    def heal_(
        old_teacher_tokens: Optional[str] = typer.Option(
            None, "--sample-tokens", hidden=True, help="Deprecated name of --teacher-tokens."
        ),
        fmt: Format = OutputFormat.table,
        shared: dict = None,
        options: dict = None,
    ) -> None:
        """Distil STUDENT (a rewrite of --teacher) toward the teacher: KL on next-token distributions."""
        from attnkit.commands.heal.heal import heal
        from attnkit.units import parse_tokens

        old = parse_tokens(old_teacher_tokens) if old_teacher_tokens is not None else None
        options["teacher_tokens"] = _teacher_tokens(options["teacher_tokens"], old)
        req = HealRequest(**request_fields(shared), **options)
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


def _teacher_tokens(given: int | None, old: int | None) -> int | None:
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
