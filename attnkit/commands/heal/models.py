"""The models of a heal run: accelerate's Accelerator on the one resolved --device, the teacher and the student
loaded on it in fp32, and their memory handed back when the teacher leaves."""

from __future__ import annotations

from attnkit.commands.heal.output import check_names, stored_layout
from attnkit.runtime import load_model
from attnkit.runtime.loader import LoadedModel


def accelerator_for(device):
    """accelerate's Accelerator on `device` (the torch.device --device names): a CUDA GPU trains with bf16
    autocast (cuda:N chooses it), MPS and the CPU in fp32."""
    import torch
    from accelerate import Accelerator

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    return Accelerator(cpu=device.type == "cpu", mixed_precision="bf16" if device.type == "cuda" else "no")


def load_models(run, student: bool = True) -> tuple:
    """(teacher, student or None) of a HealRun in fp32 on the process's device; the teacher frozen, the student's
    names checked."""

    acc, pair = run.acc, run.pair
    what = "the teacher and the student" if student else "the teacher"
    run.log(f"loading {what} on {acc.device} ({acc.num_processes} process(es))")
    teacher = load_model(str(pair.teacher.root), device=str(acc.device), dtype="float32").model
    for p in teacher.parameters():
        p.requires_grad_(False)
    if not student:
        return teacher, None
    model = load_model(str(pair.student.root), device=str(acc.device), dtype="float32").model
    check_names(model, stored_layout(pair.student.ckpt))
    return teacher, model


def as_loaded(model, run) -> LoadedModel:
    """A model heal holds (an nn.Module in eval mode) as a LoadedModel with the teacher's tokenizer, for scoring."""
    import torch

    return LoadedModel(
        model=model, tokenizer=run.plan.tokenizer, checkpoint=None, device=run.acc.device, dtype=torch.float32
    )


def release_memory() -> None:
    """Hand a freed model's memory back (the garbage collector, then the C heap)."""
    import gc

    from attnkit.runtime.streaming import trim_heap

    gc.collect()
    trim_heap()
