"""Cold start of `attnkit kvmem` and `attnkit inspect` (a preset, a config file) against `python -c pass`, side by side.

Every command runs --repeat times in fresh interpreters, all of them interleaved (each round in a new random order)
so that machine load hits them alike; the table gives the median wall time and the ratios of the median wall and CPU times (user + sys of the
child) to `python -c pass` of this checkout. Every environment starts from a bytecode cache, as an installed package
does (pip writes the .pyc files at install): PYTHONPYCACHEPREFIX points into a temporary folder, which the warm-up
run fills. Other environments run the same commands in the same loop:
  --checkout NAME=PATH  another attnkit source tree with this interpreter (e.g. `git archive` of an earlier commit)
  --no-bytecode         this checkout (and each --checkout) once more with PYTHONDONTWRITEBYTECODE=1 and no cache:
                        every attnkit module compiled from source on every start
  --typer VERSION       a temporary venv with typer==VERSION and its dependencies installed (pip) that sees this
                        environment's other packages and this checkout: the same attnkit code on another typer
  --with NAME=PY        any other interpreter with its own attnkit, e.g. another checkout's venv

Usage: python benchmarks/bench_cold_start.py [--repeat 15] [--checkout before=/tmp/old] [--no-bytecode]
                                             [--typer 0.29.2] [--with main=/path/bin/python] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import benchlib
from benchlib import ROOT

PRESET = "llama-3.1-8b"
BASE = "python -c pass"


def commands(config: Path) -> dict[str, list[str]]:
    """Row name -> interpreter arguments; `config` is the preset's config.json written to a temporary folder."""
    return {
        BASE: ["-c", "pass"],
        "python -c 'import typer'": ["-c", "import typer"],
        "attnkit --version": ["-m", "attnkit", "--version"],
        f"attnkit kvmem {PRESET} --format json": ["-m", "attnkit", "kvmem", PRESET, "--format", "json"],
        f"attnkit inspect {PRESET} --format json": ["-m", "attnkit", "inspect", PRESET, "--format", "json"],
        "attnkit inspect config.json --format json": ["-m", "attnkit", "inspect", str(config), "--format", "json"],
        "the same kvmem, every command registered": [
            "-c",
            f"from attnkit.cli import app; app(['kvmem', '{PRESET}', '--format', 'json'])",
        ],
    }


@dataclass
class Env:
    """An interpreter, the folder it starts in (a checkout: its attnkit comes first) and its environment."""

    python: str
    cwd: Path
    env: dict = field(default_factory=dict)


