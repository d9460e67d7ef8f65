"""This machine's dense matrix-multiply peak: the yardstick the throughput benchmark divides by.

Square GEMMs ``C = A @ B`` at several sizes, ``2 n³`` FLOPs each, timed as the median of several
rounds after warm-up (``ttt2la.timing``) with torch using every core on CPU. The peak is the best
size's median rate. Run it alone with ``python benchmarks/gemm_peak.py``.
"""
from __future__ import annotations

import argparse
import os
import sys

from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttt2la.timing import Timing, time_side_by_side  # noqa: E402

DEFAULT_SIZES = (256, 512, 1024, 2048)


@dataclass
class GemmPeak:
    """Measured GEMM rates: FLOP/s per matrix size and the best of them."""

    device: str
    dtype: str
    threads: int
    timings: dict[int, Timing]          # per size n; units are FLOPs

    @property
    def flops_per_size(self) -> dict[int, float]:
        return {n: t.rate for n, t in self.timings.items()}

    @property
    def peak(self) -> float:
        return max(self.flops_per_size.values())


def measure_gemm_peak(sizes=DEFAULT_SIZES, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", repeats: int = 9,
                      max_seconds: float = 5.0) -> GemmPeak:
    """Time square ``n x n`` GEMMs for each ``n`` in ``sizes`` and return the FLOP/s of each.

    On CPU, torch is set to one thread per core first (``os.cpu_count()``), as a tuned library
    would run; TF32 is left as torch's default (off for fp32 matmuls), so fp32 means fp32.
    Each size gets up to ``repeats`` rounds or ``max_seconds`` of timing (at least 3 rounds).
    """
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    generator = torch.Generator(device=device).manual_seed(0)
    timings = {}
    for n in sizes:
        a = torch.randn(n, n, generator=generator, device=device).to(dtype)
        b = torch.randn(n, n, generator=generator, device=device).to(dtype)
        timings[n] = time_side_by_side({"gemm": torch.matmul}, (a, b), 2 * n**3, rounds=repeats,
                                       max_seconds=max_seconds)["gemm"]
    return GemmPeak(str(device), str(dtype).removeprefix("torch."), torch.get_num_threads(),
                    timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    result = measure_gemm_peak(args.sizes, dtype=getattr(torch, args.dtype), device=args.device,
                               repeats=args.repeats)
    print(f"{result.dtype} GEMM on {result.device} ({result.threads} threads)")
    for n, t in result.timings.items():
        print(f"  n={n:5d}: {t.rate / 1e9:10.1f} GFLOP/s ({t.spread()})")
    print(f"peak: {result.peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
