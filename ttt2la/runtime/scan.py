"""Scans over the chunk axis: prefix sums and the affine recurrence ``S_j = a_j ⊙ S_{j-1} + f_j``.

The affine scan carries momentum over chunk increments and decayed states over chunk
boundaries. It never forms a cumulative product that is divided out later (that underflows to
0/0 over long sequences): the doubling form composes ``(a, f)`` pairs, so decay products are only
ever multiplied and an underflow to 0 is the correct limit.

Strategy (``benchmarks/runtime_cpu.py``, CPU, 1-2 threads): the sequential loop costs ~5-10 µs
of dispatch per step, the doubling scan ``⌈log₂ N⌉`` full passes over the data. Doubling wins
from ~32 steps while the whole scanned tensor stays small (≤ 2^17 elements, e.g. 512 chunks of
8×8 states for 4 heads); beyond that its large temporaries make it up to 10× slower than the
loop, which then wins at every length measured. ``method="auto"`` applies that rule (on CUDA
too, where it has not been measured).
"""
from __future__ import annotations

import torch

from ttt2la.runtime.naive import compute_dtype

#: Scans with at most this many steps always run the sequential loop.
SEQUENTIAL_MAX_STEPS = 16
#: Longer scans run the doubling form while the scanned tensor has at most this many elements.
DOUBLING_MAX_NUMEL = 1 << 17


def prefix_sum(f: torch.Tensor, *, dim: int = 1,
               initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = initial + Σ_{i≤j} f_i`` along ``dim``; ``initial`` has ``f``'s shape without ``dim``.

    On CPU a loop of adds, measured 2-4× faster (forward and backward) than ``torch.cumsum`` over
    a chunk axis that is not the innermost; on CUDA one ``cumsum`` kernel. Half-precision inputs
    are summed in fp32; the result has ``f``'s dtype.
    """
    dim = dim % f.dim()
    dt = compute_dtype(f.dtype)
    if f.is_cuda:
        S = torch.cumsum(f, dim=dim, dtype=dt)
        return (S if initial is None else S + initial.to(dt).unsqueeze(dim)).to(f.dtype)
    S = None if initial is None else initial.to(dt)
    out = []
    for f_j in f.to(dt).unbind(dim):
        S = f_j if S is None else S + f_j
        out.append(S)
    return torch.stack(out, dim=dim).to(f.dtype)


def _align(a: torch.Tensor, f: torch.Tensor, dim: int) -> torch.Tensor:
    """Left-pad ``a`` to ``f``'s rank and give it ``f``'s length along the scan axis."""
    while a.dim() < f.dim():
        a = a.unsqueeze(0)
    if a.shape[dim] != f.shape[dim]:
        a = a.expand(*[f.shape[dim] if d == dim else s for d, s in enumerate(a.shape)])
    return a


def _fold_initial(a, f, initial, dim):
    if initial is None:
        return f
    first = f.narrow(dim, 0, 1) + a.narrow(dim, 0, 1) * initial.unsqueeze(dim)
    return torch.cat([first, f.narrow(dim, 1, f.shape[dim] - 1)], dim=dim)


def affine_scan_sequential(a: torch.Tensor, f: torch.Tensor, *, dim: int = 1,
                           initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = a_j ⊙ S_{j-1} + f_j`` by a loop over ``dim`` (O(N) steps, O(N) work)."""
    dim = dim % f.dim()
    a = _align(a, f, dim)
    S = initial
    out = []
    for a_j, f_j in zip(a.unbind(dim), f.unbind(dim)):
        S = f_j if S is None else a_j * S + f_j
        out.append(S)
    return torch.stack(out, dim=dim)


def affine_scan_doubling(a: torch.Tensor, f: torch.Tensor, *, dim: int = 1,
                         initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = a_j ⊙ S_{j-1} + f_j`` by recursive doubling (⌈log₂ N⌉ steps, O(N log N) work).

    Step ``d`` composes every pair with the one ``d`` places before it:
    ``(A, F)_j ← (A_j A_{j-d}, A_j F_{j-d} + F_j)``.
    """
    dim = dim % f.dim()
    A = _align(a, f, dim)
    F = _fold_initial(A, f, initial, dim)
    n = F.shape[dim]
    d = 1
    while d < n:
        F = torch.cat([F.narrow(dim, 0, d),
                       F.narrow(dim, d, n - d) + A.narrow(dim, d, n - d) * F.narrow(dim, 0, n - d)],
                      dim=dim)
        if 2 * d < n:
            A = torch.cat([A.narrow(dim, 0, d),
                           A.narrow(dim, d, n - d) * A.narrow(dim, 0, n - d)], dim=dim)
        d *= 2
    return F


def affine_scan(a: torch.Tensor, f: torch.Tensor, initial: torch.Tensor | None = None, *,
                dim: int = 1, method: str = "auto") -> torch.Tensor:
    """Inclusive scan ``S_j = a_j ⊙ S_{j-1} + f_j`` along ``dim`` with ``S_{-1} = initial`` (0).

    ``a`` broadcasts to ``f`` (one factor per batch/head with trailing size-1 dims, or
    elementwise); ``initial`` has ``f``'s shape without ``dim``. ``method``: ``"auto"``,
    ``"sequential"`` or ``"doubling"``. Half-precision inputs are scanned in fp32; the result
    has ``f``'s dtype.
    """
    dim = dim % f.dim()
    if method == "auto":
        method = "doubling" if _prefer_doubling(f, dim) else "sequential"
    scans = {"sequential": affine_scan_sequential, "doubling": affine_scan_doubling}
    if method in scans:
        dt = compute_dtype(f.dtype)
        S = scans[method](a.to(dt), f.to(dt), dim=dim,
                          initial=None if initial is None else initial.to(dt))
        return S.to(f.dtype)
    raise ValueError(
        f"affine_scan: method must be 'auto', 'sequential' or 'doubling', got {method!r}")


def _prefer_doubling(f: torch.Tensor, dim: int) -> bool:
    return f.shape[dim] > SEQUENTIAL_MAX_STEPS and f.numel() <= DOUBLING_MAX_NUMEL


__all__ = ["affine_scan", "affine_scan_sequential", "affine_scan_doubling", "prefix_sum"]
