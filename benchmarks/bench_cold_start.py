"""Cold start of `attnkit kvmem <preset> --format json` (and --version, inspect) against `python -c pass`, side by side.

Every command runs --repeat times in fresh interpreters, all of them interleaved so that machine load hits them
alike; the table gives medians and their ratio to `python -c pass` of this interpreter (an editable install, whose
start-up includes setuptools' import hook; the venvs made by --typer have none, so their own `python -c pass` is
shorter). Other environments run the same commands in the same loop:
  --typer VERSION   a temporary venv with only typer==VERSION installed (pip, --no-deps) that sees this
                    environment's other packages and this checkout: the same attnkit code on another typer
  --with NAME=PY    any other interpreter, e.g. another checkout's venv

Usage: python benchmarks/bench_cold_start.py [--repeat 15] [--typer 0.29.2] [--with main=/path/bin/python]
                                             [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import typer'": ["-c", "import typer"],
    "attnkit --version": ["-m", "attnkit", "--version"],
    "attnkit kvmem llama-3.1-8b --format json": ["-m", "attnkit", "kvmem", "llama-3.1-8b", "--format", "json"],
    "attnkit inspect llama-3.1-8b --format json": ["-m", "attnkit", "inspect", "llama-3.1-8b", "--format", "json"],
    "the same kvmem, every command registered": [
        "-c",
        "from attnkit.cli import app; app(['kvmem', 'llama-3.1-8b', '--format', 'json'])",
    ],
}


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def typer_env(version: str, folder: Path) -> str:
    """A venv holding typer==version alone; a .pth file adds this checkout and this environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", purelib, f"typer=={version}"],
        check=True,
    )
    (Path(purelib) / "zz_attnkit_bench.pth").write_text(f"{ROOT}\n{sysconfig.get_paths()['purelib']}\n")
    return str(python)


def typer_version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import typer; print(typer.__version__)"], check=True, capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()


def measure(envs: dict[str, str], repeat: int) -> dict[tuple[str, str], list[float]]:
    samples = {(env, name): [] for env in envs for name in COMMANDS}
    for python in envs.values():  # warm the page cache once
        for args in COMMANDS.values():
            timed([python, *args])
    for _ in range(repeat):
        for env, python in envs.items():
            for name, args in COMMANDS.items():
                samples[(env, name)].append(timed([python, *args]))
    return samples


def table(envs: dict[str, str], samples: dict) -> str:
    """Medians, and ratios to `python -c pass` of the first environment (the one a user of this checkout runs)."""
    base = statistics.median(samples[(next(iter(envs)), "python -c pass")])
    lines = ["| environment | command | median (s) | ratio to `python -c pass` |", "|---|---|---:|---:|"]
    for env in envs:
        for name in COMMANDS:
            med = statistics.median(samples[(env, name)])
            lines.append(f"| {env} | `{name}` | {med:.3f} | {med / base:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--typer", action="append", default=[], help="also run with this typer version")
    parser.add_argument("--with", dest="others", action="append", default=[], metavar="NAME=PYTHON")
    parser.add_argument("--write", type=Path, help="replace the '## cold start' section of this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        envs = {f"this checkout, typer {typer_version(sys.executable)}": sys.executable}
        for version in args.typer:
            envs[f"this checkout, typer {version}"] = typer_env(version, Path(tmp) / f"typer-{version}")
        for spec in args.others:
            name, _, python = spec.partition("=")
            envs[f"{name}, typer {typer_version(python)}"] = python
        result = table(envs, measure(envs, args.repeat))
    print(result)
    if args.write:
        sys.path.insert(0, str(Path(__file__).parent))
        from docsection import replace_section

        section = (
            f"## cold start (kvmem, inspect)\n\n`python benchmarks/bench_cold_start.py "
            f"{' '.join(sys.argv[1:])}`".replace(f" --write {args.write}", "")
            + f": each command in a fresh interpreter, every environment and command interleaved, "
            f"{args.repeat} runs, medians; ratios to the first row's `python -c pass` (this checkout's editable install; "
            f"the typer venv made for the comparison has no editable-install hook, so its own start is shorter). "
            f"Python {platform.python_version()} on {platform.machine()}.\n\n{result}\n\n{NOTES}"
        )
        replace_section(args.write, section)


NOTES = """Where the time goes (`python -X importtime`): typer 0.29 builds a pydantic TypeAdapter for every
parameter it parses, and importing pydantic (with its plugin scan through `importlib.metadata`) is most of the
difference between the typer 0.29 and 0.26 rows; attnkit now requires typer 0.26, which parses without it.
`attnkit.cli.main` registers only the command it runs, so the other commands' modules are not imported and their
typer commands not built (the last row builds them all, as `attnkit.cli.app` does). Of what is left, `import typer` alone is the row above; the rest is attnkit's registry,
preset and spec code. torch, transformers, pandas and pydantic are never imported on this path (a test checks
it)."""


if __name__ == "__main__":
    main()
