"""Architecture registry: one JSON file per family under attnkit/archs/data/."""

from __future__ import annotations

import json
import os
import reprlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from attnkit.archs.schema import validate_arch
from attnkit.errors import AttnkitError


@dataclass(frozen=True)
class Arch:
    """One architecture family as data (see attnkit/archs/schema.py for the fields)."""

    data: dict

    @property
    def family(self) -> str:
        return self.data["family"]

    @property
    def tensors(self) -> dict[str, str]:
        return self.data["tensors"]

    @property
    def other_tensors(self) -> dict[str, str]:
        """Roles outside attention (embed, final_norm, input_norm, ...: attnkit.archs.schema.OTHER_ROLES) -> name
        template, relative to the prefix."""
        return self.data.get("other_tensors", {})

    @property
    def head_name(self) -> str | None:
        """The output head's full name (required.head; absent where the config ties it to the embeddings)."""
        return self.data["required"].get("head")

    @property
    def norm_offset(self) -> float:
        """What an RMSNorm adds to its stored weight before scaling (Gemma stores w and applies 1 + w)."""
        return self.data.get("norm_weight_offset", 0.0)

    def __getattr__(self, name: str) -> Any:  # position, qk_norm, qkv_layout, ...
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None

    def config_value(self, config: dict, role: str, default: Any = None) -> Any:
        """First present config key for `role` (dotted keys walk nested dicts), else the default."""
        return self.config_item(config, role, default)[1]

    def config_item(self, config: dict, role: str, default: Any = None) -> tuple[str, Any]:
        """(key, value) of the first present config key for `role`; ("default", default) when none is."""
        for key in self.data["config"].get(role, []):
            value = _lookup(config, key)
            if value is not None:
                return key, value
        return "default", self.data.get("defaults", {}).get(role, default)

    def norm_names(self, num_layers: int, prefix: str = "") -> set[str]:
        """The full names of every norm weight outside attention: the other_tensors roles ending in _norm."""
        names = set()
        for role, template in self.other_tensors.items():
            if role.endswith("_norm"):
                layers = range(num_layers) if "{i}" in template else [None]
                names |= {self.tensor_name(role, layer, prefix) for layer in layers}
        return names

    def tensor_name(self, role: str, layer: int | None = None, prefix: str = "") -> str | None:
        """The name of `role` (an attention role or one of other_tensors) in `layer` (None for a model role), or
        None where the family has no such role."""
        template = self.tensors.get(role) or self.other_tensors.get(role)
        if template is None:
            return None
        if layer is None and "{i}" in template:
            raise ValueError(f"{role} is a per-layer role: give the layer")
        return prefix + template.format(i=layer)


def _lookup(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


#: The architecture files, `<family>.json` each (a family is named like its usual model_type). A plain folder:
#: importlib.resources costs a cold start more than the registry does.
DATA = Path(__file__).parent / "data"


@cache
def _load(file: str) -> Arch:
    """One architecture file, parsed and checked against the schema."""
    try:
        doc = json.loads((DATA / file).read_text())
    except json.JSONDecodeError as exc:
        raise AttnkitError(f"invalid architecture file {file}: {exc}") from None
    return Arch(validate_arch(doc, file))


@cache
def _registry() -> dict[str, Arch]:
    by_type: dict[str, Arch] = {}
    for file in sorted(f for f in os.listdir(DATA) if f.endswith(".json")):
        arch = _load(file)
        for model_type in arch.model_types:
            if model_type in by_type:
                raise AttnkitError(f"model_type '{model_type}' is claimed by two architecture files")
            by_type[model_type] = arch
    return by_type


def supported_model_types() -> list[str]:
    return sorted(_registry())


def all_archs() -> list[Arch]:
    seen: dict[str, Arch] = {}
    for arch in _registry().values():
        seen.setdefault(arch.family, arch)
    return [seen[k] for k in sorted(seen)]


def get_arch(model_type: str | None) -> Arch:
    """The architecture for a config's `model_type`; unknown types list the supported ones. A family's own
    model_type reads its file alone (every model_type is claimed once, which tests/test_archs.py checks)."""
    if isinstance(model_type, str) and f"{model_type}.json" in os.listdir(DATA):
        arch = _load(f"{model_type}.json")
        if model_type in arch.model_types:
            return arch
    reg = _registry()
    if isinstance(model_type, str) and model_type in reg:
        return reg[model_type]
    raise AttnkitError(f"unsupported model_type {reprlib.repr(model_type)}; supported: {', '.join(sorted(reg))}")
