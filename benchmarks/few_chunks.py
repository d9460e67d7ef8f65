"""Chunked layers on ``block_linear_attention`` at a few chunks, against their source: the forward
without gradients (the plan alone, race off) and a training step (forward + backward, which
never races), one thread, interleaved calls, medians with the min–max spread, and the forward
split into the runtime op, the rest of the lifted plan and the rest of the call (guards, the
code around the loop).

    python benchmarks/few_chunks.py [--lengths 256 1024] [--rounds 25] [--dim 64]

Run from the repository root on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ttt2la
import ttt2la.lowering.lift as lift
import ttt2la.runtime.dispatch as dispatch
from ttt2la.zoo import FlaChunkReferenceLayer, GatedChunkMemory, ListedChunksLayer, SplitZipLayer

from single_step import _spread, _time as _ms

LAYERS = {
    "SplitZipLayer": lambda d: SplitZipLayer(d, 64),
    "ListedChunksLayer": lambda d: ListedChunksLayer(d, 64, "list"),
    "GatedChunkMemory": lambda d: GatedChunkMemory(d, 4, 64),
    "FlaChunkReferenceLayer(gla)": lambda d: FlaChunkReferenceLayer(d, 2, rule="gla",
                                                                    chunk_size=64),
}


def _interleaved(calls: dict, rounds: int) -> dict[str, list[float]]:
    """Each call's times over ``rounds`` rounds after 3 untimed, the order flipped each round."""
    times = {name: [] for name in calls}
    order = list(calls.items())
    for i in range(rounds + 3):
        for name, call in (order if i % 2 else order[::-1]):
            t = _ms(call)
            if i >= 3:
                times[name].append(t)
    return times


def _training(m, x):
    def step():
        m(x).sum().backward()
        m.zero_grad(set_to_none=True)
    return step


class _Phases:
    """The forward's time in the runtime op and in the lifted plan around it (each call's)."""

    def __init__(self):
        self.op, self.plan = [], []

    def __enter__(self):
        self._op, self._plan = dispatch._TORCH["block"], lift.LiftedPlan.__call__

        def op(*a, **k):
            start = time.perf_counter()
            try:
                return self._op(*a, **k)
            finally:
                self.op.append((time.perf_counter() - start) * 1e3)

        def whole(plan, *a, **k):
            start = time.perf_counter()
            try:
                return self._plan(plan, *a, **k)
            finally:
                self.plan.append((time.perf_counter() - start) * 1e3)

        dispatch._TORCH["block"], lift.LiftedPlan.__call__ = op, whole
        return self

    def __exit__(self, *exc):
        dispatch._TORCH["block"], lift.LiftedPlan.__call__ = self._op, self._plan


def row(name: str, layer: torch.nn.Module, x: torch.Tensor, rounds: int) -> None:
    """Print the forward and training-step rows of one layer at one length."""
    with ttt2la.race_as_written(False):
        conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
        with torch.no_grad():
            fwd = _interleaved({"plan": lambda: conv(x), "source": lambda: layer(x)}, rounds)
            with _Phases() as phases:
                whole = [_ms(lambda: conv(x)) for _ in range(rounds)]
        train = _interleaved({"plan": _training(conv, x), "source": _training(layer, x)},
                             rounds)
    op = statistics.median(phases.op) if phases.op else 0.0
    plan = statistics.median(phases.plan) if phases.plan else 0.0
    split = (f"op {op:.2f}, plan around it {plan - op:.2f}, call around the plan "
             f"{statistics.median(whole) - plan:.2f} ms" if phases.op and phases.plan
             else "no block op ran")
    for what, t in (("forward", fwd), ("training step", train)):
        ratio = statistics.median(t["source"]) / statistics.median(t["plan"])
        print(f"| {name} | {x.shape[1]} | {what} | {_spread(t['plan'])} | "
              f"{_spread(t['source'])} | {ratio:.2f}× | {split if what == 'forward' else ''} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"B = 2, {a.dim} features, chunk 64, level 0, one thread; plan (race off) against "
          "source, medians (min–max) of interleaved calls\n")
    print("| layer | L | call | plan | source | source / plan | forward's split |\n"
          "|---|---:|---|---:|---:|---:|---|")
    for L in a.lengths:
        for name in a.layers:
            torch.manual_seed(0)
            row(name, LAYERS[name](a.dim), torch.randn(2, L, a.dim), a.rounds)


if __name__ == "__main__":
    main()
