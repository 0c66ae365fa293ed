"""Refit o_proj so the converted attention reproduces the source attention's output on calibration tokens."""

from __future__ import annotations

import torch

from attnkit.ops.whiten import cholesky_in_place

#: Elements of o_proj made float64 at a time (32 MiB).
SLICE_ELEMENTS = 1 << 22


def refit_o(
    z_new: torch.Tensor, z_old: torch.Tensor, o_w: torch.Tensor, prior: torch.Tensor, ridge: float = 1e-2
) -> torch.Tensor:
    """argmin_O ||z_new O^T - z_old o_w^T||^2 + ridge * mean(diag(z_new^T z_new)) ||O - prior||^2.

    The ridge pulls toward `prior` (the folded o_proj), not toward zero. z_new, z_old: [N, H*D]
    attention outputs before o_proj (converted and source), o_w, prior: [hidden, H*D] in any dtype, read a
    slice of rows at a time.  -> float64. Holds two float64 [H*D, H*D]-sized matrices (0.5 GiB each at a
    70B model's width): the gram, factored in place before the right-hand side is built, and the right-hand
    side, solved in place.
    """
    zn, zo = z_new.to(torch.float64), z_old.to(torch.float64)
    gram = zn.T @ zn  # [HD, HD]
    lam = ridge * gram.diagonal().mean()
    gram.diagonal().add_(lam)
    lower = cholesky_in_place(gram)  # gram + lam I is positive definite; factored before rhs exists
    target = torch.empty(zo.shape[0], o_w.shape[0], dtype=torch.float64)  # [N, hidden]: z_old o_w^T
    for rows in _row_slices(o_w):
        target[:, rows] = zo @ o_w[rows].to(torch.float64).T
    rhs = zn.T @ target  # [HD, hidden]
    del target
    for rows in _row_slices(prior):
        rhs[:, rows] += lam * prior[rows].to(torch.float64).T
    torch.linalg.solve_triangular(lower, rhs, upper=False, out=rhs)  # in place, unlike cholesky_solve
    return torch.linalg.solve_triangular(lower.mT, rhs, upper=True, out=rhs).T


def _row_slices(w: torch.Tensor) -> list[slice]:
    """Row ranges of w [rows, cols] of about SLICE_ELEMENTS elements each."""
    step = max(1, SLICE_ELEMENTS // max(1, w.shape[1]))
    return [slice(start, start + step) for start in range(0, w.shape[0], step)]
