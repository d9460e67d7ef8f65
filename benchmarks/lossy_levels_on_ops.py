"""Two plans side by side with the code they replace, one thread, interleaved rounds:

* the gated delta rule (``zoo.FlaReferenceLayer(32, 2, "gated_delta")``) as written and converted
  at levels 3, 4 and 6 (absorb_lr makes ``β`` a constant per head from level 4 on);
* a fast weight with a bias stepped by the chunk's values summed (``b += 0.1 Σ_t v_t``) as
  written and converted at level 2, at lengths that leave the last chunk of 4 partial.

``python benchmarks/lossy_levels_on_ops.py [--rounds N]``; prints the plan each row ran and the
medians (spread in brackets), forward without gradients and forward + backward.
"""
from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import ttt2la
from ttt2la.timing import time_side_by_side
from ttt2la.zoo import FlaReferenceLayer


class BiasedFastWeight(nn.Module):
    """``f(x) = x W + b`` per head, both stepped per chunk of 4; returns the outputs and the
    final ``(W, b)`` (so the last chunk's update is live)."""

    def __init__(self, d=16, heads=2, chunk=4):
        super().__init__()
        self.H, self.dh, self.C = heads, d // heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(heads, self.dh, self.dh) * 0.1)
        self.b0 = nn.Parameter(torch.zeros(heads, 1, self.dh))

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.dh).permute(2, 0, 3, 1, 4)
        k = k / self.dh ** 0.5
        W = self.W0.unsqueeze(0).repeat(B, 1, 1, 1)
        b = self.b0.unsqueeze(0).repeat(B, 1, 1, 1)
        ys = []
        for i in range(math.ceil(T / self.C)):
            s = i * self.C
            qc, kc, vc = q[:, :, s:s + self.C], k[:, :, s:s + self.C], v[:, :, s:s + self.C]
            ys.append(qc @ W + b)
            W = W + 0.1 * kc.transpose(-1, -2) @ vc
            b = b + 0.1 * vc.sum(2, keepdim=True)
        return torch.cat(ys, 2).transpose(1, 2).reshape(B, T, d), (W, b)


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)]


def _plan(conv) -> str:
    runs = conv.ttt2la_report.layers[0].runs
    return "; ".join(f"{k}: {v[:90]}" for k, v in runs.items())


def _time(models: dict, x: torch.Tensor, rounds: int) -> None:
    fwd = time_side_by_side(models, (x,), rounds=rounds, max_seconds=120.0)

    def step(m):
        def call(inp):
            sum(t.sum() for t in _tensors(m(inp))).backward()
        return call

    bwd = time_side_by_side({k: step(m) for k, m in models.items()}, (x,), rounds=rounds,
                            max_seconds=120.0, no_grad=False)
    for name in models:
        print(f"  {name:>12}: forward {fwd[name].median * 1e3:7.1f} ms ({fwd[name].spread()}), "
              f"forward + backward {bwd[name].median * 1e3:7.1f} ms ({bwd[name].spread()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)

    torch.manual_seed(0)
    layer = FlaReferenceLayer(32, 2, "gated_delta").eval()
    models = {"as written": layer}
    for level in (3, 4, 6):
        models[f"level {level}"] = ttt2la.convert(layer, level=level,
                                                  example_inputs=(torch.randn(2, 19, 32),))
    x = torch.randn(2, 1024, 32)
    print("gated delta rule, B = 2, T = 1024")
    _time(models, x, args.rounds)
    for level in (3, 4, 6):
        print(f"  level {level} ran: {_plan(models[f'level {level}'])}")

    torch.manual_seed(0)
    biased = BiasedFastWeight()
    conv = ttt2la.convert(biased, level=2, example_inputs=(torch.randn(2, 32, 16),))
    for T in (255, 256, 1023):
        print(f"fast weight with a stepped bias, B = 2, T = {T}")
        _time({"as written": biased, "level 2": conv}, torch.randn(2, T, 16), args.rounds)
    print(f"  level 2 ran: {_plan(conv)}")


if __name__ == "__main__":
    main()
