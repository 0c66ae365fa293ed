"""`convert mla` defaults on three held-out texts of different kinds, side by side with TransMLA.

Usage: python benchmarks/eval_texts.py /tmp/texts
       python benchmarks/bench_mla_texts.py run --texts /tmp/texts --work DIR [--only REGEX] >> rows.jsonl
       python benchmarks/bench_mla_texts.py render rows.jsonl --transmla tm.jsonl [--write]
run: each variant is written by the `attnkit convert mla` command in VARIANTS (calibration: the first 2048
tokens of tests/data/prose/calib.txt, windows of 512) and scored against the source on the first 4096 tokens
(8 windows of 512) of tests/data/prose/heldout.txt (prose), the GPL-3 (legal) and Python's language
reference (technical): perplexity, the source's, KL(source || result). One JSON row per variant.
tm.jsonl: `benchmarks/transmla_side_by_side.py --settings 32:4,64:2,64:4 --eval legal=... --eval
technical=...` on the same tokens (its own venv). render writes "## convert mla, three texts" of
docs/benchmarks.md (today's defaults, TransMLA) and "## convert mla, three texts: the defaults before" of
docs/ablations.md (the other rows).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import benchlib
from benchlib import ROOT

CALIB = ["--calib", str(ROOT / "tests/data/prose/calib.txt"), "--calib-tokens", "2048", "--calib-seq-len", "512"]
TEXTS = {"prose": ROOT / "tests/data/prose/heldout.txt", "legal": "legal_gpl3.txt", "technical": "technical_pyref.txt"}
#: budget label -> (cached values per token and layer, the convert mla options that give it)
BUDGETS = {
    "50%": (192, ["--kv-budget", "0.5"]),
    "33%": (128, ["--kv-budget", "0.3333"]),
    "25%": (96, ["--kv-budget", "0.25"]),
    "512+64": (576, ["--kv-lora-rank", "512", "--rope-dim", "64"]),
}
#: name -> (cached values per token and layer, convert mla options beyond SOURCE OUT and the calibration)
#: Every row but the defaults predates the stock target's key balance of 0.25 and was written at 1 (BEFORE).
BEFORE = ["--key-balance", "1"]
VARIANTS = {
    **{f"default {pct}": (values, budget) for pct, (values, budget) in BUDGETS.items()},
    **{
        f"--key-balance 1 (before), {pct}": (values, [*budget, *BEFORE])
        for pct in ("50%", "33%", "25%")
        for values, budget in [BUDGETS[pct]]
    },
    **{
        f"--key-weight query (before), {pct}": (values, [*budget, "--key-weight", "query", *BEFORE])
        for pct, (values, budget) in BUDGETS.items()
    },
    **{
        f"--shrink {s}, {pct} (key weight query)": (values, [*budget, "--shrink", s, "--key-weight", "query", *BEFORE])
        for s, pcts in (("0.3", ("50%", "33%", "25%")), ("0.7", ("33%",)), ("0.1", ("33%",)))
        for pct in pcts
        for values, budget in [BUDGETS[pct]]
    },
    **{
        f"--shrink 0 (before), {pct} (key weight query)": (
            values,
            [*budget, "--shrink", "0", "--key-weight", "query", *BEFORE],
        )
        for pct, (values, budget) in BUDGETS.items()
    },
}


def score(model_dir: Path, texts: Path) -> dict:
    """{text: {ppl, src, kl}} against the source, on the first 4096 tokens of each text."""
    from attnkit.realmodels import smollm2_folder

    src = benchlib.load(smollm2_folder())
    files = {name: texts / path for name, path in TEXTS.items()}
    scores = benchlib.score_texts(benchlib.load(model_dir), src, files, 4096)
    return {t: {"ppl": r.perplexity, "src": r.reference_perplexity, "kl": r.kl_mean} for t, r in scores.items()}


def run(args) -> None:
    from attnkit.realmodels import smollm2_folder

    for name, (values, options) in VARIANTS.items():
        if args.only and not re.search(args.only, name):
            continue
        out = args.work / re.sub(r"\W+", "_", name)
        rep = benchlib.attnkit("convert", "mla", str(smollm2_folder()), str(out), *CALIB, *options)
        print(
            json.dumps(
                {
                    "variant": name,
                    "values": values,
                    "R": rep["kv_lora_rank"],
                    "P": rep["rope_dim"],
                    "command": " ".join(["attnkit", "convert", "mla", "SRC", "OUT", *options]),
                    "texts": score(out, args.texts),
                }
            ),
            flush=True,
        )


def _transmla_best(rows: list[dict], values: int, text: str) -> tuple[float, str] | None:
    """TransMLA's best perplexity on `text` at `values` over the settings run, and that setting."""
    found = [
        (r["ppl"] if text == "prose" else r["texts"][text], f"{r['R']} + {r['P']}, freqfold {r['freqfold']}")
        for r in rows
        if r.get("variant") == "transmla" and r["values"] == values
    ]
    return min(found) if found else None


