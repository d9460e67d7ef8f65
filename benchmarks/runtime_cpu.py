"""CPU timings of the runtime ops against a plain loop over chunks doing the same math.

    PYTHONPATH=. python benchmarks/runtime_cpu.py [--quick] [--rounds N] [--threads N]

The loop is what a user writes by hand (per chunk: the increment ``φ(K_j)ᵀ(lr ⊙ V_j)``, momentum,
Newton–Schulz, the state add, the read ``φ(Q_j) W``), fp32 throughout. Each round times every
variant once, interleaved, after a warm-up; the table gives the median over the rounds and the
spread (min-max) of the op/loop ratio. On a shared machine only ratios from one run mean much.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from ttt2la.runtime import block_linear_attention

MUON = (3.4445, -4.7750, 2.0315)


def plain_loop(q, k, v, lr, momentum, steps, C):
    """The block rule, exclusive order, written as a loop over chunks."""
    B, T, H, D = q.shape
    n = math.ceil(T / C)
    W = q.new_zeros(B, H, D, v.shape[-1])
    M = None
    u = v * lr.unsqueeze(-1)
    outs = []
    for j in range(n):
        sl = slice(j * C, (j + 1) * C)
        outs.append(torch.einsum("bthk,bhkv->bthv", q[:, sl], W))
        if j == n - 1:
            break
        G = torch.einsum("bthk,bthv->bhkv", k[:, sl], u[:, sl])
        M = G if M is None else momentum[:, j, :, None, None] * M + G
        X = M
        if steps:
            X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
            for _ in range(steps):
                A = X @ X.mT
                X = MUON[0] * X + (MUON[1] * A + MUON[2] * (A @ A)) @ X
        W = W + X
    return torch.cat(outs, dim=1)


def op(q, k, v, lr, momentum, steps, C):
    return block_linear_attention(q, k, v, chunk_size=C, lr=lr, momentum=momentum,
                                  muon_steps=steps, backend="torch")[0]


def job(fn, inputs, steps, C, backward):
    def run():
        xs = [x.detach().requires_grad_(backward) for x in inputs]
        o = fn(*xs, steps, C)
        if backward:
            o.sum().backward()
    return run


def compare(B, T, H, D, C, steps, backward, rounds):
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(B, T, H, D, generator=g) for _ in range(3)]
    inputs += [torch.rand(B, T, H, generator=g),
               0.5 + 0.4 * torch.rand(B, math.ceil(T / C), H, generator=g)]
    runs = {"op": job(op, inputs, steps, C, backward), "loop": job(plain_loop, inputs, steps, C,
                                                                   backward)}
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ratios = [lp / o for o, lp in zip(times["op"], times["loop"])]
    med = {name: statistics.median(t) for name, t in times.items()}
    return (f"B={B} T={T} H={H}×{D} C={C}", f"{steps}", "fwd+bwd" if backward else "fwd",
            f"{B * T / med['op'] / 1e6:.3f}", f"{B * T / med['loop'] / 1e6:.3f}",
            f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunk", type=int, default=None, help="only the shapes with this chunk size")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(4, 8192, 1, 128, 2048), (1, 4096, 4, 128, 64), (1, 16384, 4, 128, 2048)]
    if args.quick:
        shapes = [(2, 2048, 1, 64, 512), (1, 1024, 4, 64, 64)]
    shapes = [sh for sh in shapes if args.chunk in (None, sh[-1])]
    print(f"## block op vs plain loop, fp32, momentum, exclusive (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} interleaved rounds)\n")
    print("| shape | NS steps | pass | op M tok/s | loop M tok/s | op/loop | spread |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        for steps in (0, 5):
            for backward in (False, True):
                print("| " + " | ".join(compare(*shape, steps, backward, args.rounds)) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
