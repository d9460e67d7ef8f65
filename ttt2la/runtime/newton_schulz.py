"""Muon's orthogonalisation: the quintic Newton–Schulz iteration, batched over leading dims.

Same iteration as the standard ``zeropower_via_newtonschulz5`` (normalise by the Frobenius norm
plus ``eps``, work on the wide orientation, ``X ← aX + (bA + cA²)X`` with ``A = XXᵀ``), with the
coefficients as data: one ``(a, b, c)`` triple per step, so Muon's classic constant triple,
LaCT's five-step schedule and a user's own all run here. The iteration runs in the dtype the
user's code iterates in (``dtype``; a cast to bf16 before the iteration stays bf16), never in a
wider one: Newton–Schulz amplifies rounding by up to ``a^steps``, for the original code as much
as for this one, and tests judge that honestly against a float64 evaluation.

Speed: each step is three matmuls, ``aX + BX`` computed as the last one's epilogue (``baddbmm``).
The backward is autograd's formula written by hand on the matrices the forward keeps, its sums
fused into the GEMMs too (six matmuls a step and no recomputation; recomputing the iteration for
the backward took nine). Half GEMMs on a CPU without bf16 dot-product units (AMX, AVX512-BF16)
ran at a small fraction of the fp32 rate, so there the same products are fp32 GEMMs of the half
operands, rounded once (``half_gemms_native``).
"""
from __future__ import annotations

import torch

from ttt2la.runtime.higher_order import backward_as_graph, recording_graph
from ttt2la.runtime.naive import NS_EPS, ns_schedule

HALF = (torch.bfloat16, torch.float16)


def _cpu_half_units() -> dict:
    """Which half dtypes this CPU multiplies in hardware (read once: Dynamo traces a dict read,
    not these C calls): bf16 with AMX tiles or AVX512-BF16 dot products (on a 2-core AMD EPYC
    with AVX512-BF16, a bf16 ``bmm`` of 64 128×128 updates ran at 387 GFLOP/s against 126 in
    fp32, and 50 as an fp32 GEMM of the bf16 operands with its casts), fp16 with AMX-FP16."""
    has = lambda name: bool(getattr(torch.cpu, name, lambda: False)())  # noqa: E731
    return {torch.bfloat16: has("_is_amx_tile_supported") or has("_is_avx512_bf16_supported"),
            torch.float16: has("_is_amx_fp16_supported")}


#: Half dtypes whose GEMMs run natively on this CPU; ``half_gemms`` overrides it.
CPU_NATIVE_HALF = _cpu_half_units()
_forced: list = [None]


def half_gemms_native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a half GEMM runs as one (on GPU, and on a CPU with half dot-product units: 2.6-6.2x
    the fp32 rate measured with AMX on 128x128 updates, 3.1x with AVX512-BF16) rather than as an
    fp32 GEMM of the half operands rounded once (on a CPU without them, where native half GEMMs
    measured 14x slower).
    Both accumulate in fp32 and round the product once: the same rounding points."""
    if device.type != "cpu":
        return True
    return CPU_NATIVE_HALF.get(dtype, False) if _forced[0] is None else _forced[0]


class half_gemms:
    """Force half GEMMs on CPU native (``half_gemms(True)``) or formed in fp32 (``False``) within
    a ``with`` block: tests hold both paths to the precision criterion on any machine."""

    def __init__(self, native: bool):
        self.native = native

    def __enter__(self):
        self.before, _forced[0] = _forced[0], self.native

    def __exit__(self, *exc):
        _forced[0] = self.before


def newton_schulz(G: torch.Tensor, steps: int = 5, coefficients=None, eps: float = NS_EPS, *,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """Approximately orthogonalise every ``[..., m, n]`` matrix of ``G`` (towards its ``U Vᵀ``).

    ``steps``/``coefficients`` as ``ns_schedule`` (a per-step schedule takes ``steps`` 0 or
    its length); matrices taller than wide are transposed for the iteration and back. The
    iteration runs in ``dtype`` (default ``G``'s; in bf16/fp16 every product accumulates in
    fp32 and every step's combination is rounded once, as compiled code does); the result has
    ``G``'s dtype. Differentiable (a hand-written backward; to second order through
    ``higher_order``).
    """
    schedule = ns_schedule(steps, coefficients)
    tall = G.shape[-2] > G.shape[-1]
    dt = dtype or G.dtype
    X = G.to(dt)
    if tall:
        X = X.mT
    lead, (m, n) = X.shape[:-2], X.shape[-2:]
    X = _normalise(X, eps).reshape(-1, m, n)
    if schedule:
        X = QuinticSteps.apply(X, tuple(schedule))
    X = X.reshape(*lead, m, n)
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _normalise(X: torch.Tensor, eps: float) -> torch.Tensor:
    """``X / (‖X‖_F + eps)`` per matrix; half inputs are normalised in fp32 and rounded once."""
    wide = X.float() if X.dtype in HALF else X
    return (wide / (wide.square().sum(dim=(-2, -1), keepdim=True).sqrt() + eps)).to(X.dtype)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of ``[N, ·, ·]`` batches as a GEMM computes it: half operands accumulate in fp32
    and round once (as an fp32 GEMM where ``half_gemms_native`` says the half one is slow)."""
    if a.dtype in HALF and not half_gemms_native(a.dtype, a.device):
        return torch.bmm(a.float(), b.float()).to(a.dtype)
    return torch.bmm(a, b)


