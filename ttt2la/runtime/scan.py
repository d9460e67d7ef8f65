"""Scans over the chunk axis: prefix sums and the affine recurrence ``S_j = a_j ⊙ S_{j-1} + f_j``.

The affine scan carries momentum over chunk increments and decayed states over chunk
boundaries. No form here divides out a cumulative product (that underflows to 0/0 over long
sequences): factors are only ever multiplied, and an underflow to 0 is the correct limit.

Three forms, all differentiable through autograd:

* *blocked* (the default wherever one factor covers a whole row of features: a prefix sum,
  momentum, a per-head decay): blocks of ``SCAN_BLOCK`` steps; inside a block the scan is one
  batched matmul with the block's transfer matrix ``L[j, i] = a_{i+1} ⋯ a_j`` (a cumulative
  product, never a quotient), and the blocks' end states are scanned the same way one level up.
  ``⌈log_SCAN_BLOCK N⌉`` levels of a fixed handful of ops, O(N·SCAN_BLOCK) multiply-adds on the
  (small) factors and one matmul pass over the features per level (the carry into each block
  is added to that matmul's result in place).
* *doubling* (elementwise factors): ``⌈log₂ N⌉`` passes composing ``(a, f)`` pairs.
* *sequential*: a loop over the steps, kept for scans of at most ``SEQUENTIAL_MAX_STEPS``
  elementwise steps.

``benchmarks/runtime_cpu.py`` measures them against the loop.
"""
from __future__ import annotations

import math

import torch

from ttt2la.runtime.naive import compute_dtype

#: Elementwise scans with at most this many steps run the sequential loop.
SEQUENTIAL_MAX_STEPS = 16
#: Steps per block of the blocked scan (the side of its transfer matrices): up to 64 chunks scan
#: in one matmul, with no padding and no carry pass over the (often large) states.
SCAN_BLOCK = 64


