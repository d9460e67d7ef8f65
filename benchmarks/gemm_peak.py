"""This machine's dense matrix-multiply peak: the yardstick the throughput benchmark divides by.

Square GEMMs ``C = A @ B`` at several sizes, ``2 n³`` FLOPs each, timed as the median of several
runs (``ttt2la.cli.measure_throughput``) with torch using every core on CPU. The peak is the best
size's median rate. Run it alone with ``python benchmarks/gemm_peak.py``.
"""
from __future__ import annotations

import argparse
import os

from dataclasses import dataclass

import torch

from ttt2la.cli import measure_throughput

DEFAULT_SIZES = (256, 512, 1024, 2048)


@dataclass
class GemmPeak:
    """Measured GEMM rates: FLOP/s per matrix size and the best of them."""

    device: str
    dtype: str
    threads: int
    flops_per_size: dict[int, float]

    @property
    def peak(self) -> float:
        return max(self.flops_per_size.values())


def measure_gemm_peak(sizes=DEFAULT_SIZES, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", repeats: int = 5) -> GemmPeak:
    """Time square ``n x n`` GEMMs for each ``n`` in ``sizes`` and return the FLOP/s of each.

    On CPU, torch is set to one thread per core first (``os.cpu_count()``), as a tuned library
    would run; TF32 is left as torch's default (off for fp32 matmuls), so fp32 means fp32.
    """
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    generator = torch.Generator(device=device).manual_seed(0)
    rates = {}
    with torch.no_grad():
        for n in sizes:
            a = torch.randn(n, n, generator=generator, device=device).to(dtype)
            b = torch.randn(n, n, generator=generator, device=device).to(dtype)
            rates[n] = measure_throughput({"gemm": torch.matmul}, (a, b), 2 * n**3,
                                          repeats=repeats)["gemm"]
    return GemmPeak(str(device), str(dtype).removeprefix("torch."), torch.get_num_threads(), rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = measure_gemm_peak(args.sizes, dtype=getattr(torch, args.dtype), device=args.device,
                               repeats=args.repeats)
    print(f"{result.dtype} GEMM on {result.device} ({result.threads} threads)")
    for n, rate in result.flops_per_size.items():
        print(f"  n={n:5d}: {rate / 1e9:10.1f} GFLOP/s")
    print(f"peak: {result.peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
