"""An output head kept in its stored dtype and applied a slice of vocabulary rows at a time, each slice widened
to the run dtype as it is used: a layer-streamed model's head costs its file size, not float32's (4.2 GB for
Llama-3.1-70B's), and a widened slice at most SLICE_ELEMENTS."""

from __future__ import annotations

import torch

#: Elements of one widened slice of the head (64 MiB in float32).
SLICE_ELEMENTS = 1 << 24


class SlicedHead(torch.nn.Module):
    """logits = hidden @ weight.T with weight [V, d] as stored, computed in `dtype` slice by slice of rows.

    Each logit is the same dot product over d as the whole head's, so on the CPU (where this is what runs) the
    result equals a head widened up front bit for bit (tests/test_layerwise.py)."""

    def __init__(self, weight: torch.nn.Parameter, dtype: torch.dtype):
        super().__init__()
        self.weight = weight  # [V, d], as stored (shared with a tied embedding table)
        self.dtype = dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., V]
        if self.weight.dtype == self.dtype:
            return torch.nn.functional.linear(hidden, self.weight)
        rows = max(1, SLICE_ELEMENTS // self.weight.shape[1])
        parts = [
            torch.nn.functional.linear(hidden, self.weight[start : start + rows].to(self.dtype))  # [..., rows]
            for start in range(0, self.weight.shape[0], rows)
        ]
        return torch.cat(parts, dim=-1)
