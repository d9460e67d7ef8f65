"""CPU timings of converted gated memories, whose state is scalar-affine in itself
(``W ← γ_c W + η Kᵀ V``), against the layer as written: the converted layer as shipped (its plan
raced against the code as written, ``ttt2la.as_written``), the plan's own choice alone
(``affine_scan_pays``, ``decayed_op_pays``), the op or scan forced and the loop over chunks
forced, side by side.

    python benchmarks/gated_memories.py [--quick] [--rounds N] [--threads N]
                                        [--backward | --fit-rule | --expansions]

The layer is ``ttt2la.zoo.GatedChunkMemory`` (4 heads, a decay gate per chunk, einsum style, a
loop over whole chunks) over a grid of head widths and chunk sizes at B = 4, L = 2048. Rows of a
case run interleaved in one process (``ttt2la.timing``): medians, the spread next to them, ratios
as medians of per-round ratios against the layer as written (``matrix_affine_memories.py`` does the
same for delta rules, and its helpers serve here).
"""
from __future__ import annotations

import torch

import ttt2la
from matrix_affine_memories import _Forced, arguments, print_table
from unittest import mock

from ttt2la.lowering import loop_expansions, scan_choice
from ttt2la.testing import rel_rms_error
from ttt2la.timing import time_side_by_side
from ttt2la.zoo import GatedChunkMemory

#: (head width, chunk) of the cases, and of the grid the cost rule's constants were fitted to.
GRID = [(4, 1), (4, 4), (8, 1), (8, 4), (8, 16), (16, 4), (16, 16), (32, 16), (64, 16), (64, 64)]
HEADS, BATCH, LENGTH = 4, 4, 2048


def cases(quick: bool):
    """(name, layer, input) of every case."""
    g = torch.Generator().manual_seed(0)
    grid = [(4, 1), (64, 64)] if quick else GRID
    length = 512 if quick else LENGTH
    for dh, chunk in grid:
        torch.manual_seed(0)
        yield (f"gated memory, {HEADS} heads × {dh}, chunk {chunk}, L={length}",
               GatedChunkMemory(HEADS * dh, HEADS, chunk),
               torch.randn(BATCH, length, HEADS * dh, generator=g))


def fit_rule(rounds: int) -> None:
    """Time the scan and the loop forced over ``GRID`` and fit the rule's two constants to the
    differences (least squares, weighted by the inverse of each difference); print them beside
    the constants in use, with the faster path and the rule's choice per shape."""
    features, differences = [], []
    print("| head width | chunk | scan (ms) | loop (ms) | faster | the rule picks |")
    print("|---|---|---|---|---|---|")
    for name, layer, x in cases(False):
        fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        t = time_side_by_side({"scan": _Forced(fast, True), "loop": _Forced(fast, False)}, (x,),
                              rounds=rounds, max_seconds=20.0)
        scan, loop = t["scan"].median, t["loop"].median
        chunk = layer.chunk
        n, state = LENGTH // chunk, torch.zeros(BATCH, HEADS, layer.dh, layer.dh)
        features.append([n * state.numel(), -n])
        differences.append(scan - loop)
        picks = "scan" if scan_choice.affine_scan_pays(state) else "loop"
        print(f"| {layer.dh} | {chunk} | {scan * 1e3:.1f} | {loop * 1e3:.1f} | "
              f"{'scan' if scan < loop else 'loop'} | {picks} |", flush=True)
    A = torch.tensor(features, dtype=torch.float64)
    d = torch.tensor(differences, dtype=torch.float64)
    w = 1 / d.abs().clamp_min(1e-3)
    per_element, step = torch.linalg.lstsq(A * w[:, None], d * w).solution
    print(f"fitted: AFFINE_LOOP_STEP_SECONDS = {step:.3g}, AFFINE_SCAN_ELEMENT_SECONDS = "
          f"{per_element:.3g}")
    print(f"in use: AFFINE_LOOP_STEP_SECONDS = {scan_choice.AFFINE_LOOP_STEP_SECONDS:.3g}, "
          f"AFFINE_SCAN_ELEMENT_SECONDS = {scan_choice.AFFINE_SCAN_ELEMENT_SECONDS:.3g}")


#: (head width, chunk) where the loop's ``η Kᵀ V`` is an expansion (larger than K and V), with
#: increments of 4,096 to 65,536 elements at B = 4: the grid ``EXPANSION_MIN_ELEMENTS`` was
#: read off.
EXPANSION_GRID = [(16, 2), (16, 4), (32, 4), (32, 8), (64, 16)]


class _Expansions:
    """The converted layer's loop forced, its expansions computed in the loop (``moved``) or
    read batched before it, whatever the size rule says."""

    def __init__(self, layer, moved: bool):
        self.layer, self.limit = layer, 0 if moved else 10**12

    def __call__(self, x):
        with scan_choice.scanning(False), ttt2la.race_as_written(False), \
                mock.patch.object(loop_expansions, "EXPANSION_MIN_ELEMENTS", self.limit):
            return self.layer(x)


def expansion_rule(rounds: int) -> None:
    """Time the loop over the chunks with its expansions moved and batched, side by side, over
    ``EXPANSION_GRID``; print each beside the rule's choice."""
    print("| head width | chunk | increment (elements) | as written (ms) | batched (ms) | "
          "moved (ms) | moved vs batched | the rule picks | error (moved, batched) |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for dh, chunk in EXPANSION_GRID:
        torch.manual_seed(0)
        layer = GatedChunkMemory(HEADS * dh, HEADS, chunk)
        x = torch.randn(BATCH, LENGTH, HEADS * dh, generator=g)
        fast = ttt2la.convert(layer, level=0, example_inputs=(x[:1, :256],))
        rows = {"as written": layer, "batched": _Expansions(fast, False),
                "moved": _Expansions(fast, True)}
        t = time_side_by_side(rows, (x,), rounds=rounds, max_seconds=30.0)
        with torch.no_grad():
            ref = layer(x)
            errors = [rel_rms_error(rows[k](x), ref) for k in ("moved", "batched")]
        size = BATCH * HEADS * dh * dh
        picks = "moved" if size >= loop_expansions.EXPANSION_MIN_ELEMENTS else "batched"
        ms = {k: v.median * 1e3 for k, v in t.items()}
        print(f"| {dh} | {chunk} | {size:,} | {ms['as written']:.1f} | {ms['batched']:.1f} "
              f"({t['batched'].spread()}) | {ms['moved']:.1f} ({t['moved'].spread()}) | "
              f"{t['moved'].speedup_over(t['batched'])} | {picks} | "
              f"{errors[0]:.1e}, {errors[1]:.1e} |", flush=True)


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--fit-rule", action="store_true",
                        help="time scan and loop over the grid and fit the rule's constants again")
    parser.add_argument("--expansions", action="store_true",
                        help="time the loop with its outer products moved into it and batched "
                             "before it, over the grid the size rule was read off")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fit_rule:
        fit_rule(args.rounds)
        return
    if args.expansions:
        expansion_rule(args.rounds)
        return
    print_table(cases(args.quick), backward=args.backward, rounds=args.rounds)

if __name__ == "__main__":
    main()
