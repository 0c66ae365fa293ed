"""The healed student's tensors: the student's own names, shapes and dtypes (written by attnkit.commands.write)."""

from __future__ import annotations

from attnkit.errors import AttnkitError
from attnkit.io.safetensors_header import read_headers

#: safetensors dtype code -> torch dtype name.
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def stored_layout(student_ckpt) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of every tensor in the student's checkpoint."""

    return {name: (tuple(info.shape), info.dtype) for name, info in read_headers(student_ckpt.weight_files).items()}


def check_names(model, layout: dict) -> None:
    """Every stored tensor is a parameter or buffer of the loaded model under the same name and shape."""
    state = model.state_dict()
    for name, (shape, _dtype) in layout.items():
        if name not in state:
            raise AttnkitError(
                f"the student's tensor {name!r} is not a parameter of the loaded model; cannot write it back"
            )
        if tuple(state[name].shape) != shape:
            raise AttnkitError(
                f"the student's tensor {name!r} loads with shape {list(state[name].shape)}, stored {list(shape)}"
            )


def healed_tensors(model, student_ckpt, writer) -> dict[str, tuple]:
    """Add `model`'s tensors to the writer under the student's stored names and dtypes; name -> shape."""
    import torch

    layout = stored_layout(student_ckpt)
    state = model.state_dict()
    for name, (_shape, code) in layout.items():
        tensor = state[name].detach()
        writer.add(name, tensor.to(getattr(torch, DTYPES[code])) if code in DTYPES else tensor)
    return {name: shape for name, (shape, _code) in layout.items()}