#: The boolean triangles of ``_transfer`` per (side, device), made once: they depend on the
#: side alone, and a short call dispatched the five ops making them on every scan.
_TRIANGLES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _triangles(s: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lower, after, above)``: ``[s, s]`` masks of ``i ≤ j``, ``i < j`` and ``i > j``
    (``[j, i]``). Kept for plain tensors outside a compiler's tracing; fake or traced tensors
    get their own, as a constant kept across calls must be a real tensor."""
    key = (s, like.device)
    found = _TRIANGLES.get(key)
    if found is not None and type(like) is torch.Tensor and not torch.compiler.is_compiling():
        return found
    # outside inference mode: a kept mask is read by calls that record gradients
    with torch.inference_mode(False):
        lower = torch.ones(s, s, dtype=torch.bool, device=like.device).tril()
        after = torch.ones(s, s, dtype=torch.bool, device=like.device).tril(-1)  # l > i
        made = (lower, after, ~lower)
    if type(like) is torch.Tensor and not torch.compiler.is_compiling() \
            and type(lower) is torch.Tensor:
        _TRIANGLES[key] = made
    return made


def _transfer(a: torch.Tensor | None, s: int, like: torch.Tensor) -> torch.Tensor:
    """``L[..., j, i] = a_{i+1} ⋯ a_j`` for ``i ≤ j`` (0 above the diagonal), from ``a [..., s]``.

    ``a=None`` means every factor is 1 (a prefix sum): ``L`` is the lower-triangular ones.
    """
    lower, after, above = _triangles(s, like)
    if a is None:
        return lower.to(like.dtype)
    factors = torch.where(after, a.unsqueeze(-1), 1.0)     # a scalar 1 keeps a's dtype
    return torch.cumprod(factors, dim=-2).masked_fill(above, 0.0)


def blocked_scan(a: torch.Tensor | None, f: torch.Tensor,
                 initial: torch.Tensor | None = None, block: int = SCAN_BLOCK) -> torch.Tensor:
    """``S_j = a_j S_{j-1} + f_j`` over axis 1 of ``f [N, n, X]`` with one factor per row, ``a [N, n]``.

    ``a=None`` is a prefix sum; ``initial [N, X]`` is ``S_{-1}`` (0 when None). Log-depth: one
    level per factor of ``block`` steps, each a fixed number of ops.
    """
    N, n, X = f.shape
    m = -(-n // block)
    s = block if m > 1 else n
    pad = m * s - n
    if pad:
        f = torch.nn.functional.pad(f, (0, 0, 0, pad))
        a = None if a is None else torch.nn.functional.pad(a, (0, pad), value=1.0)
    L = _transfer(None if a is None else a.reshape(N, m, s), s, f)  # [N, m, s, s] or [s, s]
    blocks = f.reshape(N, m, s, X)
    if m == 1 and initial is None:
        return (L @ blocks).reshape(N, s, X)[:, :n]
    # the state entering every block, from the scan one level up of the blocks' end states,
    # is carried in as through ⊗ entering, added to the blocks' product in place
    through = None if a is None else a.reshape(N, m, s)[..., :1] * L[..., :, 0]  # a_0 ⋯ a_j
    if m == 1:
        entering = initial.unsqueeze(1)
    else:
        ends = blocks.sum(dim=2) if a is None else (L[..., -1:, :] @ blocks).squeeze(-2)
        after = blocked_scan(None if a is None else through[..., -1], ends, initial, block)
        first = torch.zeros_like(after[:, :1]) if initial is None else initial.unsqueeze(1)
        entering = torch.cat([first, after[:, :-1]], dim=1)  # [N, m, X]
    L = L.expand(N, m, s, s)
    S = L.reshape(N * m, s, s) @ blocks.reshape(N * m, s, X)
    if a is None:       # in place: the product's backward does not read its result
        S += entering.reshape(N * m, 1, X)
    else:
        S.baddbmm_(through.reshape(N * m, s, 1), entering.reshape(N * m, 1, X))
    return S.reshape(N, m * s, X)[:, :n]


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``Z[..., t, i] = Σ_{i<l≤t} g_l`` for ``t ≥ i`` (−inf above the diagonal), from ``g [..., C]``.

    Summed directly (a cumulative sum over ``t`` of ``g_t`` masked to ``t > i``), never as a
    difference of two cumulative sums.
    """
    C = g.shape[-1]
    later = torch.ones(C, C, dtype=torch.bool, device=g.device).triu(1)  # [i, t]: t > i
    sums = torch.cumsum(g.unsqueeze(-2).masked_fill(~later, 0.0), dim=-1)  # [..., i, t]
    return sums.mT.masked_fill(later, -math.inf)  # [..., t, i]; later[t, i]: i > t


