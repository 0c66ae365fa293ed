"""Long-context retrieval: a pass key (random digits) hidden at evenly spaced depths in filler text, greedy
decoding, exact match; accuracy per context length and depth.

Variants:
- `repeat`: the classic test (Mohtashami and Jaggi, 2023): "The pass key is 71432. Remember it. 71432 is the
  pass key." once in the filler; the question asks for it. Copying the one number in the text passes it.
- `distractors`: the key stated once ("The pass key is 71432.") at the depth under test, and NAMED_KEYS - 1 other
  five-digit numbers at random places ("The room number is 48213."). A model that copies a number it saw gets
  1 / NAMED_KEYS by chance.
- `named`: NAMED_KEYS keys of as many doors ("The pass key of the red door is 71432."), spread through the filler
  with the asked one at the depth under test; the question names one door. Chance is 1 / NAMED_KEYS again, and
  only retrieval by name passes it.

Prompts start as the tokenizer starts a text (attnkit.runtime.texts) and are sized in tokens: a length is the
whole sequence, the question and the ANSWER_TOKENS generated included, so every length up to the model's
max_position_embeddings runs within the positions it was trained on.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from attnkit.errors import UsageError
from attnkit.progress import phase
from attnkit.runtime.texts import encode, text_prefix
from attnkit.units import MAX_COUNT, check_bounds

VARIANTS = ("repeat", "named", "distractors")
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
    "it. I will quiz you about it."
)
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMED_KEYS = 4
DOORS = ("red", "blue", "green", "yellow", "white", "black", "golden", "silver")
#: Sentences that put other five-digit numbers in the filler (the distractors variant).
DISTRACTORS = (
    "The room number is {}.",
    "The year of the great storm was {}.",
    "The price of the old house was {}.",
    "The town has {} people.",
    "The train number is {}.",
    "The box weighs {} grams.",
)
DIGITS = 5
#: Tokens generated per answer: enough for the digits however the tokenizer splits them.
ANSWER_TOKENS = 12


@dataclass(frozen=True)
class PasskeySpec:
    """Context lengths in tokens, depths per length (evenly spaced, both ends included), trials per cell."""

    lengths: tuple[int, ...]
    depths: int = 5
    trials: int = 3
    seed: int = 0
    variant: str = "repeat"


@dataclass(frozen=True)
class Probe:
    length: int
    depth: float
    trial: int
    text: str
    answer: str


def check_passkey(spec: PasskeySpec, max_positions: int | None, ref: str = "the model") -> None:
    """Lengths, depths, trials and the variant, before any model loads; a length past the model's position limit
    (max_position_embeddings) is refused."""
    if spec.variant not in VARIANTS:
        raise UsageError(f"--passkey-variant must be one of {', '.join(VARIANTS)}, got {spec.variant!r}")
    if not spec.lengths:
        raise UsageError("--passkey needs at least one context length")
    for length in spec.lengths:
        check_bounds("--passkey", length, 256, MAX_COUNT)
        if max_positions is not None and length > max_positions:
            raise UsageError(
                f"--passkey {length:,} is past {ref}'s {max_positions:,} positions (max_position_embeddings)"
            )
    check_bounds("--depths", spec.depths, 1, 101)
    check_bounds("--trials", spec.trials, 1, 10_000)


def depths(count: int) -> list[float]:
    """`count` depths from 0 (the key first) to 1 (the key last), evenly spaced."""
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def _key(rng: random.Random) -> str:
    return str(rng.randrange(10 ** (DIGITS - 1), 10**DIGITS))


def _needles(spec: PasskeySpec, rng: random.Random) -> tuple[list[str], str, str, str]:
    """(needle sentences, the asked one first), the question, the answer prefix and the key asked for."""
    key = _key(rng)
    if spec.variant == "repeat":
        return (
            [f" The pass key is {key}. Remember it. {key} is the pass key."],
            " What is the pass key?",
            " The pass key is",
            key,
        )
    if spec.variant == "distractors":
        others = [" " + s.format(_key(rng)) for s in rng.sample(DISTRACTORS, NAMED_KEYS - 1)]
        return [f" The pass key is {key}.", *others], " What is the pass key?", " The pass key is", key
    doors = rng.sample(DOORS, NAMED_KEYS)
    keys = [key] + [_key(rng) for _ in doors[1:]]
    needles = [f" The pass key of the {door} door is {k}." for door, k in zip(doors, keys)]
    return needles, f" What is the pass key of the {doors[0]} door?", f" The pass key of the {doors[0]} door is", key


def probes(tokenizer, spec: PasskeySpec) -> list[Probe]:
    """Every (length, depth, trial) prompt, with filler sized so that the prompt and its answer fill about `length`
    tokens."""
    rng = random.Random(spec.seed)
    filler = len(encode(tokenizer, FILLER))
    fixed = len(text_prefix(tokenizer)) + len(encode(tokenizer, INTRO))
    out = []
    for length in spec.lengths:
        for depth in depths(spec.depths):
            for trial in range(spec.trials):
                needles, question, lead, key = _needles(spec, rng)
                tail = question + lead
                budget = (
                    length
                    - ANSWER_TOKENS
                    - fixed
                    - len(encode(tokenizer, tail))
                    - len(encode(tokenizer, "".join(needles)))
                )
                count = max(1, budget // filler)
                parts = [FILLER] * count
                others = needles[1:]
                for needle in others:  # the other doors' keys at random places
                    parts.insert(rng.randrange(len(parts) + 1), needle)
                parts.insert(round(depth * len(parts)), needles[0])
                out.append(Probe(length, depth, trial, INTRO + "".join(parts) + tail, key))
    return out


def run_passkey(loaded, spec: PasskeySpec, name: str = "model") -> dict:
    """Greedy answers of one loaded model; accuracy per (length, depth) cell, per length and in all."""
    import torch

    from attnkit.runtime.texts import prompt_ids

    tok, model = loaded.tokenizer, loaded.model
    cells: dict[tuple[int, float], list[bool]] = {}
    lengths: dict[int, list[int]] = {}
    items = probes(tok, spec)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad(), phase(f"pass keys: {name}", len(items), "prompts") as advance:
        for probe in items:
            ids = torch.tensor([prompt_ids(tok, probe.text)], device=loaded.device)  # [1, T]
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=ANSWER_TOKENS,
                do_sample=False,
                pad_token_id=pad,
            )
            answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            found = re.search(r"\d+", answer)
            cells.setdefault((probe.length, probe.depth), []).append(bool(found) and found.group() == probe.answer)
            lengths.setdefault(probe.length, []).append(ids.shape[1])
            advance(1)
    rows = [
        {"length": length, "depth": depth, "trials": len(hits), "correct": sum(hits), "accuracy": sum(hits) / len(hits)}
        for (length, depth), hits in cells.items()
    ]
    by_length = []
    for length in spec.lengths:
        hits = [h for (n, _), cell in cells.items() if n == length for h in cell]
        by_length.append(
            {
                "length": length,
                "prompt_tokens": round(sum(lengths[length]) / len(lengths[length])),
                "accuracy": sum(hits) / len(hits),
            }
        )
    every = [h for cell in cells.values() for h in cell]
    return {
        "variant": spec.variant,
        "depths": depths(spec.depths),
        "trials": spec.trials,
        "seed": spec.seed,
        "chance": None if spec.variant == "repeat" else 1 / NAMED_KEYS,
        "accuracy": sum(every) / len(every),
        "by_length": by_length,
        "cells": rows,
    }


def compare_passkey(source: dict, result: dict) -> list[dict]:
    """Per length: the source's accuracy, the result's and their difference."""
    theirs = {r["length"]: r for r in source["by_length"]}
    return [
        {
            "length": r["length"],
            "source": theirs[r["length"]]["accuracy"],
            "result": r["accuracy"],
            "difference": r["accuracy"] - theirs[r["length"]]["accuracy"],
        }
        for r in result["by_length"]
        if r["length"] in theirs
    ]
