"""The matrix-affine scan over chunks: ``S_j = A_j S_{j-1} + B_j`` with ``A_j`` a square matrix.

The delta rule's chunk boundaries follow this recurrence (``A_j`` is ``[Dk, Dk]``, the states
``[Dk, Dv]``). Unlike the scalar-affine scan (``scan.py``) the factors do not commute with the
features, so the blocked transfer-matrix form does not apply; two forms instead, both plain
autograd:

* *pairwise* (log-depth): compose neighbouring maps two by two,
  ``(A, B)_{2i+1} ∘ (A, B)_{2i} = (A_{2i+1} A_{2i}, A_{2i+1} B_{2i} + B_{2i+1})``, scan the
  ``⌈n/2⌉`` pairs the same way, then recover the even steps from the odd ones before them.
  ``⌈log₂ n⌉`` levels of a fixed handful of batched matmuls, O(n) maps composed in all (about
  ``Dk/Dv + 2`` times the sequential form's multiply-adds);
* *sequential*: one ``baddbmm`` per chunk.
"""
from __future__ import annotations

import torch

METHODS = ("pairwise", "sequential")


def _identity_maps(A: torch.Tensor, B: torch.Tensor, count: int):
    """``count`` maps ``S ↦ S`` shaped like one step of ``A`` and ``B`` (to pad to even length)."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    return (eye.expand(*A.shape[:-3], count, *A.shape[-2:]),
            B.new_zeros(*B.shape[:-3], count, *B.shape[-2:]))


def matrix_affine_scan_sequential(A: torch.Tensor, B: torch.Tensor,
                                  initial: torch.Tensor) -> torch.Tensor:
    """Every ``S_j`` by a loop over the chunks (one batched matmul per chunk)."""
    S = initial
    states = []
    for A_j, B_j in zip(A.unbind(-3), B.unbind(-3)):
        S = A_j @ S + B_j
        states.append(S)
    return torch.stack(states, dim=-3)


def matrix_affine_scan_pairwise(A: torch.Tensor, B: torch.Tensor,
                                initial: torch.Tensor) -> torch.Tensor:
    """Every ``S_j`` by composing neighbouring maps, one level per halving (log-depth)."""
    n = A.shape[-3]
    if n == 1:
        return (A[..., 0, :, :] @ initial + B[..., 0, :, :]).unsqueeze(-3)
    if n % 2:
        eye, zero = _identity_maps(A, B, 1)
        A, B = torch.cat([A, eye], dim=-3), torch.cat([B, zero], dim=-3)
    A_even, A_odd = A[..., 0::2, :, :], A[..., 1::2, :, :]
    B_even, B_odd = B[..., 0::2, :, :], B[..., 1::2, :, :]
    # states after every odd step, from the scan of the composed pairs one level up
    odd = matrix_affine_scan_pairwise(A_odd @ A_even, A_odd @ B_even + B_odd, initial)
    before_even = torch.cat([initial.unsqueeze(-3), odd[..., :-1, :, :]], dim=-3)
    even = A_even @ before_even + B_even
    return torch.stack([even, odd], dim=-3).flatten(-4, -3)[..., :n, :, :]


def matrix_affine_scan(A: torch.Tensor, B: torch.Tensor, initial: torch.Tensor | None = None,
                       *, method: str = "pairwise") -> torch.Tensor:
    """Inclusive scan ``S_j = A_j S_{j-1} + B_j`` over axis ``-3``, ``S_{-1} = initial`` (0).

    ``A``: ``[..., n, Dk, Dk]``; ``B``: ``[..., n, Dk, Dv]``; ``initial``: ``[..., Dk, Dv]``.
    Returns every ``S_j``, ``[..., n, Dk, Dv]``. ``method``: ``"pairwise"`` (log-depth) or
    ``"sequential"``.
    """
    if method not in METHODS:
        raise ValueError(f"matrix_affine_scan: method must be one of {METHODS}, got {method!r}")
    if initial is None:
        initial = B.new_zeros(*B.shape[:-3], *B.shape[-2:])
    scan = matrix_affine_scan_pairwise if method == "pairwise" else matrix_affine_scan_sequential
    return scan(A, B, initial)


__all__ = ["matrix_affine_scan", "matrix_affine_scan_pairwise", "matrix_affine_scan_sequential",
           "METHODS"]
