"""Whitening for activation-aware low-rank fits: ||(A - B) x|| over calibration inputs x."""

from __future__ import annotations

import torch

#: Ridge added to a covariance, relative to its mean diagonal, so rank-deficient calibration stays solvable.
DEFAULT_RIDGE = 1e-6


def regularize(cov: torch.Tensor, ridge: float = DEFAULT_RIDGE) -> torch.Tensor:
    """cov + ridge * mean(diag(cov)) * I, a new float64 matrix (one copy, no identity built).  cov: [n, n] PSD."""
    out = cov.to(torch.float64, copy=True)
    out.diagonal().add_(ridge * out.diagonal().mean().clamp_min(1e-30))
    return out


def cholesky_in_place(mat: torch.Tensor) -> torch.Tensor:
    """The lower Cholesky factor L of a symmetric positive definite float64 matrix, written over it and returned
    (its transpose is the same matrix, so LAPACK factors the column-major view in place; no [n, n] copy)."""
    torch.linalg.cholesky(mat.mT, upper=True, out=mat.mT)  # U = L^T, column-major: the row-major view is L
    return mat


def psd_sqrt(mat: torch.Tensor, ridge: float = DEFAULT_RIDGE) -> torch.Tensor:
    """Symmetric square root of a PSD matrix (eigenvalues floored by the ridge).  [n, n] float64."""
    vals, vecs = torch.linalg.eigh(regularize(mat, ridge))
    return (vecs * vals.clamp_min(0).sqrt()) @ vecs.T


def energy(rows: torch.Tensor, cov: torch.Tensor | None) -> torch.Tensor:
    """E||rows x||^2 = tr(rows cov rows^H), real (cov None: identity).  rows: [m, n] real or complex, cov: [n, n]."""
    if cov is None:
        flat = rows.reshape(-1)
        return torch.vdot(flat, flat).real
    cov = cov.to(torch.float64).to(rows.dtype) if rows.is_complex() else cov.to(rows.dtype)
    return ((rows @ cov) * rows.conj()).sum().real


def relative_error(old: torch.Tensor, new: torch.Tensor, cov: torch.Tensor | None) -> float:
    """sqrt(E||(old - new) x||^2 / E||old x||^2) for row stacks old, new: [m, n] and cov: [n, n] (None: identity)."""
    old, new = old.to(torch.float64), new.to(torch.float64)
    denom = float(energy(old, cov))
    if denom <= 0:
        return 0.0 if float(energy(old - new, cov)) <= 0 else float("inf")
    return float(energy(old - new, cov) / denom) ** 0.5
