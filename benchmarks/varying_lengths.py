"""Converted layers fed a length that changes call by call, against the code they replace.

A converted layer builds what depends on a call's sizes the first time it sees them (the code
around its loop per length, its loop per batch size, with gradients its planned feature graphs
per shape); a model fed sequences of many lengths pays that on every new one. Each case converts
a layer at L = 128, warms both sides at an unrelated length, then calls both, interleaved (the
order alternating), at ``--calls`` lengths drawn from 64..512 in steps of ``--step`` (step 1: most
calls end in a partial chunk; a layer that runs whole chunks only takes multiples of its chunk).
It prints the totals, the median and quartiles of the per-call
ratios (original time / converted time: above 1 the conversion is faster), and what the first
call at a new length costs against a later call at it.

    python benchmarks/varying_lengths.py [--train] [--step 1] [--calls 60]

With ``--overhead`` it times instead what a converted call costs beyond the original at short
calls, no gradients: shapes whose race keeps the code as written (set so, not raced, so that
every run times the same path) and shapes that run the plan, the original and the converted
layer interleaved (the order alternating), medians and quartiles of ``--calls`` calls each; for
a planned call also the plan's graph called alone, and what the wrapper adds to it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

import ttt2la
from ttt2la import zoo
from ttt2la.as_written import PLAN, WRITTEN, Race
from ttt2la.ir import params_and_buffers
from ttt2la.zoo import lact_layer


def _cases():
    """``(name, layer, level, the step its lengths take)``: the gated memory's loop runs over
    whole chunks only."""
    torch.manual_seed(0)
    yield "LaCT variant 2, 64 features, 2 heads, chunk 16, level 2", \
        lact_layer("folded", variant=2, d_model=64, num_heads=2, chunk_size=16), 2, 1
    yield "gated chunk memory, 64 features, 2 heads, chunk 16, level 0", \
        zoo.GatedChunkMemory(64, 2, 16), 0, 16


def _call(module, x: torch.Tensor, train: bool) -> None:
    if train:
        x = x.detach().requires_grad_()
        module(x).square().mean().backward()
    else:
        with torch.no_grad():
            module(x)


def _timed(module, x, train: bool) -> float:
    start = time.perf_counter()
    _call(module, x, train)
    return time.perf_counter() - start


def _quartiles(values) -> str:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return f"median {q2:.2f}x (quartiles {q1:.2f}-{q3:.2f})"


def run_case(name: str, layer, level: int, step: int, args) -> None:
    layer = layer.eval()
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 128, 64),))
    for module in (layer, conv):
        for _ in range(2):
            _call(module, torch.randn(1, 96, 64), args.train)
    rng = random.Random(0)
    step = step * max(1, args.step // step)
    lengths = [rng.randrange(64, 513, step) for _ in range(args.calls)]
    times = {"original": [], "converted": []}
    for i, L in enumerate(lengths):
        x = torch.randn(1, L, 64)
        sides = [("original", layer), ("converted", conv)]
        for side, module in sides if i % 2 == 0 else sides[::-1]:
            times[side].append(_timed(module, x, args.train))
    ratios = [o / c for o, c in zip(times["original"], times["converted"])]
    total = sum(times["original"]) / sum(times["converted"])
    print(f"{name}, {'training step' if args.train else 'forward, no gradients'}: "
          f"{len(lengths)} calls at {len(set(lengths))} lengths in steps of {step}; total original "
          f"{sum(times['original']):.3f} s, converted {sum(times['converted']):.3f} s "
          f"({total:.2f}x); per call {_quartiles(ratios)}")
    firsts, laters = [], []
    for L in (528, 544, 560, 576, 592):      # longer than any drawn: new
        x = torch.randn(1, L, 64)
        firsts.append(_timed(conv, x, args.train))
        for _ in range(9):
            _call(conv, x, args.train)
        laters.append(_timed(conv, x, args.train))
    print(f"  first call at a new length {statistics.median(firsts) * 1e3:.1f} ms "
          f"({min(firsts) * 1e3:.1f}-{max(firsts) * 1e3:.1f}), its eleventh "
          f"{statistics.median(laters) * 1e3:.1f} ms ({min(laters) * 1e3:.1f}-"
          f"{max(laters) * 1e3:.1f}), five lengths")


def _overhead_cases():
    """``(name, layer, level, length, side)``: the race's side set at that length."""
    torch.manual_seed(0)
    lact = lambda: lact_layer("folded", variant=2, d_model=64, num_heads=2, chunk_size=16)  # noqa: E731
    yield "gated chunk memory, level 0, 64 (as written)", zoo.GatedChunkMemory(64, 2, 16), 0, 64, \
        WRITTEN
    yield "LaCT variant 2, level 2, 16 (as written)", lact(), 2, 16, WRITTEN
    yield "per-token layer, 64 features, level 0, 8 (as written)", zoo.PerTokenTTTLayer(64, 4), 0, \
        8, WRITTEN
    yield "LaCT variant 2, level 2, 16 (plan)", lact(), 2, 16, PLAN
    yield "gated chunk memory, level 0, 64 (plan)", zoo.GatedChunkMemory(64, 2, 16), 0, 64, PLAN