def render(args) -> tuple[str, str]:
    """ "## convert mla, three texts" of docs/benchmarks.md (today's defaults, TransMLA) and "## convert mla, three
    texts: the defaults before" of docs/ablations.md (every other row)."""
    rows, tm = benchlib.read_jsonl(args.rows), benchlib.read_jsonl(args.transmla)
    src = next(r for r in tm if r["variant"] == "source")
    src_ppl = {"prose": src["ppl"], **src["texts"]}
    source = "Source perplexity: " + ", ".join(f"{k} {v:.2f}" for k, v in src_ppl.items()) + "."
    header = ["| variant | R + P | command | prose | legal | technical |", "|---|---:|---|---:|---:|---:|"]
    lines = [
        "## convert mla, three texts",
        "",
        "`python benchmarks/eval_texts.py /tmp/texts`, `python benchmarks/bench_mla_texts.py run --texts "
        "/tmp/texts --work DIR > rows.jsonl`, TransMLA's rows from `benchmarks/transmla_side_by_side.py "
        "--settings 32:4,64:2,64:4 --eval legal=/tmp/texts/legal_gpl3.txt --eval "
        "technical=/tmp/texts/technical_pyref.txt` (its venv), then `render rows.jsonl --transmla tm.jsonl "
        "--write`. SmolLM2-135M-Instruct, fp32, CPU; calibration: the first 2048 tokens of "
        "tests/data/prose/calib.txt (both stacks); evaluation: the first 4096 tokens (8 windows of 512) "
        "of each text: prose = tests/data/prose/heldout.txt, legal = the GPL-3, technical = Python 3.11's "
        "language reference (pydoc_data.topics). Perplexity (x source); TransMLA: the best of its three "
        "best settings of the prose grid (rope dim 64 with freqfold 2 or 4, rope dim 32 with freqfold 4) "
        "per text and budget. attnkit's defaults otherwise (sequential calibration, o_proj refit 0.1, "
        "engine latent norm, `--key-weight output`, key balance 0.25); the defaults before (`--key-balance 1`, "
        "`--key-weight query`, `--shrink 0`) "
        'and other shrinkages, on the same tokens: [ablations.md](ablations.md), "## convert mla, three texts: '
        'the defaults before" (33% and 25% there at key balance 1, not re-run at 0.25). ' + source,
        "",
        *header,
    ]
    before = [
        "## convert mla, three texts: the defaults before",
        "",
        "The rows of `python benchmarks/bench_mla_texts.py` that are not today's defaults (docs/benchmarks.md, "
        '"## convert mla, three texts": the same model, texts, tokens and scoring), each named by what changed: '
        "`--key-balance 1 (before)` rows are the default before the stock target's key balance of 0.25 (issue 43), "
        "`--key-weight query (before)` rows the default before the output key weight (issue 29), `--shrink 0 "
        "(before)` rows the default before the shrinkage; the shrinkage rows were measured with `--key-weight "
        "query`; every row here at key balance 1. " + source,
        "",
        *header,
    ]

    def cell(ppl: float, text: str) -> str:
        return f"{ppl:.2f} ({ppl / src_ppl[text]:.2f}x)"

    for r in rows:
        (lines if r["variant"].startswith("default ") else before).append(
            f"| {r['variant']} | {r['R']} + {r['P']} | `{r['command']}` | "
            + " | ".join(cell(r["texts"][t]["ppl"], t) for t in TEXTS)
            + " |"
        )
    for values in sorted({r["values"] for r in tm if r.get("variant") == "transmla"}, reverse=True):
        best = {t: _transmla_best(tm, values, t) for t in TEXTS}
        lines.append(
            f"| TransMLA {values} values | best per text | "
            + "; ".join(f"{t}: {best[t][1]}" for t in TEXTS)
            + " | "
            + " | ".join(cell(best[t][0], t) for t in TEXTS)
            + " |"
        )
    return "\n".join(lines) + "\n", "\n".join(before) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--texts", type=Path, required=True)
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--only", default=None)
    d = sub.add_parser("render")
    d.add_argument("rows")
    d.add_argument("--transmla", required=True)
    d.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
        return
    shown, before = render(args)
    benchlib.publish(shown, args.write)
    benchlib.publish(before, args.write, benchlib.ABLATIONS)


if __name__ == "__main__":
    main()
