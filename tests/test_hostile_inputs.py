"""One test per class of hostile metadata: safetensors headers the library refuses, tensor files outside the
checkpoint, GGUF fields of the wrong type, and inputs tiny on disk that would cost gigabytes to believe."""

from __future__ import annotations

import json
import os
import time
import tracemalloc

import pytest

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_NAME, safetensors_files
from attnkit.io.gguf_meta import read_gguf
from attnkit.io.safetensors_header import read_header
from tests import hostile
from tests.helpers import library_accepts


def _with(edit) -> dict:
    header = hostile.safetensors_header()
    edit(header)
    return header


# ------------------------------------------------------------------ safetensors: as strict as the library


@pytest.mark.parametrize(
    "header, words",
    [
        (
            _with(lambda h: h["b"].update(data_offsets=[-16, 0])),
            "data_offsets of 'b' must be two non-negative integers",
        ),
        (
            _with(lambda h: h["b"].update(data_offsets=[64, 80.0])),
            "data_offsets of 'b' must be two non-negative integers",
        ),
        (_with(lambda h: h["b"].update(data_offsets=[64])), "data_offsets of 'b' must be two non-negative integers"),
        (_with(lambda h: h["b"].update(data_offsets=[48, 64])), "'b' overlaps the previous tensor"),
        (_with(lambda h: h["c"].update(data_offsets=[84, 96], shape=[12])), "'c' leaves a gap at byte 80"),
        (_with(lambda h: h.update(__metadata__=["pt"])), "__metadata__ must be an object of strings"),
        (_with(lambda h: h.update(__metadata__={"format": 1})), "__metadata__ must be an object of strings"),
        (_with(lambda h: h["a"].update(shape="4x4")), "shape of 'a' must be a list of non-negative integers"),
        (_with(lambda h: h["a"].update(shape=[4, -4])), "shape of 'a' must be a list of non-negative integers"),
        (_with(lambda h: h["a"].update(dtype=["F32"])), "tensor 'a' has unknown dtype ['F32']"),
        (_with(lambda h: h["a"].update(shape=[4, 5])), "tensor 'a' does not fit the file"),
        (_with(lambda h: h.update(a=[1, 2])), "entry for 'a' is not an object"),
    ],
)
def test_headers_the_library_refuses_are_refused_naming_the_problem(tmp_path, header, words):
    path = tmp_path / "model.safetensors"
    path.write_bytes(hostile.safetensors_bytes(header))
    assert not library_accepts(path)
    with pytest.raises(AttnkitError) as err:
        read_header(path)
    assert str(path) in str(err.value) and words in str(err.value)


