"""What rewrites of SmolLM2-135M (and of Gemma 3 270M: --family gemma3) keep of long context: scores by distance of
the predicted token on 4096- and 8192-token windows of two held-out texts, and pass-key retrieval at 1k-8k tokens,
every result against the source.

Usage: python benchmarks/bench_long_context.py run --work DIR [--family smollm2|gemma3] [--only NAME ...]
           [--windows 4096:4,8192:2] [--passkey 1k,2k,4k,8k] [--trials 2]
       python benchmarks/bench_long_context.py render [--write]
  run: writes the texts (prose: the last HELD_OUT Wikipedia articles of benchmarks/wiki_corpus.py's excerpt, which
       nothing calibrates or heals on; technical: Python's language reference, benchmarks/eval_texts.py) and the
       healing data (the excerpt's other articles), writes every rewrite with attnkit's own command (MODELS; kept
       when DIR holds it), then scores each with `attnkit eval` (the command lines are in the rows): by distance
       (--reference SRC) on --windows windows of each length of each text, and pass keys (both variants,
       --passkey lengths, none when empty; DEPTHS depths x --trials keys). --family gemma3: the rewrites of
       GEMMA3_MODELS, of Gemma 3 270M (attnkit/realmodels.py's fp32 folder of the Q4_K_M GGUF; its source rows are
       named "gemma3-source"). Rows go to DIR/long_context.jsonl and
       benchmarks/results/long_context.jsonl (one per model, text and length, or model and variant).
  render: "## long context" of docs/benchmarks.md (the defaults and the recipe: SHOWN) and "## long context, variants"
       of docs/ablations.md (every other row: CHANGED) from benchmarks/results/long_context.jsonl.
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
import time
from pathlib import Path

import benchlib
from benchlib import ROOT, portable

RESULTS = ROOT / "benchmarks" / "results" / "long_context.jsonl"
CALIB = "--calib " + str(ROOT / "tests/data/prose/calib.txt")
#: Window length -> windows scored per text (run --windows overrides).
WINDOWS = {4096: 4, 8192: 2}
PASSKEY = "1k,2k,4k,8k"
VARIANTS = ("repeat", "distractors")
DEPTHS, TRIALS = 3, 2
#: Calibration on 2048-token windows of the healing text (8,192 tokens): what a long calibration changes;
#: the "512x16" rows are the same tokens in 512-token windows, "code" the long windows of Python source,
#: "1x2048" the default calibration text's first 2048 tokens as one window, "512x4" 2048 tokens of the healing text,
#: "mixed" two windows of prose (prose-2.jsonl) then two of Python source.
LONG_CALIB = "--calib {work}/heal.jsonl --calib-seq-len 2048 --calib-tokens 8192"
PROSE_CHARS = 10_000
#: Standard-library modules interleaved with the healing articles in heal-mixed.jsonl (Python source, not the
#: language reference that is scored as the technical text), and the share of its characters they make.
CODE_MODULES = (
    "functools.py",
    "dataclasses.py",
    "pathlib.py",
    "textwrap.py",
    "shutil.py",
    "subprocess.py",
    "enum.py",
    "inspect.py",
    "ast.py",
    "tokenize.py",
    "csv.py",
    "datetime.py",
    "heapq.py",
    "random.py",
    "statistics.py",
    "fractions.py",
    "typing.py",
    "logging/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "collections/__init__.py",
)
CODE_SHARE = 1 / 3
HEAL = "--max-time 30m --seq-len 2048 --batch-size 4 --micro-batch-size 1 --val-tokens 4096 --retrieval-mix 0.25"
#: HEAL on 4096-token windows, the same tokens a step.
HEAL_4K = "--max-time 30m --seq-len 4096 --batch-size 2 --micro-batch-size 1 --val-tokens 4096 --retrieval-mix 0.25"


def two_heals(first: int) -> dict:
    """The MODELS entries of the 50% result healed in bf16 on the mixed stream by two heals in a row that share 30
    minutes: `first` minutes on 2048-token windows (HEAL), then the rest on 4096-token ones (HEAL_4K; a student
    healed already, so its warmup is 2 steps)."""
    part = f"mla-50-calib-mixed-healed-mixed-bf16-{first}m"
    common = " {out} --teacher {src} --data {work}/heal-mixed.jsonl --precision bf16 "
    short = HEAL.replace("--max-time 30m", f"--max-time {first}m")
    long = HEAL_4K.replace("--max-time 30m", f"--max-time {30 - first}m --warmup-steps 2")
    return {
        part: "heal {work}/mla-50-calib-mixed" + common + short,
        part + "-4k": "heal {work}/" + part + common + long,
    }


#: convert mla as these rows were written: they predate the stock target's key balance of 0.25 (the families rows,
#: docs/benchmarks.md "## families", are the default's).
MLA = "convert mla {src} {out} --key-balance 1 "
#: name -> attnkit command line after "attnkit" ({src} {out} {work}), in the order they are written; the source
#: itself is scored as "source".
MODELS = {
    "mqa-mean": "convert mqa {src} {out} --method mean",
    "mqa-merge": "convert mqa {src} {out} --method merge " + CALIB,
    "mla-50": MLA + "--kv-budget 0.5 " + CALIB,
    "mla-25": MLA + "--kv-budget 0.25 " + CALIB,
    "qknorm": "retrofit qknorm {src} {out} " + CALIB,
    "mla-50-calib-2048": MLA + "--kv-budget 0.5 " + LONG_CALIB,
    "mla-50-calib-1x2048": MLA + "--kv-budget 0.5 --calib-seq-len 2048 " + CALIB,
    "mla-50-calib-512x4": MLA + "--kv-budget 0.5 --calib {work}/heal.jsonl --calib-tokens 2048",
    "mla-50-calib-512x16": MLA + "--kv-budget 0.5 --calib {work}/heal.jsonl --calib-tokens 8192",
    "mla-50-calib-2048-code": MLA + "--kv-budget 0.5 --calib {work}/code.txt --calib-seq-len 2048 --calib-tokens 8192",
    "mla-25-calib-2048": MLA + "--kv-budget 0.25 " + LONG_CALIB,
    "mla-50-calib-mixed": MLA + "--kv-budget 0.5 --calib {work}/prose-2.jsonl --calib {work}/code.txt "
    "--calib-seq-len 2048 --calib-tokens 8192",
    "mqa-merge-calib-2048": "convert mqa {src} {out} --method merge " + LONG_CALIB,
    "mqa-merge-calib-512x16": "convert mqa {src} {out} --method merge --calib {work}/heal.jsonl --calib-tokens 8192",
    "mla-50-healed": "heal {work}/mla-50 {out} --teacher {src} --data {work}/heal.jsonl " + HEAL,
    "mqa-merge-healed": "heal {work}/mqa-merge {out} --teacher {src} --data {work}/heal.jsonl " + HEAL,
    "mla-50-calib-mixed-healed": "heal {work}/mla-50-calib-mixed {out} --teacher {src} --data {work}/heal.jsonl "
    + HEAL,
    "mla-50-calib-mixed-healed-mixed": "heal {work}/mla-50-calib-mixed {out} --teacher {src} --data "
    "{work}/heal-mixed.jsonl " + HEAL,
    "mqa-merge-healed-mixed": "heal {work}/mqa-merge {out} --teacher {src} --data {work}/heal-mixed.jsonl " + HEAL,
    "mla-50-calib-mixed-healed-mixed-bf16": "heal {work}/mla-50-calib-mixed {out} --teacher {src} --data "
    "{work}/heal-mixed.jsonl --precision bf16 " + HEAL,
    "mqa-merge-healed-mixed-bf16": "heal {work}/mqa-merge {out} --teacher {src} --data {work}/heal-mixed.jsonl "
    "--precision bf16 " + HEAL,
    "mla-50-calib-mixed-healed-mixed-bf16-4k": "heal {work}/mla-50-calib-mixed {out} --teacher {src} --data "
    "{work}/heal-mixed.jsonl --precision bf16 " + HEAL_4K,
    **two_heals(20),
    **two_heals(15),
}


#: The same for Gemma 3 270M (QK-norm, 5 sliding layers of 512 per global one, 1 KV head): convert mla needs
#: attnkit's Gemma 3 MLA layout (--target gemma3-mla), every layer converted (--sliding-layers convert: these rows
#: predate the default that keeps the sliding layers, measured in docs/benchmarks.md "## families"); calibration as
#: mla-50-calib-mixed.
GEMMA3_MODELS = {
    "gemma3-mla-50-calib-mixed": "convert mla {src} {out} --target gemma3-mla --sliding-layers convert --kv-budget 0.5 --calib "
    "{work}/prose-2.jsonl --calib {work}/code.txt --calib-seq-len 2048 --calib-tokens 8192",
    # 75% as 256 latent (incl. the key factor) + a 128-wide RoPE key: --kv-budget 0.75's split before it put every
    # key dimension in the RoPE key (the next entry's, its split now)
    "gemma3-mla-75-calib-mixed": "convert mla {src} {out} --target gemma3-mla --sliding-layers convert --kv-lora-rank 256 --rope-dim 128 "
    "--calib {work}/prose-2.jsonl --calib {work}/code.txt --calib-seq-len 2048 --calib-tokens 8192",
    # 75% as 128 latent (incl. the key factor) + a 256-wide RoPE key: every key position-exact, the latent for values
    "gemma3-mla-75-p256-calib-mixed": "convert mla {src} {out} --target gemma3-mla --sliding-layers convert --kv-lora-rank 128 --rope-dim 256 "
    "--calib {work}/prose-2.jsonl --calib {work}/code.txt --calib-seq-len 2048 --calib-tokens 8192",
    # 50% as 64 latent (incl. the key factor) + a 192-wide RoPE key: three quarters of the key pairs position-exact
    "gemma3-mla-50-p192-calib-mixed": "convert mla {src} {out} --target gemma3-mla --sliding-layers convert --kv-lora-rank 64 --rope-dim 192 "
    "--calib {work}/prose-2.jsonl --calib {work}/code.txt --calib-seq-len 2048 --calib-tokens 8192",
    # the default at 50% (sliding layers kept, key balance 4), as the families rows write it, and the recipe's heal of it
    "gemma3-mla-50": "convert mla {src} {out} --target gemma3-mla --kv-budget 0.5 --calib "
    + str(ROOT / "tests/data/mixed/calib.txt"),
    "gemma3-mla-50-healed-mixed-bf16": "heal {work}/gemma3-mla-50 {out} --teacher {src} --data {work}/heal-mixed.jsonl "
    "--precision bf16 " + HEAL,
    # the same tokens as that heal trained in 30 minutes (7 steps), on 4096-token windows: the live teacher's logits
    # do not fit 24 GB there (262,144-token vocabulary), so its top-64 are cached (--teacher-logits top-k)
    "gemma3-mla-50-healed-mixed-bf16-4k": "heal {work}/gemma3-mla-50 {out} --teacher {src} --data {work}/heal-mixed.jsonl "
    "--precision bf16 --teacher-logits top-k --tokens 57344 --seq-len 4096 --batch-size 2 --micro-batch-size 1 "
    "--val-tokens 4096 --retrieval-mix 0.25",
}
#: --family -> (its source folder, its rewrites, the name of its source rows)
FAMILIES = {
    "smollm2": ("smollm2_folder", MODELS, "source"),
    "gemma3": ("gemma3_folder", GEMMA3_MODELS, "gemma3-source"),
}
#: The rows docs/benchmarks.md shows, "## long context": the defaults and the recipe, each with what it is (its name
#: in the rows file in parentheses).
SHOWN = {
    "mla-50": "convert mla at 50% of the cache, the defaults then (key balance 1)",
    "mqa-merge": "convert mqa, defaults: the merge",
    "qknorm": "retrofit qknorm, defaults",
    "mla-25": "convert mla at 25%, the defaults then (key balance 1)",
    "mla-50-calib-mixed": "convert mla at 50%, calibrated on prose and code",
    "mla-50-calib-mixed-healed-mixed-bf16": "the recipe: that, healed 30 minutes on prose and code in bf16",
    "mqa-merge-healed-mixed-bf16": "convert mqa, healed as the recipe",
    "gemma3-mla-50-calib-mixed": "convert mla --target gemma3-mla, every layer at 50%, the default split, prose and code",
    "gemma3-mla-75-p256-calib-mixed": "every layer at 75%, every key pair in the RoPE key, 128 + 256 (the recipe before "
    "the sliding layers were kept)",
    "gemma3-mla-50": "convert mla --target gemma3-mla --kv-budget 0.5 at its defaults (sliding layers kept, key balance 4; "
    "the families row's command)",
    "gemma3-mla-50-healed-mixed-bf16": "that, healed as the recipe (30 minutes, 2048-token windows, prose and code, bf16)",
}
#: Every other row, on docs/ablations.md ("## long context, variants"): what changed from the row it varies.
#: Calibration on "Wikipedia" is heal.jsonl, 512-token windows unless said; "the recipe" is
#: mla-50-calib-mixed-healed-mixed-bf16, "Gemma's recipe" gemma3-mla-75-p256-calib-mixed.
CHANGED = {
    "mqa-mean": "convert mqa: mean pooling instead of the merge",
    "mla-50-calib-1x2048": "mla-50, calibration: calib.txt's first 2048 tokens as one window",
    "mla-50-calib-512x4": "mla-50, calibration: 2048 tokens of Wikipedia",
    "mla-50-calib-512x16": "mla-50, calibration: 8,192 tokens of Wikipedia",
    "mla-50-calib-2048": "mla-50, calibration: 8,192 tokens of Wikipedia in 2048-token windows",
    "mla-50-calib-2048-code": "mla-50, calibration: 8,192 tokens of Python source in 2048-token windows",
    "mla-25-calib-2048": "mla-25, calibration: 8,192 tokens of Wikipedia in 2048-token windows",
    "mqa-merge-calib-512x16": "mqa-merge, calibration: 8,192 tokens of Wikipedia",
    "mqa-merge-calib-2048": "mqa-merge, calibration: 8,192 tokens of Wikipedia in 2048-token windows",
    "mla-50-healed": "the recipe started from mla-50, healed on Wikipedia alone, in fp32",
    "mla-50-calib-mixed-healed": "the recipe healed on Wikipedia alone, in fp32",
    "mla-50-calib-mixed-healed-mixed": "the recipe in fp32",
    "mla-50-calib-mixed-healed-mixed-bf16-4k": "the recipe on 4096-token windows, batch 2",
    "mla-50-calib-mixed-healed-mixed-bf16-20m": "the recipe stopped at 20 minutes",
    "mla-50-calib-mixed-healed-mixed-bf16-20m-4k": "the recipe: 20 minutes, then 10 on 4096-token windows",
    "mla-50-calib-mixed-healed-mixed-bf16-15m": "the recipe stopped at 15 minutes",
    "mla-50-calib-mixed-healed-mixed-bf16-15m-4k": "the recipe: 15 minutes, then 15 on 4096-token windows",
    "mqa-merge-healed": "mqa-merge healed as the recipe, but on Wikipedia alone in fp32",
    "mqa-merge-healed-mixed": "mqa-merge healed as the recipe, but in fp32",
    "gemma3-mla-75-calib-mixed": "Gemma's recipe with the split 256 + 128, --kv-budget 0.75's before",
    "gemma3-mla-50-p192-calib-mixed": "Gemma 3 at 50%, three quarters of the key pairs in the RoPE key: 64 + 192",
    "gemma3-mla-50-healed-mixed-bf16-4k": "Gemma 3's 50% default healed on 4096-token windows (batch 2), the teacher's "
    "top-64 cached, as many tokens as the recipe's 30 minutes",
}
if set(SHOWN) | set(CHANGED) != set(MODELS) | set(GEMMA3_MODELS) or set(SHOWN) & set(CHANGED):
    raise ValueError("every model of MODELS and GEMMA3_MODELS is in SHOWN or CHANGED, once")


def prepare(work: Path) -> dict:
    """The two held-out texts, the healing data, a calibration text of another kind (Python source: the
    standard library's argparse.py) and prose-2.jsonl (the first two healing articles of over PROSE_CHARS
    characters, cut there: about two 2048-token windows); returns {held-out text name: path}."""
    import eval_texts
    import local_tasks
    from wiki_corpus import wiki_corpus

    lines = wiki_corpus(work).read_text(encoding="utf-8").splitlines()
    texts = {"prose": work / "prose_heldout.jsonl", "technical": work / "technical_pyref.txt"}
    if not texts["prose"].is_file():
        texts["prose"].write_text("\n".join(lines[-local_tasks.HELD_OUT :]) + "\n")
    if not (work / "heal.jsonl").is_file():
        (work / "heal.jsonl").write_text("\n".join(lines[: -local_tasks.HELD_OUT]) + "\n")
    if not texts["technical"].is_file():
        eval_texts.main(work)
    if not (work / "code.txt").is_file():
        (work / "code.txt").write_text((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text())
    if not (work / "prose-2.jsonl").is_file():
        long = [json.loads(line)["text"] for line in lines[: -local_tasks.HELD_OUT]]
        cut = [json.dumps({"text": text[:PROSE_CHARS]}) for text in long if len(text) > PROSE_CHARS][:2]
        (work / "prose-2.jsonl").write_text("\n".join(cut) + "\n")
    if not (work / "heal-mixed.jsonl").is_file():
        (work / "heal-mixed.jsonl").write_text(mixed_heal_data(lines[: -local_tasks.HELD_OUT]))
    return texts


def mixed_heal_data(article_lines: list[str]) -> str:
    """The healing articles with CODE_MODULES interleaved (a module whenever code falls under CODE_SHARE of the
    characters so far) as jsonl; articles left over when the modules run out are kept."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [json.dumps({"text": (stdlib / name).read_text()}) for name in CODE_MODULES]
    out, prose, code = [], 0, 0
    for line in article_lines:
        out.append(line)
        prose += len(line)
        while modules and code < CODE_SHARE * (prose + code):
            out.append(modules.pop(0))
            code += len(out[-1])
    return "\n".join(out + modules) + "\n"


