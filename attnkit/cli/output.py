"""Render rows of data as a rich table, JSON, CSV or Markdown on stdout."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from attnkit.cli.common import OutputFormat


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: Callable[[Any], str] | None = None
    justify: str = "right"


def _plain(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(_plain(v) for v in value)
    return str(value)


def _cell(col: Column, row: dict) -> str:
    value = row.get(col.key)
    if value is None:
        return "-"
    return col.fmt(value) if col.fmt else _plain(value)


def write_json(obj: Any) -> None:
    """Write a JSON document (sorted keys are not used: key order is part of the schema)."""
    sys.stdout.write(json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def render(
    rows: Sequence[dict],
    columns: Sequence[Column],
    fmt: OutputFormat,
    *,
    title: str | None = None,
    json_obj: Any = None,
    caption: str | None = None,
) -> None:
    """Print `rows` in the chosen format; JSON prints `json_obj` (or the rows) instead, CSV every key of the
    rows (the JSON row names), the table and Markdown the `columns`."""
    if fmt == OutputFormat.json:
        write_json(json_obj if json_obj is not None else list(rows))
    elif fmt == OutputFormat.csv:
        import csv

        keys = list(dict.fromkeys(k for row in rows for k in row)) or [c.key for c in columns]
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(keys)
        for row in rows:
            writer.writerow(["" if row.get(k) is None else _csv_value(row.get(k)) for k in keys])
        sys.stdout.write(buf.getvalue())
    elif fmt == OutputFormat.markdown:
        lines = []
        if title:
            lines.append(f"**{title}**\n")
        lines.append("| " + " | ".join(c.header for c in columns) + " |")
        lines.append("|" + "|".join("---:" if c.justify == "right" else "---" for c in columns) + "|")
        for row in rows:
            lines.append("| " + " | ".join(_cell(c, row) for c in columns) + " |")
        if caption:
            lines.append(f"\n{caption}")
        sys.stdout.write("\n".join(lines) + "\n")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, caption=caption, caption_justify="left")
        for c in columns:
            table.add_column(c.header, justify=c.justify)
        for row in rows:
            table.add_row(*(_cell(c, row) for c in columns))
        # Piped output gets the table's natural width instead of being squeezed into 80 columns; titles, captions
        # and cells echo paths and model names, so they are never read as markup or emoji codes.
        console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 400, markup=False, emoji=False)
        console.print(table)


def _csv_value(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value):
        return json.dumps(value, default=_json_default)  # rows of a sub-table (e.g. by_distance)
    if isinstance(value, (list, tuple)):
        return ";".join("" if v is None else str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, default=_json_default)
    return value


def render_samples(evaluation: dict | None, fmt: OutputFormat) -> None:
    """A rewrite's greedy samples (source vs result) after its table, in table and Markdown output."""
    if not evaluation or not evaluation.get("samples") or fmt not in (OutputFormat.table, OutputFormat.markdown):
        return
    lines = []
    for sample in evaluation["samples"]:
        if fmt == OutputFormat.markdown:
            lines += [
                f"\n**greedy sample:** {sample['prompt']}",
                "",
                f"- source: {sample['source']!r}",
                f"- result: {sample['result']!r}",
            ]
        else:
            lines += [
                f"greedy sample: {sample['prompt']!r}",
                f"  source: {sample['source']!r}",
                f"  result: {sample['result']!r}",
            ]
    sys.stdout.write("\n".join(lines) + "\n")


def _share(v) -> str:
    return f"{v:.3f}"


def _signed(v) -> str:
    return f"{v:+.3f}"


def render_capability(section: dict | None, fmt: OutputFormat, names: tuple[str, str]) -> None:
    """The task-accuracy and pass-key tables of a report (attnkit.scoring.capability.side_by_side), in
    table and Markdown output: `names` are the keys of the model measured and of the one it is measured against
    (("model", "reference") in eval, ("result", "source") in rewrite reports)."""
    if not section or fmt not in (OutputFormat.table, OutputFormat.markdown):
        return
    measured, against = names
    tasks = section.get("tasks")
    if tasks and tasks.get("comparison") is not None:
        columns = [
            Column("task", "task", justify="left"),
            Column("metric", "metric", justify="left"),
            Column("source", against, _share),
            Column("result", measured, _share),
            Column("difference", "difference", _signed),
            Column("ci95_low", "95% CI low", _signed),
            Column("ci95_high", "95% CI high", _signed),
            Column("n", "items"),
        ]
        render(
            tasks["comparison"],
            columns,
            fmt,
            title=f"tasks: {measured} against {against}",
            caption="paired difference on the same items; 95% interval by the normal approximation",
        )
    elif tasks:
        columns = [
            Column("task", "task", justify="left"),
            Column("metric", "metric", justify="left"),
            Column("value", "value", _share),
            Column("stderr", "stderr", _share),
            Column("n", "items"),
        ]
        render(tasks[measured]["rows"], columns, fmt, title=f"tasks: {measured}")
    passkey = section.get("passkey")
    if passkey and passkey.get("comparison") is not None:
        columns = [
            Column("length", "context tokens"),
            Column("source", against, _share),
            Column("result", measured, _share),
            Column("difference", "difference", _signed),
        ]
        render(passkey["comparison"], columns, fmt, title=f"pass key ({passkey[measured]['variant']}): accuracy")
    elif passkey:
        scores = passkey[measured]
        columns = [
            Column("length", "context tokens"),
            Column("prompt_tokens", "prompt tokens"),
            Column("accuracy", "accuracy", _share),
        ]
        chance = f"; chance {scores['chance']:.2f}" if scores["chance"] is not None else ""
        render(
            scores["by_length"],
            columns,
            fmt,
            title=f"pass key ({scores['variant']}): accuracy",
            caption=f"{len(scores['depths'])} depths x {scores['trials']} trials per length{chance}",
        )


