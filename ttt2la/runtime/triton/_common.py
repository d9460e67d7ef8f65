"""Shared pieces of the Triton kernels: matmul and reduction helpers, dtypes, tile sizes and launch options.

Importing this module imports Triton; the package ``__init__`` only imports it when a kernel is asked for.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Whether the kernels of this process were built for Triton's CPU interpreter. It is read once, when the
#: kernels are decorated, because that is when Triton decides between compiling and interpreting.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# The kernels use these (and ``tl.full`` for ``tl.zeros``) instead of ``tl.cdiv``/``tl.sum``/``tl.cumsum``:
# those are ``@jit`` functions of Triton's own library, built when Triton is imported, so they cannot run in
# the CPU interpreter unless Triton itself was imported with ``TRITON_INTERPRET=1`` (and torch imports Triton
# early, e.g. for ``torch._dynamo``). Sums and cumulative sums combine with Triton's own ``_sum_combine``, the
# ``a + b`` that ``tl.sum`` and ``tl.cumsum`` pass: compiled, it is any ``a + b``; the interpreter never calls
# it, but recognises it and sums with numpy, where it would call a combine of ours in Python once per
# element (a scan) or per row (a reduction).

@triton.jit
def cdiv(a, b):
    """``ceil(a / b)`` for positive integers."""
    return (a + b - 1) // b


@triton.jit
def total(x, axis: tl.constexpr):
    """Sum of ``x`` along ``axis``."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def cumulative(x, axis: tl.constexpr, REVERSE: tl.constexpr):
    """Inclusive cumulative sum of ``x`` along ``axis`` (from the end with ``REVERSE``)."""
    return tl.associative_scan(x, axis, tl.standard._sum_combine, reverse=REVERSE)


@triton.jit
def mm(a, b, DT: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` with both operands rounded to ``DT`` first, accumulated in fp32.

    With ``UPCAST`` the rounded operands are multiplied in fp32 ("ieee": no tf32 for fp32 inputs). The
    interpreter needs it for bf16 too, where it would otherwise multiply the raw 16-bit patterns.
    """
    if UPCAST:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _split(x, DT: tl.constexpr):
    """``x`` (fp32) as ``hi + lo`` with both parts in ``DT``: about twice ``DT``'s mantissa."""
    hi = x.to(DT)
    return hi, (x.to(tl.float32) - hi.to(tl.float32)).to(DT)


@triton.jit
def mm_split(a, b, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` like ``mm``, but the operands flagged ``SPLIT_*`` keep about 16 mantissa bits.

    For fp32 operands computed in the kernel (a scaled value, a feature map) that feed a map which amplifies
    rounding, such as Newton–Schulz; each split costs one more low-precision matmul (the ``lo·lo`` term is
    dropped).
    """
    if SPLIT_A:
        a_hi, a_lo = _split(a, DT)
        if SPLIT_B:
            b_hi, b_lo = _split(b, DT)
            return mm(a_hi, b_hi, DT, UPCAST) + mm(a_hi, b_lo, DT, UPCAST) + mm(a_lo, b_hi, DT, UPCAST)
        else:
            return mm(a_hi, b, DT, UPCAST) + mm(a_lo, b, DT, UPCAST)
    else:
        if SPLIT_B:
            b_hi, b_lo = _split(b, DT)
            return mm(a, b_hi, DT, UPCAST) + mm(a, b_lo, DT, UPCAST)
        else:
            return mm(a, b, DT, UPCAST)


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

#: Matmul operand dtypes that run on tensor cores and can be split (``mm_split``).
HALF_DTYPES = (torch.bfloat16, torch.float16)


def tl_dtype(dtype: torch.dtype):
    """The Triton element type of a torch dtype the kernels accept."""
    return _TL_DTYPE[dtype]


def upcast(dtype: torch.dtype) -> bool:
    """Whether matmuls on ``dtype`` operands run as fp32 "ieee" dots (fp32 inputs, or the interpreter)."""
    return dtype == torch.float32 or INTERPRET


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of matmuls on ``dtype`` operands: fp32 (the kernels take no float64)."""
    return torch.float32


def tile(dim: int, cap: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Power-of-two tile side for a dimension of ``dim``: ``cap`` (halved for fp32/float64 operands).

    fp32/float64 matmuls run on CUDA cores, which hold whole operand tiles in registers (64-wide fp32 tiles
    spill heavily on Hopper, as ``ahead_of_time`` shows). Compiled kernels always use the full tile, so
    shapes share compilations (the dimensions are runtime arguments); the interpreter shrinks it to the
    dimension (at least 16, the smallest ``tl.dot`` side), which is faster there.
    """
    if dtype not in HALF_DTYPES:
        cap = max(16, cap // 2)
    if not INTERPRET:
        return cap
    return max(16, min(cap, triton.next_power_of_2(dim)))


def token_tile(chunk_size: int, dtype: torch.dtype) -> int:
    """Tokens per program tile for chunks of ``chunk_size``: the tile cap, or less for shorter chunks (a tile
    never spans two chunks, so a wider one would only be masked)."""
    cap = 64 if dtype in HALF_DTYPES else 32
    return max(16, min(cap, triton.next_power_of_2(chunk_size)))


def launch_options(*tiles: int) -> dict:
    """``num_warps``/``num_stages`` for a program whose tiles have these sides.

    Eight warps once a side reaches 64: with four, the 64×64 tiles of these kernels need more than 255
    registers per thread and spill (``ahead_of_time`` on sm_90).
    """
    if INTERPRET:
        return {}
    return {"num_warps": default_warps(*tiles), "num_stages": 2}


def default_warps(*tiles: int) -> int:
    """The default warp count of ``launch_options`` for tiles with these sides."""
    return 8 if max(tiles) >= 64 else 4


def contiguous(*tensors):
    """The tensors made contiguous (``None`` passes through)."""
    return tuple(None if t is None else t.contiguous() for t in tensors)