def score(name: str, path: Path, source: Path, texts: dict, work: Path, windows: dict, passkey: str, trials: int):
    """By-distance rows of every text and length ({length: windows}), and pass keys of both variants at the
    lengths `passkey` names, of one model."""
    rows = []
    for text, file in texts.items():
        for length, count in windows.items():
            started = time.perf_counter()
            doc, args = benchlib.eval_distance(path, file, source, length, count, "--device", "cpu")
            rows.append(
                {
                    "model": name,
                    "kind": "distance",
                    "text": text,
                    "seq_len": length,
                    "windows": doc["windows"],
                    "perplexity": doc["perplexity"],
                    "source_perplexity": doc["source_perplexity"],
                    "kl_mean": doc["kl_mean"],
                    "by_distance": doc["by_distance"],
                    "seconds": time.perf_counter() - started,
                    "command": portable("attnkit eval " + " ".join(args), work, source),
                }
            )
    for variant in VARIANTS if passkey else ():
        started = time.perf_counter()
        found, doc, args = benchlib.eval_passkey(path, passkey, variant, DEPTHS, trials, "--device", "cpu")
        rows.append(
            {
                "model": name,
                "kind": "passkey",
                "variant": variant,
                "by_length": found,
                "chance": doc["passkey"]["model"]["chance"],
                "depths": DEPTHS,
                "trials": trials,
                "seconds": time.perf_counter() - started,
                "command": portable("attnkit eval " + " ".join(args), work, source),
            }
        )
    return rows


