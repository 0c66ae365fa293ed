"""Turn a GGUF file into a Hugging Face safetensors folder through transformers' GGUF support."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.gguf_meta import check_gguf_tokenizer
from attnkit.io.tempdirs import clean_stale, follow_umask, make_temp_dir, remove_tree, unmark


@contextlib.contextmanager
def _dequantize_progress(description: str):
    """transformers' GGUF loop draws its own tqdm bar; route it to a phase of attnkit's display instead."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from attnkit.progress import phase

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def bar(iterable, *_args, **_kwargs):
        with phase(description, len(iterable), "tensors") as advance:
            for item in iterable:
                yield item
                advance(1)

    gguf_utils.tqdm = bar
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def load_gguf_model(gguf_path: Path, dtype: str = "float32"):
    """(model, tokenizer) from a GGUF file, dequantized to `dtype`, rebuilt without quantization_config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    gguf_path = Path(gguf_path)
    torch_dtype = getattr(torch, dtype)
    folder, name = str(gguf_path.parent), gguf_path.name
    hf_logging.disable_progress_bar()  # attnkit.progress shows the work instead
    try:
        with _dequantize_progress(f"dequantizing {name}"):
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype, use_kernels=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises many types for unsupported/corrupt GGUF
        raise AttnkitError(
            f"{gguf_path}: cannot load GGUF through transformers ({type(exc).__name__}: {exc})"
        ) from None
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


def check_cache_folder(folder: Path) -> None:
    """The cache folder can hold a dequantized model: a folder (or creatable as one) this process may write in."""
    from attnkit.io.writer import check_writable_parent

    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise AttnkitError(f"{folder}: attnkit's cache is a file, not a folder (set ATTNKIT_CACHE to a folder)")
    if folder.is_dir():
        if not os.access(folder, os.W_OK | os.X_OK):
            raise AttnkitError(f"{folder}: cannot write into attnkit's cache (permission denied; set ATTNKIT_CACHE)")
    else:
        check_writable_parent(folder)


def materialize_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write config, safetensors weights and tokenizer of a GGUF model to `out_dir` (atomically, once).

    The temp folder is marked with this process as its owner, so a later run removes it when this one was
    killed (attnkit.io.tempdirs); the result gets the umask's permissions."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    check_cache_folder(out_dir.parent)
    check_gguf_tokenizer(gguf_path)
    model, tokenizer = load_gguf_model(gguf_path, dtype)
    clean_stale(out_dir.parent)
    tmp = make_temp_dir(out_dir.parent, out_dir.name)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_config(tmp)
        unmark(tmp)
        follow_umask(tmp)
        tmp.rename(out_dir)
    except Exception as exc:  # safetensors reports a full disk as SafetensorError, not OSError
        remove_tree(tmp)
        if (out_dir / "config.json").is_file():  # another process finished first
            return out_dir
        raise _write_error(out_dir, exc) from exc
    except BaseException:
        remove_tree(tmp)
        raise
    return out_dir


def dequantized(ckpt):
    """A GGUF checkpoint as its fp32 safetensors folder in the cache (dequantized on first use, then reused),
    keeping the reference as given and recording the GGUF file; other checkpoints unchanged."""
    if ckpt.gguf_file is None:
        return ckpt
    from attnkit.io.resolve import resolve

    folder = resolve(str(materialize_gguf(ckpt.gguf_file, gguf_cache_folder(ckpt.gguf_file))))
    folder.ref, folder.dequantized_from = ckpt.ref, Path(ckpt.gguf_file)
    return folder


def _write_error(out_dir: Path, exc: Exception) -> AttnkitError:
    text = str(exc)
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text or "StorageFull" in text:
        return AttnkitError(f"disk full while writing the GGUF cache folder {out_dir}")
    return AttnkitError(f"cannot write the GGUF cache folder {out_dir} ({type(exc).__name__}: {text})")
