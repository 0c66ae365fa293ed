"""Hugging Face hub resolution through huggingface_hub (cache, revision, offline mode, token)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import (
    INDEX_NAME,
    SIDE_FILES,
    Checkpoint,
    inside,
    read_index,
    safetensors_files,
    split_revision,
)
from attnkit.io.config import read_config


def _hub_error(repo_id: str, revision: str | None, exc: Exception) -> AttnkitError:
    from huggingface_hub import errors

    name = f"{repo_id}@{revision}" if revision else repo_id
    status = _http_status(exc)
    if status is not None and (status >= 500 or status == 429):
        why = "is overloaded (HTTP 429)" if status == 429 else f"answered HTTP {status} (a server error)"
        return AttnkitError(
            f"hub model {name!r}: the hub {why}; try again later, or set HF_HUB_OFFLINE=1 to use the local cache"
        )
    if isinstance(exc, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE=1 forbids downloads" if hub_offline() else "the hub cannot be reached"
        return AttnkitError(f"hub model {name!r}: files are not in the local cache and {why}; download them first")
    if isinstance(exc, errors.GatedRepoError):
        return AttnkitError(f"hub model {name!r} is gated: accept its licence and set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return AttnkitError(f"hub model {name!r} not found (or it is private: set HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return AttnkitError(f"hub model {repo_id!r} has no revision {revision!r}")
    if isinstance(exc, errors.EntryNotFoundError):
        return AttnkitError(f"hub model {name!r} has no config.json")
    if isinstance(exc, errors.HFValidationError):
        return AttnkitError(f"{name!r} is not a valid hub id or revision ({str(exc).splitlines()[0].rstrip('.')})")
    if isinstance(exc, OSError):
        what = "reading the local cache failed" if hub_offline() else "download failed"
        return AttnkitError(f"hub model {name!r}: {what} ({exc.strerror or exc})")
    return AttnkitError(
        f"hub model {name!r}: download failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    )


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status behind a huggingface_hub error (it wraps server errors in LocalEntryNotFoundError)."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int):
            return status
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


#: The environment variables that place huggingface_hub's cache, most specific first.
CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def _check_hub_cache() -> None:
    """Each variable that places the hub cache names a folder (or nothing yet): a file there would fail deep
    inside huggingface_hub as a 'download' error."""
    for name in CACHE_VARIABLES:
        value = os.environ.get(name)
        if value and Path(value).expanduser().exists() and not Path(value).expanduser().is_dir():
            raise AttnkitError(f"{name}={value} is a file, not a folder: huggingface_hub keeps its cache there")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub(ref: str, *, need_weights: bool) -> Checkpoint:
    """Download (or find in the HF cache) config.json, and the weights only when asked for."""
    from huggingface_hub import hf_hub_download, snapshot_download

    repo_id, revision = split_revision(ref)
    offline = hub_offline()
    _check_hub_cache()
    try:
        if need_weights:
            root = Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    local_files_only=offline,
                    allow_patterns=SIDE_FILES + _weight_patterns(repo_id, revision, offline),
                )
            )
            config_path = root / "config.json"
        else:
            config_path = Path(hf_hub_download(repo_id, "config.json", revision=revision, local_files_only=offline))
            root = config_path.parent
    except AttnkitError:
        raise
    except Exception as exc:  # network, auth and cache misses from huggingface_hub
        raise _hub_error(repo_id, revision, exc) from None
    config = read_config(config_path)
    files = safetensors_files(root) if need_weights else []
    if need_weights and not files:
        where = "in the local cache (HF_HUB_OFFLINE=1)" if offline else "(only *.safetensors are read)"
        raise AttnkitError(f"hub model {ref!r}: no safetensors weights {where}")
    return Checkpoint(ref, "hub", config, root=root, weight_files=files, repo_id=repo_id, revision=revision)


def _weight_patterns(repo_id: str, revision: str | None, offline: bool) -> list[str]:
    """The index and the shards it names, so extra copies (e.g. consolidated.safetensors) are not fetched;
    every *.safetensors file when the repo has no index."""
    from huggingface_hub import errors, hf_hub_download

    try:
        index = Path(hf_hub_download(repo_id, INDEX_NAME, revision=revision, local_files_only=offline))
    except errors.EntryNotFoundError:  # no index in the repo, or (offline) none cached
        return ["*.safetensors"]
    shards = sorted(set(read_index(index).values()))
    for name in shards:
        inside(index.parent, name, index)  # refuses '..' and absolute names before anything is fetched
    return [INDEX_NAME, *(glob.escape(name) for name in shards)]


def hub_parameter_count(repo_id: str, revision: str | None) -> int | None:
    """Parameter count from the hub's safetensors headers (range requests, no weights); None offline."""
    from huggingface_hub import HfApi

    if hub_offline():
        return None
    try:
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    except Exception:  # offline, not a safetensors repo, ...: the caller falls back
        return None
    return int(sum(meta.parameter_count.values()))