def run(work: Path, family: str, only: list[str], windows: dict, passkey: str, trials: int) -> None:
    import attnkit.realmodels

    folder, models, source_name = FAMILIES[family]
    work.mkdir(parents=True, exist_ok=True)
    source = getattr(attnkit.realmodels, folder)()
    texts = prepare(work)
    names = only or [source_name, *models]
    benchlib.write_models(work, source, models, [n for n in names if n != source_name])
    for name in names:
        path = source if name == source_name else work / name
        rows = score(name, path, source, texts, work, windows, passkey, trials)
        for target in (work / "long_context.jsonl", RESULTS):
            benchlib.append_jsonl(target, rows)
        print(f"{name}: scored", file=sys.stderr)


def _key(row: dict) -> tuple:
    """(model, kind, text or variant, length): the rows of a key after its last replace it."""
    return row["model"], row["kind"], row.get("text") or row.get("variant"), row.get("seq_len")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def render(write: bool) -> None:
    """ "## long context" of docs/benchmarks.md (the source, SHOWN) and "## long context, variants" of
    docs/ablations.md (the source, CHANGED)."""
    rows = benchlib.latest(benchlib.read_jsonl(RESULTS), _key)
    shown = [
        "## long context",
        "",
        "`python benchmarks/bench_long_context.py run --work DIR`, then `render --write`: SmolLM2-135M-Instruct "
        "(fp32, CPU; 30 layers, 9 heads, 3 KV heads, 8,192 positions) and its rewrites, each written by attnkit's "
        "own command (calibration: tests/data/prose/calib.txt; the commands are below), scored by `attnkit eval "
        "--reference SRC` by distance of the predicted token in its window. Prose: the last 30 articles of the "
        "Wikipedia excerpt (benchmarks/wiki_corpus.py), which no rewrite was calibrated or healed on; technical: "
        "Python's language reference (benchmarks/eval_texts.py). Each cell: perplexity of the result over the "
        "source's on the same tokens (the source's own perplexity in the first row); the source gets better with "
        "context, and a rewrite that uses far context as the source does keeps its ratio flat. The files in DIR "
        "(`prepare`): heal.jsonl, the excerpt's other articles (healing, long calibration); heal-mixed.jsonl, the "
        "same with 21 standard-library modules interleaved, a third of its characters (CODE_MODULES); code.txt, "
        "argparse.py; prose-2.jsonl, two articles of heal.jsonl cut to 10,000 characters.",
        "",
        "Shown here: the defaults and the recipe (the 50% result calibrated on prose and code, then healed 30 "
        "minutes on prose and code in bf16), each row named by what it is, its name in the rows file in "
        "parentheses. The other calibrations, methods and heals, named by what changed: "
        '[ablations.md](ablations.md), "## long context, variants".',
        "",
        *family_tables(rows, "smollm2", SHOWN),
    ]
    variants = [
        "## long context, variants",
        "",
        "The rows of `python benchmarks/bench_long_context.py` that are not a default or the recipe "
        '(docs/benchmarks.md, "## long context": the same texts, windows and scoring, the commands there), each '
        "named by what changed from the row it varies, its name in the rows file (benchmarks/results/"
        "long_context.jsonl) in parentheses. Calibration on Wikipedia: DIR/heal.jsonl, in 512-token windows "
        "unless said; mla-50, mla-25 and mqa-merge: the defaults, calibrated on tests/data/prose/calib.txt; the "
        "recipe: mla-50-calib-mixed healed 30 minutes on DIR/heal-mixed.jsonl in bf16 on 2048-token windows.",
        "",
        *family_tables(rows, "smollm2", CHANGED),
    ]
    if any(key[0] == FAMILIES["gemma3"][2] for key in rows):
        gemma = (
            "`run --family gemma3`: Gemma 3 270M (the Q4_K_M GGUF dequantized to fp32; 18 layers, 4 heads, 1 KV head "
            "of 256, QK-norm, 5 sliding layers of 512 tokens per global one, 32,768 positions) and its rewrites, "
            "the same texts and scoring."
        )
        shown += ["", "### Gemma 3 270M", "", gemma, "", *family_tables(rows, "gemma3", SHOWN)]
        variants += ["", "### Gemma 3 270M", "", gemma, "", *family_tables(rows, "gemma3", CHANGED)]
    benchlib.publish("\n".join(shown), write)
    benchlib.publish("\n".join(variants), write, benchlib.ABLATIONS)


