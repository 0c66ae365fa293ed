"""What the engine tier serves (tests/test_engines.py), kept importable without the engines so the support matrix
(tests/test_support_matrix.py) can list it."""

from __future__ import annotations

from pathlib import Path

CALIB = str(Path(__file__).parent / "data" / "prose" / "calib.txt")
FAST_CALIB = ["--calib", CALIB, "--calib-tokens", "1024", "--calib-seq-len", "512"]
#: output -> (source, attnkit arguments after SOURCE OUT, whether vLLM serves it with its own MLA/attention kernels)
OUTPUTS = {
    "mqa-merge": ("smollm2", ["convert", "mqa", "{src}", "{out}", "--method", "merge", *FAST_CALIB], True),
    "gqa-mean": ("smollm2", ["convert", "gqa", "{src}", "{out}", "--kv-heads", "1", "--method", "mean"], True),
    "mla-half": ("smollm2", ["convert", "mla", "{src}", "{out}", "--kv-budget", "0.5", *FAST_CALIB], False),
    "mla-512+64": (
        "smollm2",
        ["convert", "mla", "{src}", "{out}", "--kv-lora-rank", "512", "--rope-dim", "64", *FAST_CALIB],
        True,
    ),
    "qknorm": ("smollm2", ["retrofit", "qknorm", "{src}", "{out}", *FAST_CALIB], True),
    "qknorm-mla-512+64": (
        "qwen3",
        ["convert", "mla", "{src}", "{out}", "--kv-lora-rank", "512", "--rope-dim", "64", *FAST_CALIB],
        True,
    ),
    "gemma3-export": ("gemma3-gguf", ["export", "{src}", "{out}"], True),
}
#: source name -> (family, what it is)
SOURCES = {
    "smollm2": ("llama", "SmolLM2-135M-Instruct"),
    "qwen3": ("qwen3", "the Qwen3 `retrofit qknorm` makes of SmolLM2"),
    "gemma3-gguf": ("gemma3", "Gemma 3 270M (Q4_K_M GGUF)"),
}
#: output -> the family attnkit writes
RESULT_FAMILY = {
    "mqa-merge": "llama",
    "gqa-mean": "llama",
    "mla-half": "deepseek_v3",
    "mla-512+64": "deepseek_v3",
    "qknorm": "qwen3",
    "qknorm-mla-512+64": "deepseek_v3",
    "gemma3-export": "gemma3",
}
