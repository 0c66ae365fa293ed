"""The last bad inputs a held-back battery found (issue 41): each gets one attnkit-worded line and a non-zero exit
before any model loads or temp folder is made, with the input untouched; a long .jsonl document is tokenized in
bounded pieces, as a .txt file is."""

from __future__ import annotations

import json
import os
import threading

import pytest
import transformers

from attnkit.cli import app
from attnkit.runtime import texts
from tests.helpers import PROSE, leftovers, one_line_error, tiny_source


@pytest.fixture
def src(tmp_path):
    return tiny_source(tmp_path, "llama_gqa")


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(PROSE * 40)
    return str(path)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model that transformers would build fails the test: the check must come first."""

    def refuse(*_a, **_k):
        pytest.fail("a model loaded before the check")

    for cls in (transformers.AutoModelForCausalLM, transformers.PreTrainedModel):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", classmethod(refuse))


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ------------------------------------------------------------------ .jsonl read in bounded pieces


def test_a_long_jsonl_document_is_tokenized_in_bounded_pieces(tmp_path, monkeypatch):
    """One 3 MB document on one line: pieces of at most PIECE_CHARS (plus the carried word), and a budget of a few
    windows tokenizes only the first piece, as for a .txt file."""
    doc = tmp_path / "one-line.jsonl"
    doc.write_text(json.dumps({"text": PROSE * 20000}) + "\n")
    pieces = [piece for piece, _ in texts.Texts((str(doc),)).pieces()]
    assert "".join(pieces) == PROSE * 20000
    assert len(pieces) > 2 and max(len(p) for p in pieces) <= texts.PIECE_CHARS + 100

    from tests.helpers import char_tokenizer

    tokenizer = transformers.AutoTokenizer.from_pretrained(char_tokenizer(tmp_path / "tok"))
    seen = []
    real = texts.encode
    monkeypatch.setattr(texts, "encode", lambda tok, piece: seen.append(len(piece)) or real(tok, piece))
    windows = texts.make_windows(tokenizer, texts.read_texts([str(doc)]), 128, 512)
    assert windows.shape == (4, 128)
    assert sum(seen) <= texts.FIRST_PIECE_CHARS + 100


def test_nul_escapes_in_jsonl_are_refused_before_the_model_loads(runner, src, tmp_path, no_model_loads):
    doc = tmp_path / "nul.jsonl"
    doc.write_text(json.dumps({"text": PROSE * 20}) + "\n" + json.dumps({"text": "abc\u0000def " * 50}) + "\n")
    result = runner.invoke(app, ["eval", str(src), str(doc), "--seq-len", "64"])
    one_line_error(result, 1, "nul.jsonl:2: the text holds a NUL character")


def test_nul_bytes_on_stdin_are_refused_before_the_model_loads(runner, src, no_model_loads):
    result = runner.invoke(app, ["eval", str(src), "-", "--seq-len", "64"], input=(PROSE + "\0") * 20)
    one_line_error(result, 1, "stdin: a binary file (it holds NUL bytes)")


# ------------------------------------------------------------------ configs and GGUF files


def test_kvmem_refuses_a_width_that_is_not_heads_times_a_head_dim(runner, src):
    config = _edit_config(src, hidden_size=60, num_attention_heads=8, head_dim=None) / "config.json"
    result = runner.invoke(app, ["kvmem", str(config)])
    one_line_error(result, 1, "hidden_size 60 is not a multiple of its 8 heads and no head_dim is given")


def test_a_config_dtype_torch_does_not_know_is_refused_before_the_model_loads(runner, src, text, no_model_loads):
    _edit_config(src, torch_dtype="float8", dtype="float8")
    result = runner.invoke(app, ["eval", str(src), text, "--seq-len", "64"])
    one_line_error(result, 1, "'float8' is not a dtype torch knows")


def _gguf_with_tokenizer(path, model: str, scores: bool, merges: bool):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, heads, layers = 64, 8, 1
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_context_length(512)
    writer.add_feed_forward_length(128)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    tokens = ["<unk>", "<s>", "</s>", *[chr(c) for c in range(97, 123)]]
    writer.add_token_list(tokens)
    if scores:
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
    if merges:
        writer.add_token_merges(["a b"])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), hidden), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for role in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{role}.weight", np.zeros((hidden, hidden), dtype=np.float32))
        for role, shape in (("ffn_gate", (128, hidden)), ("ffn_up", (128, hidden)), ("ffn_down", (hidden, 128))):
            writer.add_tensor(f"blk.{i}.{role}.weight", np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "model, scores, merges, words",
    [
        ("llama", False, False, "has neither tokenizer.ggml.merges nor tokenizer.ggml.scores"),
        ("bert", True, False, "its tokenizer.ggml.model is 'bert'"),
    ],
)
def test_a_gguf_whose_tokenizer_cannot_be_built_is_refused_before_dequantizing(
    runner, tmp_path, text, monkeypatch, model, scores, merges, words
):
    from attnkit.io import gguf_load

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_load, "load_gguf_model", lambda *a, **k: pytest.fail("dequantized before the check"))
    path = _gguf_with_tokenizer(tmp_path / "m.gguf", model, scores, merges)
    before = path.read_bytes()
    result = runner.invoke(app, ["eval", str(path), text, "--seq-len", "64"])
    one_line_error(result, 1, words)
    assert path.read_bytes() == before


def test_a_gguf_with_scores_and_no_merges_passes_the_tokenizer_check(tmp_path):
    from attnkit.io.gguf_meta import check_gguf_tokenizer

    check_gguf_tokenizer(_gguf_with_tokenizer(tmp_path / "m.gguf", "llama", scores=True, merges=False))
    check_gguf_tokenizer(_gguf_with_tokenizer(tmp_path / "b.gguf", "gpt2", scores=False, merges=True))


# ------------------------------------------------------------------ checks before the model loads or a folder is made


def test_a_whitespace_only_calibration_text_is_refused_before_the_model_loads(runner, src, tmp_path, no_model_loads):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n\t  \n" * 500)
    result = runner.invoke(app, ["convert", "mqa", str(src), str(tmp_path / "out"), "--calib", str(blank)])
    one_line_error(result, 1, "blank.txt: holds no text (it is empty or only whitespace)")
    assert leftovers(tmp_path, "out") == []


def test_a_calibration_window_past_the_models_positions_is_refused_before_any_folder(
    runner, src, tmp_path, no_model_loads
):
    long_text = tmp_path / "long.txt"
    long_text.write_text(PROSE * 400)  # about 58k characters: enough for the windows asked for
    out = tmp_path / "out"
    args = ["--calib", str(long_text), "--calib-seq-len", "1024", "--calib-tokens", "4096", "--kv-budget", "0.5"]
    result = runner.invoke(app, ["convert", "mla", str(src), str(out), *args])
    one_line_error(result, 2, "--calib-seq-len 1,024 is past")
    assert "512 positions" in result.output
    assert leftovers(tmp_path, "out") == []


def test_an_output_that_is_a_dangling_symlink_is_refused_before_work(runner, src, tmp_path, no_model_loads):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    result = runner.invoke(app, ["convert", "mqa", str(src), str(out)])
    one_line_error(result, 1, f"{out}: a symlink that leads nowhere")
    assert out.is_symlink() and not out.exists() and leftovers(tmp_path) == []


def test_a_heal_sample_cache_that_is_a_file_is_refused_before_the_models_load(runner, tmp_path, monkeypatch):
    from attnkit.commands.heal import models

    teacher = tiny_source(tmp_path, "llama")
    student = tmp_path / "student"
    assert runner.invoke(app, ["convert", "mqa", str(teacher), str(student), "--no-check"]).exit_code == 0
    cache = tmp_path / "cache"
    cache.write_text("a file")
    monkeypatch.setattr(models, "load_models", lambda *a, **k: pytest.fail("models loaded before the check"))
    args = ["heal", str(student), str(tmp_path / "out"), "--teacher", str(teacher), "--sample-cache", str(cache)]
    result = runner.invoke(app, args)
    one_line_error(result, 2, f"--sample-cache {cache}: is a file, not a folder")
    assert cache.read_text() == "a file"


def test_hf_home_that_is_a_file_is_named_and_offline_is_not_a_download(runner, tmp_path, monkeypatch):
    home = tmp_path / "hf-home"
    home.write_text("a file")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    result = runner.invoke(app, ["inspect", "acme/tiny-model"])
    one_line_error(result, 1, f"HF_HOME={home} is a file, not a folder")
    assert "download" not in result.output


# ------------------------------------------------------------------ pipes and devices as text


def test_a_pipe_or_a_device_given_as_text_says_what_it_is_and_does_not_hang(runner, src, tmp_path, no_model_loads):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed():  # what `<(zcat x)` passes: a writer waiting on the other end
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # nobody opened it for reading: the check never did
            return
        os.close(fd)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    result = runner.invoke(app, ["eval", str(src), str(fifo), "--seq-len", "64"])
    one_line_error(result, 1, "fifo: is a pipe (FIFO): give its text on stdin as '-'")
    result = runner.invoke(app, ["eval", str(src), "/dev/zero", "--seq-len", "64"])
    one_line_error(result, 1, "/dev/zero: is a character device, not a text file")
    writer.join(timeout=5)
