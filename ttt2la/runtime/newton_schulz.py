"""Muon's orthogonalisation: the quintic Newton–Schulz iteration, batched over leading dims.

Same iteration as the standard ``zeropower_via_newtonschulz5`` (normalise by the Frobenius norm,
work on the wide orientation, ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``), batched so the block
op orthogonalises all its chunks in one call, and run in higher precision than bf16: the
quintic's slope at 0 is ``a = 3.4445``, so rounding noise in directions with (near-)zero singular
values grows by ``aˢᵗᵉᵖˢ`` (≈ 480 for 5 steps). In fp32 that leaves rank-deficient increments
(chunks shorter than the feature size) ~3e-5 away from the exact result, above the fp32
tolerance, so fp32 inputs are iterated in float64 by default; half-precision inputs in fp32.
"""
from __future__ import annotations

import torch

from ttt2la.runtime.naive import NS_COEFFICIENTS, NS_EPS


def default_iteration_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for fp32/fp64 matrices (see the module note), fp32 for half precision."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                  eps: float = NS_EPS, *,
                  iteration_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise every ``[..., m, n]`` matrix of ``G`` (towards its ``U Vᵀ``).

    Matrices taller than wide are transposed for the iteration and back afterwards. The
    iteration runs in ``iteration_dtype`` (default: ``default_iteration_dtype(G.dtype)``); the
    result has ``G``'s dtype.
    """
    a, b, c = coefficients
    tall = G.shape[-2] > G.shape[-1]
    X = G.to(iteration_dtype or default_iteration_dtype(G.dtype))
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


__all__ = ["newton_schulz", "default_iteration_dtype"]
