"""CPU timings of the delta-rule op: the chunked form with the log-depth (pairwise) and the
sequential scan over chunks, against the token loop (``naive_delta_rule``), and the two scans
alone.

    PYTHONPATH=. python benchmarks/delta_rule_cpu.py [--rounds N] [--threads N]

Each round times every variant once, interleaved, after a warm-up; the tables give medians over
the rounds. On a shared machine only ratios from one run mean much.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ttt2la.runtime import delta_rule, matrix_affine_scan

OP_SHAPES = [  # B, T, H, D, C
    (1, 1024, 4, 64, 64),
    (1, 4096, 4, 64, 64),
    (1, 4096, 2, 128, 64),
    (1, 4096, 4, 64, 16),
]
#: Longest sequence whose token loop is also timed forward + backward (its autograd graph of
#: per-token ops takes tens of seconds beyond that on a loaded machine).
LOOP_BACKWARD_MAX_T = 1024
SCAN_SHAPES = [(4, n, 64) for n in (16, 64, 256, 1024)] + [(4, 64, 128), (4, 256, 128)]


def inputs(B, T, H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
    v = torch.randn(B, T, H, D, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    decay = torch.sigmoid(torch.randn(B, T, H, generator=g) + 3)
    return q, k, v, beta, decay


def timed(fn, rounds):
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def op_job(tensors, C, backend, scan, backward):
    def run():
        xs = [x.detach().requires_grad_(backward) for x in tensors]
        o, _ = delta_rule(*xs[:4], decay=xs[4], chunk_size=C, backend=backend, scan=scan)
        if backward:
            o.sum().backward()
    return run


def bench_op(rounds, skip=0):
    print("| B, T, H, D, C | chunks | pass | pairwise ms | sequential ms | token loop ms |")
    print("|---|---|---|---|---|---|")
    for B, T, H, D, C in OP_SHAPES[skip:]:
        tensors = inputs(B, T, H, D)
        for backward in (False, True):
            variants = [("pairwise", "torch", "pairwise"), ("sequential", "torch", "sequential")]
            if not backward or T <= LOOP_BACKWARD_MAX_T:
                variants.append(("loop", "naive", "pairwise"))
            jobs = {name: op_job(tensors, C, backend, scan, backward)
                    for name, backend, scan in variants}
            times = {name: [] for name in jobs}
            for _ in range(rounds):
                for name, job in jobs.items():
                    times[name] += timed(job, 1)
            ms = {n: f"{1e3 * statistics.median(t):.1f}" for n, t in times.items()}
            print(f"| {B}, {T}, {H}, {D}, {C} | {T // C} | {'fwd+bwd' if backward else 'fwd'} | "
                  f"{ms['pairwise']} | {ms['sequential']} | {ms.get('loop', '—')} |", flush=True)


def bench_scan(rounds):
    print("| batch, chunks, D | pass | pairwise ms | sequential ms |")
    print("|---|---|---|---|")
    for N, n, D in SCAN_SHAPES:
        g = torch.Generator().manual_seed(1)
        A = torch.randn(N, n, D, D, generator=g) / D
        Bm = torch.randn(N, n, D, D, generator=g)
        S0 = torch.randn(N, D, D, generator=g)
        for backward in (False, True):
            def job(method):
                def run():
                    a, b = A.detach().requires_grad_(backward), Bm.detach().requires_grad_(backward)
                    S = matrix_affine_scan(a, b, S0, method=method)
                    if backward:
                        S.sum().backward()
                return run
            times = {m: [] for m in ("pairwise", "sequential")}
            for _ in range(rounds):
                for m in times:
                    times[m] += timed(job(m), 1)
            ms = {m: 1e3 * statistics.median(t) for m, t in times.items()}
            print(f"| {N}, {n}, {D} | {'fwd+bwd' if backward else 'fwd'} | "
                  f"{ms['pairwise']:.2f} | {ms['sequential']:.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("op", "scan"), default=None)
    parser.add_argument("--skip", type=int, default=0, help="skip the first SKIP op shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "op":
        bench_scan(args.rounds)
    if args.only != "scan":
        bench_op(args.rounds, args.skip)


if __name__ == "__main__":
    main()
