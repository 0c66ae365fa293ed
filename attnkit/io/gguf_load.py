"""Turn a GGUF file into a Hugging Face safetensors folder through transformers' GGUF support."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from attnkit.errors import AttnkitError


def load_gguf_model(gguf_path: Path, dtype: str = "float32"):
    """(model, tokenizer) from a GGUF file, dequantized to `dtype`, rebuilt without quantization_config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types for unsupported/corrupt GGUF
        raise AttnkitError(f"{gguf_path}: cannot load GGUF through transformers ({type(exc).__name__}: {exc})") from None
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = torch_dtype
    # save_pretrained refuses a model that still carries a gguf quantization_config: rebuild it.
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    return model.eval(), tokenizer


#: Bumped when what materialize_gguf writes changes, so older cache folders are not reused.
CACHE_FORMAT = 2
#: tokenizer_config.json keys transformers 5 writes that transformers 4.x (llama.cpp's converter pins 4.57) lacks.
TOKENIZER_5X_KEYS = ("backend", "is_local", "local_files_only")


def portable_tokenizer_config(folder: Path) -> None:
    """Rewrite tokenizer_config.json as older readers take it: transformers 5 names the class "TokenizersBackend",
    which 4.x cannot load; the same tokenizer.json loads in both as PreTrainedTokenizerFast."""
    import json

    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in TOKENIZER_5X_KEYS:
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def cache_root() -> Path:
    """Where dequantized GGUF models are kept: $ATTNKIT_CACHE, else $XDG_CACHE_HOME/attnkit, else ~/.cache/attnkit."""
    if os.environ.get("ATTNKIT_CACHE"):
        return Path(os.environ["ATTNKIT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "attnkit"


def gguf_cache_folder(gguf_path: Path, cache_dir: Path | None = None, dtype: str = "float32") -> Path:
    """The cache folder for `gguf_path` in `dtype`; its name changes when the file's path, size or mtime do."""
    gguf_path = Path(gguf_path).resolve()
    try:
        stat = gguf_path.stat()
    except FileNotFoundError:
        raise AttnkitError(f"{gguf_path}: file not found") from None
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|{CACHE_FORMAT}".encode()).hexdigest()[:12]
    return Path(cache_dir or cache_root()) / f"{gguf_path.stem}-{dtype}-{key}"


def materialize_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write config, safetensors weights and tokenizer of a GGUF model to `out_dir` (atomically, once)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    model, tokenizer = load_gguf_model(gguf_path, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_config(tmp)
        tmp.rename(out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out_dir / "config.json").is_file():  # else another process finished first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
