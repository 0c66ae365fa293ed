"""Every rewrite at its defaults on every real model: what a user of each family can expect.

Usage: python benchmarks/bench_families.py run --work DIR [--family smollm2|gemma3|qwen ...] [--only NAME ...]
       python benchmarks/bench_families.py render [--write]
  run: for each family (SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder-1.5B; attnkit/realmodels.py's folders), writes each
       rewrite with attnkit's own command at its defaults (calibration: tests/data/prose/calib.txt, the docs' own
       sample text; REWRITES), keeping its report (the self-check's verdict, what it cost), then scores the source and
       each result with `attnkit eval`: by distance on WINDOWS windows of 4,096 tokens of two held-out texts
       (bench_long_context.prepare: the last Wikipedia articles of benchmarks/wiki_corpus.py's excerpt and Python's
       language reference) and pass keys at PASSKEYS lengths (both variants, 3 depths, TRIALS keys each). Qwen runs in
       bf16 (its checkpoint's dtype), the others in fp32. Rows go to DIR/families.jsonl and
       benchmarks/results/families.jsonl.
  render: "## families" of docs/benchmarks.md from benchmarks/results/families.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import benchlib
from bench_long_context import VARIANTS, prepare
from benchlib import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "families.jsonl"
CALIB = str(ROOT / "tests/data/prose/calib.txt")
#: convert mla's calibration: prose and code (docs/convert-mla.md, "## Calibration text").
MLA_CALIB = str(ROOT / "tests/data/mixed/calib.txt")
WINDOWS = 2
LENGTH = 4096
#: pass-key lengths and variants per family: Qwen2.5-Coder (1.5B, minutes per 4k prompt set on 2 cores) at 4k only,
#: repeat only for its rewrites (its source finds every key of both variants).
PASSKEYS = {"smollm2": "1k,2k,4k", "gemma3": "1k,2k,4k", "qwen": "4k"}
SHORT_VARIANTS = {"qwen": ("repeat",)}
DEPTHS, TRIALS = 3, 2
#: name -> attnkit command line after "attnkit" ({src} {out}), each rewrite at its defaults.
QKNORM = "retrofit qknorm {src} {out} --calib " + CALIB
MLA = "convert mla {src} {out} --kv-budget 0.5 --calib " + MLA_CALIB
MQA = "convert mqa {src} {out} --method merge --calib " + CALIB
#: family -> (attnkit/realmodels.py's folder function, the dtype eval runs it in, its rewrites). Gemma 3 has QK-norm
#: already (no qknorm) and one KV head (no MQA merge); its MLA is --target gemma3-mla.
FAMILIES = {
    "smollm2": ("smollm2_folder", "float32", {"qknorm": QKNORM, "mla-50": MLA, "mqa-merge": MQA}),
    "gemma3": ("gemma3_folder", "float32", {"mla-50": MLA + " --target gemma3-mla"}),
    "qwen": ("qwen_folder", "bfloat16", {"qknorm": QKNORM, "mla-50": MLA, "mqa-merge": MQA}),
}
NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M", "qwen": "Qwen2.5-Coder-1.5B"}


def rewrite(command: str, source: Path, out: Path) -> dict:
    """Write one rewrite and return its JSON report (kept beside OUT as OUT.report.json: a second run reuses both)."""
    saved = out.with_name(out.name + ".report.json")
    if saved.is_file() and (out / "attnkit.json").is_file():
        return json.loads(saved.read_text())
    started = time.perf_counter()
    report = benchlib.attnkit(*command.format(src=source, out=out).split(), ok=(0, 3))
    report["wall_seconds"] = time.perf_counter() - started
    saved.write_text(json.dumps(report))
    return report


def scores(path: Path, source: Path, texts: dict, dtype: str, work: Path, passkey: str, variants) -> list[dict]:
    """By-distance rows of both texts and pass-key rows of both variants of one model (the source: reference None)."""
    rows = []
    common = ["--device", "cpu", "--dtype", dtype]
    for text, file in texts.items():
        doc, args = benchlib.eval_distance(path, file, source, LENGTH, WINDOWS, *common)
        rows.append(
            {
                "kind": "distance",
                "text": text,
                "perplexity": doc["perplexity"],
                "source_perplexity": doc["source_perplexity"],
                "by_distance": doc["by_distance"],
                "command": benchlib.portable("attnkit eval " + " ".join(args), work, source),
            }
        )
    for variant in variants:
        found, _, _ = benchlib.eval_passkey(path, passkey, variant, DEPTHS, TRIALS, *common)
        rows.append({"kind": "passkey", "variant": variant, "by_length": found})
    return rows


def run(work: Path, families: list[str], only: list[str]) -> None:
    import attnkit.realmodels

    work.mkdir(parents=True, exist_ok=True)
    texts = prepare(work)
    for family in families:
        folder, dtype, rewrites = FAMILIES[family]
        source = getattr(attnkit.realmodels, folder)()
        for name in only or ["source", *rewrites]:
            if name != "source" and name not in rewrites:
                continue
            head = {"family": family, "model": name}
            variants = VARIANTS if name == "source" else SHORT_VARIANTS.get(family, VARIANTS)
            if name == "source":
                path, report = source, None
            else:
                path = work / family / name
                report = rewrite(rewrites[name], source, path)
                head.update(
                    rewrite=_portable_rewrite(rewrites[name], family, name),
                    check=report.get("check"),
                    method=report.get("method") or (report.get("parameters") or {}).get("method"),
                    route=(report.get("parameters") or {}).get("latent_norm"),
                    split=[report.get("kv_lora_rank"), report.get("rope_dim")] if "rope_dim" in report else None,
                    layer_shapes=report.get("layer_shapes") or None,
                    seconds=report.get("wall_seconds") or report.get("seconds"),
                )
            rows = [{**head, **row} for row in scores(path, source, texts, dtype, work, PASSKEYS[family], variants)]
            for target in (work / "families.jsonl", RESULTS):
                benchlib.append_jsonl(target, rows)
            print(f"{family} {name}: scored", file=sys.stderr)


def _key(row: dict) -> tuple:
    return row["family"], row["model"], row["kind"], row.get("text") or row.get("variant")


def _keys(rows: dict, family: str, model: str) -> str:
    cells = []
    for variant in VARIANTS:
        row = rows.get((family, model, "passkey", variant))
        if row is None:
            cells.append("-")
            continue
        cells.append(" ".join(f"{int(n) // 1024}k {v:.0%}" for n, v in row["by_length"].items()))
    return " ; ".join(cells)


def _verdict(check: dict | None) -> str:
    if not check:
        return "-"
    if check["verdict"] == "ok":
        return f"ok (worst x{check['worst']['ratio']:.2f})"
    return f"**{check['verdict']}**: " + "; ".join(check["problems"])


def render(write: bool) -> None:
    rows = benchlib.latest(benchlib.read_jsonl(RESULTS), _key)
    lines = [
        "## families",
        "",
        "`python benchmarks/bench_families.py run --work DIR`, then `render --write`: every rewrite at its defaults "
        "(calibration: tests/data/prose/calib.txt; convert mla's, where its command says so, tests/data/mixed/calib.txt, "
        'prose and code: docs/convert-mla.md "## Calibration text") on each real model, scored by `attnkit eval '
        "--reference SRC` on "
        f"{WINDOWS} windows of {LENGTH:,} tokens of two held-out texts (prose: the last 30 articles of the Wikipedia "
        "excerpt; technical: Python's language reference), by distance of the predicted token: perplexity of the "
        "result over the source's (the source's own perplexity in its row). Pass keys: accuracy by length, repeat "
        f"; distractors ({DEPTHS} depths x {TRIALS} keys; distractors: chance 25%). Self-check: the rewrite's own "
        "verdict ([check.md](check.md)). SmolLM2 and Gemma 3 in fp32, Qwen2.5-Coder in bf16 (its checkpoint's dtype), "
        "its pass keys at 4k only and its rewrites' in the repeat variant only (time: 2 cores).",
        "",
    ]
    lines += _summary(rows)
    for family in FAMILIES:
        models = list(dict.fromkeys(key[1] for key in rows if key[0] == family))
        if not models:
            continue
        lines += [f"### {NAMES[family]}", ""]
        for text in ("prose", "technical"):
            source = rows.get((family, "source", "distance", text))
            if source is None:
                continue
            buckets = benchlib.buckets(source["by_distance"])
            lines += [
                f"**{text}**",
                "",
                "| rewrite | written as | " + " | ".join(buckets) + " | all |",
                "|---|---|" + "---:|" * (len(buckets) + 1),
                "| source (perplexity) | | "
                + " | ".join(benchlib.source_cells(source["by_distance"]))
                + f" | {source['source_perplexity']:.2f} |",
            ]
            for model in models:
                row = rows.get((family, model, "distance", text))
                if model == "source" or row is None:
                    continue
                cells = " | ".join(benchlib.ratio_cells(row["by_distance"]))
                lines.append(
                    f"| {model} | {_written(row)} | {cells} | {row['perplexity'] / row['source_perplexity']:.2f}x |"
                )
            lines.append("")
        lines += [
            "| rewrite | pass keys by length (repeat ; distractors) | self-check | seconds to write (the check's) |",
            "|---|---|---|---:|",
        ]
        for model in models:
            first = next((r for k, r in rows.items() if k[:2] == (family, model)), {})
            seconds = f"{first['seconds']:.0f}" if first.get("seconds") else ""
            if seconds and first.get("check"):
                seconds += f" ({first['check']['seconds']:.0f})"
            lines.append(f"| {model} | {_keys(rows, family, model)} | {_verdict(first.get('check'))} | {seconds} |")
        lines += ["", "Commands (SRC: the source folder, DIR: --work; each output scored as the source is):", ""]
        rewrites = FAMILIES[family][2]
        for model in models:
            if model == "source":
                first = next((r for k, r in rows.items() if k[:2] == (family, model)), {})
                lines.append(f"- source: `{first['command']}`")
            elif model in rewrites:
                first = next((r for k, r in rows.items() if k[:2] == (family, model)), {})
                # rows written before a row named its command calibrated convert mla on the prose text too
                line = first.get("rewrite") or _portable_rewrite(
                    rewrites[model].replace(MLA_CALIB, CALIB), family, model
                )
                lines.append(f"- {model}: `attnkit {line}`")
        lines.append("")
    benchlib.publish("\n".join(lines), write)


def _summary(rows: dict) -> list[str]:
    """One row per model and rewrite: the range of its by-distance ratios, the growth of the ratio from 256-512 to
    2k-4k tokens of context, pass keys beside the source's, the self-check's verdict."""
    lines = [
        "| model | rewrite (defaults) | written as | prose, by distance | technical, by distance | growth "
        "(prose ; technical) | pass keys (source) | self-check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family in FAMILIES:
        for model in dict.fromkeys(key[1] for key in rows if key[0] == family and key[1] != "source"):
            texts, growth = [], []
            for text in ("prose", "technical"):
                row = rows.get((family, model, "distance", text))
                ratios = [r["ratio"] for r in row["by_distance"]] if row else []
                texts.append(f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-")
                start = next((r["ratio"] for r in (row or {}).get("by_distance", []) if r["start"] == 256), None)
                growth.append(f"{ratios[-1] / start:.2f}" if ratios and start else "-")
            first = next((r for k, r in rows.items() if k[:2] == (family, model)), {})
            keys = f"{_keys(rows, family, model)} ({_keys(rows, family, 'source')})"
            lines.append(
                f"| {NAMES[family]} | {model} | {_written(first)} | {texts[0]} | {texts[1]} | {' ; '.join(growth)} "
                f"| {keys} | {_verdict(first.get('check'))} |"
            )
    return [*lines, ""]


def _portable_rewrite(command: str, family: str, name: str) -> str:
    """A rewrite's command line as the docs show it: SRC, DIR and the repository's own paths relative."""
    return command.format(src="SRC", out=f"DIR/{family}/{name}").replace(f"{ROOT}/", "")


def _written(row: dict) -> str:
    """What the defaults wrote: retrofit qknorm's method, convert mla's route and split."""
    if row.get("split"):
        route = {"bias": "bias tensors", "none": "Gemma 3 MLA layout"}.get(row.get("route"), "engine route")
        own = "".join(
            f", layer {layer} {rank} + {rope}" for layer, (rank, rope) in (row.get("layer_shapes") or {}).items()
        )
        return f"{row['split'][0]} + {row['split'][1]}{own}, {route}"
    return row.get("method") or ""


def main() -> None:
    parser, r = benchlib.run_render_parser(__doc__)
    r.add_argument("--family", nargs="*", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    if args.cmd == "run":
        run(args.work, args.family, args.only)
    else:
        render(args.write)


if __name__ == "__main__":
    main()
