"""heal --fsdp: the student sharded over the processes with FSDP2 (torch.distributed.fsdp.fully_shard), each
decoder layer one unit, then the whole model. Every parameter becomes a DTensor split along its first dimension,
so weights, gradients and AdamW's moments each take 1/world of the memory on each process; a layer's weights are
gathered for its forward and backward and freed after.

accelerate starts the processes and their group (gloo on CPU, NCCL on GPUs); its own FSDP plugin is not used
because accelerate applies it only to GPU runs. Every function here that gathers is a collective: all processes
call it, in the same order.
"""

from __future__ import annotations

from attnkit.errors import AttnkitError


def shard(model) -> None:
    """Shard `model` in place: every decoder layer (the modules in transformers' `_no_split_modules` classes), then
    the transformers model, whose unit holds the embeddings, the final norm and the output head. With LoRA the
    peft wrapper stays outside: validation calls the transformers model directly, so it must be the root."""
    from torch.distributed.fsdp import fully_shard

    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    units = set(getattr(root, "_no_split_modules", None) or [])
    layers = [m for m in root.modules() if type(m).__name__ in units]
    if not layers:
        raise AttnkitError(f"--fsdp: {type(root).__name__} names no decoder-layer class to shard by")
    for layer in layers:
        fully_shard(layer)
    fully_shard(root)


def is_sharded(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor):
    """The whole value of a parameter or state tensor (gathered from every process when sharded), on the CPU."""
    tensor = tensor.detach()
    return (tensor.full_tensor() if is_sharded(tensor) else tensor).to("cpu", copy=True)


def load_full(param, value) -> None:
    """Set `param` (sharded or not) to the whole tensor `value`, which every process holds."""
    from torch.distributed.tensor import distribute_tensor

    if is_sharded(param):
        param.data.copy_(distribute_tensor(value.to(param.device), param.device_mesh, param.placements))
    else:
        param.data.copy_(value.to(param.device))


def clip_grad_norm(params: list, max_norm: float) -> float:
    """Scale the gradients so that their global L2 norm is at most `max_norm` (the norm over every process's
    shards); returns the norm before clipping."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if is_sharded(g) else g for g in grads]
    squares = torch.zeros((), dtype=torch.float64, device=local[0].device if local else "cpu")
    for g in local:
        squares += g.double().pow(2).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return norm


def full_optimizer_state(state_dict: dict) -> dict:
    """An optimizer's state_dict with its sharded tensors gathered whole (CPU): the same layout a run without
    --fsdp saves, so a checkpoint resumes with or without it."""
    return {
        "state": {i: {k: full(v) for k, v in s.items()} for i, s in state_dict["state"].items()},
        "param_groups": state_dict["param_groups"],
    }


def shard_optimizer_state(saved: dict, params: list) -> dict:
    """`saved` (whole tensors) laid out as the sharded `params` (in the optimizer's order) hold their values."""
    from torch.distributed.tensor import distribute_tensor

    def place(value, param):
        if is_sharded(param) and value.dim() > 0:
            return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        return value

    return {
        "state": {i: {k: place(v, params[int(i)]) for k, v in s.items()} for i, s in saved["state"].items()},
        "param_groups": saved["param_groups"],
    }
