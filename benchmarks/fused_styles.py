"""CPU timings of layers whose loop statement cuts the sequence, whose update is a fused op, or
whose step is Muon's, converted, against the layer as written and the same function written by
hand in plain arithmetic (slices, ``+``, ``*``), side by side.

    python benchmarks/fused_styles.py [--quick] [--rounds N] [--threads N] [--backward]

The layers are ``ttt2la.zoo.fused_styles``: ``split`` chunks with a ``baddbmm`` update (cut in the
loop statement, or before the loop: a list of the pieces, a generator of slices), a
per-token delta rule over ``unbind`` pieces from ``F.mse_loss``, ``lerp`` momentum and Muon's
``baddbmm`` Newton–Schulz; and ``ttt2la.zoo.MuonStepLayer``, momentum then ``W − lr·NS(m)``;
64 features at B = 4. Rows of a case run interleaved in one process
(``ttt2la.timing``): medians, spread, ratios as medians of per-round ratios against the layer as
written; the converted rows as shipped (the plan raced against the code as written) and the plan
alone, each with its error against the layer as written; with ``--backward``, a training step
of the layer as written and converted, the error the largest over the parameter gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ttt2la
from matrix_affine_memories import (SHIPPED, _Forced, _forward_error, _gradient_error, _ran,
                                    _TrainingStep, arguments)
from ttt2la.as_written import CALLS_TO_DECIDE
from ttt2la.timing import time_side_by_side
from ttt2la.zoo.fused_styles import (BaddbmmMuonLayer, LerpMomentumLayer, ListedChunksLayer,
                                     SplitZipLayer, UnbindDeltaLayer)
from ttt2la.zoo.muon_step import MuonStepLayer

DIM, BATCH = 64, 4


def split_zip_by_hand(layer: SplitZipLayer, x):
    """``SplitZipLayer`` as a slicing loop: ``W + 0.1 kᵀ(v ⊙ lr)``."""
    q, k, v = layer.proj(x).chunk(3, dim=-1)
    k, lr = F.silu(k), F.softplus(layer.lr(x))
    W, C, outs = layer.W0.repeat(x.shape[0], 1, 1), layer.c, []
    for s in range(0, x.shape[1], C):
        outs.append(q[:, s:s + C] @ W)
        W = W + 0.1 * (k[:, s:s + C].mT @ (v[:, s:s + C] * lr[:, s:s + C]))
    return torch.cat(outs, 1)


def delta_by_hand(layer: UnbindDeltaLayer, x):
    """``UnbindDeltaLayer`` with its gradient written out: ``S − ½ kᵀ(kS − v)`` per token."""
    q, k, v = layer.proj(x).chunk(3, dim=-1)
    k = F.normalize(k, dim=-1)
    S, ys = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
    for t in range(x.shape[1]):
        kt = k[:, t:t + 1]
        S = S - 0.5 * kt.mT @ (kt @ S - v[:, t:t + 1])
        ys.append((q[:, t:t + 1] @ S)[:, 0])
    return torch.stack(ys, 1)


def lerp_by_hand(layer: LerpMomentumLayer, x):
    """``LerpMomentumLayer`` with its momentum written out: ``0.75 m + 0.25 kᵀv``."""
    q, k, v = layer.proj(x).chunk(3, dim=-1)
    W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
    m, C, outs = torch.zeros_like(W), layer.c, []
    for s in range(0, x.shape[1], C):
        outs.append(q[:, s:s + C] @ W)
        m = 0.75 * m + 0.25 * (k[:, s:s + C].mT @ v[:, s:s + C])
        W = W + m
    return torch.cat(outs, 1)


def muon_by_hand(layer: BaddbmmMuonLayer, x):
    """``BaddbmmMuonLayer`` with Newton–Schulz's products and sums apart."""
    q, k, v = layer.proj(x).chunk(3, dim=-1)
    W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
    C, outs = layer.c, []
    for s in range(0, x.shape[1], C):
        outs.append(q[:, s:s + C] @ W)
        G = k[:, s:s + C].mT @ v[:, s:s + C]
        X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(3):
            A = X @ X.mT
            X = 3.4445 * X + (-4.7750 * A + 2.0315 * (A @ A)) @ X
        W = W + X
    return torch.cat(outs, 1)


