"""`retrofit qknorm`'s request and its checks before any tensor is read (the method, the calibration text, the
source family and its shape), and the head size the result gets."""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.commands.retrofit.common import check_source
from attnkit.commands.rewrite import RewriteRequest
from attnkit.engines.targets import vllm_cpu_head_size_ok
from attnkit.errors import AttnkitError, UsageError
from attnkit.ops.qknorm import METHODS
from attnkit.units import check_bounds

#: Families whose checkpoints become a stock Qwen3 (the Llama layout, optional q/k/v biases).
SOURCES = ("llama", "mistral", "qwen2")
#: Most --steps of the kl fit per layer (its default is 150).
MAX_STEPS = 100_000


@dataclass(kw_only=True)
class QKNormRequest(RewriteRequest):
    """retrofit qknorm: how the norm is made (attnkit.ops.qknorm.METHODS) and the anchor method's head size."""

    method: str = "auto"
    steps: int = 150
    head_dim: int | None = None  # anchor: the new head size (default: default_head_dim)


def default_head_dim(dim: int) -> int:
    """The anchor method's head size: D when vLLM's CPU attention kernels run it (the anchor takes the weakest
    RoPE pair's place and the KV cache keeps its size), else the smallest >= D + 2 that they run."""

    if vllm_cpu_head_size_ok(dim):
        return dim
    new = dim + 2
    while not vllm_cpu_head_size_ok(new):
        new += 2
    return new


def check_request(req: QKNormRequest):
    if req.method not in METHODS:
        raise UsageError(f"unknown --method {req.method!r}; choose from {', '.join(METHODS)}")
    if req.method in ("auto", "anchor", "bias", "kl", "lsq", "scalar") and not req.calib:
        raise UsageError(f"--method {req.method} fits on the model's activations: pass --calib FILE")
    if req.head_dim is not None and req.method not in ("auto", "anchor"):
        raise UsageError("--head-dim applies to --method anchor (and auto, when it chooses the anchor)")
    check_bounds("--steps", req.steps, 0, MAX_STEPS)

    def check(arch, spec, config) -> None:
        mt = spec.model_type
        if spec.mla is not None:
            raise AttnkitError(f"{mt}: MLA attention has no per-head q/k to normalise; retrofit qknorm does not apply")
        if spec.qk_norm != "none":
            raise UsageError(f"{mt} already has QK-norm ({spec.qk_norm}); nothing to retrofit")
        if arch.family not in SOURCES:
            raise AttnkitError(f"retrofit qknorm supports {', '.join(SOURCES)} checkpoints, not {mt}")
        if config.get("mlp_bias"):
            raise AttnkitError(f"{mt}: MLP biases (mlp_bias) have no Qwen3 equivalent")
        if spec.partial_rotary_factor != 1.0:
            raise AttnkitError(f"{mt}: partial RoPE ({spec.partial_rotary_factor}) has no Qwen3 equivalent")
        if spec.head_dim % 2:
            raise AttnkitError(f"{mt}: odd head_dim {spec.head_dim}")
        if req.head_dim is not None and (req.head_dim % 2 or not spec.head_dim <= req.head_dim <= 4 * spec.head_dim):
            raise UsageError(
                f"--head-dim must be even and between the source's {spec.head_dim} and "
                f"{4 * spec.head_dim}, got {req.head_dim}"
            )

    return check_source(req, req.method != "pad", check)


def new_head_dim(req: QKNormRequest, method: str, dim: int) -> int:
    """The result's head size for `method` (auto chooses one of the others)."""
    if method == "pad":
        return dim + 2
    if method == "anchor":
        return req.head_dim or default_head_dim(dim)
    return dim
