"""CPU timings of converted memories whose state is matrix-affine in itself (chunked delta rules),
against the layer as written: the converted layer as shipped (its plan raced against the code as
written, ``ttt2la.as_written``), the plan's own choice alone (``scan_pays``), the log-depth scan
forced and the loop over chunks forced, side by side.

    python benchmarks/matrix_affine_memories.py [--quick] [--rounds N] [--threads N] [--keep-freed-memory]
        [--backward | --fit-rule]

Rows of a case run interleaved in one process (``ttt2la.timing``): medians over the rounds, the
spread next to them, ratios as medians of per-round ratios against the layer as written. The
layers: ``TitansLinearMemory`` (windows of chunks, weight decay, with and without momentum) and a
mini-batch delta rule written here for the purpose (heads, a learning rate per token from a gate,
``W ← W − Kᵀ((K W − V) ⊙ η)`` per chunk), over a grid of head widths and chunk sizes.
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from ttt2la.as_written import CALLS_TO_DECIDE, AsWritten
from ttt2la.lowering.lift_delta import scanning
from ttt2la.testing import rel_rms_error
from ttt2la.timing import time_side_by_side
from ttt2la.zoo.titans import TitansLinearMemory


class MiniBatchDelta(nn.Module):
    """Heads of a linear memory, read and then stepped once per chunk on ``½ η ‖k W − v‖²``."""

    def __init__(self, head_dim: int, heads: int, chunk: int):
        super().__init__()
        d = head_dim * heads
        self.h, self.dh, self.chunk = heads, head_dim, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, heads)
        self.out = nn.Linear(d, d, bias=False)
        self.w0 = nn.Parameter(torch.randn(heads, head_dim, head_dim) / head_dim ** 0.5)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (t.reshape(B, L, self.h, self.dh).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        k = F.normalize(k, dim=-1)
        eta = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)
        W, ys = self.w0.expand(B, -1, -1, -1), []
        for s in range(0, L, self.chunk):
            qc, kc, vc, ec = (t[:, :, s:s + self.chunk] for t in (q, k, v, eta))
            ys.append(qc @ W)
            W = W - kc.transpose(-1, -2) @ ((kc @ W - vc) * ec)
        return self.out(torch.cat(ys, dim=2).transpose(1, 2).reshape(B, L, D))


def cases(quick: bool):
    """(name, layer, input) of every case."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    grid = [(8, 4), (8, 64), (16, 4), (16, 16), (32, 16), (64, 4), (64, 64)]
    if quick:
        grid = [(8, 4), (64, 64)]
    length = 512 if quick else 2048
    for dh, chunk in grid:
        yield (f"mini-batch delta, 4 heads × {dh}, chunk {chunk}, L={length}",
               MiniBatchDelta(dh, 4, chunk), torch.randn(4, length, 4 * dh, generator=g))
    for momentum in (False, True):
        yield (f"Titans linear memory, dim 64, chunk 16, {'momentum' if momentum else 'no momentum'}, "
               f"L={2 * length}", TitansLinearMemory(64, 16, momentum=momentum),
               torch.randn(4, 2 * length, 64, generator=g))


