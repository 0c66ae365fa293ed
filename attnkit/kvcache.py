"""KV-cache memory arithmetic: bytes per token, totals, tensor-parallel split, what fits a GPU."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from attnkit.archs.spec import AttentionSpec, MLADims
from attnkit.errors import UsageError


@dataclass(frozen=True)
class CacheDtype:
    """Storage of one cached element, plus per-(token, head) scale bytes where the format needs them.

    A "head" here is one K head or one V head (so a GQA layer has 2*Hkv scale groups per token);
    an MLA layer caches one latent vector per token, which is one group.
    """

    name: str
    bytes_per_element: float
    scale_bytes_per_group: int
    note: str


CACHE_DTYPES = {
    "fp32": CacheDtype("fp32", 4, 0, "float32"),
    "bf16": CacheDtype("bf16", 2, 0, "bfloat16"),
    "fp16": CacheDtype("fp16", 2, 0, "float16"),
    "fp8": CacheDtype("fp8", 1, 0, "fp8 e4m3/e5m2 with a per-tensor scale (vLLM, TensorRT-LLM default)"),
    "fp8-token": CacheDtype("fp8-token", 1, 4, "fp8 with one fp32 scale per token and head"),
    "int8": CacheDtype("int8", 1, 2, "int8 with one fp16 scale per token and head"),
    "int4": CacheDtype("int4", 0.5, 4, "int4 with an fp16 scale and fp16 zero-point per token and head"),
    "int2": CacheDtype("int2", 0.25, 4, "int2 with an fp16 scale and fp16 zero-point per token and head"),
    "q8_0": CacheDtype("q8_0", 34 / 32, 0, "llama.cpp's q8_0 (-ctk/-ctv): blocks of 32 int8 with an fp16 scale"),
    "q4_0": CacheDtype("q4_0", 18 / 32, 0, "llama.cpp's q4_0 (-ctk/-ctv): blocks of 32 int4 with an fp16 scale"),
}


def cache_dtype(name: str) -> CacheDtype:
    key = name.strip().lower()
    aliases = {
        "bfloat16": "bf16",
        "float16": "fp16",
        "half": "fp16",
        "float32": "fp32",
        "float": "fp32",
        "fp8_e4m3": "fp8",
        "fp8_e5m2": "fp8",
        "e4m3": "fp8",
        "f16": "fp16",
        "f32": "fp32",
    }
    key = aliases.get(key, key)
    if key not in CACHE_DTYPES:
        raise UsageError(f"unknown cache dtype {name!r}; choose from {', '.join(CACHE_DTYPES)}")
    return CACHE_DTYPES[key]


_VARIANT = re.compile(r"^(native|mha|mqa|gqa:(\d+)|mla:(\d+)\+(\d+))$")


def check_variant(variant: str) -> str:
    """The variant's spelling checked before any model is read (apply_variant checks it against the model)."""
    text = variant.strip().lower()
    if not _VARIANT.match(text):
        raise UsageError(f"unknown variant {variant!r}; use native, mha, gqa:G, mqa or mla:R+P (e.g. mla:512+64)")
    return text


def apply_variant(spec: AttentionSpec, variant: str) -> AttentionSpec:
    """The spec as it would be after a conversion: native, mha, gqa:G, mqa or mla:R+P."""
    text = check_variant(variant)
    m = _VARIANT.match(text)
    if text == "native":
        return spec
    base = dataclasses.replace(spec, mla=None)
    if text == "mha":
        return dataclasses.replace(base, num_kv_heads=spec.num_heads)
    if text == "mqa":
        return dataclasses.replace(base, num_kv_heads=1)
    if m.group(2):
        groups = int(m.group(2))
        if groups < 1 or spec.num_heads % groups:
            valid = [g for g in range(1, spec.num_heads + 1) if spec.num_heads % g == 0]
            raise UsageError(f"gqa:{groups} does not divide {spec.num_heads} query heads; valid: {valid}")
        return dataclasses.replace(base, num_kv_heads=groups)
    rank, rope = int(m.group(3)), int(m.group(4))
    if rank < 1:
        raise UsageError(f"MLA rank must be at least 1 in {variant!r}")
    nope = spec.head_dim - rope if spec.mla is None else spec.mla.qk_nope_head_dim
    mla = MLADims(
        kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=spec.v_head_dim, q_lora_rank=None
    )
    # convert mla writes DeepSeek-V3, which attends to the whole context on every layer
    full = (None,) * spec.num_layers
    return dataclasses.replace(spec, mla=mla, num_kv_heads=spec.num_heads, layer_windows=full)


