"""A last chunk applied after the loop, in the loop's own statements, with the heads as an axis.

LaCT's variant 2 (only the fast weight ``w1`` stepped; ``w0`` and ``w2`` fixed) written with the
heads as an axis of ``einsum`` or ``matmul`` recomputes, after the loop, the permutes of the fixed
weights that the loop body hoists. Those are matched against the hoisted ops, so the layer
converts; a last output computed with other values than the loop's apply step is still refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from equivalence import assert_same_function

D, HEADS, C = 16, 2, 4


class PeeledVariant2(nn.Module):
    """The last chunk read after the loop; ``swapped`` reads it with ``w0`` and ``w2``
    exchanged (another function than the loop's apply step)."""

    def __init__(self, spell: str, swapped: bool = False):
        super().__init__()
        self.spell, self.swapped, self.dh = spell, swapped, D // HEADS
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.w0 = nn.Parameter(torch.randn(HEADS, 2 * self.dh, self.dh) / 4)
        self.w1 = nn.Parameter(torch.randn(HEADS, self.dh, 2 * self.dh) / 4)
        self.w2 = nn.Parameter(torch.randn(HEADS, 2 * self.dh, self.dh) / 4)

    def feature(self, w, x):
        if self.spell == "einsum":
            return torch.einsum("bhfd,bhtd->bhtf", w, x)
        return x @ w.transpose(-1, -2)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, self.dh).permute(2, 0, 3, 1, 4)
        w0, w1, w2 = (w.unsqueeze(0).repeat(B, 1, 1, 1) for w in (self.w0, self.w1, self.w2))
        outs, e = [], 0
        for s in range(0, T - C, C):
            e = s + C
            qi, ki, vi = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
            outs.append((F.silu(self.feature(w0, qi)) * self.feature(w2, qi)) @ w1.mT)
            hk = F.silu(self.feature(w0, ki)) * self.feature(w2, ki)
            w1 = w1 + 0.1 * vi.mT @ hk
        qi = q[:, :, e:]
        a, b = (w2, w0) if self.swapped else (w0, w2)
        outs.append((F.silu(self.feature(a, qi)) * self.feature(b, qi)) @ w1.mT)
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, T, D)


@pytest.mark.parametrize("spell", ["einsum", "matmul"])
def test_the_last_chunk_after_the_loop_converts_with_heads_as_an_axis(spell):
    torch.manual_seed(0)
    layer = PeeledVariant2(spell)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 8 * C, D),))
    report = conv.ttt2la_report.layers[0]
    assert report.exact and report.runtime.startswith("block_linear_attention"), report.runtime
    assert_same_function(conv, layer, [torch.randn(2, 8 * C, D), torch.randn(3, 5 * C + 3, D)])


def test_a_last_output_from_other_values_is_refused():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="not the loop's own apply step"):
        ttt2la.convert(PeeledVariant2("einsum", swapped=True), level=2,
                       example_inputs=(torch.randn(2, 8 * C, D),))