class _Forced:
    """The converted layer called with the scan forced (``always``: True or False) or the cost rule
    deciding (None); with ``race``, as shipped: racing its plan against the code as written
    (``ttt2la.as_written``), else the plan alone."""

    def __init__(self, layer, always: bool | None, race: bool = False):
        self.layer, self.always, self.race = layer, always, race

    def __call__(self, x):
        with scanning(self.always), ttt2la.race_as_written(self.race):
            out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class _TrainingStep:
    """One forward and backward of a fixed random functional of ``model``'s output; the
    parameter gradients it leaves are what the error column compares."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x):
        self.model.zero_grad(set_to_none=True)
        out = self.model(x)
        y = out[0] if isinstance(out, tuple) else out
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        (y * weights).sum().backward()

    def grads(self) -> dict:
        return {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


#: The converted layer as a user gets it: the cost rule's plan, raced against the code as
#: written on its first calls without gradients.
SHIPPED = "converted (as shipped)"


def _forward_rows(layer, fast):
    return {"as written": lambda t, layer=layer: layer(t),
            SHIPPED: _Forced(fast, None, race=True),
            "converted, plan alone (cost rule)": _Forced(fast, None),
            "converted, scan forced": _Forced(fast, True),
            "converted, loop forced": _Forced(fast, False)}


def _forward_error(rows, row, x) -> float:
    with torch.no_grad():
        want = rows["as written"](x)
        want = want[0] if isinstance(want, tuple) else want
        return rel_rms_error(rows[row](x), want)


def _gradient_error(rows, row, x) -> float:
    """The largest relative RMS error over the parameter gradients."""
    rows["as written"](x)
    want = rows["as written"].grads()
    rows[row](x)
    got = rows[row].grads()
    return max(rel_rms_error(got[n], g) for n, g in want.items())


#: The grid the CPU cost rule's constants were fitted to: (head width, chunk) of a 4-head
#: mini-batch delta rule at B = 4, L = 2048.
RULE_GRID = [(4, 1), (4, 4), (8, 1), (8, 4), (8, 16), (8, 64), (16, 4), (16, 16), (32, 4),
             (32, 16), (64, 4), (64, 64)]


def fit_rule(rounds: int) -> None:
    """Time the scan and the loop forced over ``RULE_GRID``, fit the cost rule's four constants
    to the differences (least squares, weighted by the inverse of each difference) and print
    them beside the constants in use, with the faster path and the rule's choice per shape."""
    from ttt2la.lowering import lift_delta

    features, differences = [], []
    print("| head width | chunk | scan (ms) | loop (ms) | faster | the rule picks |")
    print("|---|---|---|---|---|---|")
    for dh, chunk in RULE_GRID:
        torch.manual_seed(0)
        layer, x = MiniBatchDelta(dh, 4, chunk), torch.randn(4, 2048, 4 * dh)
        fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        t = time_side_by_side({"scan": _Forced(fast, True), "loop": _Forced(fast, False)}, (x,),
                              rounds=rounds, max_seconds=20.0)
        scan, loop = t["scan"].median, t["loop"].median
        n, memory = 2048 // chunk, [torch.zeros(16, dh, dh)]     # B·H memories of [dh, dh]
        update, compose = lift_delta.step_flops(memory, chunk)
        features.append([1.0, n * (2 * update + compose), -n, -n * update])
        differences.append(scan - loop)
        picks = "scan" if lift_delta.scan_pays(memory, n, chunk) else "loop"
        print(f"| {dh} | {chunk} | {scan * 1e3:.1f} | {loop * 1e3:.1f} | "
              f"{'scan' if scan < loop else 'loop'} | {picks} |", flush=True)
    A = torch.tensor(features, dtype=torch.float64)
    d = torch.tensor(differences, dtype=torch.float64)
    w = 1 / d.abs().clamp_min(1e-3)
    fixed, per_scan_flop, step, per_loop_flop = torch.linalg.lstsq(A * w[:, None], d * w).solution
    print(f"fitted: LOOP_STEP_SECONDS = {step:.3g}, LOOP_FLOPS = {1 / per_loop_flop:.3g}, "
          f"SCAN_FIXED_SECONDS = {fixed:.3g}, SCAN_FLOPS = {1 / per_scan_flop:.3g}")
    print(f"in use: LOOP_STEP_SECONDS = {lift_delta.LOOP_STEP_SECONDS:.3g}, "
          f"LOOP_FLOPS = {lift_delta.LOOP_FLOPS:.3g}, "
          f"SCAN_FIXED_SECONDS = {lift_delta.SCAN_FIXED_SECONDS:.3g}, "
          f"SCAN_FLOPS = {lift_delta.SCAN_FLOPS:.3g}")


def arguments(description: str) -> argparse.ArgumentParser:
    """The options both memory benchmarks take (cases, rounds, threads, a training step)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="two small cases, shorter")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--backward", action="store_true",
                        help="time a training step (forward and backward) of the layer as written "
                             "and of the converted layer as the cost rule runs it; the error "
                             "column is the largest over the parameter gradients")
    return parser


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="make glibc keep freed memory (allocator.py), for every row alike")
    parser.add_argument("--fit-rule", action="store_true",
                        help="time scan and loop over the grid the CPU cost rule was fitted to, "
                             "and fit its constants again (about 2 min on 2 cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from allocator import allocator as chosen   # benchmarks/, next to this script
    allocator = chosen(args.keep_freed_memory)
    if args.fit_rule:
        fit_rule(args.rounds)
        return
    print_table(cases(args.quick), backward=args.backward, rounds=args.rounds, allocator=allocator)


def _ran(fast, x, row: str) -> str:
    """What the converted layer ran at ``x``'s shape in ``row``: the code as written where the
    shipped row's race kept it, else the plan."""
    runs = fast.ttt2la_report.layers[0].runs
    B, L = x.shape[:2]
    kept = runs.get(AsWritten.shape(B, L))
    if row == SHIPPED and kept is not None:
        return kept
    return runs.get(f"batch {B}", "?")


def print_table(cases, *, backward: bool, rounds: int, allocator: str = "") -> None:
    """Convert each case's layer at level 0 and print its rows side by side as a markdown table:
    the forward rows (``_forward_rows``), or a training step as written and converted."""
    what = "forward and backward" if backward else "forward under no_grad"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, {what}"
          + (f"; {allocator}" if allocator else ""))
    print("| case | row | ms (median) | spread | vs as written | plan that ran |")
    print("|---|---|---|---|---|---|")
    for name, layer, x in cases:
        fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        if backward:
            rows = {"as written": _TrainingStep(layer), SHIPPED: _TrainingStep(fast)}
            error = _gradient_error
        else:
            rows, error = _forward_rows(layer, fast), _forward_error
        # warm-up: long enough for the shipped layer's race to be decided before timing
        timings = time_side_by_side(rows, (x,), rounds=rounds, max_seconds=30.0,
                                    no_grad=not backward, warmup=CALLS_TO_DECIDE)
        for row, timing in timings.items():
            plan = ""
            if row != "as written":
                # the rows share one converted layer, whose runs name every path it took:
                # what this row's own call runs, alone
                fast.ttt2la_report.layers[0].runs.pop(f"batch {x.shape[0]}", None)
                err = error(rows, row, x)
                plan = f"{_ran(fast, x, row)} (error {err:.1e})"
            ratio = timing.speedup_over(timings["as written"]) if row != "as written" else ""
            print(f"| {name} | {row} | {timing.median * 1e3:.1f} | {timing.spread()} | {ratio} | "
                  f"{plan} |", flush=True)

if __name__ == "__main__":
    main()
