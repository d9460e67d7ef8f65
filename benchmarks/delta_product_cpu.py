"""CPU timings of gated DeltaProduct (``zoo.DeltaProductLayer``) as written against its
conversion at level 2, forward and forward + backward, one thread.

    PYTHONPATH=. python benchmarks/delta_product_cpu.py [--rounds N] [--max-seconds S] [--race]

Every row times the two models interleaved (``ttt2la.timing``), medians over the rounds; the
plan column is what the conversion's report names. The race of a generic plan against the code
as written is off unless ``--race`` (the plan itself is timed).
"""
from __future__ import annotations

import argparse

import torch

import ttt2la
from ttt2la.timing import time_side_by_side
from ttt2la.zoo.delta_product import DeltaProductLayer

SHAPES = [(n, T) for n in (2, 3) for T in (256, 1024)]   # sub-steps per token, length


def _backward(model):
    def run(x):
        model(x).sum().backward()
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--race", action="store_true", help="race a generic plan as shipped")
    args = p.parse_args()
    torch.set_num_threads(1)
    with ttt2la.race_as_written(args.race):
        _table(args)


def _table(args) -> None:
    d = args.heads * args.head_dim
    print("| n_h | T | pass | as written ms | converted ms | speed-up | plan |")
    print("|---|---|---|---|---|---|---|")
    for n, T in SHAPES:
        torch.manual_seed(0)
        layer = DeltaProductLayer(d, args.heads, n)
        fast = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(args.batch, 16, d),))
        plan = fast.ttt2la_report.to_dict()["layers"][0]["runtime"]
        x = torch.randn(args.batch, T, d)
        for backward in (False, True):
            models = {"written": layer, "converted": fast}
            if backward:
                models = {k: _backward(m) for k, m in models.items()}
            t = time_side_by_side(models, (x,), rounds=args.rounds, min_rounds=3,
                                  max_seconds=args.max_seconds, warmup=1,
                                  no_grad=not backward)
            w, c = t["written"], t["converted"]
            print(f"| {n} | {T} | {'fwd+bwd' if backward else 'fwd'} | {1e3 * w.median:.1f} | "
                  f"{1e3 * c.median:.1f} | {c.speedup_over(w)} | `{plan}` |", flush=True)


if __name__ == "__main__":
    main()
