"""How accurate a converted layer is in fp32 next to the layer as written, both measured against a
float64 evaluation of the same function (the same weights and inputs cast to float64, run as written).

Two fp32 computations of one function differ by about the sum of their own errors; where a gradient
is badly conditioned (LaCT's per-token learning rates feed Muon's Newton–Schulz step) the layer as
written is itself 1e-5 off in relative RMS, and converted and original differ by that much while
neither is less accurate. The ratio column says whether the converted layer loses precision, and
the last line checks the criterion for Newton–Schulz layers: the converted layer's error against
float64 is at most twice the original's own error, plus 1e-6, for the output and every gradient.

    python benchmarks/fp32_accuracy.py            # LaCT folded layer, variant 2, level 0, chunk 4
    python benchmarks/fp32_accuracy.py --lm       # the same in TinyLaCTLM (two blocks)
"""
from __future__ import annotations

import argparse
import copy
import math

import torch

import ttt2la
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import TinyLaCTLM, lact_layer

D, H, CHUNK = 16, 2, 4
F64 = torch.float64


def _errors_wrt(module: torch.nn.Module, x: torch.Tensor) -> dict:
    """The output and every parameter gradient of ``(module(x) * r).sum()`` with a fixed ``r``."""
    module.zero_grad(set_to_none=True)
    y = module(x)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(y.dtype)
    (y * r).sum().backward()
    return {"output": y.detach(), **{n: p.grad for n, p in module.named_parameters() if p.grad is not None}}


def _build(lm: bool, seed: int, level: int):
    torch.manual_seed(seed)
    if lm:
        model, example = TinyLaCTLM(40, D, 2, H, CHUNK, variant=2), torch.randint(0, 40, (2, 4 * CHUNK))
    else:
        model = lact_layer("folded", variant=2, d_model=D, num_heads=H, chunk_size=CHUNK)
        example = torch.randn(2, 4 * CHUNK, D)
    converted = ttt2la.convert(copy.deepcopy(model), level=level, example_inputs=(example,))
    return model, converted, copy.deepcopy(model).double()


def _inputs(lm: bool, length: int, seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    if lm:
        tokens = torch.randint(0, 40, (2, length), generator=g)
        return tokens, tokens
    x = torch.randn(2, length, D, generator=g, dtype=F64)
    return x.float(), x


def within_criterion(original_error: float, converted_error: float) -> bool:
    """Whether the converted error meets the Newton–Schulz criterion: at most twice the error of
    the code as written against float64, plus 1e-6."""
    return converted_error <= 2 * original_error + 1e-6


def main(argv: list[str] | None = None) -> int:
    """Print one row per (seed, length, tensor) and the summary; 0 where every row meets the
    criterion, 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm", action="store_true", help="measure TinyLaCTLM instead of one layer")
    ap.add_argument("--level", type=int, default=0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4, 5, 7, 8])
    args = ap.parse_args(argv)
    print(f"{'seed':>4} {'L':>3} {'tensor':30s} {'orig-f64':>9} {'conv-f64':>9} {'ratio':>6} {'conv-orig':>9}")
    ratios, outside = [], []
    for seed in range(args.seeds):
        original, converted, reference = _build(args.lm, seed, args.level)
        for length in args.lengths:
            x32, x64 = _inputs(args.lm, length, seed)
            want, orig, conv = (_errors_wrt(m, x) for m, x in
                                ((reference, x64), (original, x32), (converted, x32)))
            for name, w in want.items():
                eo, ec = rel_rms_error(orig[name], w), rel_rms_error(conv[name], w)
                if eo == 0 and ec == 0:
                    continue
                ratios.append(ec / max(eo, 1e-30))
                if not within_criterion(eo, ec):
                    outside.append(f"seed {seed}, L={length}, {name}")
                print(f"{seed:4d} {length:3d} {name:30s} {eo:9.1e} {ec:9.1e} {ec / eo:6.2f} "
                      f"{rel_rms_error(conv[name], orig[name]):9.1e}")
    print(f"conv-f64 / orig-f64: geometric mean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}, "
          f"max {max(ratios):.2f} over {len(ratios)} tensors")
    print(f"within 2x the original's error + 1e-6: {len(ratios) - len(outside)} of {len(ratios)}"
          + "".join(f"\n  outside: {o}" for o in outside))
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(main())
