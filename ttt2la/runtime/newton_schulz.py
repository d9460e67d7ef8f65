"""Muon's orthogonalisation: the quintic Newton–Schulz iteration, batched over leading dims.

Same iteration as the standard ``zeropower_via_newtonschulz5`` (normalise by the Frobenius norm
plus ``eps``, work on the wide orientation, ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``), with the
coefficients as data: one ``(a, b, c)`` triple per step, so Muon's classic constant triple,
LaCT's five-step schedule and a user's own all run here. The iteration runs in the dtype the
user's code iterates in (``dtype``; a cast to bf16 before the iteration stays bf16), never in a
wider one: Newton–Schulz amplifies rounding by up to ``a^steps``, for the original code as much
as for this one, and tests judge that honestly against a float64 evaluation.
"""
from __future__ import annotations

import torch

from ttt2la.runtime.naive import NS_EPS, ns_schedule


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=None, eps: float = NS_EPS, *,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise every ``[..., m, n]`` matrix of ``G`` (towards its ``U Vᵀ``).

    ``steps``/``coefficients`` as ``ns_schedule`` (a per-step schedule takes ``steps`` 0 or
    its length); matrices taller than wide are transposed for the iteration and back. The
    iteration runs in ``dtype`` (default ``G``'s; in bf16/fp16 each elementwise step rounds
    once, as compiled code does); the result has ``G``'s dtype.
    """
    schedule = ns_schedule(steps, coefficients)
    tall = G.shape[-2] > G.shape[-1]
    dt = dtype or G.dtype
    X = G.to(dt)
    if tall:
        X = X.mT
    if dt in (torch.bfloat16, torch.float16):
        X = _iterate_half(X, schedule, eps)
    else:
        X = X / (X.square().sum(dim=(-2, -1), keepdim=True).sqrt() + eps)
        for a, b, c in schedule:
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _half_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of half-precision matrices as a half GEMM computes it: products accumulated in
    fp32, the result rounded to the half type. On CPU, whose half GEMMs run at a small fraction
    of the fp32 rate (14× slower measured on LaCT's 128×128 updates), the same rounding points
    are reached by an fp32 GEMM of the half operands; elsewhere the half GEMM runs."""
    if a.device.type == "cpu":
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def _iterate_half(X: torch.Tensor, schedule, eps: float) -> torch.Tensor:
    """The iteration on bf16/fp16 matrices as compiled code runs it: matmuls in the half type,
    each elementwise combination in fp32 and rounded once (``torch.compile`` fuses them so; an
    eager run rounds after every op and is less accurate, never more)."""
    X32 = X.float()
    X = (X32 / (X32.square().sum(dim=(-2, -1), keepdim=True).sqrt() + eps)).to(X.dtype)
    for a, b, c in schedule:
        A = _half_matmul(X, X.mT)
        B = (b * A.float() + c * _half_matmul(A, A).float()).to(X.dtype)
        X = (a * X.float() + _half_matmul(B, X).float()).to(X.dtype)
    return X


__all__ = ["newton_schulz"]
