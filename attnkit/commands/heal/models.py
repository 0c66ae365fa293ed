"""The models of a heal run: accelerate's Accelerator on the one resolved --device and --precision, the teacher
and the student loaded on it in fp32, and their memory handed back when the teacher leaves."""

from __future__ import annotations

from attnkit.commands.heal.output import check_names, stored_layout
from attnkit.errors import UsageError
from attnkit.runtime import load_model
from attnkit.runtime.loader import LoadedModel, cpu_has_bf16


def precision_for(device, precision: str) -> str:
    """accelerate's mixed_precision for --precision on `device`: "bf16" (autocast) or "no" (fp32). auto is bf16
    on a CUDA GPU only; bf16 needs a CUDA GPU or a CPU with bf16 instructions (UsageError otherwise)."""
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return "no"
    if device.type == "cpu" and not cpu_has_bf16():
        raise UsageError("--precision bf16: this CPU has no bf16 instructions (avx512_bf16 or AMX); use fp32")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--precision bf16 runs on a CUDA GPU or the CPU, not {device.type}; use fp32")
    return "bf16"


def accelerator_for(device, mixed_precision: str):
    """accelerate's Accelerator on `device` (the torch.device --device names) with `mixed_precision` (precision_for:
    the forward passes under bf16 autocast, or fp32)."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    if AcceleratorState._shared_state.get("_mixed_precision", mixed_precision) != mixed_precision:
        # an earlier heal in this process set another precision; accelerate keeps one per process
        AcceleratorState._reset_state()
    return Accelerator(cpu=device.type == "cpu", mixed_precision=mixed_precision)


def load_models(run, student: bool = True) -> tuple:
    """(teacher, student or None) of a HealRun in fp32 on the process's device; the teacher frozen, the student's
    names checked."""

    acc, pair = run.acc, run.pair
    what = "the teacher and the student" if student else "the teacher"
    run.log(f"loading {what} on {acc.device} ({acc.num_processes} process(es))")
    teacher = load_model(pair.teacher, device=str(acc.device), dtype="float32").model
    for p in teacher.parameters():
        p.requires_grad_(False)
    if not student:
        return teacher, None
    model = load_model(pair.student, device=str(acc.device), dtype="float32").model
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
