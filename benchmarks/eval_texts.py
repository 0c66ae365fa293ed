"""Write the two held-out texts of other kinds that the quality benchmarks score besides tests/data/prose.

    python benchmarks/eval_texts.py DIR   ->  DIR/legal_gpl3.txt, DIR/technical_pyref.txt

legal: the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3).
technical: Python's language reference as the interpreter ships it (pydoc_data.topics), topics in sorted
order, joined by blank lines; it varies slightly across Python versions (these results: Python 3.11).
Only the first 4096 tokens of each are scored (8 windows of 512).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def main(folder: Path) -> None:
    import pydoc_data.topics

    folder.mkdir(parents=True, exist_ok=True)
    if not GPL3.is_file():
        sys.exit(f"{GPL3} not found (Debian's base-files package ships it)")
    (folder / "legal_gpl3.txt").write_text(GPL3.read_text())
    topics = pydoc_data.topics.topics
    (folder / "technical_pyref.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    main(ap.parse_args().folder)
