"""Write one benchmark's section into a markdown file (docs/benchmarks.md), leaving the other sections alone."""

from __future__ import annotations

import re
from pathlib import Path


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