def _set_race(conv, x: torch.Tensor, side: str) -> None:
    """Decide the race at ``x``'s shape for ``side`` (after the calls that race)."""
    with torch.no_grad():
        for _ in range(10):
            conv(x)
    races = conv._ttt2la.as_written
    key = (x.shape[0], x.shape[1], x.dtype)
    races.races.setdefault(key, Race()).winner = side
    if side == WRITTEN:
        races.kept.add(key)
    else:
        races.kept.discard(key)


def run_overhead(n: int) -> None:
    for name, layer, level, L, side in _overhead_cases():
        layer = layer.eval()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 128, 64),))
        x = torch.randn(1, L, 64)
        _set_race(conv, x, side)
        times = {"original": [], "converted": []}
        with torch.no_grad():
            for _ in range(50):
                layer(x), conv(x)
            for i in range(n):
                sides = [("original", layer), ("converted", conv)]
                for key, module in sides if i % 2 == 0 else sides[::-1]:
                    start = time.perf_counter()
                    module(x)
                    times[key].append(time.perf_counter() - start)
        o, c = (statistics.median(times[k]) * 1e6 for k in ("original", "converted"))
        ratios = [a / b for a, b in zip(times["original"], times["converted"])]
        line = f"{name}: original {o:.0f} µs, converted {c:.0f} µs, {c - o:.1f} µs more, " \
               f"{_quartiles(ratios)}"
        if side == PLAN:
            line += "; " + _wrapper(conv, x, n)
        print(line, flush=True)


def _wrapper(conv, x: torch.Tensor, n: int) -> str:
    """The converted call against its plan's graph called alone, interleaved."""
    state = conv._ttt2la
    weights, gm = params_and_buffers(conv), state.outer_for(x.shape[0], x.shape[1])
    pairs = []
    with torch.no_grad():
        for _ in range(n):
            start = time.perf_counter()
            conv(x)
            middle = time.perf_counter()
            gm.forward(weights, x)
            pairs.append((middle - start, time.perf_counter() - middle))
    call, plan = (statistics.median(p[k] for p in pairs) * 1e6 for k in (0, 1))
    extra = statistics.median(a - b for a, b in pairs) * 1e6
    return f"the call {call:.0f} µs, its plan's graph alone {plan:.0f} µs, the wrapper {extra:.1f} µs"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", action="store_true", help="time training steps")
    parser.add_argument("--step", type=int, default=1, help="lengths drawn in steps of this")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--overhead", action="store_true",
                        help="time short calls' cost beyond the original instead (--calls 600)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread")
    if args.overhead:
        run_overhead(args.calls)
        return
    for name, layer, level, step in _cases():
        run_case(name, layer, level, step, args)


if __name__ == "__main__":
    main(sys.argv[1:])
