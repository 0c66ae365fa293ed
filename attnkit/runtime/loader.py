"""Load any supported checkpoint (folder, .safetensors, .gguf, hub id) as a causal LM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnkit.errors import AttnkitError, UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")
#: kvmem's short spellings, accepted wherever a --dtype names a torch dtype.
DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def dtype_name(dtype: str) -> str:
    """A --dtype as torch names it (bf16 -> bfloat16, fp16 -> float16, fp32 -> float32; auto stays)."""
    name = str(dtype).strip().lower()
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UsageError(
            f"unknown --dtype {dtype!r}; choose from auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)"
        )
    return name


@dataclass
class LoadedModel:
    """A model ready to run: in eval mode, on `device`, with its tokenizer (None when the checkpoint has none)."""

    model: Any
    tokenizer: Any
    checkpoint: Any
    device: Any
    dtype: Any


def resolve_device(device: str):
    """auto | cpu | cuda | cuda:N | mps -> torch.device (auto: CUDA, then MPS, then CPU)."""
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown --device {device!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise AttnkitError(f"--device {device}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise AttnkitError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise AttnkitError("--device mps: MPS is not available")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"unknown --device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    return dev


def cpu_has_bf16() -> bool:
    """Whether torch's CPU kernels (oneDNN) have bf16 instructions here: avx512_bf16 or AMX."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def native_dtype(device, config: dict) -> str:
    """The dtype to run a checkpoint in where speed matters more than the last digit: its stored 16-bit dtype where
    the device computes it natively (a CUDA GPU; bfloat16 on a CPU with bf16 instructions), else float32."""
    stored = config.get("dtype") or config.get("torch_dtype")
    if stored not in ("bfloat16", "float16") or device.type == "mps":
        return "float32"
    if device.type == "cpu" and (stored != "bfloat16" or not cpu_has_bf16()):
        return "float32"
    return stored


def resolve_dtype(dtype: str, device, config: dict):
    """auto: float32 on CPU, the stored 16-bit dtype (else float32) on accelerators."""
    import torch

    dtype = dtype_name(dtype)
    if dtype != "auto":
        return getattr(torch, dtype)
    stored = config.get("dtype") or config.get("torch_dtype")
    if device.type != "cpu" and stored in ("bfloat16", "float16"):
        return getattr(torch, stored)
    return torch.float32


def load_tokenizer(root):
    """The checkpoint folder's tokenizer, or None when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception:  # noqa: BLE001 - a checkpoint without tokenizer files is still usable with token ids
        return None


def run_source(ref, *, dequantize: bool = True, check=None):
    """`ref` opened to run (attnkit.io.source.open_source: resolved, refused, complete; a GGUF file dequantized
    through the cache unless `dequantize` is False), or the Source as given when it was opened already. Families
    outside the registry pass on to transformers' own loading report; the NaN/Inf check is left to the runner:
    load_model checks the parameters it loaded (no extra read), a layer-streamed model scans the files before it
    is built (Source.check_finite), since its layers are read only as the run reaches them. `check(arch, spec,
    config)`: the caller's refusals of a registry family, before anything is dequantized."""
    from attnkit.io.source import Source, open_source

    if isinstance(ref, Source):
        return ref
    return open_source(str(ref), "run", check, registry=False, scan=False, dequantize=dequantize)


def check_models(refs: list[str], device: str, dtype: str, layer_stream: str = "auto", check=None) -> list:
    """--device, --dtype and every model reference opened (run_source: files, config, completeness; hub ids
    downloaded, GGUF files dequantized) before the first model is loaded, so the second of two models cannot
    fail after the first one ran; returns their Sources, for open_model. With `layer_stream` "always" a GGUF file
    stays as its header says: it cannot be streamed, and open_model refuses it before anything is dequantized.
    `check(ref, arch, spec, config)`: the caller's refusals of each model, on its config (a GGUF file's header)."""
    import functools

    dtype_name(dtype)
    resolve_device(device)
    return [
        run_source(ref, dequantize=layer_stream != "always", check=check and functools.partial(check, ref))
        for ref in refs
    ]


def free_memory(device) -> int | None:
    """Free memory of a device (a torch.device): CPU MemAvailable, CUDA what torch reports free; None where it
    cannot be read (MPS)."""
    import os

    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def register_layouts() -> None:
    """attnkit's own model types (attnkit.modeling) known to transformers' Auto classes, before any model of a
    checkpoint is built (whole or layer by layer)."""
    import attnkit.modeling  # noqa: F401


def ready(model) -> None:
    """What every builder does to a model before it runs it (load_model, attnkit.runtime.streaming): eval mode,
    the config's soft-caps that stock transformers ignores for its family, and MLA's narrower values through the
    fused CPU kernel rather than the math path (the same figures both ways, bit for bit)."""
    from attnkit.runtime.capped_attention import apply_softcaps
    from attnkit.runtime.padded_attention import use_padded_sdpa

    model.eval()
    apply_softcaps(model)
    use_padded_sdpa(model)


def load_model(
    ref,
    *,
    device: str = "auto",
    dtype: str = "auto",
    device_map: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> LoadedModel:
    """`ref` (a model reference, or a Source opened already: run_source) loaded with AutoModelForCausalLM; a GGUF
    file from its dequantized cache folder. The loaded parameters are checked for NaN and Inf (no extra read of
    the files) and transformers' loading report for weights it would make up. transformers' own progress bars
    are turned off: attnkit's commands show theirs (attnkit.progress)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from attnkit.io.finite import is_finite

    register_layouts()
    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    src = run_source(ref)
    ref, ckpt = src.ref, src.ckpt
    torch_dtype = resolve_dtype(dtype, dev, ckpt.config)
    # use_kernels=False: transformers 5 (which requires the `kernels` package) otherwise swaps layers and functions
    # for hub kernels it downloads at run time (on CUDA, in training mode: Llama's rotary), so an offline run
    # fails and numbers would depend on code outside the checkpoint
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, use_kernels=False)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(ckpt.root), output_loading_info=True, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc) or "does not recognize" in str(exc):
            raise AttnkitError(f"{ref}: {ckpt.model_type} is not a supported causal language model") from None
        raise AttnkitError(f"{ref}: cannot load model ({exc})") from None
    except Exception as exc:  # transformers raises many types for checkpoints it cannot build
        raise AttnkitError(f"{ref}: cannot load model ({type(exc).__name__}: {exc})") from None
    missing = sorted(info["missing_keys"])
    if missing:  # transformers would run them with random values
        raise AttnkitError(
            f"{ref}: incomplete checkpoint: {len(missing)} weight(s) the model needs are missing, e.g. {missing[0]!r}"
        )
    bad = next((name for name, p in model.named_parameters() if not is_finite(p.detach())), None)
    if bad is not None:
        raise AttnkitError(f"{ref}: tensor {bad!r} holds NaN or Inf")
    if device_map is None:
        model = model.to(dev)
    tokenizer = load_tokenizer(ckpt.root)
    ready(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        checkpoint=ckpt,
        device=next(model.parameters()).device if device_map else dev,
        dtype=torch_dtype,
    )


def unwrap(model):
    """The nn.Module inside a LoadedModel (or the module itself)."""
    return model.model if isinstance(model, LoadedModel) else model
