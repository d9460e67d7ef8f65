"""Single-step (ViTTT-like) blocks at level 0 against their source: the zoo's ``ViTTTBlock``
(its gate's kernel not stepped, so level 0 converts it) and ``ViTTTClosedFormBlock``, each on one
chunk of all its tokens, run by the generic executor. Interleaved calls of the plan alone
(``race_as_written(False)``) and of the source: forward without gradients and a training step
(forward + backward), one thread, wall time, medians with the min–max spread.

    python benchmarks/single_step.py [--rounds 25] [--dim 64] [--side 32]

Run from the repository root on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ttt2la
from ttt2la.zoo import ViTTTBlock, ViTTTClosedFormBlock


def _time(f) -> float:
    start = time.perf_counter()
    f()
    return (time.perf_counter() - start) * 1e3


def _spread(v: list[float]) -> str:
    return f"{statistics.median(v):.2f} ms ({min(v):.2f}–{max(v):.2f})"


def race(name: str, layer: torch.nn.Module, x: torch.Tensor, rounds: int) -> None:
    """Print the plan's and the source's times, forward and training step, interleaved."""
    with ttt2la.race_as_written(False):
        conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
        xg = x.clone().requires_grad_()
        calls = {
            "forward": lambda m: m(x),
            "training step": lambda m: m(xg).square().sum().backward(),
        }
        for what, call in calls.items():
            times = {"plan": [], "source": []}
            for i in range(rounds + 3):
                order = ((conv, "plan"), (layer, "source"))
                for m, side in order if i % 2 else order[::-1]:
                    with torch.set_grad_enabled(what != "forward"):
                        t = _time(lambda: call(m))
                    if i >= 3:
                        times[side].append(t)
            ratio = statistics.median(times["source"]) / statistics.median(times["plan"])
            print(f"| {name} | {what} | {_spread(times['plan'])} | {_spread(times['source'])} "
                  f"| {ratio:.2f}× |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--side", type=int, default=32, help="image side: side² tokens")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(2, a.side * a.side, a.dim)
    print(f"B = 2, {a.side}×{a.side} tokens, {a.dim} features, 2 heads, one thread; plan "
          "(race off) against source, medians (min–max)\n")
    print("| block | call | plan | source | source / plan |\n|---|---|---:|---:|---:|")
    race("ViTTTBlock", ViTTTBlock(a.dim, 2, a.side, a.side, update_gate=False), x, a.rounds)
    race("ViTTTClosedFormBlock", ViTTTClosedFormBlock(a.dim, 2, update_gate=False), x, a.rounds)


if __name__ == "__main__":
    main()
