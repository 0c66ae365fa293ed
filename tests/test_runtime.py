"""Runtime: loading, text windows, final hidden states and chunked logits."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime import batches, load_model, make_windows, read_texts
from attnkit.runtime.lm import final_hidden, logit_chunks
from tests.helpers import PROSE, char_tokenizer
from tests.tiny import build_model


@pytest.fixture
def tok(tmp_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(char_tokenizer(tmp_path))


def test_read_texts_txt_jsonl_and_literal(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    assert list(read_texts([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "fourth")) == [
        "first document",
        "second",
        "third",
        "fourth",
    ]


def test_read_texts_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(AttnkitError, match="bad.jsonl:1: no string field 'text'"):
        list(read_texts([str(tmp_path / "bad.jsonl")]))
    with pytest.raises(AttnkitError, match="file not found"):
        read_texts([str(tmp_path / "missing.txt")])
    with pytest.raises(UsageError, match="no text"):
        read_texts([], None)


def test_make_windows_joins_documents_with_eos_and_cuts_full_windows(tok):
    windows = make_windows(tok, ["abc", "de"], seq_len=2)
    # a b c </s> d e -> 6 tokens -> 3 windows of 2
    expected = [
        vocab for vocab in (tok.convert_tokens_to_ids(list("abc")) + [2] + tok.convert_tokens_to_ids(list("de")))
    ]
    assert windows.tolist() == [expected[0:2], expected[2:4], expected[4:6]]
    assert make_windows(tok, ["abc", "de"], seq_len=2, max_tokens=5).shape == (2, 2)
    assert make_windows(tok, [PROSE], seq_len=16).equal(make_windows(tok, [PROSE], seq_len=16))


@pytest.fixture
def bos_tok(tmp_path):
    """The character tokenizer with a post-processor that puts <s> in front of every text, as Gemma's does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_tokenizer(tmp_path))
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def test_text_prefix_is_what_the_tokenizer_puts_in_front(tok, bos_tok):
    from attnkit.runtime.texts import prompt_ids, text_prefix

    assert text_prefix(tok) == []
    assert text_prefix(bos_tok) == [1]
    assert prompt_ids(bos_tok, "ab") == bos_tok("ab")["input_ids"] == [1, *tok.convert_tokens_to_ids(["a", "b"])]


def test_windows_start_as_the_tokenizer_starts_a_text(bos_tok):
    a, b, c, d, e = bos_tok.convert_tokens_to_ids(list("abcde"))
    # stream: a b c </s> <s> d e; windows of 3 = <s> + 2 stream tokens each
    assert make_windows(bos_tok, ["abc", "de"], seq_len=3).tolist() == [[1, a, b], [1, c, 2], [1, 1, d]]
    assert make_windows(bos_tok, ["abc", "de"], seq_len=3, max_tokens=7).tolist() == [[1, a, b], [1, c, 2]]
    with pytest.raises(AttnkitError, match="after the tokenizer's 1 start token"):
        make_windows(bos_tok, ["abc"], seq_len=6)
    with pytest.raises(UsageError, match="leaves no room"):
        make_windows(bos_tok, ["abc"], seq_len=2)


def test_text_files_are_read_in_pieces_and_only_as_far_as_needed(tmp_path, tok, monkeypatch):
    import attnkit.runtime.texts as texts

    monkeypatch.setattr(texts, "FIRST_PIECE_CHARS", 64)
    monkeypatch.setattr(texts, "PIECE_CHARS", 64)
    line = "the quick brown fox jumps over the lazy dog\n"
    (tmp_path / "big.txt").write_text(line * 1000)
    source = read_texts([str(tmp_path / "big.txt")])
    pieces = list(source.pieces())
    assert len(pieces) > 100 and [starts for _, starts in pieces].count(True) == 1
    assert "".join(p for p, _ in pieces) == line * 1000 and all(p.endswith("\n") for p, _ in pieces)
    seen, encode = [], texts.encode

    def counting(tokenizer, piece):
        seen.append(piece)
        return encode(tokenizer, piece)

    monkeypatch.setattr(texts, "encode", counting)
    windows = make_windows(tok, source, seq_len=32, max_tokens=64)
    assert windows.shape == (2, 32) and len(seen) <= 2  # 64 tokens need at most two 64-character pieces
    assert windows.flatten().tolist() == tok((line * 2)[:64], add_special_tokens=False)["input_ids"]


def test_make_windows_errors(tok):
    with pytest.raises(AttnkitError, match="the text has 3 tokens, shorter than one window of 8"):
        make_windows(tok, ["abc"], seq_len=8)
    with pytest.raises(UsageError, match="shorter than one window"):
        make_windows(tok, [PROSE], seq_len=8, max_tokens=4)
    with pytest.raises(AttnkitError, match="no tokenizer"):
        make_windows(None, [PROSE], seq_len=8)


def test_batches():
    ids = torch.arange(10).view(5, 2)
    assert [b.shape[0] for b in batches(ids, 2)] == [2, 2, 1]
    assert torch.cat(list(batches(ids, 2))).equal(ids)


@pytest.mark.parametrize("family", ["llama_gqa", "gemma2", "gpt2", "qwen3"])
def test_chunked_logits_equal_model_logits(family, monkeypatch):
    import attnkit.runtime.lm as lm

    model = build_model(family)
    ids = torch.randint(3, 256, (2, 24))
    monkeypatch.setattr(lm, "CHUNK_ELEMENTS", 2 * 256 * 5)  # 5 positions per chunk
    chunks = list(logit_chunks(model, final_hidden(model, ids)))
    assert [s for s, _ in chunks] == [0, 5, 10, 15, 20]
    with torch.no_grad():
        full = model(ids).logits.float()
    torch.testing.assert_close(torch.cat([c for _, c in chunks], 1), full, rtol=1e-5, atol=1e-5)


def test_load_model_folder_with_tokenizer(tiny):
    folder = char_tokenizer(tiny("llama_gqa"))
    loaded = load_model(str(folder), device="cpu")
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.tokenizer.eos_token_id == 2
    assert not loaded.model.training and loaded.checkpoint.kind == "folder"


def test_models_load_without_hub_kernels(tiny):
    """transformers 5 with the `kernels` package kernelizes by default and, in training mode on CUDA, fetches hub
    kernels (Llama's rotary) that an offline run cannot get: attnkit's models keep transformers' own code."""
    loaded = load_model(str(char_tokenizer(tiny("llama_gqa"))), device="cpu")
    loaded.model.train()  # heal's mode: where transformers would re-kernelize for training
    assert getattr(loaded.model, "use_kernels", False) is False


def test_load_model_errors(tiny):
    with pytest.raises(AttnkitError, match="bert is not a causal language model"):
        load_model(str(tiny("bert")), device="cpu")
    with pytest.raises(UsageError, match="unknown --dtype"):
        load_model(str(tiny("llama")), dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(AttnkitError, match="no CUDA device"):
            load_model(str(tiny("llama")), device="cuda")
