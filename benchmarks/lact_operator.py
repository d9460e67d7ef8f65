"""The LaCT operator alone: the converted ``ttt`` submodule against variant 2's own operator.

``throughput.py`` times whole layers, whose code around the operator (the ``qkv`` projection,
its ``silu``, the norms, ``o_proj``) is the same in every row and dilutes their ratios. This
script times the operator itself — ``LaCTPublishedLayer.ttt`` converted at level 2, and the
same operator of the layer built as variant 2 (``update_theta=False, weight_norm=False``), on
the inputs that layer hands it — beside the two whole layers, interleaved in one process
(``ttt2la.timing``): medians, spread, ratios as medians of per-round ratios against variant
2's operator, and each converted row's error against its variant-2 counterpart.

    python benchmarks/lact_operator.py [--chunk 2048] [--length 16384] [--muon]
                                       [--batch 1] [--rounds 9] [--keep-freed-memory]

Variant 2's operator is compiled by ``torch.compile`` as LaCT's release compiles it, unless the
sequence has more chunks than ``throughput.COMPILED_CHUNKS`` (then eagerly, as there).
"""
from __future__ import annotations

import argparse

import torch

import ttt2la
from allocator import allocator as chosen_allocator
from throughput import COMPILED_CHUNKS, Eager
from ttt2la.testing import rel_rms_error
from ttt2la.timing import time_side_by_side
from ttt2la.zoo.lact_published import LaCTPublishedLayer

HEADS, HEAD_DIM = 4, 128


def build(chunk: int, length: int, muon: bool, batch: int):
    """``(converted, variant 2, variant 2 as timed, x, the operator's inputs)``: the layer
    converted at level 2, variant 2 as written with the same weights and that layer as it is
    timed (eagerly past ``COMPILED_CHUNKS``), the input, and what variant 2 hands its operator
    on it."""
    torch.manual_seed(0)
    d_model = HEADS * HEAD_DIM
    original = LaCTPublishedLayer(d_model, HEADS, chunk, muon=muon).eval()
    v2 = LaCTPublishedLayer(d_model, HEADS, chunk, muon=muon, update_theta=False,
                            weight_norm=False).eval()
    v2.load_state_dict(original.state_dict())
    x = torch.randn(batch, length, d_model, generator=torch.Generator().manual_seed(1))
    converted = ttt2la.convert(original, level=2, example_inputs=(x[:1, :3 * chunk],))
    timed = Eager(v2) if -(-length // chunk) > COMPILED_CHUNKS else v2
    captured = []
    hook = v2.ttt.register_forward_pre_hook(lambda _m, args: captured.append(args))
    with torch.no_grad():
        timed(x)
    hook.remove()
    return converted, v2, timed, x, captured[0]


def rows(converted, v2, timed, x):
    """The timed rows: each takes the operator's inputs (the layer rows read ``x``)."""
    return {"variant 2's operator": lambda *a: v2.ttt(*a),
            "converted operator (level 2)": lambda *a: converted.ttt(*a),
            "variant 2 as written (layer)": lambda *_: timed(x),
            "level 2 converted (layer)": lambda *_: converted(x)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--muon", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="make glibc keep freed memory (allocator.py), for every row alike")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = chosen_allocator(args.keep_freed_memory)
    converted, v2, timed, x, inputs = build(args.chunk, args.length, args.muon, args.batch)
    with torch.no_grad():
        errors = {"converted operator (level 2)": rel_rms_error(converted.ttt(*inputs),
                                                                v2.ttt(*inputs)),
                  "level 2 converted (layer)": rel_rms_error(converted(x), timed(x))}
    t = time_side_by_side(rows(converted, v2, timed, x), inputs, rounds=args.rounds,
                          max_seconds=300.0)
    print(f"LaCT operator, {HEADS} heads × {HEAD_DIM}, chunk {args.chunk}, L={args.length}, "
          f"B={args.batch}, {'Muon' if args.muon else 'no Muon'}, fp32, forward under no_grad; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; {allocator}")
    print("| row | ms (median) | spread | vs variant 2's same part | error vs it |")
    print("|---|---|---|---|---|")
    against = {"converted operator (level 2)": "variant 2's operator",
               "level 2 converted (layer)": "variant 2 as written (layer)"}
    for name, timing in t.items():
        base = against.get(name)
        ratio = timing.speedup_over(t[base]) if base else ""
        error = f"{errors[name]:.1e}" if name in errors else ""
        print(f"| {name} | {timing.median * 1e3:.1f} | {timing.spread()} | {ratio} | {error} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
