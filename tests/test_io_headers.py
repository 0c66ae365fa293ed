"""Safetensors header reading without torch, and its errors on damaged files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import safetensors_files
from attnkit.io.safetensors_header import read_header, read_headers


def test_headers_match_torch_on_sharded_checkpoint(tiny):
    folder = tiny("llama_gqa", max_shard_size="100KB")
    files = safetensors_files(folder)
    assert len(files) > 1
    infos = read_headers(files)
    state = {}
    for f in files:
        state.update(load_file(f))
    assert set(infos) == set(state)
    for name, tensor in state.items():
        assert infos[name].shape == tuple(tensor.shape)
        assert infos[name].dtype == "F32"
        assert infos[name].nbytes == tensor.numel() * tensor.element_size()
    assert sum(i.numel for i in infos.values()) == sum(t.numel() for t in state.values())


def test_metadata_is_returned(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(path), metadata={"format": "pt"})
    infos, metadata = read_header(path)
    assert metadata == {"format": "pt"}
    assert infos["w"].dtype == "BF16" and infos["w"].shape == (2, 3) and infos["w"].nbytes == 12


def _valid_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.ones(8)}, str(path))
    return path


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _corrupt_length(path):
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 10) + raw[8:])


def _corrupt_json(path):
    raw = bytearray(path.read_bytes())
    raw[8] = ord("#")
    path.write_bytes(bytes(raw))


def _truncate(path):
    raw = path.read_bytes()
    path.write_bytes(raw[:-20])


def _offsets_beyond(path):
    _rewrite_header(path, lambda h: h["b"].update(data_offsets=[10_000, 10_032]))


def _unknown_dtype(path):
    _rewrite_header(path, lambda h: h["a"].update(dtype="F13"))


def _too_short(path):
    path.write_bytes(b"\x01\x02")


def _not_an_object(path):
    body = b"[1, 2]  "
    path.write_bytes(struct.pack("<Q", len(body)) + body)


@pytest.mark.parametrize(
    "damage, words",
    [
        (_corrupt_length, "exceeds the file"),
        (_corrupt_json, "not valid JSON"),
        (_truncate, "does not fit the file"),
        (_offsets_beyond, "does not fit the file"),
        (_unknown_dtype, "unknown dtype 'F13'"),
        (_too_short, "shorter than 8 bytes"),
        (_not_an_object, "not a JSON object"),
    ],
)
def test_damaged_file_gives_one_line_error_naming_it(tmp_path, damage, words):
    path = _valid_file(tmp_path)
    damage(path)
    with pytest.raises(AttnkitError) as err:
        read_header(path)
    message = str(err.value)
    assert str(path) in message and words in message and "\n" not in message


def test_tensor_in_two_shards_is_an_error(tiny):
    folder = tiny("llama")
    (folder / "copy.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(AttnkitError, match=r"model.safetensors: tensor '.*' is also in copy.safetensors"):
        read_headers(safetensors_files(folder))


def test_missing_file(tmp_path):
    with pytest.raises(AttnkitError, match="file not found"):
        read_header(tmp_path / "absent.safetensors")


def test_io_modules_import_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import attnkit.io.safetensors_header, attnkit.io.resolve, attnkit.io.hub, "
        "attnkit.io.config, attnkit.io.gguf_meta, attnkit.io.gguf_header, attnkit.io.reader, attnkit.io.writer; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
