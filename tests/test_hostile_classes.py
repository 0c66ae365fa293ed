"""One test per class of bad input a hostile battery found (tests/hostile_battery.py, part `classes`): each
gets one attnkit-worded line and exit 1 or 2, before any long work, with the input untouched and nothing left
behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnkit.cli import app
from tests import hostile
from tests.helpers import PROSE, digest, leftovers, one_line_error, tiny_source, tree


@pytest.fixture
def src(tmp_path):
    return tiny_source(tmp_path, "llama_gqa")


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(PROSE * 12)
    return str(path)


def _edit_tensor(folder: Path, name: str, edit) -> Path:
    state = load_file(str(folder / "model.safetensors"))
    state[name] = edit(state[name])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------------ non-finite weights: refused before work


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_before_work_naming_the_tensor(runner, src, text, tmp_path, bad):
    name = "model.layers.1.mlp.down_proj.weight"
    _edit_tensor(src, name, lambda t: t.index_fill(0, torch.tensor([3]), bad))
    before = tree(src)
    out = tmp_path / "out"
    for args in (
        ["convert", "mqa", str(src), str(out)],
        ["convert", "mla", str(src), str(out), "--calib", text, "--kv-budget", "0.5"],
        ["retrofit", "softcap", str(src), str(out), "--attn-cap", "30"],
        ["diff", str(src), str(src)],
        ["eval", str(src), text, "--seq-len", "64"],
    ):
        result = runner.invoke(app, args)
        one_line_error(result, 1, f"tensor {name!r} holds NaN or Inf")
        assert not out.exists() and leftovers(tmp_path) == [] and tree(src) == before


# ------------------------------------------------------------------ text read only as far as the budget needs


def test_text_is_read_only_as_far_as_the_token_budget_needs(runner, src, tmp_path, monkeypatch):
    import attnkit.runtime.texts as texts

    big = tmp_path / "big.txt"
    with big.open("w") as fh:  # 8 MiB of text, 64 times what --calib-tokens 2048 needs at 1 char per token
        for _ in range(8 * 1024):
            fh.write((PROSE * 8)[:1023] + "\n")
    read = []
    pieces = texts._pieces

    def counting(fh):
        for piece in pieces(fh):
            read.append(len(piece))
            yield piece

    monkeypatch.setattr(texts, "FIRST_PIECE_CHARS", 1 << 16)
    monkeypatch.setattr(texts, "_pieces", counting)
    for args in (
        ["eval", str(src), str(big), "--seq-len", "64", "--max-tokens", "2048"],
        [
            "convert",
            "mqa",
            str(src),
            str(tmp_path / "out"),
            "--method",
            "merge",
            "--calib",
            str(big),
            "--calib-tokens",
            "2048",
            "--calib-seq-len",
            "64",
            "--dry-run",
        ],
    ):
        read.clear()
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert sum(read) <= 3 * (1 << 16)  # 2048 characters need the first 64 KiB piece, at most one more


# ------------------------------------------------------------------ a full disk


def test_a_full_disk_leaves_no_unmarked_temp_folder_and_says_so(tmp_path, monkeypatch):
    from attnkit.errors import AttnkitError
    from attnkit.io import tempdirs

    def full(_folder):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempdirs, "mark", full)
    with pytest.raises(AttnkitError, match="disk full while writing in"):
        tempdirs.make_temp_dir(tmp_path, "out")
    assert list(tmp_path.iterdir()) == []


def test_probe_plot_on_a_full_disk_is_one_line_and_leaves_nothing(runner, src, text, tmp_path, monkeypatch):
    import matplotlib.figure

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    plot = tmp_path / "plots" / "heads.png"
    plot.parent.mkdir()
    result = runner.invoke(app, ["probe", str(src), text, "--seq-len", "64", "--plot", str(plot)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: disk full while writing {plot}"], result.stderr
    assert list(plot.parent.iterdir()) == []


# ------------------------------------------------------------------ an output place that cannot work: found first


@pytest.mark.parametrize(
    "where, words", [("file", "exists and is not a folder"), ("under-a-file", "is a file and not a folder")]
)
def test_an_output_place_that_cannot_work_is_found_before_any_work(
    runner, src, text, tmp_path, monkeypatch, where, words
):
    from attnkit.commands.convert import mla

    monkeypatch.setattr(mla, "calibrate", lambda *a, **k: pytest.fail("calibrated before the output was checked"))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    out = blocker if where == "file" else blocker / "out"
    result = runner.invoke(app, ["convert", "mla", str(src), str(out), "--calib", text, "--kv-budget", "0.5"])
    one_line_error(result, 1, words)
    assert blocker.read_text() == "a file"


def test_a_cache_path_that_is_a_file_is_refused_before_dequantizing(runner, tmp_path, monkeypatch):
    from attnkit.io import gguf_load

    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    monkeypatch.setenv("ATTNKIT_CACHE", str(cache))
    monkeypatch.setattr(gguf_load, "load_gguf_model", lambda *a, **k: pytest.fail("dequantized into a file"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(), hostile.gguf_tensors()))
    result = runner.invoke(app, ["export", str(gguf), str(tmp_path / "out")])
    one_line_error(result, 1, "attnkit's cache is a file, not a folder")


# ------------------------------------------------------------------ options checked before the model loads


@pytest.mark.parametrize(
    "args, words",
    [
        (["eval", "{src}", "{text}", "--seq-len", "0"], "--seq-len must be at least 2"),
        (["eval", "{src}", "{text}", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["eval", "{src}", "{text}", "--max-tokens", "-5"], "--max-tokens must be at least 1"),
        (["probe", "{src}", "{text}", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["probe", "{src}", "{text}", "--threshold", "nan"], "--threshold must be a finite number"),
    ],
)
def test_options_are_checked_before_the_model_loads(runner, src, text, monkeypatch, args, words):
    from attnkit.commands.analyse import eval as eval_command
    from attnkit.commands.analyse import probe

    for module in (eval_command, probe):
        monkeypatch.setattr(module, "open_model", lambda *a, **k: pytest.fail("a model loaded before the checks"))
    result = runner.invoke(app, [a.format(src=src, text=text) for a in args])
    one_line_error(result, 2, words)


def test_a_heal_jsonl_of_the_wrong_shape_is_refused_before_the_models_load(runner, tmp_path, monkeypatch):
    from attnkit.commands.heal import models

    teacher = tiny_source(tmp_path, "llama")
    student = tmp_path / "student"
    assert runner.invoke(app, ["convert", "mqa", str(teacher), str(student)]).exit_code == 0
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": PROSE * 40}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    monkeypatch.setattr(models, "load_models", lambda *a, **k: pytest.fail("models loaded before the data check"))
    result = runner.invoke(
        app,
        [
            "heal",
            str(student),
            str(tmp_path / "out"),
            "--teacher",
            str(teacher),
            "--data",
            str(data),
            "--tokens",
            "1k",
            "--seq-len",
            "32",
        ],
    )
    one_line_error(result, 1, "data.jsonl:2: no string field 'text'")


# ------------------------------------------------------------------ config values that cannot be right


@pytest.mark.parametrize(
    "edit, words",
    [
        (
            lambda f: _edit_config(f, rope_parameters={"rope_type": "warp9", "rope_theta": 10000.0}),
            "rope_parameters.rope_type = 'warp9' is not a RoPE type transformers knows",
        ),
        (
            lambda f: _edit_config(f, rope_parameters={"rope_type": "linear", "factor": -2.0, "rope_theta": 10000.0}),
            "rope_parameters.factor = -2.0 must be a positive number",
        ),
        (
            lambda f: _edit_tensor(f, "model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.int32)),
            "is stored as I32; weights must be floating point",
        ),
        (
            lambda f: _edit_tensor(f, "model.embed_tokens.weight", lambda t: t[:-3]),
            "'model.embed_tokens.weight' has shape [253, 64] but the config implies [256, 64]",
        ),
    ],
)
def test_config_values_and_weights_that_cannot_be_right(runner, src, tmp_path, edit, words):
    edit(src)
    before = digest(src)
    for args in (
        ["convert", "mqa", str(src), str(tmp_path / "out")],
        ["retrofit", "softcap", str(src), str(tmp_path / "out"), "--attn-cap", "30"],
    ):
        one_line_error(runner.invoke(app, args), 1, words)
    assert digest(src) == before and not (tmp_path / "out").exists()


def test_a_gguf_whose_width_is_not_heads_times_head_size(tmp_path):
    from attnkit.errors import AttnkitError
    from attnkit.io.gguf_meta import read_gguf

    fields = [(k, t, 60 if k.endswith("embedding_length") else v) for k, t, v in hostile.gguf_fields()]
    path = tmp_path / "m.gguf"
    path.write_bytes(hostile.gguf_bytes(fields, hostile.gguf_tensors()))
    with pytest.raises(AttnkitError, match="embedding_length 60 is not a multiple of its 8 heads"):
        read_gguf(path)


# ------------------------------------------------------------------ GGUF tensors: missing, twice, misaligned


def _gguf_with(tmp_path, tensors, patch=None) -> Path:
    raw = bytearray(hostile.gguf_bytes(hostile.gguf_fields(), tensors))
    if patch:
        patch(raw)
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(raw))
    return path


def _misalign(raw: bytearray) -> None:
    """Move the last tensor's data offset by 4 bytes (the offset is the info's last 8 bytes)."""
    name = b"blk.1.attn_output.weight"
    at = raw.index(name) + len(name) + 4 + 2 * 8 + 4  # name, n_dims, two dims, type
    (offset,) = struct.unpack_from("<Q", raw, at)
    struct.pack_into("<Q", raw, at, offset + 4)


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda p: _gguf_with(p, [t for t in hostile.gguf_tensors() if t[0] != "blk.1.attn_k.weight"]),
            "incomplete GGUF (no blk.1.attn_k.weight)",
        ),
        (lambda p: _gguf_with(p, hostile.gguf_tensors() + [hostile.gguf_tensors()[1]]), "appears twice"),
        (lambda p: _gguf_with(p, hostile.gguf_tensors(), _misalign), "not a multiple of the alignment 32"),
        (
            lambda p: _gguf_with(
                p, [(n, (64, 24) if n == "blk.0.attn_k.weight" else d, t) for n, d, t in hostile.gguf_tensors()]
            ),
            "blk.0.attn_k.weight has dims [64, 24] but the header's head counts imply [64, 16]",
        ),
    ],
)
def test_gguf_tensors_missing_twice_misaligned_or_misshapen(runner, tmp_path, make, words):
    path = make(tmp_path)
    for args in (["inspect", str(path)], ["export", str(path), str(tmp_path / "out")]):
        one_line_error(runner.invoke(app, args), 1, words)


# ------------------------------------------------------------------ special files


def test_a_fifo_or_a_symlink_loop_is_refused_instead_of_hanging(runner, src, text, tmp_path):
    fifo_config = tmp_path / "fifo-config"
    shutil.copytree(src, fifo_config)
    (fifo_config / "config.json").unlink()
    os.mkfifo(fifo_config / "config.json")
    fifo_weights = tmp_path / "fifo-weights"
    shutil.copytree(src, fifo_weights)
    (fifo_weights / "model.safetensors").unlink()
    os.mkfifo(fifo_weights / "model.safetensors")
    loop = tmp_path / "loop"
    shutil.copytree(src, loop)
    (loop / "tokenizer.json").unlink()
    (loop / "tokenizer.json").symlink_to("tokenizer.json")
    for folder, words in (
        (fifo_config, "config.json: is a FIFO, not a config.json"),
        (fifo_weights, "model.safetensors: is a FIFO, not a safetensors file"),
        (loop, "tokenizer.json: a symlink that leads nowhere"),
    ):
        for args in (
            ["inspect", str(folder)],
            ["convert", "mqa", str(folder), str(tmp_path / "out")],
            ["eval", str(folder), text],
        ):
            if args[0] == "inspect" and folder is loop:
                continue  # inspect reads no tokenizer
            one_line_error(runner.invoke(app, args), 1, words)


# ------------------------------------------------------------------ numbers without bounds


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["retrofit", "qknorm", "{src}", "{out}", "--method", "kl", "--calib", "{text}", "--steps", "10000000000"],
            "--steps 10,000,000,000 is over the limit of 100,000",
        ),
        (["eval", "{src}", "{text}", "--batch-size", str(2**32 + 1)], "--batch-size 4,294,967,297 is over the limit"),
        (["probe", "{src}", "{text}", "--fail-if", "max_logit>nan"], "expected METRIC>VALUE"),
        (["probe", "{src}", "{text}", "--fail-if", "max_logit>1e999"], "the bound must be a finite number"),
        (["probe", "{src}", "{text}", "--top", "-1"], "-1 is not in the range x>=0"),
        (["kvmem", "llama-3.1-8b", "--context", "4k,,8k"], "empty item in the list '4k,,8k'"),
        (
            ["heal", "{src}", "{out}", "--teacher", "{src}", "--batch-size", str(2**32 + 4), "--micro-batch-size", "4"],
            "--batch-size 4,294,967,300 is over the limit",
        ),
        (
            ["convert", "mla", "{src}", "{out}", "--calib", "{text}", "--kv-budget", "0.5", "--shrink", "nan"],
            "--shrink must be a finite number",
        ),
        (
            ["convert", "mla", "{src}", "{out}", "--calib", "{text}", "--kv-budget", "0.5", "--key-balance", "inf"],
            "--key-balance must be a positive finite number, got inf",
        ),
    ],
)
def test_numbers_are_bounded(runner, src, text, tmp_path, args, words):
    result = runner.invoke(app, [a.format(src=src, text=text, out=tmp_path / "out") for a in args])
    assert result.exit_code == 2 and words in result.output, result.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ library exceptions in attnkit's words


def test_a_hub_id_the_hub_would_reject_is_one_line(runner, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for ref in ("acme/tiny@bad..rev", "acme/ti--ny", "acme/" + "x" * 200):
        result = runner.invoke(app, ["inspect", ref])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and "Error" not in result.stderr, result.stderr


def test_a_calibration_text_with_no_variation_is_one_line(runner, src, tmp_path):
    flat = tmp_path / "flat.txt"
    flat.write_text("a" * 8000)
    args = ["--calib", str(flat), "--calib-tokens", "4096", "--kv-budget", "0.5"]
    result = runner.invoke(app, ["convert", "mla", str(src), str(tmp_path / "out"), *args])
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output
    if result.exit_code == 1:
        one_line_error(result, 1, "calibration")
    assert leftovers(tmp_path) == []