def family_tables(rows: dict, family: str, labels: dict[str, str]) -> list[str]:
    """The by-distance tables, pass keys and commands of one --family's source and the rewrites `labels` names,
    each row named "label (name)"."""
    _, commands, source_name = FAMILIES[family]
    gemma = FAMILIES["gemma3"][2], *GEMMA3_MODELS
    models = [
        m
        for m in dict.fromkeys(key[0] for key in rows)
        if (m in gemma) == (family == "gemma3") and (m == source_name or m in labels)
    ]
    rows = {key: row for key, row in rows.items() if key[0] in models}
    lines = []
    for text in ("prose", "technical"):
        for length in sorted({key[3] for key in rows if key[1] == "distance"}):
            found = [rows[k] for k in rows if k[1] == "distance" and k[2] == text and k[3] == length]
            if not found:
                continue
            buckets = benchlib.buckets(found[0]["by_distance"])
            count = found[0]["windows"]
            lines += [
                f"**{text}, windows of {length:,} tokens** ({_count(count, 'window')} a row unless its name says; KL: "
                "mean over the window)",
                "",
                "| model | " + " | ".join(buckets) + " | all | KL |",
                "|---|" + "---:|" * (len(buckets) + 2),
            ]
            source = found[0]
            lines.append(
                "| source (perplexity) | "
                + " | ".join(benchlib.source_cells(source["by_distance"]))
                + f" | {source['source_perplexity']:.2f} | |"
            )
            for model in models:
                row = rows.get((model, "distance", text, length))
                if row is None or model == source_name:
                    continue
                cells = benchlib.ratio_cells(row["by_distance"])
                ratio = row["perplexity"] / row["source_perplexity"]
                name = _name(model, labels)
                if row["windows"] != count:
                    name += f" [{_count(row['windows'], 'window')}]"
                lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}x | {row['kl_mean']:.3f} |")
            lines.append("")
    keys = [r for r in rows.values() if r["kind"] == "passkey"]
    lengths = list(keys[0]["by_length"]) if keys else []
    trials = keys[0]["trials"] if keys else TRIALS
    lines += [
        f"**pass keys**: accuracy by context length, repeat / distractors ({DEPTHS} depths x "
        f"{_count(trials, 'key')} per length unless the row's name says; distractors: chance 25%)",
        "",
        "| model | " + " | ".join(lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for model in models:
        pairs = [rows.get((model, "passkey", v, None)) for v in VARIANTS]
        if None in pairs:
            continue
        cells = [" / ".join(_share(p["by_length"].get(n)) for p in pairs) for n in lengths]
        name = _name(model, labels)
        if pairs[0]["trials"] != trials:
            name += f" [{DEPTHS} x {_count(pairs[0]['trials'], 'key')}]"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Commands (SRC: the source folder, DIR: --work):", ""]
    for model in models:
        if model in commands:
            command = commands[model].format(src="SRC", out=f"DIR/{model}", work="DIR")
            lines.append(f"- {model}: `attnkit {portable(command, Path('DIR'), Path('SRC'))}`")
    missing = [m for m in commands if m in labels and m not in models]
    if missing:
        lines += ["", "Not measured yet (in MODELS, no rows): " + ", ".join(missing) + "."]
    example = next((r["command"] for r in rows.values() if r["kind"] == "distance" and r["model"] != source_name), None)
    if example:
        lines += ["", f"Scored with e.g. `{re.sub(r'^attnkit eval DIR/[^ ]+ ', 'attnkit eval MODEL ', example)}`."]
    return lines


def _count(n: int, noun: str) -> str:
    """'1 window', '2 windows'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _name(model: str, labels: dict[str, str]) -> str:
    """A row's name in the docs: what it is or what changed, its name in the rows file in parentheses."""
    return f"{labels[model]} ({model})" if model in labels else model


def main() -> None:
    parser, r = benchlib.run_render_parser(__doc__)
    r.add_argument("--windows", default=",".join(f"{k}:{v}" for k, v in WINDOWS.items()), help="LENGTH:COUNT,...")
    r.add_argument("--passkey", default=PASSKEY)
    r.add_argument("--trials", type=int, default=TRIALS)
    r.add_argument("--family", choices=sorted(FAMILIES), default="smollm2")
    args = parser.parse_args()
    if args.cmd == "run":
        windows = dict(tuple(int(x) for x in item.split(":")) for item in args.windows.split(","))
        run(args.work, args.family, args.only, windows, args.passkey, args.trials)
    else:
        render(args.write)


if __name__ == "__main__":
    main()
