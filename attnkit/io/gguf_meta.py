"""GGUF metadata without torch: a Hugging Face style config and tensor sizes from the header."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError

#: GGUF `general.architecture` -> Hugging Face `model_type`.
GGUF_ARCH_TO_MODEL_TYPE = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
    "olmo2": "olmo2", "gpt2": "gpt2", "gptneox": "gpt_neox", "bert": "bert",
    "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss",
}

#: GGUF key suffix (after "<arch>.") -> config key.
GGUF_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank",
    "rope.freq_base": "rope_theta",
    "rope.dimension_count": "rope_dimension_count",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "vocab_size": "vocab_size",
    "expert_count": "num_local_experts",
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int
    quant_type: str


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except FileNotFoundError:
        raise AttnkitError(f"{path}: file not found") from None
    except Exception as exc:  # gguf raises ValueError/struct.error/etc. on bad files
        raise AttnkitError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """A config dict (HF key names) and the tensor list of a GGUF file."""
    path = Path(path)
    reader = _open(path)
    fields = reader.fields

    def value(key: str):
        field = fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise AttnkitError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCH_TO_MODEL_TYPE))}"
        )
    config: dict = {"model_type": GGUF_ARCH_TO_MODEL_TYPE[arch], "gguf_architecture": arch}
    for suffix, key in GGUF_KEYS.items():
        v = value(f"{arch}.{suffix}")
        if v is not None:
            config[key] = v
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    tensors = [
        GGUFTensor(t.name, tuple(int(x) for x in t.shape), int(t.n_elements), int(t.n_bytes), t.tensor_type.name)
        for t in reader.tensors
    ]
    names = {t.name for t in tensors}
    config["tie_word_embeddings"] = "output.weight" not in names
    return config, tensors