def render_distance(rows: list[dict] | None, fmt: OutputFormat, names: tuple[str, str]) -> None:
    """The scores by distance of the predicted token in its window (attnkit.scoring.perplexity, `by_distance`)
    as a table after the main one, in table and Markdown output (JSON and CSV carry them in the document):
    `names` are the model measured and the one it is measured against."""
    if not rows or fmt not in (OutputFormat.table, OutputFormat.markdown):
        return
    measured, against = names
    table = [{**r, "tokens": f"{r['start']:,}-{r['end']:,}"} for r in rows]
    columns = [Column("tokens", "predicted token at", justify="left"), Column("predicted", "tokens")]
    if rows[0]["reference_perplexity"] is None:
        columns.append(Column("perplexity", "perplexity", _ppl))
    else:
        columns += [
            Column("reference_perplexity", f"{against} perplexity", _ppl),
            Column("perplexity", f"{measured} perplexity", _ppl),
            Column("ratio", "ratio", _ratio),
            Column("kl_mean", "KL", _kl),
            Column("top1_agreement", "top-1 agree", _share),
        ]
    render(table, columns, fmt, title="by distance", caption="position of the predicted token in its window")


def _ppl(v) -> str:
    return f"{v:.2f}"


def _ratio(v) -> str:
    return f"{v:.3f}x"


def _kl(v) -> str:
    return f"{v:.4f}"


def eval_caption(evaluation: dict | None) -> str:
    """The quality part of a rewrite's caption: perplexity of source and result on the --eval text, KL, top-1
    agreement ("" without --eval text)."""
    if not evaluation or evaluation.get("perplexity") is None:
        return ""
    e = evaluation
    caption = (
        f"; perplexity {e['source_perplexity']:.3f} -> {e['perplexity']:.3f} on {e['tokens']} tokens, "
        f"KL {e['kl_mean']:.4g}, top-1 agreement {e['top1_agreement']:.3f}"
    )
    longest = (e.get("long_context") or {}).get("longest")
    if longest:
        caption += (
            f"; at {longest['start']:,}-{longest['end']:,} tokens of context perplexity x{longest['ratio']:.3f} "
            f"the source's, KL {longest['kl_mean']:.4g}"
        )
    return caption


def render_rewrite_scores(evaluation: dict | None, fmt: OutputFormat) -> None:
    """After a rewrite's table: its greedy samples, its scores by distance on long windows and its task and pass-key
    tables, result against source."""
    render_samples(evaluation, fmt)
    render_distance(((evaluation or {}).get("long_context") or {}).get("by_distance"), fmt, ("result", "source"))
    render_capability(evaluation, fmt, ("result", "source"))


def finish_check(report: dict, operation: str) -> None:
    """The self-check's verdict as the last line on stderr (a warning when the output is worse than the rewrite's
    limit or was not checked); exit 3 when it crossed --max-loss. Nothing without a check (--no-check, --dry-run,
    nothing written)."""
    import typer
    from rich.text import Text

    from attnkit.cli.common import stderr
    from attnkit.errors import EXIT_THRESHOLD
    from attnkit.scoring.selfcheck import summary

    block = report.get("check")
    if not block:
        return
    line = summary(block, operation)
    if block["verdict"] == "ok":
        stderr.print(Text(line), soft_wrap=True)
    else:
        stderr.print(Text.assemble(("warning: ", "bold yellow"), line), soft_wrap=True)
    if block["over_max_loss"]:
        worst = block["worst"]
        crossed = f"x{worst['ratio']:.3f} at {worst['where']}" if worst else "not checked"
        stderr.print(
            Text.assemble(("error:", "bold red"), f" self-check {crossed}, above --max-loss {block['max_loss']:g}"),
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_THRESHOLD)