def _fused(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1.0,
           alpha: float = 1.0) -> torch.Tensor:
    """``beta·c + alpha·(a @ b)`` in one GEMM with the sum as its epilogue: half operands
    accumulate in fp32 and the sum rounds once (through an fp32 GEMM where ``_product`` says)."""
    if a.dtype in HALF and not half_gemms_native(a.dtype, a.device):
        return torch.baddbmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(a.dtype)
    return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def _polynomial(A: torch.Tensor, AA: torch.Tensor, b: float, c: float,
                work: torch.Tensor | None) -> torch.Tensor:
    """``bA + cA²`` from ``A`` and ``A²``, computed in fp32 for half inputs and rounded once. Kept
    out of the GEMM's epilogue on purpose: fused into ``baddbmm``, the gradients that cancel
    through Muon's scale invariance (a momentum gate's) were measured 2.5× less precise. Half
    inputs widen into ``work`` (``[2, *A.shape]`` fp32, ``None`` for other dtypes), reused by
    every step of one iteration: a fresh fp32 temporary per step cost more in page faults on
    CPU than the arithmetic."""
    if A.dtype not in HALF:
        return b * A + c * AA
    bA, cAA = work[0].copy_(A).mul_(b), work[1].copy_(AA).mul_(c)
    return bA.add_(cAA).to(A.dtype)


def plain_quintic(X: torch.Tensor, schedule) -> torch.Tensor:
    """``QuinticSteps`` in plain differentiable ops."""
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X


class QuinticSteps(torch.autograd.Function):
    """The polynomial steps on normalised wide ``[N, m, n]`` matrices, keeping each step's
    ``X``, ``A = XXᵀ`` and ``B = bA + cA²`` for the backward (only when a gradient is wanted: in
    inference each step's matrices are freed as the next one starts).

    Backward of ``Y = aX + BX``: autograd's own formula for the step, in its order of rounding
    (``c`` scales ``dB`` before the products, ``dA X`` and ``dAᵀ X`` are separate terms), with the
    sums moved into the GEMMs' epilogues: ``dB = dY Xᵀ``, ``dA = b dB + (c dB) A + A (c dB)``,
    ``dX = a dY + B dY + dA X + dAᵀ X`` (``A`` and ``B`` are symmetric). Gradients that cancel
    through Muon's scale invariance (a momentum gate's) are sensitive to that order: symmetrising
    ``dA`` first or scaling inside the products cost them 2–3× in precision.
    """

    @staticmethod
    def forward(ctx, X, schedule):
        keep, kept = ctx.needs_input_grad[0], []
        work = X.new_empty((2, *X.shape[:-1], X.shape[-2]), dtype=torch.float32) \
            if X.dtype in HALF else None
        for a, b, c in schedule:
            A = _product(X, X.mT)
            B = _polynomial(A, _product(A, A), b, c, work)
            if keep:
                kept += [X, A, B]
            X = _fused(X, B, X, beta=a)
        ctx.save_for_backward(*kept)
        ctx.schedule = schedule
        return X

    @staticmethod
    def backward(ctx, dY):
        kept = ctx.saved_tensors
        if recording_graph():
            return (*backward_as_graph(lambda X: plain_quintic(X, ctx.schedule), kept[:1],
                                       ctx.needs_input_grad[:1], dY), None)
        dY = dY.to(kept[0].dtype).contiguous()
        for i in reversed(range(len(ctx.schedule))):
            a, b, c = ctx.schedule[i]
            X, A, B = kept[3 * i:3 * i + 3]
            dB = _product(dY, X.mT)
            cdB = dB * c
            dA = _fused(_fused(dB * b, cdB, A), A, cdB)
            dY = _fused(_fused(_fused(dY, B, dY, beta=a), dA, X), dA.mT, X)
        return dY, None


__all__ = ["newton_schulz", "QuinticSteps", "half_gemms", "half_gemms_native"]
