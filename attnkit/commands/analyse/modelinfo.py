"""Config, attention spec and weight sizes of a model reference, from headers and config only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnkit.archs.spec import AttentionSpec, attention_spec
from attnkit.presets import find_preset

if TYPE_CHECKING:
    from attnkit.io.checkpoint import Checkpoint

WEIGHT_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
_TORCH_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def weight_dtype_name(name: str) -> str:
    """--weight-dtype in kvmem's spelling; torch's names (bfloat16, float16, float32) are accepted too."""
    key = name.strip().lower()
    key = _TORCH_DTYPE_NAMES.get(key, key)
    if key not in WEIGHT_DTYPE_BYTES:
        from attnkit.errors import UsageError

        raise UsageError(f"unknown --weight-dtype {name!r}; choose from {', '.join(WEIGHT_DTYPE_BYTES)}")
    return key


@dataclass
class ModelInfo:
    ref: str
    kind: str  # preset | folder | safetensors | gguf | config | hub
    config: dict
    spec: AttentionSpec
    parameters: int
    weight_bytes: float | None  # bytes as stored, when known from headers
    parameters_origin: str  # headers | gguf | preset | hub | estimate
    weight_dtype: str
    source: str | None = None  # preset attribution or hub repo id
    tensor_names: tuple[str, ...] = ()

    def weights_bytes_as(self, dtype: str | None) -> float:
        """Weight bytes in `dtype`, or as stored when dtype is None and headers give it."""
        if dtype is None and self.weight_bytes is not None:
            return self.weight_bytes
        return self.parameters * WEIGHT_DTYPE_BYTES[dtype or self.weight_dtype]


def config_weight_dtype(config: dict) -> str:
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return _TORCH_DTYPE_NAMES.get(name, "bf16")


def model_info(ref: str, *, use_presets: bool = True) -> ModelInfo:
    """Describe `ref` without loading tensors (headers only; hub: config + header metadata)."""
    preset = find_preset(ref) if use_presets else None
    if preset is not None:
        return ModelInfo(
            ref=ref,
            kind="preset",
            config=preset.config,
            spec=attention_spec(preset.config),
            parameters=preset.parameters,
            weight_bytes=None,
            parameters_origin="preset",
            weight_dtype=preset.weight_dtype,
            source=f"{preset.source} ({preset.url})",
        )
    from attnkit.io.resolve import resolve  # presets need no file reading

    if use_presets:
        _check_not_a_typo(ref)
    ckpt = resolve(ref, need_weights=False)
    spec = attention_spec(ckpt.config)
    params, nbytes, origin, names = _weights(ckpt, spec)
    return ModelInfo(
        ref=ref,
        kind=ckpt.kind,
        config=ckpt.config,
        spec=spec,
        parameters=params,
        weight_bytes=nbytes,
        parameters_origin=origin,
        weight_dtype=config_weight_dtype(ckpt.config),
        source=ckpt.repo_id,
        tensor_names=names,
    )


def _check_not_a_typo(ref: str) -> None:
    """A name without '/' that is no file but close to a preset is refused before any hub request."""
    from pathlib import Path

    from attnkit.errors import UsageError
    from attnkit.presets import suggest

    if "/" in ref or Path(ref).expanduser().exists():
        return
    close = suggest(ref)
    if close is not None:
        raise UsageError(
            f"{ref!r} is neither a preset nor a file or folder; did you mean {close}? "
            "(attnkit presets lists the presets)"
        )


def _weights(ckpt: Checkpoint, spec: AttentionSpec) -> tuple[int, float | None, str, tuple[str, ...]]:
    if ckpt.gguf_file is not None:
        from attnkit.io.gguf_meta import read_gguf

        _, tensors = read_gguf(ckpt.gguf_file)
        return sum(t.numel for t in tensors), sum(t.nbytes for t in tensors), "gguf", tuple(t.name for t in tensors)
    files = ckpt.weight_files
    if ckpt.kind == "hub":
        from attnkit.io.checkpoint import safetensors_files

        files = safetensors_files(ckpt.root) if ckpt.root else []
        if not files:
            from attnkit.io.hub import hub_parameter_count

            count = hub_parameter_count(ckpt.repo_id, ckpt.revision)
            if count is not None:
                return count, None, "hub", ()
    if files:
        import dataclasses

        from attnkit.archs import get_arch
        from attnkit.io.complete import checked_weights

        infos, _ = checked_weights(dataclasses.replace(ckpt, weight_files=files), get_arch(spec.model_type), spec)
        return (
            sum(i.numel for i in infos.values()),
            float(sum(i.nbytes for i in infos.values())),
            "headers",
            tuple(infos),
        )
    from attnkit.param_count import estimate_parameters

    return estimate_parameters(ckpt.config, spec), None, "estimate", ()
