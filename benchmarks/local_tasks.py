"""Two lm-eval tasks built offline from text no model here was calibrated or healed on, for bench_capability.

    python benchmarks/local_tasks.py DIR   ->  DIR/wiki_cloze.{yaml,jsonl}, DIR/wiki_lastword.{yaml,jsonl}

Both come from the last HELD_OUT articles of the Wikipedia excerpt in gensim's wheel (benchmarks/wiki_corpus.py;
bench_capability heals on the others):
- wiki_cloze (multiple choice, acc and acc_norm): a sentence of 12+ words without its last word, after up to
  CONTEXT_WORDS words of the paragraph before it; the choices are that word and three last words of other
  sentences of the same articles (plausible sentence endings, drawn with a fixed seed). Chance: 0.25.
- wiki_lastword (LAMBADA-style, loglikelihood): up to CONTEXT_WORDS words of a paragraph, then its last word
  (with its leading space, as lm-eval joins a loglikelihood target to the context unchanged);
  `acc` is whether the word is the model's greedy continuation, `perplexity` lm-eval's over the items.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from wiki_corpus import wiki_corpus

HELD_OUT = 30
CONTEXT_WORDS = 80
CLOZE_ITEMS, LASTWORD_ITEMS = 400, 300
SEED = 0
_WORD = re.compile(r"^[A-Za-z][a-z]{2,}$")

CLOZE_YAML = """task: wiki_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
LASTWORD_YAML = """task: wiki_lastword
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def held_out_articles(folder: Path) -> list[str]:
    """The last HELD_OUT articles of the Wikipedia excerpt (bench_capability heals on the ones before)."""
    lines = wiki_corpus(folder).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines[-HELD_OUT:]]


def _paragraphs(article: str) -> list[list[str]]:
    """Paragraphs as lists of sentences (of whole words), headings and lists left out."""
    out = []
    for block in article.split("\n"):
        block = " ".join(block.split())
        if len(block.split()) < 30 or block.endswith(":"):
            continue
        out.append([s for s in re.split(r"(?<=[.!?])\s+", block) if s])
    return out


def _last_word(sentence: str) -> tuple[str, str] | None:
    """(sentence without its last word, the word) when it ends in a plain word and a full stop."""
    words = sentence.rstrip(".").split()
    if not sentence.endswith(".") or len(words) < 12 or not _WORD.match(words[-1]):
        return None
    return " ".join(words[:-1]), words[-1]


def build(folder: Path) -> None:
    rng = random.Random(SEED)
    cloze, lastword, endings = [], [], []
    for article in held_out_articles(folder):
        for paragraph in _paragraphs(article):
            for i, sentence in enumerate(paragraph):
                split = _last_word(sentence)
                if split is None:
                    continue
                before = " ".join(" ".join(paragraph[:i]).split()[-CONTEXT_WORDS:])
                cloze.append({"context": f"{before} {split[0]}".strip(), "answer": split[1]})
                endings.append(split[1])
            split = _last_word(paragraph[-1])
            if split is not None:
                words = " ".join(paragraph[:-1] + [split[0]]).split()[-CONTEXT_WORDS:]
                # a loglikelihood task's target follows the context as it is (lm-eval adds no delimiter)
                lastword.append({"context": " ".join(words), "target": f" {split[1]}"})
    rng.shuffle(cloze)
    rng.shuffle(lastword)
    with (folder / "wiki_cloze.jsonl").open("w") as fh:
        for item in cloze[:CLOZE_ITEMS]:
            distractors = rng.sample([w for w in set(endings) if w.lower() != item["answer"].lower()], 3)
            choices = [item["answer"], *distractors]
            rng.shuffle(choices)
            fh.write(
                json.dumps({"context": item["context"], "choices": choices, "label": choices.index(item["answer"])})
                + "\n"
            )
    with (folder / "wiki_lastword.jsonl").open("w") as fh:
        for item in lastword[:LASTWORD_ITEMS]:
            fh.write(json.dumps(item) + "\n")
    (folder / "wiki_cloze.yaml").write_text(CLOZE_YAML.format(data=folder.resolve() / "wiki_cloze.jsonl"))
    (folder / "wiki_lastword.yaml").write_text(LASTWORD_YAML.format(data=folder.resolve() / "wiki_lastword.jsonl"))
    print(
        f"{folder}: wiki_cloze {min(len(cloze), CLOZE_ITEMS)} items, wiki_lastword "
        f"{min(len(lastword), LASTWORD_ITEMS)} items",
        file=sys.stderr,
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    target = ap.parse_args().folder
    target.mkdir(parents=True, exist_ok=True)
    build(target)
