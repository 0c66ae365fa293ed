"""What each serving engine's loader and kernels take, as data read from their code (docs/serving.md cites it).

- llama.cpp (the tree vendored in llama-cpp-python 0.3.36): deepseek2 reads q_lora_rank as a required key
  unless the model has 26 or 27 layers (its "lite" check), and then refuses q_a/q_b tensors; MLA shapes are
  free (even RoPE dims); standard attention takes any even head size; no o_proj bias for qwen3.
- vLLM 0.32: every MLA backend checks kv_lora_rank + qk_rope_head_dim in {320, 512, 576}; the CPU kernel,
  FlashMLA and CUTLASS MLA run only 512 + 64. CPU attention runs head sizes that are multiples of 32, and 80
  and 112. DeepSeek MLPs must be silu; unknown `.bias` weights are skipped without a word.
- SGLang 0.5: its triton MLA backend pads any shape; fa3 and flashmla need DeepSeek's own shapes.
"""

from __future__ import annotations

#: --engine values. "any": the loaders of llama.cpp, vLLM and SGLang take the output, at any shape (vLLM's MLA
#: kernels run only its shapes; name the engine to snap to them).
TARGETS = ("any", "llama.cpp", "vllm", "sglang", "transformers")
#: (kv_lora_rank, qk_rope_head_dim) the engine's MLA kernels take; None: any (even RoPE dims).
MLA_SHAPES: dict[str, tuple[tuple[int, int], ...] | None] = {
    "llama.cpp": None,
    "vllm": ((512, 64),),
    "sglang": None,
    "transformers": None,
}
#: Model types attnkit writes that no serving engine has a model class for (transformers, with attnkit.modeling).
TRANSFORMERS_ONLY = {"attnkit_gemma3_mla": "convert mla --target gemma3-mla"}
#: Layer counts for which llama.cpp's deepseek2 loader wants no q_lora (its "lite" models).
LLAMA_CPP_LITE_LAYERS = (26, 27)


def engines_of(target: str) -> tuple[str, ...]:
    """The engines whose loaders a --engine value asks an output to satisfy ("any": llama.cpp, vLLM, SGLang)."""
    if target not in TARGETS:
        raise ValueError(target)
    return ("llama.cpp", "vllm", "sglang") if target == "any" else (target,)


def mla_shapes(target: str) -> tuple[tuple[int, int], ...] | None:
    """The (R, P) shapes the named engine's MLA kernels take; None for any shape ("any" snaps to none)."""
    return None if target == "any" else MLA_SHAPES[target]


def needs_q_lora(target: str, num_layers: int) -> bool:
    """Whether the query must go through q_a/q_b: llama.cpp's deepseek2 needs it except for 26/27 layers."""
    return "llama.cpp" in engines_of(target) and num_layers not in LLAMA_CPP_LITE_LAYERS


def engine_safe(target: str) -> bool:
    """Whether the output must run in a serving engine (bias tensors dropped, silu MLPs, default RoPE)."""
    return target != "transformers"


def vllm_cpu_head_size_ok(head_dim: int) -> bool:
    """vLLM's CPU attention kernels: head sizes that are multiples of 32, and 80 and 112."""
    return head_dim % 32 == 0 or head_dim in (80, 112)


def mla_serving(rank: int, rope: int, num_heads: int, head_dim: int) -> dict[str, dict]:
    """Per serving engine, how it serves a stock DeepseekV3 output of latent R = `rank` and RoPE key P = `rope`
    (`head_dim` D: the nope and value width): {"as_written": whether its cache holds the latent (R + P values per
    token and layer), "values": the values it caches per token and layer, "why"}. llama.cpp's deepseek2 caches
    the latent and RoPE key as K and no V at any shape; vLLM's MLA kernels take only MLA_SHAPES["vllm"] and run
    any other shape with VLLM_MLA_DISABLE=1 as plain attention, caching each head's expanded key and its value
    padded to the key width (H x 2(D + P); docs/serving.md measured it); SGLang's triton MLA backend pads any
    shape (read from its code, not run here)."""
    latent = rank + rope
    expanded = num_heads * 2 * (head_dim + rope)
    vllm = (rank, rope) in MLA_SHAPES["vllm"]
    return {
        "llama.cpp": {"as_written": True, "values": latent, "why": "deepseek2: latent and RoPE key cached as K, no V"},
        "vllm": {
            "as_written": vllm,
            "values": latent if vllm else expanded,
            "why": "its MLA kernels"
            if vllm
            else (
                f"its MLA kernels take only {' or '.join(f'{r} + {p}' for r, p in MLA_SHAPES['vllm'])}: "
                "VLLM_MLA_DISABLE=1 runs it as plain attention over expanded keys and values"
            ),
        },
        "sglang": {
            "as_written": True,
            "values": latent,
            "why": "its triton MLA backend pads any shape",
        },
    }
