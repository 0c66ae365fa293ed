"""A real English training corpus for bench_heal: the Wikipedia sample that gensim's wheel ships for its tests.

gensim 4.4.0 (PyPI) carries `enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`, an excerpt of
an English Wikipedia dump (206 pages, 1.7 MB). `wiki_corpus(folder)` downloads the wheel with pip, checks the
file's sha256, strips the wiki markup with mwparserfromhell (`pip install 'attnkit[bench]'`) and writes the
articles (redirects, namespaced pages and stubs under MIN_CHARS dropped) as a .jsonl of {"text": ...} lines
for `attnkit heal --data`: 105 articles, about 500,000 words. Wikipedia text is CC BY-SA; it is fetched at
benchmark time, not stored in this repository.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

WHEEL = "gensim==4.4.0"
MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
NAME = "enwiki-gensim.jsonl"
#: Articles shorter than this after stripping (disambiguation pages, stubs) are left out.
MIN_CHARS = 500
#: Lines that are leftovers of image markup ("thumb|...", "250px|...").
_IMAGE_LINE = re.compile(r"^\s*(thumb|left|right|upright|\d+px)\b")


def wiki_corpus(folder: Path) -> Path:
    """FOLDER/enwiki-gensim.jsonl, built once (download, check, strip); returns its path."""
    out = Path(folder) / NAME
    if out.is_file():
        return out
    if importlib.util.find_spec("mwparserfromhell") is None:  # fail before downloading
        raise SystemExit("benchmarks/wiki_corpus.py needs mwparserfromhell: pip install 'attnkit[bench]'")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("gensim-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            dump = zf.read(MEMBER)
    if hashlib.sha256(dump).hexdigest() != SHA256:
        raise SystemExit(f"{WHEEL}: {MEMBER} does not have the expected sha256")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tmp_out.open("w", encoding="utf-8") as fh:
        for text in articles(bz2.decompress(dump)):
            fh.write(json.dumps({"text": text}) + "\n")
    os.replace(tmp_out, out)
    return out


def articles(xml: bytes):
    """Plain text of each main-namespace, non-redirect page of a MediaWiki XML dump of at least MIN_CHARS."""
    import mwparserfromhell

    for _, el in ET.iterparse(io.BytesIO(xml)):
        if not el.tag.endswith("page"):
            continue
        title = next((c.text or "" for c in el.iter() if c.tag.endswith("title")), "")
        wikitext = next((c.text or "" for c in el.iter() if c.tag.endswith("text")), "")
        el.clear()
        if ":" in title or wikitext.lower().startswith("#redirect"):
            continue
        plain = mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True)
        plain = "\n".join(line for line in plain.split("\n") if not _IMAGE_LINE.match(line))
        plain = re.sub(r"\n{3,}", "\n\n", plain).strip()
        if len(plain) >= MIN_CHARS:
            yield plain


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, nargs="?", default=Path(".cache/bench-heal"))
    print(wiki_corpus(ap.parse_args().folder))
