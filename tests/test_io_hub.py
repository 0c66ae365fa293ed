"""Hub ids through a fake local Hugging Face cache (offline) and recorded download calls (no network)."""

from __future__ import annotations

import hashlib
import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

import huggingface_hub
import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.io.reader import LazyReader
from attnkit.io.resolve import resolve
from attnkit.io.source import open_source
from tests.tiny import build_model, save_model


def _cache_repo(cache: Path, repo_id: str, src: Path, commit: str, refs=("main",), files=None) -> Path:
    """Lay out `src` files like huggingface_hub's cache: blobs, snapshots/<commit> symlinks, refs/<name>."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for path in sorted(src.iterdir()):
        if files is not None and path.name not in files:
            continue
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(Path("../../blobs") / blob.name)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model = build_model("llama_gqa", seed=7)
    return model, save_model(model, tmp_path_factory.mktemp("hubsrc"), max_shard_size="100KB")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty HF cache in tmp_path with HF_HUB_OFFLINE=1 (huggingface_hub reads both at import: patch them)."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_cached_model_resolves_offline_and_reads_weights(hf_cache, tiny_model, capsys):
    model, src = tiny_model
    snapshot = _cache_repo(hf_cache, "acme/tiny", src, "a" * 40)
    ckpt = resolve("acme/tiny")
    assert (ckpt.kind, ckpt.repo_id, ckpt.revision, ckpt.root) == ("hub", "acme/tiny", None, snapshot)
    assert len(ckpt.weight_files) > 1 and ckpt.config["num_key_value_heads"] == 2
    light = resolve("acme/tiny", need_weights=False)
    assert light.weight_files == [] and light.config == ckpt.config
    with LazyReader(open_source("acme/tiny", "read").ckpt.weight_files) as reader:  # weights fetched (from the cache)
        state = model.state_dict()
        assert sorted(reader.names()) == sorted(state)
        assert all(torch.equal(reader.get(n), state[n]) for n in reader.names())
    assert capsys.readouterr().out == ""  # nothing on stdout


def test_revision_from_cache(hf_cache, tiny_model):
    _, src = tiny_model
    _cache_repo(hf_cache, "acme/tiny", src, "b" * 40, refs=("v2",))
    by_branch = resolve("acme/tiny@v2")
    by_commit = resolve("acme/tiny@" + "b" * 40)
    assert by_branch.revision == "v2" and by_branch.root == by_commit.root == hf_cache.joinpath(
        "models--acme--tiny", "snapshots", "b" * 40
    )
    with pytest.raises(AttnkitError, match="hub model 'acme/tiny@v3': files are not in the local cache"):
        resolve("acme/tiny@v3")


@pytest.mark.parametrize("need_weights", [False, True])
def test_uncached_id_offline_names_the_id(hf_cache, need_weights):
    with pytest.raises(AttnkitError) as err:
        resolve("acme/absent-model", need_weights=need_weights)
    message = str(err.value)
    assert "'acme/absent-model'" in message and "not in the local cache" in message
    assert "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_cached_config_without_weights(hf_cache, tiny_model):
    _, src = tiny_model
    _cache_repo(hf_cache, "acme/cfg", src, "c" * 40, files={"config.json"})
    assert resolve("acme/cfg", need_weights=False).config["model_type"] == "llama"
    with pytest.raises(AttnkitError, match="hub model 'acme/cfg': no safetensors weights in the local cache"):
        resolve("acme/cfg")


def test_index_without_its_shards_in_cache(hf_cache, tiny_model):
    _, src = tiny_model
    _cache_repo(
        hf_cache,
        "acme/half",
        src,
        "d" * 40,
        files={"config.json", "model.safetensors.index.json", "model-00001-of-00005.safetensors"},
    )
    with pytest.raises(AttnkitError, match="model.safetensors.index.json: shard model-00002-of-00005.safetensors"):
        resolve("acme/half")


def _record_downloads(monkeypatch, src: Path) -> list:
    """Replace the two huggingface_hub download functions by fakes that serve `src` and log their calls."""
    from huggingface_hub import errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def fake_file(repo_id, filename, revision=None, local_files_only=False):
        calls.append(("file", filename, revision, local_files_only))
        if not (src / filename).is_file():
            raise errors.EntryNotFoundError(f"{filename} not in {repo_id}")
        return str(src / filename)

    def fake_snapshot(repo_id, revision=None, local_files_only=False, allow_patterns=None):
        calls.append(("snapshot", tuple(allow_patterns), revision, local_files_only))
        return str(src)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    return calls


WANTED = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]
UNWANTED = ["pytorch_model.bin", "model.gguf", "original/consolidated.00.pth", "flax_model.msgpack", "README.md"]


def test_online_config_only_fetches_config_json(tiny_model, monkeypatch):
    calls = _record_downloads(monkeypatch, tiny_model[1])
    resolve("acme/tiny@v1", need_weights=False)
    assert calls == [("file", "config.json", "v1", False)]


def test_online_sharded_fetches_index_then_its_shards(tiny_model, monkeypatch):
    _, src = tiny_model
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    calls = _record_downloads(monkeypatch, src)
    ckpt = resolve("acme/tiny")
    assert [f.name for f in ckpt.weight_files] == shards
    (_, index_name, _, _), (kind, patterns, revision, offline) = calls
    assert index_name == "model.safetensors.index.json" and kind == "snapshot" and not offline
    for name in WANTED + shards + [index_name]:
        assert any(fnmatch(name, p) for p in patterns), name
    for name in UNWANTED + ["consolidated.safetensors"]:
        assert not any(fnmatch(name, p) for p in patterns), name


def test_online_single_file_fetches_all_safetensors(tiny, monkeypatch):
    src = tiny("llama")
    calls = _record_downloads(monkeypatch, src)
    ckpt = resolve("acme/single@main")
    assert [f.name for f in ckpt.weight_files] == ["model.safetensors"]
    (_, _, index_rev, _), (_, patterns, revision, _) = calls
    assert index_rev == revision == "main"
    assert any(fnmatch("model.safetensors", p) for p in patterns)
    assert not any(fnmatch(name, p) for name in UNWANTED for p in patterns)


@pytest.mark.parametrize(
    "exc_name, words",
    [
        ("RepositoryNotFoundError", "not found (or it is private: set HF_TOKEN)"),
        ("GatedRepoError", "is gated: accept its licence and set HF_TOKEN"),
        ("RevisionNotFoundError", "has no revision 'v9'"),
    ],
)
def test_hub_http_errors_become_one_line(monkeypatch, exc_name, words):
    import httpx2
    from huggingface_hub import errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/x"))
    exc = getattr(errors, exc_name)("boom", response=response)

    def failing(*args, **kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing)
    with pytest.raises(AttnkitError, match=re.escape(words)) as err:
        resolve("acme/private@v9", need_weights=False)
    assert "acme/private" in str(err.value)