def summed_scan(a: torch.Tensor, f: torch.Tensor,
                initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = initial + Σ_{l≤j} M_l`` with ``M_l = a_l M_{l-1} + f_l`` over axis 1 of ``f [N, n, X]``.

    Momentum followed by the state's prefix sum. Both are linear in ``f``: within one block
    (``n ≤ SCAN_BLOCK``) their composition is one ``[n, n]`` matrix, the row-wise cumulative
    sum of the momentum's transfer matrix, so the states come from one matmul pass over the
    features instead of two; longer scans run the two blocked scans.
    """
    N, n, X = f.shape
    if n > SCAN_BLOCK:
        return blocked_scan(None, blocked_scan(a, f), initial)
    K = _transfer(a, n, f).cumsum(dim=-2)                # K[j, i] = Σ_{i≤l≤j} a_{i+1} ⋯ a_l
    S = K @ f
    if initial is not None:     # in place: the product's backward does not read its result
        S += initial.unsqueeze(1)
    return S


def _as_rows(f: torch.Tensor, dim: int, last: int):
    """``f`` with the scan axis ``dim`` moved to ``last`` and flattened to ``[N, n, X]``."""
    moved = f.movedim(dim, last)
    features = 1
    for s in moved.shape[last + 1:]:
        features *= s
    return moved.reshape(-1, moved.shape[last], features), moved.shape


def _factor_axis(A: torch.Tensor, dim: int) -> int:
    """The last axis at or after ``dim`` along which the aligned factors vary."""
    varying = [d for d in range(dim + 1, A.dim()) if A.shape[d] > 1]
    return varying[-1] if varying else dim


def prefix_sum(f: torch.Tensor, *, dim: int = 1,
               initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = initial + Σ_{i≤j} f_i`` along ``dim``; ``initial`` has ``f``'s shape without ``dim``.

    The blocked scan (a few batched matmuls, log-depth): on CPU, ``torch.cumsum`` over an axis
    that is not the innermost runs an unvectorised strided loop and was measured slower than
    even a Python loop of adds. Half-precision inputs are summed in fp32; the result has ``f``'s
    dtype.
    """
    dim = dim % f.dim()
    dt = compute_dtype(f.dtype)
    if f.shape[dim] == 1:       # one term (a single step): the sum itself, no scan to run
        return f if initial is None else (f.to(dt) + initial.to(dt).unsqueeze(dim)).to(f.dtype)
    rows, shape = _as_rows(f.to(dt), dim, dim)
    init = None if initial is None else initial.to(dt).reshape(rows.shape[0], rows.shape[2])
    return blocked_scan(None, rows, init).reshape(shape).to(f.dtype)


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


def affine_scan_blocked(a: torch.Tensor, f: torch.Tensor, *, dim: int = 1,
                        initial: torch.Tensor | None = None) -> torch.Tensor:
    """``S_j = a_j ⊙ S_{j-1} + f_j`` by ``blocked_scan``, one factor per row of ``f``'s trailing
    features (the scan axis is moved past the last axis the factors vary along; a copy unless
    that is ``dim`` itself)."""
    dim = dim % f.dim()
    A = _align(a, f, dim)
    last = _factor_axis(A, dim)
    rows, shape = _as_rows(f, dim, last)
    factors = A.expand(*f.shape[:last + 1], *A.shape[last + 1:]).movedim(dim, last)
    factors = factors[(...,) + (0,) * (f.dim() - last - 1)].reshape(rows.shape[:2])
    init = None
    if initial is not None:
        init = initial.unsqueeze(dim).movedim(dim, last).reshape(rows.shape[0], rows.shape[2])
    return blocked_scan(factors, rows, init).reshape(shape).movedim(last, dim)


_SCANS = {"sequential": affine_scan_sequential, "doubling": affine_scan_doubling,
          "blocked": affine_scan_blocked}


def affine_scan(a: torch.Tensor, f: torch.Tensor, initial: torch.Tensor | None = None, *,
                dim: int = 1, method: str = "auto") -> torch.Tensor:
    """Inclusive scan ``S_j = a_j ⊙ S_{j-1} + f_j`` along ``dim`` with ``S_{-1} = initial`` (0).

    ``a`` broadcasts to ``f`` (one factor per batch/head with trailing size-1 dims, or
    elementwise); ``initial`` has ``f``'s shape without ``dim``. ``method``: ``"auto"``
    (blocked when each factor covers at least ``SCAN_BLOCK`` features, else sequential up to
    ``SEQUENTIAL_MAX_STEPS`` steps and doubling beyond), ``"blocked"``, ``"sequential"`` or
    ``"doubling"``. Half-precision inputs are scanned in fp32; the result has ``f``'s dtype.
    """
    dim = dim % f.dim()
    if method == "auto":
        method = _auto_method(a, f, dim)
    if method not in _SCANS:
        raise ValueError(f"affine_scan: method must be 'auto', 'blocked', 'sequential' or "
                         f"'doubling', got {method!r}")
    dt = compute_dtype(f.dtype)
    S = _SCANS[method](a.to(dt), f.to(dt), dim=dim,
                       initial=None if initial is None else initial.to(dt))
    return S.to(f.dtype)


def _auto_method(a: torch.Tensor, f: torch.Tensor, dim: int) -> str:
    last = _factor_axis(_align(a, f, dim), dim)
    features = 1
    for s in f.shape[last + 1:]:
        features *= s
    if features >= SCAN_BLOCK:
        return "blocked"
    return "sequential" if f.shape[dim] <= SEQUENTIAL_MAX_STEPS else "doubling"


__all__ = ["affine_scan", "summed_scan", "segment_sums", "affine_scan_blocked", "affine_scan_sequential", "affine_scan_doubling",
           "blocked_scan", "prefix_sum", "SCAN_BLOCK"]