def kv_heads_per_gpu(spec: AttentionSpec, tp: int) -> int:
    """KV heads held by one GPU: heads are split over ranks and replicated when tp > Hkv."""
    return max(1, -(-spec.num_kv_heads // tp))


def layer_bytes_per_token(spec: AttentionSpec, dtype: CacheDtype, tp: int = 1, layer: int = 0) -> float:
    """Bytes one token adds to one layer's cache on one GPU (tp=1: the whole model); `layer` matters only for a
    layout whose layers differ (AttentionSpec.layer_spec)."""
    spec = spec.layer_spec(layer)
    if spec.mla is not None:  # the latent is replicated on every rank
        return spec.kv_elements_per_token() * dtype.bytes_per_element + dtype.scale_bytes_per_group
    heads = kv_heads_per_gpu(spec, tp)
    return heads * (spec.head_dim + spec.v_head_dim) * dtype.bytes_per_element + 2 * heads * dtype.scale_bytes_per_group


def layer_tokens(spec: AttentionSpec, context: int) -> list[int]:
    """Tokens each layer caches for one sequence of `context` tokens: a sliding-window layer at most its window."""
    return [context if window is None else min(context, window) for window in spec.layer_windows]


def bytes_per_token(spec: AttentionSpec, dtype: CacheDtype, tp: int = 1) -> float:
    """Bytes per token over all layers, ignoring sliding windows (the cost of a short context)."""
    return sum(layer_bytes_per_token(spec, dtype, tp, layer) for layer in range(spec.num_layers))


@dataclass(frozen=True)
class LlamaCppPaging:
    """llama.cpp's cache for one sequence of `context` tokens (`-c`), as the llama.cpp that llama-cpp-python 0.3.36
    vendors (0c1e570) allocates it (src/llama-context.cpp, llama-kv-cache.cpp, llama-kv-cache-iswa.cpp):
    PAD256(context) cells on each full-attention layer; a sliding layer PAD256(min(cells, window + ubatch)), or
    every cell with `swa_full` (the CLI's --swa-full; llama-cpp-python's Llama() leaves the library default, on)
    or where llama.cpp's architecture ignores the windows (LLAMACPP_SLIDING);
    ubatch is min(context, n_batch, n_ubatch) (the CLI's 2048 and 512). A DeepSeek-V2/V3 MLA layer (deepseek2)
    caches its latent and RoPE key as K and no V (V is a view of K)."""

    ubatch: int = 512
    n_batch: int = 2048
    swa_full: bool = False

    def request_bytes(self, spec: AttentionSpec, dtype: CacheDtype, context: int, tp: int = 1) -> float:
        """Bytes of the KV buffers llama.cpp allocates for `-c context` (one sequence)."""
        cells = _pad(context)
        ubatch = min(context, self.n_batch, self.ubatch)
        sliding = spec.model_type in LLAMACPP_SLIDING and not self.swa_full
        return sum(
            (cells if window is None or not sliding else _pad(min(cells, window + ubatch)))
            * layer_bytes_per_token(spec, dtype, tp, layer)
            for layer, window in enumerate(spec.layer_windows)
        )


def _pad(cells: int) -> int:
    """llama.cpp's GGML_PAD(cells, LLAMACPP_PAD)."""
    return _cdiv(cells, LLAMACPP_PAD) * LLAMACPP_PAD


#: llama.cpp pads every cache's cell count to a multiple of this (GGML_PAD(n_ctx, 256)).
LLAMACPP_PAD = 256
#: The families of attnkit's registry whose llama.cpp architecture keeps sliding windows (src/models/gemma2.cpp,
#: gemma3.cpp); the others' windows are ignored there (Mistral converts to `llama`, whose cache is full-size;
#: phi3 turns its window off), so every layer holds every cell.
LLAMACPP_SLIDING = ("gemma2", "gemma3", "gemma3_text")


@dataclass(frozen=True)
class VllmPaging:
    """vLLM's paged cache: whole blocks of `block_size` tokens, layers grouped as its hybrid allocator groups them.

    A sliding-window layer holds its window plus the tokens in flight (`in_flight_tokens`: concurrent batches x
    max_num_batched_tokens, 2 x 8192 for `vllm serve` on an H100/H200) plus one block; vLLM sizes its pool and
    admits requests by this bound (SlidingWindowSpec.max_admission_blocks_per_request).
    """

    block_size: int = 16
    in_flight_tokens: int = 2 * 8192

    def request_bytes(self, spec: AttentionSpec, dtype: CacheDtype, context: int, tp: int = 1) -> float:
        return vllm_request_bytes(spec, dtype, context, self, tp)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vllm_request_bytes(spec: AttentionSpec, dtype: CacheDtype, context: int, paging: VllmPaging, tp: int = 1) -> float:
    """Bytes vLLM reserves for one request of `context` tokens (vllm/v1/core/kv_cache_utils.py).

    Layers are bucketed by window; every bucket is cut into groups of `group_size` layers (the smallest
    bucket, or the largest when it is under 1.5x the smallest), the last group padded; a block of any
    group costs group_size pages.
    """
    buckets: dict[int | None, list[int]] = {}  # window (None = full) -> its layers
    for layer, window in enumerate(spec.layer_windows):
        buckets.setdefault(window, []).append(layer)
    sizes = [len(layers) for layers in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < 1.5 * group_size:
        group_size = max(sizes)
    total = 0.0
    for window, layers in buckets.items():
        if window is None:
            per_group = _cdiv(context, paging.block_size)
        else:
            held = min(window - 1 + paging.in_flight_tokens, context)
            per_group = _cdiv(held, paging.block_size) + 1
        # one page size per bucket: its widest layer's (every layer of a layout vLLM serves has the same width)
        page = paging.block_size * max(layer_bytes_per_token(spec, dtype, tp, layer) for layer in layers)
        total += _cdiv(len(layers), group_size) * per_group * group_size * page
    return total


#: An engine's cache accounting (kv_bytes' `paging`).
Paging = VllmPaging | LlamaCppPaging


def kv_bytes(
    spec: AttentionSpec, dtype: CacheDtype, context: int, batch: int, tp: int = 1, paging: Paging | None = None
) -> float:
    """Whole KV cache for `batch` sequences of `context` tokens (per GPU when tp > 1).

    paging None: the tokens each layer keeps (a sliding layer its window); else what the engine reserves
    (VllmPaging, LlamaCppPaging).
    """
    if paging is not None:
        return batch * paging.request_bytes(spec, dtype, context, tp)
    return batch * sum(
        held * layer_bytes_per_token(spec, dtype, tp, layer) for layer, held in enumerate(layer_tokens(spec, context))
    )


#: The longest context max_context searches (2**40 tokens): reaching it means sliding windows cap the cache.
MAX_CONTEXT = 1 << 40


def max_context(
    spec: AttentionSpec,
    dtype: CacheDtype,
    batch: int,
    budget: float,
    tp: int = 1,
    limit: int = MAX_CONTEXT,
    paging: Paging | None = None,
) -> int:
    """Largest context up to `limit` whose cache fits `budget` bytes (binary search; cache size is monotone)."""

    def fits(context: int) -> bool:
        return kv_bytes(spec, dtype, context, batch, tp, paging) <= budget

    if budget <= 0 or not fits(1):
        return 0
    lo, hi = 1, limit
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch(
    spec: AttentionSpec, dtype: CacheDtype, context: int, budget: float, tp: int = 1, paging: Paging | None = None
) -> int:
    per_sequence = kv_bytes(spec, dtype, context, 1, tp, paging)
    return int(budget // per_sequence) if budget > 0 else 0
