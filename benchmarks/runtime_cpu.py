"""CPU timings behind the runtime's strategy choices; prints Markdown tables.

    PYTHONPATH=. python benchmarks/runtime_cpu.py [--quick] [--threads N] [--out FILE.md]

1. ``affine_scan``: sequential loop vs log-depth doubling, by number of steps and state size
   (sets ``scan.SEQUENTIAL_MAX_STEPS`` / ``scan.DOUBLING_MAX_NUMEL``).
2. Block op state pass: ``torch.cumsum`` over chunks vs a loop of adds, and the Appendix-H masked
   form ``Φ(Q)W₀ + ((Φ(Q)Φ(K)ᵀ) ⊙ mask) U`` vs the state form.
3. The block op's matmuls with heads batched in vs one call per head.
4. The block and token-causal ops against their recurrent references, forward and backward.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from ttt2la.runtime import (block_linear_attention, chunk_linear_attention,
                            naive_block_linear_attention, naive_chunk_linear_attention)
from ttt2la.runtime.block import chunk_increments, read_states
from ttt2la.runtime.scan import affine_scan_doubling, affine_scan_sequential


def timeit(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` runs after one warm-up, in milliseconds."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def table(title, header, rows):
    lines = [f"\n### {title}\n", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_scans(quick, repeats):
    rows = []
    for d in ((4, 16, 64) if quick else (4, 8, 16, 32, 64, 128)):
        for n in ((4, 16, 64, 512) if quick else (4, 8, 16, 32, 64, 128, 512, 2048)):
            if n * d * d > (1 << 22):
                continue
            f = torch.randn(1, n, 4, d, d)
            a = torch.rand(1, n, 4, 1, 1)
            seq = timeit(lambda: affine_scan_sequential(a, f, dim=1), repeats)
            dbl = timeit(lambda: affine_scan_doubling(a, f, dim=1), repeats)
            rows.append((f"{d}x{d}", n, f"{seq:.2f}", f"{dbl:.2f}",
                         "sequential" if seq <= dbl else "doubling"))
    return table("affine_scan, 4 heads, ms", ["state", "steps", "sequential", "doubling", "faster"],
                 rows)


def masked_form(phi_q, phi_k, u, C, W0):
    """Appendix H, inclusive order, no momentum: token-level mask over the chunk index."""
    T = phi_q.shape[1]
    chunk = torch.arange(T) // C
    mask = (chunk[:, None] >= chunk[None, :]).to(phi_q.dtype)
    scores = torch.einsum("bthk,bshk->bhts", phi_q, phi_k) * mask
    return torch.einsum("bhts,bshv->bthv", scores, u) + torch.einsum("bthk,bhkv->bthv", phi_q, W0)


def state_form(phi_q, phi_k, u, C, W0, sequential):
    B, T, H, Dk = phi_k.shape
    n = math.ceil(T / C)
    G = chunk_increments(phi_k, u, n, C)
    if sequential:
        W, states = W0, []
        for g in G.unbind(1):
            W = W + g
            states.append(W)
        states = torch.stack(states, 1)
    else:
        states = torch.cumsum(G, dim=1) + W0.unsqueeze(1)
    return read_states(phi_q, states, n, C)


def bench_block_forms(quick, repeats):
    rows = []
    cases = [(64, 16, 64), (256, 64, 64), (1024, 256, 64), (4096, 64, 64), (2048, 512, 128),
             (8192, 2048, 128), (16384, 128, 64)]
    if quick:
        cases = cases[:2] + cases[4:6]
    for T, C, D in cases:
        phi_q, phi_k, u = (torch.randn(1, T, 4, D) for _ in range(3))
        W0 = torch.randn(1, 4, D, D)
        cum = timeit(lambda: state_form(phi_q, phi_k, u, C, W0, False), repeats)
        seq = timeit(lambda: state_form(phi_q, phi_k, u, C, W0, True), repeats)
        msk = timeit(lambda: masked_form(phi_q, phi_k, u, C, W0), repeats) if T <= 4096 else None
        rows.append((T, C, D, T // C, f"{cum:.2f}", f"{seq:.2f}",
                     "-" if msk is None else f"{msk:.2f}"))
    return table("block op forms (inclusive, no momentum/Muon/norm), 4 heads, ms",
                 ["T", "C", "D", "chunks", "state, cumsum", "state, loop", "masked (App. H)"],
                 rows)


def heads_batched(phi_q, phi_k, u, C):
    """Increments, cumsum and outputs with heads batched into the matmuls (transposed copies)."""
    B, T, H, D = phi_k.shape
    n = T // C
    kc = phi_k.view(B, n, C, H, D).permute(0, 1, 3, 4, 2)
    uc = u.view(B, n, C, H, D).transpose(2, 3)
    states = (kc @ uc).cumsum(1)
    qc = phi_q.view(B, n, C, H, D).transpose(2, 3)
    return (qc @ states).transpose(2, 3).reshape(B, T, H, D)


def heads_looped(phi_q, phi_k, u, C):
    """The same with one matmul per head over strided views (what ``block.py`` does)."""
    B, T, H, D = phi_k.shape
    n = T // C
    states = chunk_increments(phi_k, u, n, C).cumsum(1)
    return read_states(phi_q, states, n, C)


def bench_layouts(quick, repeats):
    rows = []
    cases = [(1, 16384, 4, 128, 2048), (2, 4096, 8, 64, 512), (1, 8192, 16, 64, 64)]
    for B, T, H, D, C in cases[:2] if quick else cases:
        x = [torch.randn(B, T, H, D) for _ in range(3)]
        batched = timeit(lambda: heads_batched(*x, C), repeats)
        looped = timeit(lambda: heads_looped(*x, C), repeats)
        rows.append((B, T, H, D, C, f"{batched:.1f}", f"{looped:.1f}"))
    return table("block matmuls: heads batched vs one call per head, ms",
                 ["B", "T", "H", "D", "C", "heads batched", "per head"], rows)


def fwd_bwd(fn, args, kwargs):
    leaves = [a.detach().clone().requires_grad_() for a in args]

    def run():
        o, final = fn(*leaves, **kwargs)
        loss = o.sum() + (final.sum() if final is not None else 0)
        torch.autograd.grad(loss, leaves)
    return run


def bench_ops(quick, repeats):
    rows = []
    H = 4
    shapes = [(4096, 512, 64), (4096, 64, 32)] if quick else [(16384, 2048, 128), (16384, 128, 64)]
    block_cases = [("exclusive", 0, False), ("exclusive", 5, False), ("inclusive", 5, True)]
    for T, C, D in shapes:
        x = [torch.randn(1, T, H, D) for _ in range(3)]
        lr = torch.rand(1, T, H)
        momentum = torch.rand(1, math.ceil(T / C), H)
        for order, muon, wn in block_cases:
            kw = dict(chunk_size=C, order=order, lr=lr, momentum=momentum, muon_steps=muon,
                      weight_norm=torch.ones(1, H, D) if wn else None, output_final_state=True)
            fast = timeit(lambda: block_linear_attention(*x, backend="torch", **kw), repeats)
            ref = timeit(lambda: naive_block_linear_attention(*x, **kw), repeats)
            fb = timeit(fwd_bwd(lambda *a, **k: block_linear_attention(*a, backend="torch", **k),
                                x, kw), repeats)
            rows.append((f"block {order} muon={muon} wn={wn}", f"T={T} C={C} D={D}",
                         f"{fast:.1f}", f"{ref:.1f}", f"{fb:.1f}"))
    Tc = 1024 if quick else 4096
    xc = [torch.randn(1, Tc, H, 64) for _ in range(3)]
    decay = torch.nn.functional.logsigmoid(torch.randn(1, Tc, H) + 3)
    for C in (32, 64, 128):
        kw = dict(chunk_size=C, log_decay=decay, output_final_state=True)
        fast = timeit(lambda: chunk_linear_attention(*xc, backend="torch", **kw), repeats)
        ref = (timeit(lambda: naive_chunk_linear_attention(*xc, **kw), 1) if C == 64 else None)
        fb = timeit(fwd_bwd(lambda *a, **k: chunk_linear_attention(*a, backend="torch", **k),
                            xc, kw), repeats)
        rows.append((f"chunk (decay) C={C}", f"T={Tc} D=64", f"{fast:.1f}",
                     "-" if ref is None else f"{ref:.1f}", f"{fb:.1f}"))
    return table(f"runtime ops, fp32, {H} heads, ms",
                 ["op", "shape", "torch fwd", "naive fwd", "torch fwd+bwd"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    header = (f"## runtime CPU benchmark (torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads)")
    report = "\n".join([header, bench_scans(args.quick, args.repeats),
                        bench_block_forms(args.quick, args.repeats),
                        bench_layouts(args.quick, args.repeats),
                        bench_ops(args.quick, args.repeats)])
    print(report)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report + "\n")


if __name__ == "__main__":
    main()
