"""Runtime: loading, text windows, final hidden states and chunked logits."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.errors import AttnkitError, UsageError
from attnkit.runtime import batches, load_model, make_windows, read_texts
from attnkit.runtime.lm import final_hidden, logit_chunks
from tests.tiny import build_model

PROSE = ("Rain fell on the old harbour town all night, and by morning the fishing boats "
         "sat low in the water while the gulls argued over scraps on the pier. ")


def char_tokenizer(folder):
    """Save a character-level tokenizer (ids < 100, EOS = 2) into `folder` so tiny models can read text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({chr(c): 4 + i for i, c in enumerate(range(32, 127))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture
def tok(tmp_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(char_tokenizer(tmp_path))


def test_read_texts_txt_jsonl_and_literal(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    assert read_texts([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "fourth") == [
        "first document", "second", "third", "fourth"]


def test_read_texts_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(AttnkitError, match="bad.jsonl:1: no string field 'text'"):
        read_texts([str(tmp_path / "bad.jsonl")])
    with pytest.raises(AttnkitError, match="file not found"):
        read_texts([str(tmp_path / "missing.txt")])
    with pytest.raises(UsageError, match="no text"):
        read_texts([], None)


def test_make_windows_joins_documents_with_eos_and_cuts_full_windows(tok):
    windows = make_windows(tok, ["abc", "de"], seq_len=2)
    # a b c </s> d e -> 6 tokens -> 3 windows of 2
    expected = [vocab for vocab in (tok.convert_tokens_to_ids(list("abc")) + [2] + tok.convert_tokens_to_ids(list("de")))]
    assert windows.tolist() == [expected[0:2], expected[2:4], expected[4:6]]
    assert make_windows(tok, ["abc", "de"], seq_len=2, max_tokens=5).shape == (2, 2)
    assert make_windows(tok, [PROSE], seq_len=16).equal(make_windows(tok, [PROSE], seq_len=16))


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


def test_load_model_errors(tiny):
    with pytest.raises(AttnkitError, match="bert is not a causal language model"):
        load_model(str(tiny("bert")), device="cpu")
    with pytest.raises(UsageError, match="unknown --dtype"):
        load_model(str(tiny("llama")), dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(AttnkitError, match="no CUDA device"):
            load_model(str(tiny("llama")), device="cuda")
