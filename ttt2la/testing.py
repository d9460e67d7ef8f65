"""Numerical comparison helpers shared by the test suite, the benchmarks and ``convert``'s checks."""
from __future__ import annotations

import torch

#: Relative RMS error allowed between two computations that are mathematically equal.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)``, computed in float64 (0 when both are 0)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    num = torch.linalg.vector_norm(a - e)
    den = torch.linalg.vector_norm(e)
    if den == 0:
        return float(num)
    return float(num / den)


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE[dtype]


__all__ = ["rel_rms_error", "tolerance", "TOLERANCE"]
