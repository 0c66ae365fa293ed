"""Model references: folders, files, GGUF, and their one-line errors."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_NAME
from attnkit.io.gguf_meta import read_gguf
from attnkit.io.resolve import resolve
from tests.helpers import write_gguf


def test_folder_sharded_file_and_config(tiny):
    folder = tiny("llama", max_shard_size="100KB")
    ckpt = resolve(str(folder))
    index = json.loads((folder / INDEX_NAME).read_text())
    assert ckpt.kind == "folder" and ckpt.model_type == "llama"
    assert [f.name for f in ckpt.weight_files] == sorted(set(index["weight_map"].values()))
    one = ckpt.weight_files[0]
    single = resolve(str(one))
    assert single.kind == "safetensors" and single.weight_files == [one]
    config = resolve(str(folder / "config.json"))
    assert config.kind == "config" and config.weight_files == [] and config.config["num_hidden_layers"] == 2


def test_missing_config_json(tiny, tmp_path):
    folder = tiny("llama")
    (folder / "config.json").unlink()
    for ref in (folder, folder / "model.safetensors"):
        with pytest.raises(AttnkitError, match=f"missing config.json: {folder / 'config.json'} does not exist"):
            resolve(str(ref))


def test_invalid_config_json_names_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(AttnkitError, match=f"{tmp_path / 'config.json'}: invalid JSON"):
        resolve(str(tmp_path), need_weights=False)


def test_index_naming_a_missing_shard(tiny):
    folder = tiny("llama", max_shard_size="100KB")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(AttnkitError, match=f"{folder / INDEX_NAME}: shard {victim.name} is missing"):
        resolve(str(folder))


def test_corrupt_index(tiny):
    folder = tiny("llama", max_shard_size="100KB")
    (folder / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(AttnkitError, match=f"{folder / INDEX_NAME}: corrupt index"):
        resolve(str(folder))


def test_folder_without_weights(tiny):
    folder = tiny("llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(AttnkitError, match=f"{folder}: no \\*.safetensors weights found"):
        resolve(str(folder))
    assert resolve(str(folder), need_weights=False).weight_files == []


@pytest.mark.parametrize(
    "ref, words",
    [
        ("./absent-folder", "no such file or folder"),
        ("absent.gguf", "absent.gguf: file not found"),
        ("absent.safetensors", "absent.safetensors: file not found"),
        ("not a model!", "not a valid hub id"),
        ("", "empty model path"),  # Path("") is the current folder: not a reason to read ./config.json
        ("  ", "empty model path"),
    ],
)
def test_missing_paths(ref, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AttnkitError, match=words):
        resolve(ref)


def test_unknown_file_type(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(AttnkitError, match=f"{path}: not a model file"):
        resolve(str(path))


@pytest.mark.parametrize(
    "content, words",
    [
        (b"", "not a GGUF file \\(too short\\)"),
        (b"definitely not a gguf file" * 4, "not a GGUF file \\(bad magic\\)"),
        (b"GGUF" + struct.pack("<IQQ", 0, 0, 0), "unsupported GGUF version 0"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + struct.pack("<Q", 500) + b"key", "truncated GGUF file"),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77),
            "corrupt GGUF header \\(unknown value type 77 for 'k'\\)",
        ),
    ],
)
def test_not_a_gguf(tmp_path, content, words):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(AttnkitError, match=f"{path}: {words}"):
        resolve(str(path))


def test_gguf_with_truncated_tensor_data(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(AttnkitError, match=f"{path}: tensor 'blk.1.attn_output.weight' runs past the end of the file"):
        read_gguf(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "mamba9")
    with pytest.raises(AttnkitError, match=f"{path}: unsupported GGUF architecture 'mamba9'; supported: .*llama"):
        resolve(str(path))


def test_synthetic_gguf_config_and_folder_with_one_gguf(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama", layers=3, hidden=96, heads=6, kv_heads=2)
    config, tensors = read_gguf(path)
    assert (
        config["model_type"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    ) == ("llama", 3, 6, 2, 16)
    assert config["tie_word_embeddings"] is True  # no output.weight
    block = [("attn_norm", 96), ("attn_q", 96 * 96), ("attn_k", 32 * 96), ("attn_v", 32 * 96), ("attn_output", 96 * 96)]
    assert [(t.name, t.numel) for t in tensors] == [("token_embd.weight", 16 * 96)] + [
        (f"blk.{i}.{role}.weight", numel) for i in range(3) for role, numel in block
    ]
    ckpt = resolve(str(tmp_path))  # a folder holding only one GGUF
    assert ckpt.kind == "gguf" and ckpt.gguf_file == path


@pytest.mark.real_model
def test_real_smollm2_gguf_metadata(tmp_path):
    from attnkit.realmodels import smollm2_gguf

    gguf_file = smollm2_gguf()
    config, tensors = read_gguf(gguf_file)
    assert config["model_type"] == "llama"
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
        config["hidden_size"],
    ) == (30, 9, 3, 64, 576)
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    assert {"blk.0.attn_q.weight", "blk.29.attn_k.weight", "token_embd.weight"} <= {t.name for t in tensors}
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_file, "rb") as src, open(truncated, "wb") as dst:
        shutil.copyfileobj(src, dst, length=1 << 20)
        dst.truncate(3_000_000)
    with pytest.raises(AttnkitError, match=f"{truncated}: tensor '.*' runs past the end of the file"):
        read_gguf(truncated)


@pytest.mark.real_model
def test_fast_gguf_header_agrees_with_gguf_reader():
    from gguf import GGUFReader, GGUFValueType

    from attnkit.io.gguf_header import parse_gguf_header
    from attnkit.realmodels import smollm2_gguf

    path = smollm2_gguf()
    reference = GGUFReader(str(path))
    header = parse_gguf_header(path)
    assert set(header.fields) == set(reference.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            assert header.array_lengths[key] == len(field.data), key
            if header.fields[key] is not None:
                assert header.fields[key] == pytest.approx(field.contents()), key
        else:
            expected = field.contents()
            assert header.fields[key] == (pytest.approx(expected) if isinstance(expected, float) else expected), key
    _, tensors = read_gguf(path)
    assert [(t.name, t.shape, t.numel, t.nbytes, t.quant_type) for t in tensors] == [
        (t.name, tuple(int(x) for x in t.shape), int(t.n_elements), int(t.n_bytes), t.tensor_type.name)
        for t in reference.tensors
    ]
