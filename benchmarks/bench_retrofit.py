"""Quality cost of every retrofit on SmolLM2-135M-Instruct: perplexity and KL vs the source on held-out prose.

Usage: python benchmarks/bench_retrofit.py [--eval-tokens 2048] [--seq-len 256] [--kl-steps 60]
                                           [--only softcap,qknorm,qkclip] [--qknorm-methods pad,kl,lsq,scalar,unit]
                                           [--write docs/benchmarks.md]
Calibration: tests/data/prose/calib.txt; evaluation: tests/data/prose/heldout.txt (disjoint).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import ROOT

PROSE = ROOT / "tests" / "data" / "prose"


def _variants(args) -> list[tuple[str, str, dict]]:
    """(retrofit, label, request arguments) to run."""
    runs = []
    if "qknorm" in args.only:
        for method in args.qknorm_methods.split(","):
            runs.append(("qknorm", f"method {method}", {"method": method, "steps": args.kl_steps}))
    if "qkclip" in args.only:
        for tau in (15.0, 10.0):
            runs.append(("qkclip", f"tau {tau:g}", {"tau": tau}))
    if "softcap" in args.only:
        for cap in (50.0, 20.0, 10.0, 5.0):
            runs.append(("softcap", f"attn cap {cap:g}", {"attn_cap": cap}))
        for frac in (1e-3, 1e-4):
            runs.append(("softcap", f"attn cap auto (affect {frac:g})", {"attn_cap": "auto", "affect_fraction": frac}))
        runs.append(("softcap", "final cap 30", {"final_cap": 30.0}))
    return runs


def _run(kind: str, kwargs: dict, src: str, out: Path, args) -> dict:
    """The retrofit without --eval (its probe pass is measured elsewhere); scored by _score."""
    opts = dict(
        model=src,
        out=out,
        calib=[str(PROSE / "calib.txt")],
        calib_tokens=args.calib_tokens,
        calib_seq_len=args.seq_len,
        device="cpu",
    )
    if kind == "softcap":
        from attnkit.commands.retrofit.softcap import SoftcapRequest, retrofit_softcap

        return retrofit_softcap(SoftcapRequest(**opts, **kwargs))
    if kind == "qknorm":
        from attnkit.commands.retrofit.qknorm import QKNormRequest, retrofit_qknorm

        return retrofit_qknorm(QKNormRequest(**opts, **kwargs))
    from attnkit.commands.retrofit.qkclip import QKClipRequest, retrofit_qkclip

    return retrofit_qkclip(QKClipRequest(**opts, **kwargs))


def _score(source, folder: Path, wins) -> dict:
    """Perplexity of source and result, KL(source || result) and top-1 agreement on the held-out windows."""
    from attnkit.commands.retrofit.common import load
    from attnkit.scoring.perplexity import evaluate

    return evaluate(load(folder, "cpu"), wins, reference=source).to_dict()


def _detail(kind: str, report: dict) -> str:
    if kind == "softcap":
        auto = (report.get("auto") or {}).get("attn")
        if auto:
            return f"cap {auto['cap']:.3g}, affected {auto['affected_fraction']:.2g} of {auto['logits']:,} calib logits"
        return ""
    if kind == "qknorm":
        head = f"head_dim {report['head_dim_before']} -> {report['head_dim_after']}"
        kls = [r["attention_kl"] for r in report["layers"] if r["attention_kl"] is not None]
        return head + (f", mean attention KL (calib) {sum(kls) / len(kls):.3g}" if kls else "")
    return f"{report['clipped_heads']} of {len(report['heads'])} heads clipped"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--kl-steps", type=int, default=60)
    parser.add_argument("--only", default="softcap,qknorm,qkclip")
    parser.add_argument("--qknorm-methods", default="pad,kl,lsq,scalar,unit", help="qknorm methods to run, in order.")
    parser.add_argument("--write", default=None, help="Markdown file whose '## retrofit' section is rewritten.")
    args = parser.parse_args()
    args.only = set(args.only.split(","))
    from attnkit.commands.retrofit.common import load
    from attnkit.realmodels import smollm2_folder
    from attnkit.runtime.texts import make_windows, read_texts

    src = str(smollm2_folder())
    source = load(src, "cpu")
    wins = make_windows(source.tokenizer, read_texts([str(PROSE / "heldout.txt")]), args.seq_len, args.eval_tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (kind, label, kwargs) in enumerate(_variants(args)):
            started = time.perf_counter()
            report = _run(kind, kwargs, src, Path(tmp) / f"out{n}", args)
            e = _score(source, Path(tmp) / f"out{n}", wins)
            row = (
                f"| {kind} | {label} | {e['reference_perplexity']:.3f} | {e['perplexity']:.3f} | {e['kl_mean']:.4g} | "
                f"{e['top1_agreement']:.3f} | {_detail(kind, report)} | {time.perf_counter() - started:.0f} |"
            )
            print(row, flush=True)
            rows.append(row)
    body = (
        "`python benchmarks/bench_retrofit.py --write docs/benchmarks.md`: SmolLM2-135M-Instruct (fp32, CPU), "
        f"calibration on tests/data/prose/calib.txt ({args.calib_tokens} tokens), evaluation on "
        f"tests/data/prose/heldout.txt ({args.eval_tokens} tokens in windows of {args.seq_len}); KL = mean "
        "KL(source || retrofit) per token; *s* = wall time of the retrofit plus its evaluation "
        f"(2-core machine shared with other jobs; torch {torch.__version__}). qknorm kl: {args.kl_steps} Adam steps "
        "per layer.\n\n"
        "| retrofit | variant | source ppl | ppl | KL | top-1 agree | detail | s |\n"
        "|---|---|---:|---:|---:|---:|---|---:|\n" + "\n".join(rows)
    )
    benchlib.publish("## retrofit\n\n" + body, bool(args.write), args.write)
    if args.write:
        print(f"wrote the '## retrofit' section of {args.write}")


if __name__ == "__main__":
    main()
