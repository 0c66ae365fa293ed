"""`attnkit verify` checks its options, texts and the checkpoint before it looks for an engine or loads a model."""

from __future__ import annotations

import pytest

from attnkit.cli import app


@pytest.fixture
def no_engines(monkeypatch):
    """Fail a test that looks up an engine or loads a model: patched where verify looks them up (its own module
    imported them by name), so the patch is undone with the test."""
    import attnkit.commands.analyse.verify as verify

    for name in ("find_llama_cpp", "find_vllm"):
        monkeypatch.setattr(verify, name, lambda *a, **k: pytest.fail("engine looked up before the checks"))
    monkeypatch.setattr(verify, "load_model", lambda *a, **k: pytest.fail("model loaded before the checks"))


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
    """verify's vLLM row: the pool vLLM reports equals kvmem's prediction (bytes per token, per request and the
    tokens the pool holds, to one block) for a layout served as written, and for an MLA shape vLLM falls back on,
    its expanded keys and values; one byte off, or a capacity a block and more away, is not equal (exit 3)."""
    from attnkit.commands.analyse.verify_saving import capacity_ratio, vllm_cache

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
    per_token = 30 * 3 * 2 * 64 * 4  # fp32 K and V of 3 heads of 64 in 30 layers
    request = 65 * 16 * per_token  # 1040 tokens in 65 blocks of 16
    # a pool of 650 blocks: 10 requests of 1040 tokens, 10,400 tokens
    pool = {"block_size": 16, "max_in_flight_tokens": 8192, "max_model_len": 1040, "num_blocks": 650}
    pool.update(pool_bytes=10 * request, capacity_tokens=10_400, request_bytes=request)
    assert vllm_cache(pool, per_token, llama)["equal"]
    assert vllm_cache({**pool, "capacity_tokens": 10_400 - 16}, per_token, llama)["equal"]  # one block's rounding
    assert not vllm_cache({**pool, "capacity_tokens": 10_400 - 17}, per_token, llama)["equal"]
    assert not vllm_cache(pool, per_token + 1, llama)["equal"]
    assert not vllm_cache({**pool, "request_bytes": request + 1}, per_token, llama)["equal"]
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
    fallback = {**pool, "request_bytes": 65 * 16 * expanded, "capacity_tokens": 10_400 * per_token // expanded}
    found = vllm_cache(fallback, expanded, mla)
    assert found["equal"] and found["kvmem_bytes_per_token"] == 276_480, found
    # the same pool holds a sixth of the tokens: the fallback caches 6x the source (2,304 values, not 384)
    ratio = capacity_ratio(found, vllm_cache(pool, per_token, llama))
    assert ratio["ratio_equal"] and abs(ratio["kvmem_ratio"] - 6) < 1e-9 and abs(ratio["cache_ratio"] - 6) < 1e-2
    assert not capacity_ratio({**found, "capacity_tokens": 1_700}, vllm_cache(pool, per_token, llama))["ratio_equal"]


def test_decode_runs_the_models_side_by_side_in_alternating_order():
    """verify's decode speed: one run of each model a round, the order reversed every other round, the median of
    the rounds and the output's over the source's."""
    from attnkit.commands.analyse.verify_saving import side_by_side

    runs = []
    speed = {"output": iter([10.0, 30.0, 20.0]), "source": iter([5.0, 1.0, 10.0])}

    def measure(name):
        runs.append(name)
        return {64: next(speed[name])}

    found = side_by_side(measure, ["output", "source"], [64], 3)
    assert runs == ["output", "source", "source", "output", "output", "source"]
    assert found["tokens_per_second"] == {"output": {64: 20.0}, "source": {64: 5.0}} and found["ratio"] == {64: 4.0}


def test_decode_depths_and_source_are_checked_before_any_engine(runner, tiny, tmp_path, no_engines):
    """A decode depth past the model's positions (for either engine), rounds out of range or a source that is
    incomplete: exit 2 (1 for the checkpoint) before an engine is looked up."""
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
    result = runner.invoke(app, ["verify", str(model), "--engine", "vllm", "--decode-depths", "1m"])
    assert result.exit_code == 2 and "is past" in result.stderr, result.output
    broken = tiny("llama_gqa")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    result = runner.invoke(app, [*base, "--source", str(broken)])
    assert result.exit_code == 1 and "v_proj" in result.stderr, result.output


def test_the_table_prints_what_each_engine_saves_beside_the_source(runner, tiny, monkeypatch):
    """With --source, the table format prints, per engine, the output's cache beside the source's (llama.cpp's MiB
    at -c N, the tokens vLLM's pool holds) with the two ratios, and decode tokens/s at each depth."""
    import attnkit.commands.analyse.verify as verify_module

    def row(engine, pool, source):
        decode = {"depths": [1024], "rounds": 3, "tokens_per_second": {"output": {1024: 30.0}, "source": {1024: 20.0}}}
        return {
            "engine": engine,
            "status": "ok",
            "detail": "",
            "notes": [],
            "kv_pool": pool,
            "source_cache": source,
            "cache_ratio": 1 / 3,
            "kvmem_ratio": 1 / 3,
            "decode": {**decode, "ratio": {1024: 1.5}},
            **dict.fromkeys(("greedy_equal", "greedy_ties", "perplexity_transformers", "perplexity_engine")),
            **dict.fromkeys(("ppl_rel_diff", "kl_mean", "kv_bytes_per_token")),
        }

    report = {
        "prompts": ["a"],
        "new_tokens": 4,
        "ctx": 512,
        "windows": 1,
        "mismatch": False,
        "engines": [
            row("llama.cpp", {"n_ctx": 512, "mib": 3.75}, {"mib": 11.25}),
            row("vllm", {"pool_bytes": 1 << 30, "capacity_tokens": 69_888}, {"capacity_tokens": 23_296}),
        ],
    }
    monkeypatch.setattr(verify_module, "verify", lambda req, log: report)
    result = runner.invoke(app, ["verify", str(tiny("llama_gqa")), "--source", "x"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    for expected in ("what the output saves in llama.cpp", "KV cache at -c 512 (MiB) │ 3.75 │ 11.25 │ 0.333 │ 0.333"):
        assert expected in out, out
    assert "what the output saves in vllm" in out and "tokens in a 1,024 MiB pool │ 69,888 │ 23,296 │ 0.333" in out
    assert out.count("decode tok/s at depth 1,024 │ 30.00 │ 20.00 │ 1.50") == 2, out
