"""What the benchmark scripts share: run attnkit and read its JSON report, the peak memory of a child command,
publish a section into a docs page, rows files, and scores against a source (by distance, perplexity ratios).

A script run as `python benchmarks/NAME.py` has this folder on sys.path, so `import benchlib` needs no path edit;
attnkit is imported as installed. Nothing here imports tests/, and no test imports this module.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The docs pages the scripts publish into.
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
ABLATIONS = ROOT / "docs" / "ablations.md"
SERVING = ROOT / "docs" / "serving.md"

# -- running attnkit


def attnkit(*args: str, ok: Iterable[int] = (0,), cwd=None, env: dict | None = None, entry=None, log=False) -> dict:
    """`attnkit ARGS --format json` in a fresh interpreter; its JSON report ({} when it printed none). `--format
    json` is added unless ARGS give a format; `entry` replaces `-m attnkit` (a script's own child mode), `env` adds
    to the environment, `log` lets its stderr through to this terminal (a long run's progress). An exit status
    outside `ok` stops the script with the command (and the end of its stderr)."""
    cmd = [sys.executable, *(entry or ("-m", "attnkit")), *args]
    if "--format" not in args and "-f" not in args:
        cmd += ["--format", "json"]
    done = subprocess.run(
        cmd,
        stdout=subprocess.PIPE,
        stderr=None if log else subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
    )
    if done.returncode not in tuple(ok):
        raise SystemExit(f"attnkit {' '.join(args[:3])}: exit {done.returncode}\n{(done.stderr or '').strip()[-2000:]}")
    return json.loads(done.stdout) if done.stdout.strip() else {}


def write_models(work: Path, source: Path, commands: dict[str, str], names: Iterable[str]) -> None:
    """Write each named model as DIR/NAME with its command line (after "attnkit"; {src} {out} {work} filled in),
    skipping those DIR holds already (their attnkit.json written)."""
    for name in names:
        out = work / name
        if (out / "attnkit.json").is_file():
            continue
        started = time.perf_counter()
        attnkit(*commands[name].format(src=source, out=out, work=work).split(), log=True)
        print(f"{name}: written in {time.perf_counter() - started:.0f}s", file=sys.stderr)


def portable(command: str, work: Path, source: Path) -> str:
    """A command line with this machine's folders replaced by SRC and DIR, the repository's paths relative."""
    return command.replace(str(source), "SRC").replace(str(work), "DIR").replace(str(ROOT) + "/", "")


# -- peak memory


def status_kib(pid: int | str, field: str) -> int:
    """A kB field of /proc/PID/status (PID "self": this process), e.g. RssAnon, VmRSS, VmHWM; 0 once it is gone."""
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return 0
    return int(found.group(1)) if found else 0


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc/*/stat."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def measure(cmd: list[str], interval: float = 0.2, sync: bool = False, stdout: bool = False) -> dict:
    """Run `cmd` under /usr/bin/time -v: `seconds` (wall), `max_rss_bytes` (its maximum RSS, pages of mapped files
    included), `peak_anon_bytes` (the largest RssAnon of it and its children, polled every `interval` s: what they
    hold themselves) and `load_after` (the 1-minute load average at the end: other work stretches the seconds).
    `sync`: dirty pages flushed before, and after inside the timing (a writer's output is on disk). `stdout`: the
    command's stdout kept as `stdout` (else discarded). A failure stops the script with the command's error."""
    if sync:
        subprocess.run(["sync"], check=True)
    out = subprocess.PIPE if stdout else subprocess.DEVNULL
    proc = subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=out, stderr=subprocess.PIPE, text=True)
    peak = {"anon": 0}

    def poll() -> None:
        pids, found = [], 0.0  # the process tree, looked up again every 0.2 s (a walk of /proc costs more than a read)
        while proc.poll() is None:
            if time.perf_counter() - found >= 0.2:
                pids, found = _descendants(proc.pid), time.perf_counter()
            peak["anon"] = max(peak["anon"], sum(status_kib(p, "RssAnon") for p in pids))
            time.sleep(interval)

    started = time.perf_counter()
    poller = threading.Thread(target=poll)
    poller.start()
    printed, err = proc.communicate()
    if sync:
        subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - started
    poller.join()
    if proc.returncode != 0:
        lines = [line for line in err.splitlines() if line.startswith("error")] or err.splitlines()[-3:]
        raise SystemExit(f"{' '.join(cmd[:4])}: failed: {lines[-1] if lines else proc.returncode}")
    max_rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
    result = {
        "seconds": seconds,
        "max_rss_bytes": max_rss * 1024,
        "peak_anon_bytes": peak["anon"] * 1024,
        "load_after": round(os.getloadavg()[0], 1),
    }
    return {**result, "stdout": printed} if stdout else result


# -- publishing


def replace_section(path: Path, section: str) -> None:
    """Replace the section of the Markdown file `path` that starts with `section`'s first line ("## name") by
    `section`, or append it; the other sections stay as they are."""
    heading = section.split("\n", 1)[0]
    if not heading.startswith("## "):
        raise ValueError(f"a section starts with '## ', not {heading!r}")
    text = path.read_text() if path.exists() else f"# {path.stem.capitalize()}\n"
    block = section.strip("\n") + "\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _m: block, text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")


def publish(section: str, write: bool, page: Path = BENCHMARKS) -> None:
    """Put `section` into the docs page `page` (docs/benchmarks.md unless named) when `write`, else print it."""
    if write:
        replace_section(Path(page), section)
    else:
        print(section)


def run_render_parser(description: str):
    """(parser, its "run" subparser) of a benchmark that runs (--work DIR, --only NAME ...) and renders its section
    (--write); the caller adds its own run options and dispatches on `cmd`."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--work", type=Path, required=True)
    run.add_argument("--only", nargs="*", default=[])
    sub.add_parser("render").add_argument("--write", action="store_true")
    return parser, run


def run_or_render(description: str, results: Path, run, render) -> None:
    """The command line of a benchmark whose run writes one JSON results file and whose section renders from it:
    `--work DIR` runs (run(DIR) -> the results) and stores them, then the section is published (`--write`) or
    printed from the stored results."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        Path(results).write_text(json.dumps(run(args.work), indent=1) + "\n")
    publish(render(json.loads(Path(results).read_text())), args.write)


# -- rows files


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, rows: Iterable[dict]) -> None:
    with Path(path).open("a") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


def latest(rows: Iterable[dict], key: Callable[[dict], object]) -> dict:
    """The last row of each key(row), in the order the keys first appear."""
    out = {}
    for row in rows:
        out[key(row)] = row
    return out


# -- scores against a source


def load(path):
    """A model folder loaded in float32 on the CPU (attnkit's LoadedModel)."""
    from attnkit.runtime import load_model

    return load_model(str(path), device="cpu", dtype="float32")


def score_texts(model, reference, texts: dict[str, Path], tokens: int | None, seq_len: int = 512) -> dict:
    """{text name: attnkit's EvalResult} of the loaded `model` against the loaded `reference` on the first `tokens`
    tokens (all: None) of each text file, in windows of `seq_len` cut by the reference's tokenizer."""
    from attnkit.runtime import make_windows, read_texts
    from attnkit.scoring.perplexity import evaluate

    out = {}
    for name, path in texts.items():
        windows = make_windows(reference.tokenizer, read_texts([str(path)]), seq_len, tokens)
        out[name] = evaluate(model, windows, reference=reference)
    return out


def report_scores(report: dict) -> dict:
    """A convert command's scores against its source, from its JSON report: perplexity, the source's, KL, top-1
    agreement (its --eval block) and the mean per-layer K and V reconstruction errors."""
    e, layers = report["eval"], report["layers"]
    return {
        "ppl": e["perplexity"],
        "source_ppl": e["source_perplexity"],
        "kl": e["kl_mean"],
        "top1": e["top1_agreement"],
        "k_err": sum(r["k_err"] for r in layers) / len(layers),
        "v_err": sum(r["v_err"] for r in layers) / len(layers),
    }


def eval_distance(model: Path, text: Path, reference: Path, seq_len: int, windows: int, *options: str):
    """`attnkit eval MODEL TEXT --reference REF` on `windows` windows of `seq_len` tokens, by distance of the
    predicted token: (its report, the arguments after "attnkit eval")."""
    args = [str(model), str(text), "--reference", str(reference), "--seq-len", str(seq_len)]
    args += ["--max-tokens", str(seq_len * windows), *options]
    return attnkit("eval", *args), args


def eval_passkey(model: Path, lengths: str, variant: str, depths: int, trials: int, *options: str):
    """`attnkit eval MODEL --passkey LENGTHS` in one variant: ({length: accuracy}, its report, the arguments)."""
    args = [str(model), "--passkey", lengths, "--passkey-variant", variant, "--depths", str(depths)]
    args += ["--trials", str(trials), *options]
    doc = attnkit("eval", *args)
    return {r["length"]: r["accuracy"] for r in doc["passkey"]["model"]["by_length"]}, doc, args


def buckets(by_distance: list[dict]) -> list[str]:
    """The header cells of an eval report's by-distance buckets: "0-128", "128-256", ..."""
    return [f"{r['start']:,}-{r['end']:,}" for r in by_distance]


def source_cells(by_distance: list[dict]) -> list[str]:
    """The source's own perplexity in each bucket."""
    return [f"{r['reference_perplexity']:.2f}" for r in by_distance]


def ratio_cells(by_distance: list[dict]) -> list[str]:
    """The result's perplexity over the source's in each bucket."""
    return [f"{r['ratio']:.2f}x" for r in by_distance]
