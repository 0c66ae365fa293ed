"""What a resolved model reference is: the Checkpoint record, the shard list of a folder and the side files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.errors import AttnkitError

INDEX_NAME = "model.safetensors.index.json"
#: Files a command that runs the model needs besides weights.
SIDE_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
              "vocab.*", "merges.txt", "*.model", "chat_template*"]


@dataclass
class Checkpoint:
    """A resolved model reference. `weight_files` are safetensors shards (empty for GGUF/config)."""

    ref: str
    kind: str  # "folder" | "safetensors" | "gguf" | "config" | "hub"
    config: dict
    root: Path | None = None
    weight_files: list[Path] = field(default_factory=list)
    gguf_file: Path | None = None
    repo_id: str | None = None
    revision: str | None = None

    @property
    def model_type(self) -> str | None:
        return self.config.get("model_type")


def split_revision(ref: str) -> tuple[str, str | None]:
    repo, _, rev = ref.partition("@")
    return repo, rev or None


def safetensors_files(folder: Path) -> list[Path]:
    """The shards of a folder: from the index when there is one, else every *.safetensors file."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise AttnkitError(f"{index}: corrupt index (no weight_map)") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise AttnkitError(f"{index}: shard {missing[0]} is missing")
        return files
    return sorted(folder.glob("*.safetensors"))
