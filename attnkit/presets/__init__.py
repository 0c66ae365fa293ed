"""Embedded model presets: published configs of widely used models, so kvmem works offline."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from attnkit.errors import AttnkitError

#: The preset files, `<name>.json` each (tests/test_presets.py checks the names).
DATA = Path(__file__).parent / "data"
PRESET_KEYS = {"name", "aliases", "source", "url", "parameters", "weight_dtype", "config", "notes"}


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # Hugging Face repo id the config was taken from
    url: str
    parameters: int  # published/total parameter count (all experts for MoE)
    weight_dtype: str
    config: dict
    aliases: tuple[str, ...] = ()
    notes: str = ""


def _validate(doc: dict, file: str) -> Preset:
    unknown = set(doc) - PRESET_KEYS
    missing = {"name", "source", "url", "parameters", "config"} - set(doc)
    if unknown or missing or "model_type" not in doc.get("config", {}):
        raise AttnkitError(f"invalid preset file {file}: unknown {sorted(unknown)}, missing {sorted(missing)}")
    return Preset(
        name=doc["name"],
        source=doc["source"],
        url=doc["url"],
        parameters=int(doc["parameters"]),
        weight_dtype=doc.get("weight_dtype", "bf16"),
        config=doc["config"],
        aliases=tuple(doc.get("aliases", ())),
        notes=doc.get("notes", ""),
    )


@cache
def _read(file: str) -> Preset:
    return _validate(json.loads((DATA / file).read_text()), file)


@cache
def all_presets() -> dict[str, Preset]:
    """Presets keyed by lower-case name."""
    presets: dict[str, Preset] = {}
    for file in sorted(f for f in os.listdir(DATA) if f.endswith(".json")):
        preset = _read(file)
        presets[preset.name.lower()] = preset
    return presets


def find_preset(ref: str) -> Preset | None:
    """A preset matching `ref` by name, alias or source repo id (case-insensitive). A name is one file read:
    names, aliases and sources are unique across presets (tests/test_presets.py), so the file named `ref` is the
    only match."""
    key = ref.strip().lower()
    if f"{key}.json" in os.listdir(DATA):
        return _read(f"{key}.json")
    for preset in all_presets().values():
        names = {preset.name.lower(), preset.source.lower(), *(a.lower() for a in preset.aliases)}
        if key in names:
            return preset
    return None


def suggest(ref: str) -> str | None:
    """The preset name or alias closest to a mistyped `ref` ('llama3.1-8b' -> 'llama-3.1-8b'), or None."""
    import difflib

    names = [n for p in all_presets().values() for n in (p.name, *p.aliases)]
    lowered = {n.lower(): n for n in names}
    close = difflib.get_close_matches(ref.strip().lower(), list(lowered), n=1, cutoff=0.8)
    return lowered[close[0]] if close else None
