"""`attnkit verify` checks its options, texts and the checkpoint before it looks for an engine or loads a model."""

from __future__ import annotations

import pytest

from attnkit.cli import app


@pytest.fixture
def no_engines(monkeypatch):
    import attnkit.engines.llamacpp as llamacpp
    import attnkit.runtime as runtime

    monkeypatch.setattr(llamacpp, "find_llama_cpp", lambda *a, **k: pytest.fail("engine looked up before the checks"))
    monkeypatch.setattr(runtime, "load_model", lambda *a, **k: pytest.fail("model loaded before the checks"))


def test_bad_engine_and_binary_text_are_refused_first(runner, tiny, tmp_path, no_engines):
    model = tiny("llama_gqa")
    result = runner.invoke(app, ["verify", str(model), "--engine", "tgi"])
    assert result.exit_code == 2 and "--engine must be one of" in result.stderr
    binary = tmp_path / "t.txt"
    binary.write_bytes(b"some\0text")
    result = runner.invoke(app, ["verify", str(model), "--engine", "llama.cpp", "--text", str(binary)])
    assert result.exit_code == 1 and "a binary file" in result.stderr


def test_an_incomplete_checkpoint_is_refused_before_any_engine_runs(runner, tiny, tmp_path, no_engines):
    from safetensors.torch import load_file, save_file

    model = tiny("llama_gqa")
    tensors = load_file(str(model / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    result = runner.invoke(app, ["verify", str(model), "--engine", "llama.cpp"])
    assert result.exit_code == 1 and "k_proj" in result.stderr, result.output


def test_llama_cpp_output_cut_inside_a_utf8_character_is_read():
    """llama-completion prints a continuation byte for byte; one that stops inside a multi-byte character (common
    for a badly degraded rewrite) is read with a replacement character, not a UnicodeDecodeError."""
    import sys

    from attnkit.engines.llamacpp import _run

    proc = _run([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'ok \\xe2\\x82')"], "test", 60)
    assert proc.stdout == "ok \ufffd"
