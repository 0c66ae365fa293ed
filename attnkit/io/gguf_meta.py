"""GGUF metadata without torch: a Hugging Face style config and tensor sizes from the header."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.gguf_header import GGUFHeader, parse_gguf_header

#: GGUF `general.architecture` -> Hugging Face `model_type`.
GGUF_ARCH_TO_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "gpt2": "gpt2",
    "gptneox": "gpt_neox",
    "bert": "bert",
    "deepseek2": "deepseek_v2",
    "gpt-oss": "gpt_oss",
}

#: Attention tensors every block of a GGUF architecture holds (llama.cpp's names, without ".weight").
BLOCK_TENSORS = {
    "phi3": ("attn_qkv", "attn_output"),
    "gpt2": ("attn_qkv", "attn_output"),
    "gptneox": ("attn_qkv", "attn_output"),
    "deepseek2": ("attn_kv_a_mqa", "attn_output"),
}
SEPARATE_QKV = ("attn_q", "attn_k", "attn_v", "attn_output")

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


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """A config dict (HF key names) and the tensor list of a GGUF file, its values checked like any config's."""
    from attnkit.archs import get_arch
    from attnkit.archs.validate import check_config

    path = Path(path)
    header = parse_gguf_header(path)
    fields = header.fields
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in GGUF_ARCH_TO_MODEL_TYPE:
        raise AttnkitError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCH_TO_MODEL_TYPE))}"
        )
    config: dict = {"model_type": GGUF_ARCH_TO_MODEL_TYPE[arch], "gguf_architecture": arch}
    for suffix, key in GGUF_KEYS.items():
        v = fields.get(f"{arch}.{suffix}")
        if v is not None:
            config[key] = _one_value(path, f"{arch}.{suffix}", v)
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.array_lengths:
        config["vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    try:
        check_config(get_arch(config["model_type"]), config)
    except AttnkitError as exc:
        raise AttnkitError(f"{path}: {exc}") from None
    if "head_dim" not in config:
        if config["hidden_size"] % config["num_attention_heads"]:
            raise AttnkitError(
                f"{path}: embedding_length {config['hidden_size']} is not a multiple of its "
                f"{config['num_attention_heads']} heads and no key_length gives the head size"
            )
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]  # llama.cpp's default
    tensors = _tensors(path, header)
    _check_blocks(path, {t.name: t.shape for t in tensors}, arch, config)
    config["tie_word_embeddings"] = "output.weight" not in {t.name for t in tensors}
    return config, tensors


def _one_value(path: Path, key: str, value):
    """A per-layer array (some GGUF files store head counts per layer) must repeat one value; scalars pass."""
    if not isinstance(value, list):
        return value
    if not value or any(v != value[0] for v in value):
        raise AttnkitError(f"{path}: {key} differs between layers ({len(value)} values); not supported")
    return value[0]


def _check_blocks(path: Path, shapes: dict[str, tuple], arch: str, config: dict) -> None:
    """The token embedding and the attention tensors of every block blk.0 .. blk.{layers-1} are present, and
    separate q/k/v/output tensors have the shapes the head counts imply (GGUF dims are [in, out])."""
    if "token_embd.weight" not in shapes:
        raise AttnkitError(f"{path}: incomplete GGUF (no token_embd.weight)")
    layers = config["num_hidden_layers"]
    blocks = {name.split(".")[1] for name in shapes if name.startswith("blk.") and name.count(".") > 1}
    missing = [i for i in range(layers) if str(i) not in blocks]
    if missing:
        raise AttnkitError(
            f"{path}: incomplete GGUF (block_count is {layers} but block blk.{missing[0]} has no "
            f"tensors; {len(missing)} block(s) missing)"
        )
    roles = BLOCK_TENSORS.get(arch, SEPARATE_QKV)
    d, dim = config["hidden_size"], config["head_dim"]
    want = {
        "attn_q": (d, config["num_attention_heads"] * dim),
        "attn_k": (d, config["num_key_value_heads"] * dim),
        "attn_v": (d, config["num_key_value_heads"] * dim),
        "attn_output": (config["num_attention_heads"] * dim, d),
    }
    for i in range(layers):
        for role in roles:
            name = f"blk.{i}.{role}.weight"
            if name not in shapes:
                raise AttnkitError(f"{path}: incomplete GGUF (no {name})")
            if roles is SEPARATE_QKV and tuple(shapes[name]) != want[role]:
                raise AttnkitError(
                    f"{path}: tensor {name} has dims {list(shapes[name])} but the header's head "
                    f"counts imply {list(want[role])}"
                )


def _tensors(path: Path, header: GGUFHeader) -> list[GGUFTensor]:
    """Tensor infos with byte sizes; errors when a type is unknown or data runs past the end of the file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    tensors = []
    for name, dims, ggml_type, offset in header.tensors:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise AttnkitError(f"{path}: tensor {name!r} has unknown GGML type {ggml_type}") from None
        numel = math.prod(dims)
        nbytes = numel // block * type_size
        if header.data_start + offset + nbytes > size:
            raise AttnkitError(f"{path}: tensor {name!r} runs past the end of the file (truncated GGUF)")
        tensors.append(GGUFTensor(name, tuple(dims), numel, nbytes, qtype.name))
    return tensors


#: tokenizer.ggml.model values transformers builds a tokenizer from, and the GGUF architectures whose
#: sentencepiece vocabulary it orders by file position (no scores needed).
TOKENIZER_MODELS = ("gpt2", "llama", "t5", "gemma4")
POSITION_ORDERED = ("gemma", "gemma2", "gemma3")


def check_gguf_tokenizer(path: str | Path) -> None:
    """The GGUF file holds what transformers builds its tokenizer from (checked on the header, before anything is
    dequantized): tokenizer.ggml.model of a kind it knows, the token list, and merges or the scores that order
    them (sentencepiece and unigram vocabularies; Gemma's are ordered by position)."""
    path = Path(path)
    header = parse_gguf_header(path)
    fields, arrays = header.fields, header.array_lengths
    kind = fields.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise AttnkitError(
            f"{path}: its tokenizer.ggml.model is {kind!r}; transformers builds a tokenizer from "
            f"{', '.join(TOKENIZER_MODELS)}"
        )
    if "tokenizer.ggml.tokens" not in arrays:
        raise AttnkitError(f"{path}: has no token list (tokenizer.ggml.tokens): its tokenizer cannot be built")
    if kind == "t5" and "tokenizer.ggml.scores" not in arrays:
        raise AttnkitError(f"{path}: its unigram (t5) tokenizer has no tokenizer.ggml.scores: it cannot be built")
    by_position = kind == "llama" and fields.get("general.architecture") in POSITION_ORDERED
    if not ({"tokenizer.ggml.merges", "tokenizer.ggml.scores"} & set(arrays) or by_position):
        raise AttnkitError(
            f"{path}: has neither tokenizer.ggml.merges nor tokenizer.ggml.scores: its {kind} tokenizer's merges "
            "cannot be built"
        )
