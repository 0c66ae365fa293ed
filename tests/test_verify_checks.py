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


def test_vllm_pool_is_held_against_kvmem_with_the_fallback_counted():
    """verify's vLLM row: the pool vLLM reports equals kvmem's prediction (bytes per token and per request) for a
    layout served as written, and for an MLA shape vLLM falls back on, its expanded keys and values; one byte off
    in either is not equal (a mismatch, exit 3)."""
    from types import SimpleNamespace

    from attnkit.commands.analyse.verify_saving import vllm_cache

    def loaded(config):
        return SimpleNamespace(checkpoint=SimpleNamespace(config=config))

    llama = dict(
        model_type="llama",
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
    )
    pool = {"block_size": 16, "max_in_flight_tokens": 8192, "max_model_len": 1040, "num_blocks": 100}
    per_token = 30 * 3 * 2 * 64 * 4  # fp32 K and V of 3 heads of 64 in 30 layers
    request = 65 * 16 * per_token  # 1040 tokens in 65 blocks of 16
    assert vllm_cache({**pool, "request_bytes": request}, per_token, loaded(llama))["equal"]
    assert not vllm_cache({**pool, "request_bytes": request}, per_token + 1, loaded(llama))["equal"]
    assert not vllm_cache({**pool, "request_bytes": request + 1}, per_token, loaded(llama))["equal"]
    mla = dict(
        model_type="deepseek_v3",
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=9,
        num_hidden_layers=30,
        intermediate_size=1536,
        moe_intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=8192,
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        q_lora_rank=None,
        n_routed_experts=None,
        first_k_dense_replace=30,
    )
    expanded = 30 * 9 * 2 * (64 + 64) * 4  # 128 + 64 runs as plain attention: 276,480 bytes a token
    found = vllm_cache({**pool, "request_bytes": 65 * 16 * expanded}, expanded, loaded(mla))
    assert found["equal"] and found["kvmem_bytes_per_token"] == 276_480, found


def test_decode_depths_and_source_are_checked_before_any_engine(runner, tiny, tmp_path, no_engines):
    """A decode depth past the model's positions, rounds out of range, a source that is incomplete, or
    --decode-depths without llama.cpp: exit 2 (1 for the checkpoint) before an engine is looked up."""
    from safetensors.torch import load_file, save_file

    model = tiny("llama_gqa")
    base = ["verify", str(model), "--engine", "llama.cpp"]
    for extra, code, message in (
        (["--decode-depths", "1m"], 2, "is past"),
        (["--decode-depths", "128", "--decode-rounds", "0"], 2, "--decode-rounds must be 1 to 9"),
        (["--decode-depths", "0"], 2, "not a positive whole token count"),
        (["--decode-depths", "64", "--flash-attn", "maybe"], 2, "--flash-attn must be one of auto, on, off"),
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == code and message in result.stderr, (extra, result.output)
    result = runner.invoke(app, ["verify", str(model), "--engine", "vllm", "--decode-depths", "64"])
    assert result.exit_code == 2 and "give --engine llama.cpp" in result.stderr, result.output
    broken = tiny("llama_gqa")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = runner.invoke(app, [*base, "--source", str(broken)])
    assert result.exit_code == 1 and "v_proj" in result.stderr, result.output