@pytest.mark.parametrize(
    "raw, words",
    [
        (b'{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', "NaN is not a JSON number"),
        (
            b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
            b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
            "duplicate key 'a'",
        ),
        (b'{"a": \xff}', "not UTF-8"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    ],
)
def test_json_that_python_would_half_accept_is_refused(tmp_path, raw, words):
    path = tmp_path / "model.safetensors"
    path.write_bytes(hostile.safetensors_bytes(raw, data_len=1))
    with pytest.raises(AttnkitError, match=words):
        read_header(path)


def test_trailing_bytes_after_the_last_tensor_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(hostile.safetensors_bytes(hostile.safetensors_header(), data_len=100))
    assert not library_accepts(path)
    with pytest.raises(AttnkitError, match="the tensors end at byte 96 of a 100-byte data section"):
        read_header(path)


def test_a_tiny_header_with_a_huge_shape_costs_neither_time_nor_memory(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(
        hostile.safetensors_bytes(
            {"a": {"dtype": "F32", "shape": [100000000, 100000000, 100000000], "data_offsets": [0, 96]}}
        )
    )
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(AttnkitError, match="does not fit the file"):
        read_header(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - started < 1 and peak < 1 << 20


def test_header_length_over_the_library_limit_names_it(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(hostile.safetensors_bytes(hostile.safetensors_header(), length=100_000_001))
    with pytest.raises(AttnkitError, match="over the 100,000,000-byte limit"):
        read_header(path)


# ------------------------------------------------------------------ tensor files stay inside the checkpoint


def _sharded(tmp_path, weight_map) -> None:
    for shard in hostile.SHARDS:
        (tmp_path / shard).write_bytes(hostile.safetensors_bytes(hostile.safetensors_header()))
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    "name", ["../../../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors", "", "..\\..\\x.safetensors"]
)
def test_index_names_outside_the_folder_are_refused_before_opening(tmp_path, name):
    _sharded(tmp_path, {"a": hostile.SHARDS[0], "b": name})
    with pytest.raises(AttnkitError, match="points outside the checkpoint folder"):
        safetensors_files(tmp_path)


def test_a_symlink_out_of_the_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(hostile.safetensors_bytes(hostile.safetensors_header()))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(AttnkitError, match="outside the checkpoint folder"):
        safetensors_files(folder)


def test_hub_snapshot_links_into_its_blobs_are_allowed(tmp_path):
    repo = tmp_path / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    blob = repo / "blobs" / "deadbeef"
    blob.write_bytes(hostile.safetensors_bytes(hostile.safetensors_header()))
    os.symlink("../../blobs/deadbeef", snapshot / "model.safetensors")
    assert safetensors_files(snapshot) == [snapshot / "model.safetensors"]


@pytest.mark.parametrize(
    "doc, words",
    [
        ({"weight_map": ["model.safetensors"]}, "corrupt index (no weight_map)"),
        ({"weight_map": {"a": 3}}, "weight_map values must be shard file names"),
        ([1, 2], "corrupt index (no weight_map)"),
    ],
)
def test_index_of_the_wrong_shape(tmp_path, doc, words):
    (tmp_path / INDEX_NAME).write_text(json.dumps(doc))
    with pytest.raises(AttnkitError) as err:
        safetensors_files(tmp_path)
    assert words in str(err.value)


# ------------------------------------------------------------------ GGUF fields of the wrong type


def _gguf(tmp_path, **changes):
    fields = [(key, *changes.get(key.split(".", 1)[-1], (vtype, value))) for key, vtype, value in hostile.gguf_fields()]
    path = tmp_path / "model.gguf"
    path.write_bytes(hostile.gguf_bytes(fields, hostile.gguf_tensors()))
    return path


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("alignment", (hostile.ARRAY, (hostile.U32, [32])), "general.alignment must be a positive power of two"),
        ("alignment", (hostile.F32, 0.5), "general.alignment must be a positive power of two"),
        ("alignment", (hostile.U32, 0), "general.alignment must be a positive power of two"),
        ("alignment", (hostile.U32, 24), "general.alignment must be a positive power of two"),
        ("attention.head_count_kv", (hostile.U32, 0), "num_key_value_heads = 0 must be at least 1"),
        ("attention.head_count", (hostile.F32, 9.5), "num_attention_heads = 9.5 must be a whole number"),
        ("attention.head_count", (hostile.STRING, "eight"), "num_attention_heads = 'eight' must be a whole number"),
        ("attention.head_count_kv", (hostile.ARRAY, (hostile.U32, [2, 4])), "head_count_kv differs between layers"),
        ("block_count", (hostile.U64, 2**62), "num_hidden_layers = 4611686018427387904 is over the limit of 4,096"),
    ],
)
def test_gguf_fields_are_type_checked(tmp_path, key, value, words):
    path = _gguf(tmp_path, **{key: value})
    with pytest.raises(AttnkitError) as err:
        read_gguf(path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_per_layer_gguf_head_counts_that_agree_are_one_value(tmp_path):
    config, _ = read_gguf(_gguf(tmp_path, **{"attention.head_count_kv": (hostile.ARRAY, (hostile.U32, [2, 2]))}))
    assert config["num_key_value_heads"] == 2


@pytest.mark.parametrize(
    "counts, words",
    [
        ({"n_kv": 2**62}, "key/values, over the limit of 1,048,576"),
        ({"n_tensors": 100_000}, "100,000 tensors cannot fit in"),
    ],
)
def test_gguf_counts_are_bounded_by_the_file(tmp_path, counts, words):
    path = tmp_path / "model.gguf"
    path.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(), hostile.gguf_tensors(), **counts))
    started = time.perf_counter()
    with pytest.raises(AttnkitError, match=words):
        read_gguf(path)
    assert time.perf_counter() - started < 1


def test_gguf_missing_a_block_is_incomplete(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(layers=3), hostile.gguf_tensors(layers=2)))
    with pytest.raises(AttnkitError, match="block_count is 3 but block blk.2 has no tensors"):
        read_gguf(path)


def test_a_side_file_linking_out_is_refused_before_work(runner, tiny, tmp_path):
    from attnkit.cli import app

    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    src = tiny("llama")
    (src / "tokenizer.json").symlink_to(secret)  # would be copied into the output next to the weights
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out")])
    assert result.exit_code == 1 and "outside the checkpoint folder" in result.stderr, result.output
    assert not (tmp_path / "out").exists()
