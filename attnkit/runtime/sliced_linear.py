"""A linear layer kept in its stored dtype and applied a slice of output rows at a time, each slice widened to the
run dtype as it is used: a layer-streamed model's decoder layers and output head cost their file size (the
safetensors pages, not anonymous memory), not float32's (3.2 GiB for one Llama-3.1-70B layer, 4.2 GB for its
head), and a widened slice at most SLICE_ELEMENTS."""

from __future__ import annotations

import torch

#: Elements of one widened slice of a weight (64 MiB in float32).
SLICE_ELEMENTS = 1 << 24


class SlicedLinear(torch.nn.Module):
    """y = x @ weight.T + bias with weight [out, in] (and bias [out]) as stored, computed in `dtype` slice by
    slice of output rows.

    Where the weight is stored in `dtype` it is one plain linear, the whole layer's own result. Otherwise each
    output is the same dot product over `in` as the widened layer's, but BLAS may sum a product split by rows
    in another order: equal to float rounding, not bit for bit (tests/test_layerwise.py,
    tests/test_streaming.py)."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.nn.Parameter | None, dtype: torch.dtype):
        super().__init__()
        self.weight = weight  # [out, in], as stored (a head's may be shared with a tied embedding table)
        self.register_parameter("bias", bias)  # [out] or None
        self.dtype = dtype

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.weight.dtype == self.dtype and (self.bias is None or self.bias.dtype == self.dtype):
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = max(1, SLICE_ELEMENTS // self.weight.shape[1])
        parts = [
            torch.nn.functional.linear(
                x,
                self.weight[start : start + rows].to(self.dtype),
                None if self.bias is None else self.bias[start : start + rows].to(self.dtype),
            )  # [..., rows]
            for start in range(0, self.weight.shape[0], rows)
        ]
        return torch.cat(parts, dim=-1)


def slice_linears(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace every plain torch.nn.Linear inside `module` by a SlicedLinear with the same parameters (so the same
    parameter names): what read_layer then fills as stored."""
    for name, child in list(module.named_modules()):
        if type(child) is torch.nn.Linear:
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            setattr(owner, leaf, SlicedLinear(child.weight, child.bias, dtype))


def sliced_parameters(module: torch.nn.Module) -> set[str]:
    """Names (relative to `module`) of the parameters of its SlicedLinear layers."""
    return {
        f"{name}.{leaf}" if name else leaf
        for name, child in module.named_modules()
        if isinstance(child, SlicedLinear)
        for leaf, _ in child.named_parameters(recurse=False)
    }
