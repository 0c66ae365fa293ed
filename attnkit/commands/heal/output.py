"""Write the healed student: the student's own tensor names, shapes and dtypes, config and side files copied byte
for byte, an attnkit.json manifest; checked, then renamed into place (attnkit.io.writer.OutputDir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from attnkit.errors import AttnkitError

#: safetensors dtype code -> torch dtype name.
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def stored_layout(student_ckpt) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of every tensor in the student's checkpoint."""
    from attnkit.io.safetensors_header import read_headers

    return {name: (tuple(info.shape), info.dtype) for name, info in read_headers(student_ckpt.weight_files).items()}


def check_names(model, layout: dict) -> None:
    """Every stored tensor is a parameter or buffer of the loaded model under the same name and shape."""
    state = model.state_dict()
    for name, (shape, _dtype) in layout.items():
        if name not in state:
            raise AttnkitError(f"the student's tensor {name!r} is not a parameter of the loaded model; "
                               "cannot write it back")
        if tuple(state[name].shape) != shape:
            raise AttnkitError(f"the student's tensor {name!r} loads with shape {list(state[name].shape)}, "
                               f"stored {list(shape)}")


def write_healed(model, student_ckpt, out: Path, overwrite: bool, sources: list[Path], max_shard_bytes: int,
                 manifest: Callable[[Path], dict]) -> Path:
    """Write `model`'s tensors under the student's names and dtypes to `out`; manifest(temp folder) returns the
    attnkit.json document (it may load the written model to score it) before the folder is committed."""
    import torch

    from attnkit.io.writer import OutputDir, ShardedWriter, copy_side_files, verify_output

    layout = stored_layout(student_ckpt)
    state = model.state_dict()
    root = Path(student_ckpt.root)
    with OutputDir(Path(out), overwrite=overwrite, sources=sources) as od:
        writer = ShardedWriter(od.path, max_shard_bytes)
        for name, (_shape, code) in layout.items():
            tensor = state[name].detach()
            writer.add(name, tensor.to(getattr(torch, DTYPES[code])) if code in DTYPES else tensor)
        writer.finish()
        shutil.copyfile(root / "config.json", od.path / "config.json")
        copy_side_files(root, od.path)
        verify_output(od.path, {name: shape for name, (shape, _code) in layout.items()})
        doc = manifest(od.path)
        (od.path / "attnkit.json").write_text(json.dumps(doc, indent=2) + "\n")
        return od.commit()
