"""ShardedWriter output loads in safetensors and transformers; verify_output; copy_side_files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from attnkit.errors import AttnkitError
from attnkit.io import finite as finite_mod
from attnkit.io.checkpoint import safetensors_files
from attnkit.io.reader import LazyReader
from attnkit.io.safetensors_header import read_header
from attnkit.io.writer import ShardedWriter, copy_side_files, verify_output
from tests.tiny import build_model


def _write(folder, tensors, max_shard_bytes):
    writer = ShardedWriter(folder, max_shard_bytes=max_shard_bytes)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    return writer.finish()


def test_sharded_round_trip_and_index(tmp_path):
    state = build_model("llama_gqa", seed=1).state_dict()
    limit = 60_000
    index = _write(tmp_path, state, limit)
    n = len({*index["weight_map"].values()})
    assert n > 3
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in state.values())
    assert set(index["weight_map"]) == set(state)
    for shard in tmp_path.glob("*.safetensors"):
        infos, metadata = read_header(shard)
        assert metadata == {"format": "pt"}
        size = sum(i.nbytes for i in infos.values())
        assert size <= limit or len(infos) == 1
        assert all(index["weight_map"][name] == shard.name for name in infos)
        for name, tensor in load_file(shard).items():
            assert torch.equal(tensor, state[name]), name


def test_single_shard_has_no_index(tmp_path):
    state = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64)}
    index = _write(tmp_path, state, 1 << 30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert index["weight_map"] == {"a": "model.safetensors", "b": "model.safetensors"}


def test_big_tensor_gets_its_own_shard_and_buffer_stays_bounded(tmp_path):
    writer = ShardedWriter(tmp_path, max_shard_bytes=1000)
    sizes = [100, 100, 600, 50, 50, 50]  # float32 elements: 400, 400, 2400, 200, 200, 200 bytes
    for i, n in enumerate(sizes):
        writer.add(f"t{i}", torch.full((n,), float(i)))
        assert writer._buffer_bytes <= 1000 or len(writer._buffer) == 1
    index = writer.finish()
    shard_of = index["weight_map"]
    assert shard_of["t2"] not in {shard_of["t0"], shard_of["t3"]}
    assert shard_of["t0"] == shard_of["t1"] and shard_of["t3"] == shard_of["t4"] == shard_of["t5"]
    assert len(set(shard_of.values())) == 3


def _raw_bytes(tensor):
    """The bytes of a tensor, for exact comparison of any dtype (NaN-safe)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_dtypes_views_and_tied_tensors_round_trip(tmp_path):
    base = torch.randn(6, 8)
    tensors = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "f64": torch.randn(2, 2, dtype=torch.float64),
        "i64": torch.arange(5),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "fp8": torch.randn(4).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "transposed": base.t(),
        "row_slice": base[2:4],
        "tied_a": base,
        "tied_b": base,
    }
    _write(tmp_path, tensors, 1 << 20)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        for name, expected in tensors.items():
            got = fh.get_tensor(name)
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(_raw_bytes(got), _raw_bytes(expected)), name


def test_writer_errors(tmp_path):
    writer = ShardedWriter(tmp_path)
    with pytest.raises(AttnkitError, match="no tensors were written"):
        writer.finish()
    writer.add("a", torch.ones(2))
    with pytest.raises(AttnkitError, match="'a' added twice"):
        writer.add("a", torch.ones(2))
    writer.add("c", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(AttnkitError, match="cannot store dtype torch.complex64"):
        writer.finish()
    with pytest.raises(AttnkitError, match="must be positive"):
        ShardedWriter(tmp_path, max_shard_bytes=0)


def test_transformers_loads_written_checkpoint_with_identical_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_model("qwen2", seed=5)
    _write(tmp_path, model.state_dict(), 50_000)
    model.config.save_pretrained(tmp_path)
    assert len(safetensors_files(tmp_path)) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_verify_output_accepts_good_and_names_problems(tmp_path):
    tensors = {"a": torch.randn(4, 3), "b": torch.randn(5).bfloat16(), "i": torch.arange(3)}
    _write(tmp_path, tensors, 1 << 20)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    verify_output(tmp_path, shapes)
    verify_output(tmp_path, None)
    with pytest.raises(AttnkitError, match="expected tensor\\(s\\) missing, e.g. 'z'"):
        verify_output(tmp_path, {**shapes, "z": (1,)})
    with pytest.raises(AttnkitError, match="unexpected tensor\\(s\\), e.g. 'i'"):
        verify_output(tmp_path, {"a": (4, 3), "b": (5,)})
    with pytest.raises(AttnkitError, match=r"'a' has shape \[4, 3\], expected \[3, 4\]"):
        verify_output(tmp_path, {**shapes, "a": (3, 4)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 23, 49])
def test_verify_output_finds_non_finite_values_in_any_chunk(tmp_path, monkeypatch, bad, dtype, where):
    from safetensors.torch import save_file

    monkeypatch.setattr(finite_mod, "SCAN_CHUNK", 7)
    values = torch.randn(50)
    values[where] = bad  # first, middle or last chunk
    tensors = {"ok": torch.randn(3).to(dtype), "bad": values.to(dtype).reshape(10, 5)}
    with pytest.raises(AttnkitError, match="tensor 'bad' holds NaN or Inf"):
        _write(tmp_path / "refused", tensors, 1 << 20)  # the writer refuses it as it is added
    save_file(tensors, str(tmp_path / "model.safetensors"))  # written by another tool: found by the scan
    with pytest.raises(AttnkitError, match=f"{tmp_path}: tensor 'bad' holds NaN or Inf"):
        verify_output(tmp_path, None)


def test_verify_output_on_empty_folder(tmp_path):
    with pytest.raises(AttnkitError, match="no safetensors weights"):
        verify_output(tmp_path, None)


def test_copy_side_files(tmp_path):
    repo = tmp_path / "models--acme--tiny"  # how the HF cache stores files: snapshot links into blobs/
    src, dst = repo / "snapshots" / "0123abc", tmp_path / "dst"
    src.mkdir(parents=True)
    dst.mkdir()
    side = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "added_tokens.json",
    ]
    other = ["config.json", "model.safetensors", "model.safetensors.index.json", "README.md", "attnkit.json"]
    for name in side + other:
        (src / name).write_text(name)
    (repo / "blobs").mkdir()
    blob = repo / "blobs" / "deadbeef"
    blob.write_text("linked")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(blob)
    copied = copy_side_files(src, dst)
    assert sorted(copied) == sorted(side)
    assert sorted(p.name for p in dst.iterdir()) == sorted(side)
    assert not (dst / "tokenizer.json").is_symlink() and (dst / "tokenizer.json").read_text() == "linked"
    assert (dst / "merges.txt").read_text() == "merges.txt"


def test_reader_to_writer_copy_matches(tiny, tmp_path):
    folder = tiny("gemma2", max_shard_size="100KB")
    out = tmp_path / "out"
    out.mkdir()
    with LazyReader(safetensors_files(folder)) as reader:
        writer = ShardedWriter(out, max_shard_bytes=80_000)
        for name in reader.names():
            writer.add(name, reader.get(name))
        writer.finish()
        expected = {name: reader.info(name).shape for name in reader.names()}
    verify_output(out, expected)
    with LazyReader(safetensors_files(folder)) as a, LazyReader(safetensors_files(out)) as b:
        for name in a.names():
            assert torch.equal(a.get(name), b.get(name)), name
