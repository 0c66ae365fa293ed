"""LazyReader: exact round-trip against torch, one shard open at a time; open_source on folders, files, GGUF."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import safetensors_files
from attnkit.io.reader import LazyReader
from attnkit.io.source import open_source
from tests.tiny import build_model, save_model


def _mapped_shards() -> set[str]:
    """Safetensors files this process has memory-mapped now."""
    with open("/proc/self/maps") as fh:
        return {line.split()[-1] for line in fh if line.rstrip().endswith(".safetensors")}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = build_model("llama_gqa", seed=3)
    folder = save_model(model, tmp_path_factory.mktemp("sharded"), max_shard_size="100KB")
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_equals_state_dict(sharded):
    folder, state = sharded
    files = safetensors_files(folder)
    assert len(files) > 2
    with LazyReader(files) as reader:
        assert sorted(reader.names()) == sorted(state)
        assert len(reader) == len(state)
        for name in reader.names():
            tensor = reader.get(name)
            assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
            assert reader.info(name).shape == tuple(state[name].shape)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_shard_open_at_a_time(sharded):
    folder, _ = sharded
    files = safetensors_files(folder)
    before = _mapped_shards()
    with LazyReader(files) as reader:
        seen = set()
        for name in reader.names():
            reader.get(name).sum()  # the tensor is dropped right away
            now = _mapped_shards() - before
            assert now == {str(reader.info(name).file)}, name
            seen |= now
        assert reader.opens == len(files)  # names() groups tensors by shard
        assert seen == {str(f) for f in files}
    assert _mapped_shards() - before == set()


def test_switching_back_reopens(sharded):
    folder, state = sharded
    files = safetensors_files(folder)
    with LazyReader(files) as reader:
        first, last = reader.names()[0], reader.names()[-1]
        assert reader.info(first).file != reader.info(last).file
        for name in (first, last, first):
            assert torch.equal(reader.get(name), state[name])
        assert reader.opens == 3


def test_cast_and_unknown_name(sharded):
    folder, state = sharded
    files = safetensors_files(folder)
    name = "model.layers.0.self_attn.k_proj.weight"
    with LazyReader(files) as reader:
        assert reader.get(name, dtype="bfloat16").dtype == torch.bfloat16
        assert torch.equal(reader.get(name, dtype=torch.float16), state[name].half())
        assert name in reader and "nope" not in reader
        with pytest.raises(AttnkitError, match=r"no tensor named 'model.nope.weight'") as err:
            reader.get("model.nope.weight")
        assert str(folder) in str(err.value)


def test_in_place_edit_does_not_touch_the_file(sharded):
    folder, state = sharded
    name = "model.norm.weight"
    with LazyReader(safetensors_files(folder)) as reader:
        reader.get(name).mul_(3)
    with LazyReader(safetensors_files(folder)) as reader:
        assert torch.equal(reader.get(name), state[name])


def test_damaged_shard_data_is_one_line_error(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(3)}, str(path))
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(AttnkitError, match=str(path)):
        LazyReader([path])


def test_open_source_folder_and_single_file(tiny):
    folder = tiny("qwen2")
    src = open_source(str(folder), "read")
    assert "model.layers.0.self_attn.q_proj.bias" in src.names
    assert src.tensor("q_bias", 0) == "model.layers.0.self_attn.q_proj.bias" and src.tensor("o_bias", 0) is None
    assert open_source(str(folder / "model.safetensors"), "read").names == src.names


def test_open_source_config_only_is_an_error(tiny):
    folder = tiny("llama")
    with pytest.raises(AttnkitError, match="a config file has no weights to convert"):
        open_source(str(folder / "config.json"), "convert")


def test_empty_file_list_is_an_error():
    with pytest.raises(AttnkitError, match="no safetensors files"):
        LazyReader([])


@pytest.mark.real_model
def test_real_gguf_source_materializes_once():
    from attnkit.realmodels import smollm2_gguf

    src = open_source(str(smollm2_gguf()), "read")
    assert src.record()["kind"] == "gguf" and src.record()["dequantized"] == str(src.root)
    with LazyReader(src.ckpt.weight_files) as reader:
        folder = Path(reader.files[0]).parent
        assert reader.info("model.layers.0.self_attn.q_proj.weight").shape == (576, 576)
        k = reader.get("model.layers.29.self_attn.k_proj.weight")
        assert k.shape == (192, 576) and k.dtype == torch.float32 and torch.isfinite(k).all()
        n_params = sum(reader.info(n).numel for n in reader.names())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert open_source(str(smollm2_gguf()), "read").root == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert 134_000_000 < n_params < 135_000_000  # SmolLM2-135M, tied embeddings stored once