def timed(env: Env, args: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + sys) of one run of the interpreter."""
    start = time.perf_counter()
    proc = subprocess.Popen([env.python, *args], cwd=env.cwd, env=env.env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, [env.python, *args])
    return wall, usage.ru_utime + usage.ru_stime


def environ(pycache: Path | None, pythonpath: Path | None) -> dict:
    """This process's environment with a bytecode cache in `pycache` (None: no .pyc read or written) and
    PYTHONPATH set to `pythonpath` (None: removed)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")
    }
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def typer_env(version: str, folder: Path) -> str:
    """A venv holding typer==version and its dependencies (typer 0.29 needs pydantic); a .pth file adds this checkout
    and this environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", purelib, f"typer=={version}"],
        check=True,
    )
    (Path(purelib) / "zz_attnkit_bench.pth").write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return str(python)


def typer_version(env: Env) -> str:
    return subprocess.run(
        [env.python, "-c", "import typer; print(typer.__version__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=env.cwd,
        env=env.env,
    ).stdout.strip()


def measure(envs: dict[str, Env], rows: dict[str, list[str]], repeat: int) -> dict[tuple[str, str], list]:
    samples = {(name, row): [] for name in envs for row in rows}
    for env in envs.values():  # warm the page cache and write the bytecode caches
        for args in rows.values():
            timed(env, args)
    order = list(samples)
    shuffle = random.Random(0).shuffle
    for _ in range(repeat):  # every round in a new order: no row always runs after the same one
        shuffle(order)
        for name, row in order:
            samples[(name, row)].append(timed(envs[name], rows[row]))
    return samples


def table(envs: dict[str, Env], rows: dict[str, list[str]], samples: dict) -> str:
    """Medians, and ratios to `python -c pass` of the first environment (the one a user of this checkout runs)."""
    first = next(iter(envs))
    base_wall = statistics.median(s[0] for s in samples[(first, BASE)])
    base_cpu = statistics.median(s[1] for s in samples[(first, BASE)])
    lines = [
        f"| environment | command | median wall (s) | wall ratio to `{BASE}` | CPU ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for name in envs:
        for row in rows:
            wall = statistics.median(s[0] for s in samples[(name, row)])
            cpu = statistics.median(s[1] for s in samples[(name, row)])
            lines.append(f"| {name} | `{row}` | {wall:.3f} | {wall / base_wall:.2f}x | {cpu / base_cpu:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--no-bytecode", action="store_true", help="also run the checkouts without a bytecode cache")
    parser.add_argument("--typer", action="append", default=[], help="also run with this typer version")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="NAME=PYTHON")
    parser.add_argument(
        "--write", action="store_true", help="replace the '## cold start' section of docs/benchmarks.md"
    )
    args = parser.parse_args()
    from attnkit.presets import find_preset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = tmp / "model" / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(find_preset(PRESET).config, indent=2))
        pycache = tmp / "pycache"
        checkouts = {"this checkout": ROOT}
        for spec in args.checkout:
            name, _, path = spec.partition("=")
            checkouts[name] = Path(path).resolve()
        envs = {name: Env(sys.executable, path, environ(pycache, path)) for name, path in checkouts.items()}
        if args.no_bytecode:
            for name, path in checkouts.items():
                envs[f"{name}, no bytecode cache"] = Env(sys.executable, path, environ(None, path))
        for version in args.typer:
            envs[f"this checkout in a typer {version} venv"] = Env(
                typer_env(version, tmp / f"typer-{version}"), ROOT, environ(pycache, ROOT)
            )
        for spec in args.others:
            name, _, python = spec.partition("=")
            envs[name] = Env(python, tmp, environ(pycache, None))
        envs = {f"{name}, typer {typer_version(env)}": env for name, env in envs.items()}
        rows = commands(config)
        result = table(envs, rows, measure(envs, rows, args.repeat))
    command = " ".join(["python benchmarks/bench_cold_start.py", *(a for a in sys.argv[1:] if a != "--write")])
    section = (
        f"## cold start (kvmem, inspect)\n\n`{command}`: each command in a fresh interpreter, every environment and command interleaved (each round shuffled), {args.repeat} runs, "
        f"medians; ratios to the first row's `{BASE}` (this checkout's editable install; a typer venv made for the "
        f"comparison has no editable-install hook, so its own start is shorter), of the wall time and of the CPU "
        f"time (user + sys, steadier where the machine is shared). Every environment but those marked 'no bytecode "
        f"cache' reads its .pyc files from a cache that the warm-up run writes, as an installed package does. "
        f"config.json is the {PRESET} preset's config in a temporary folder. Python {platform.python_version()} on "
        f"{platform.machine()}.\n\n{result}\n\n{NOTES}"
    )
    benchlib.publish(section, args.write)


NOTES = """Where the time goes (`python -X importtime`, and the commands timed phase by phase in one interpreter):
`import typer` (the second row) and `attnkit --version` (typer's root command built and run, no attnkit command
imported) are the floor of a command line on typer 0.26; the interpreter's teardown of typer's modules counts in
every row. kvmem and inspect add typer building the one command from its signature and parsing, and attnkit's own
modules and work: the command's modules (tests/test_cli_startup.py lists every module the two commands import),
of which the dataclasses cost most (Python 3.11 compiles each generated method: about half a millisecond a
class, some ten of them), json, and the model's architecture file and preset file (a preset name and a family's
own model_type read one file each, other references every file of the folder). Neither command imports torch,
transformers, pandas, numpy, huggingface_hub, safetensors, pydantic, importlib.resources or csv, nor rich unless
it prints a table. `attnkit.cli.main` registers only the command it runs, so the other commands' modules are not
imported and their typer commands not built (the last row builds them all, as `attnkit.cli.app` does). Rows
marked 'no bytecode cache' run with PYTHONDONTWRITEBYTECODE=1, as a checkout run that way does: every start
compiles the attnkit modules it imports. typer 0.29 builds a pydantic TypeAdapter for every parameter it parses,
and importing pydantic (with its plugin scan through `importlib.metadata`) is most of the difference between the
typer 0.29 and 0.26 rows; attnkit requires typer 0.26, which parses without it."""


if __name__ == "__main__":
    main()
