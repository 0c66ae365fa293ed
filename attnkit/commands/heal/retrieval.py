"""heal's synthetic retrieval mix (--retrieval-mix F): a share F of the training windows turned into long-range
retrieval tasks, made offline from the windows themselves (their text is the haystack), so that the student learns
from the teacher what needs far context: where the answer is said once, thousands of tokens back.

Three kinds, in turn:
- key: a number stated once at a random depth ("The access code of the north gate is 48213."), asked at the end
  and answered ("... The access code of the north gate is 48213.");
- lookup: a table of name-number pairs at a random depth, three of them asked and answered at the end;
- copy: a span of the window's own text (32-128 tokens) said again at the end, word for word.

Every window keeps its length and starts as the tokenizer starts a text; the loss is the usual KL to the teacher
over the whole window. The phrasing differs from `attnkit eval --passkey`'s ("The pass key is ..." in a repeated
filler), so the pass-key scores measure retrieval, not the training template.
"""

from __future__ import annotations

import random
from collections import Counter

from attnkit.runtime.texts import encode, text_prefix

KINDS = ("key", "lookup", "copy")
#: (statement, question) of the key task; {thing} and {key} filled in.
KEY_TEMPLATES = (
    (
        "The access code of the {thing} is {key}.",
        "What is the access code of the {thing}? The access code of the {thing} is {key}.",
    ),
    ("Write down this number for the {thing}: {key}.", "Which number was given for the {thing}? It was {key}."),
    (
        "The {thing} was registered under the number {key}.",
        "Under which number was the {thing} registered? The {thing} was registered under the number {key}.",
    ),
)
THINGS = (
    "north gate",
    "old mill",
    "blue boat",
    "library vault",
    "river bridge",
    "east tower",
    "night train",
    "garden shed",
    "copper mine",
    "harbour office",
    "mountain hut",
    "village well",
)
NAMES = (
    "Alder",
    "Birch",
    "Cedar",
    "Dahlia",
    "Elm",
    "Fern",
    "Gorse",
    "Hazel",
    "Iris",
    "Juniper",
    "Laurel",
    "Maple",
    "Nettle",
    "Oak",
    "Poppy",
    "Rowan",
    "Sorrel",
    "Thyme",
    "Willow",
    "Yarrow",
)
LOOKUP_PAIRS = 8
LOOKUP_ASKED = 3
COPY_SPAN = (32, 128)


def _number(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 1_000_000))


def _key_task(rng: random.Random) -> tuple[str, str]:
    statement, question = rng.choice(KEY_TEMPLATES)
    thing, key = rng.choice(THINGS), _number(rng)
    return " " + statement.format(thing=thing, key=key), " " + question.format(thing=thing, key=key)


def _lookup_task(rng: random.Random) -> tuple[str, str]:
    names = rng.sample(NAMES, LOOKUP_PAIRS)
    numbers = [_number(rng) for _ in names]
    table = " The register lists: " + "; ".join(f"{n}: {v}" for n, v in zip(names, numbers)) + "."
    asked = rng.sample(range(LOOKUP_PAIRS), LOOKUP_ASKED)
    question = "".join(f" In the register, {names[i]} has the number {numbers[i]}." for i in asked)
    return table, question


def retrieval_window(window: list[int], prefix: list[int], kind: str, tokenizer, rng: random.Random) -> list[int]:
    """One training window (token ids, len(window) of them, starting with `prefix`) turned into a `kind` task."""
    length, body = len(window), window[len(prefix) :]
    if kind == "copy":
        span = rng.randint(*COPY_SPAN)
        span = min(span, (len(body) - 1) // 4)
        start = rng.randrange(0, max(1, len(body) // 2 - span))
        said = body[start : start + span]
        cue = encode(tokenizer, " Once more:")
        kept = body[: len(body) - span - len(cue)]
        return (prefix + kept + cue + said)[:length]
    needle, ask = _key_task(rng) if kind == "key" else _lookup_task(rng)
    needle_ids, ask_ids = encode(tokenizer, needle), encode(tokenizer, ask)
    filler = body[: max(0, len(body) - len(needle_ids) - len(ask_ids))]
    at = rng.randrange(0, len(filler) + 1)
    return (prefix + filler[:at] + needle_ids + filler[at:] + ask_ids)[:length]


def mix_retrieval(windows, tokenizer, fraction: float, seed: int) -> tuple[object, dict]:
    """(windows [N, T] with round(fraction * N) of them, spread evenly, turned into retrieval tasks of the kinds
    in turn; the report's "retrieval" entry: the fraction, the windows changed, how many of each kind)."""
    import torch

    n = windows.shape[0]
    count = min(n, max(1, round(fraction * n)))
    rng = random.Random(seed)
    prefix = text_prefix(tokenizer)
    chosen = sorted({int(i * n / count) for i in range(count)})
    out = windows.clone()
    kinds: Counter = Counter()
    for j, i in enumerate(chosen):
        kind = KINDS[j % len(KINDS)]
        ids = retrieval_window(windows[i].tolist(), prefix, kind, tokenizer, rng)
        out[i] = torch.tensor(ids, dtype=windows.dtype)
        kinds[kind] += 1
    return out, {"fraction": fraction, "windows": len(chosen), "kinds": dict(kinds)}
