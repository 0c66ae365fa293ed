"""Write one benchmark's section into a markdown file (docs/benchmarks.md), leaving the other sections alone."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def replace_section(path: Path, section: str) -> None:
    """Replace the section that starts with `section`'s first line ("## name") by `section`, or append it."""
    heading = section.split("\n", 1)[0]
    if not heading.startswith("## "):
        raise ValueError(f"a section starts with '## ', not {heading!r}")
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = section.strip("\n") + "\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _m: block, text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")


def publish(section: str, write: bool) -> None:
    """Put `section` into docs/benchmarks.md when `write`, else print it."""
    if write:
        replace_section(DOCS, section)
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
