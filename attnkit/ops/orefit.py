"""Refit o_proj so the converted attention reproduces the source attention's output on calibration tokens."""

from __future__ import annotations

import torch


def refit_o(
    z_new: torch.Tensor, z_old: torch.Tensor, o_w: torch.Tensor, prior: torch.Tensor, ridge: float = 1e-2
) -> torch.Tensor:
    """argmin_O ||z_new O^T - z_old o_w^T||^2 + ridge * mean(diag(z_new^T z_new)) ||O - prior||^2.

    The ridge pulls toward `prior` (the folded o_proj), not toward zero. z_new, z_old: [N, H*D]
    attention outputs before o_proj (converted and source), o_w, prior: [hidden, H*D].  -> float64.
    """
    zn, zo = z_new.to(torch.float64), z_old.to(torch.float64)
    gram = zn.T @ zn  # [HD, HD]
    lam = ridge * gram.diagonal().mean()
    eye = torch.eye(gram.shape[0], dtype=torch.float64)
    rhs = zn.T @ (zo @ o_w.to(torch.float64).T) + lam * prior.to(torch.float64).T  # [HD, hidden]
    return torch.linalg.solve(gram + lam * eye, rhs).T