def muon_step_by_hand(layer: MuonStepLayer, x):
    """``MuonStepLayer`` with its gradient, momentum and step written out in one loop."""
    B, L, D = x.shape
    q, k, v = (t.view(B, L, layer.h, -1).transpose(1, 2) for t in layer.qkv(x).chunk(3, -1))
    k = F.normalize(k, dim=-1)
    W = x.new_zeros(B, layer.h, D // layer.h, D // layer.h)
    m, C, outs = torch.zeros_like(W), layer.c, []
    for s in range(0, L, C):
        outs.append(q[:, :, s:s + C] @ W)
        m = layer.beta * m - k[:, :, s:s + C].mT @ v[:, :, s:s + C]
        X = m / (m.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(layer.ns_steps):
            A = X @ X.mT
            X = 3.4445 * X + (-4.7750 * A + 2.0315 * (A @ A)) @ X
        W = W - layer.lr * X
    return layer.out(torch.cat(outs, dim=2).transpose(1, 2).reshape(B, L, D))


def cases(quick: bool, dim: int = DIM, batch: int = BATCH, length: int | None = None):
    """(name, layer, hand-written function, input) of every case."""
    g = torch.Generator().manual_seed(0)
    length = length or (512 if quick else 2048)
    torch.manual_seed(0)
    yield (f"split chunks, baddbmm update, chunk 64, L={length}", SplitZipLayer(dim, 64),
           split_zip_by_hand, torch.randn(batch, length, dim, generator=g))
    for how in ("list", "generator"):
        torch.manual_seed(0)
        yield (f"split chunks made before the loop ({how}), chunk 64, L={length}",
               ListedChunksLayer(dim, 64, how), split_zip_by_hand,
               torch.randn(batch, length, dim, generator=g))
    yield (f"unbind tokens, mse_loss delta rule, L={length // 2}", UnbindDeltaLayer(dim),
           delta_by_hand, torch.randn(batch, length // 2, dim, generator=g))
    yield (f"lerp momentum, chunk 64, L={length}", LerpMomentumLayer(dim, 64), lerp_by_hand,
           torch.randn(batch, length, dim, generator=g))
    yield (f"baddbmm Newton–Schulz (3 steps), chunk 64, L={length}", BaddbmmMuonLayer(dim, 64),
           muon_by_hand, torch.randn(batch, length, dim, generator=g))
    yield (f"Muon's step (momentum, 5 Newton–Schulz steps, then the rate), 2 heads, chunk 64, L={length}",
           MuonStepLayer(dim, 2, 64), muon_step_by_hand, torch.randn(batch, length, dim, generator=g))


def print_table(cases, rounds: int, backward: bool = False) -> None:
    """Convert each case's layer at level 0 and print its rows side by side (markdown): the
    forward rows, or (``backward``) a training step as written and converted."""
    what = "forward and backward" if backward else "forward under no_grad"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {what}")
    print("| case | row | ms (median) | spread | vs as written | plan that ran (error) |")
    print("|---|---|---|---|---|---|")
    for name, layer, by_hand, x in cases:
        fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        if backward:
            rows = {"as written": _TrainingStep(layer), SHIPPED: _TrainingStep(fast)}
            error = _gradient_error
        else:
            rows = {"as written": lambda t, layer=layer: layer(t),
                    "hand-written (plain arithmetic)": lambda t, f=by_hand, m=layer: f(m, t),
                    SHIPPED: _Forced(fast, None, race=True),
                    "converted, plan alone": _Forced(fast, None)}
            if by_hand is None:                 # the layer as written is the hand-written form
                del rows["hand-written (plain arithmetic)"]
            error = _forward_error
        timings = time_side_by_side(rows, (x,), rounds=rounds, max_seconds=30.0,
                                    no_grad=not backward, warmup=CALLS_TO_DECIDE)
        for row, timing in timings.items():
            plan = "" if row == "as written" else f"{error(rows, row, x):.1e}"
            if row in (SHIPPED, "converted, plan alone"):
                plan = f"{_ran(fast, x, row)} ({plan})"
            ratio = timing.speedup_over(timings["as written"]) if row != "as written" else ""
            print(f"| {name} | {row} | {timing.median * 1e3:.1f} | {timing.spread()} | {ratio} | "
                  f"{plan} |", flush=True)


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_table(cases(args.quick), args.rounds, args.backward)


if __name__ == "__main__":
    main()
