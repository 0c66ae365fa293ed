"""Read and patch `config.json` files."""

from __future__ import annotations

from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.jsonsafe import read_json_file


def read_config(path: str | Path) -> dict:
    """Parse a config.json; missing or malformed files give a one-line error naming the file."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise AttnkitError(f"missing config.json: {path} does not exist")
    config = read_json_file(path, "config.json")
    if not isinstance(config, dict):
        raise AttnkitError(f"{path}: config must be a JSON object")
    return text_config(config)


def text_config(config: dict) -> dict:
    """For multimodal configs (e.g. Gemma 3), the language model's sub-config; else the config."""
    text = config.get("text_config")
    if isinstance(text, dict) and "model_type" in text:
        merged = dict(text)
        merged.setdefault("torch_dtype", config.get("torch_dtype") or config.get("dtype"))
        return merged
    return config


def patch_config(config: dict, **changes) -> dict:
    """A copy of `config` with `changes` applied (None removes a key)."""
    patched = dict(config)
    for key, value in changes.items():
        if value is None:
            patched.pop(key, None)
        else:
            patched[key] = value
    return patched
