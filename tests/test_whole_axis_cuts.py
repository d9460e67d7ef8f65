"""Cuts with a constant bound past the traced lengths (``frontend.whole_axis_cuts``).

``torch.sigmoid(x[:, :40]).mean(1)`` traced at lengths under 40 takes every token, and a trace
records the cut as the tensor itself: a converted layer read every token at any length, off by
0.3-2 % from 41 tokens on with no error, at every level. Such a cut is a decision of the length
now: an exact conversion checks each other length against the code as written (and runs that
where they differ); a lossy one refuses the lengths where the cut takes part of the axis.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la

from shape_checks import each_call_same_or_refused, same_or_refused

D, C = 8, 4
BETA, LR = 0.5, 0.1

#: how each layer reads a gate from its first (or last) ``n`` tokens, ``n`` past the example's
CUTS = {
    "prefix": lambda x, n: x[:, :n],
    "ellipsis": lambda x, n: x[..., :n, :],
    "suffix": lambda x, n: x[:, -n:],
    "split": lambda x, n: x.split(n, 1)[0],
    "batch": lambda x, n: x[:n // 8 + 1],
}


def _written(x, n):
    """A copy of ``x`` with its first ``n`` tokens zeroed by an index assignment."""
    y = x.clone()
    y[:, :n] = 0
    return y


CUTS["assigned"] = _written


class GatedMomentum(nn.Module):
    """Chunked linear attention with momentum whose values are scaled by a gate read from a cut
    of the tokens (or the batch) before the loop; ``simplified`` is the function level 5
    computes (the momentum folded into the rate by ``c``)."""

    def __init__(self, cut: str, bound: int):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)
        self.cut, self.bound = CUTS[cut], bound

    def _gated(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        g = torch.sigmoid(self.cut(x, self.bound)).mean((0, 1), keepdim=True)
        return q, k, v * g

    def forward(self, x):
        q, k, v = self._gated(x)
        S, M = x.new_zeros(x.shape[0], D, D), x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ S)
            M = BETA * M + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
            S = S + LR * M
        return torch.cat(outs, 1)

    def simplified(self, x, c: float):
        q, k, v = self._gated(x)
        S, outs = x.new_zeros(x.shape[0], D, D), []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ S)
            S = S + LR * c * k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_cut_past_the_traced_lengths_is_the_code_function_or_refused(cut):
    """Converted from 16 tokens, a gate over the first 40: at 41 tokens and more the exact
    conversion gives the original's output and gradients, the lossy one its function or a
    refusal, and the report names the line."""
    for level in (0, 5):
        torch.manual_seed(0)
        layer = GatedMomentum(cut, 40)
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))
        notes = " ".join(conv.ttt2la_report.layers[0].notes)
        assert "takes a whole axis at some values, not all, of the" in notes, notes
        shapes = [(2, 16), (9, 16), (7, 20), (2, 20)] if cut == "batch" else \
            [(2, 16), (2, 44), (2, 80), (2, 20)]
        seen = [same_or_refused(layer, conv, T, B) for B, T in shapes]
        if level == 0:
            assert seen == ["same"] * 4
        else:
            assert seen[0] == seen[3] == "simplified" and "refused" in seen, seen


def test_a_cut_within_the_traced_lengths_is_traced_as_a_cut():
    """A bound under the example's length cuts at the traced shapes: the graph computes the cut
    at any length, no check or refusal needed."""
    torch.manual_seed(0)
    layer = GatedMomentum("prefix", 4)
    conv = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, 16, D),))
    assert not any("whole axis" in n for n in conv.ttt2la_report.layers[0].notes)
    assert [same_or_refused(layer, conv, T) for T in (3, 16, 44, 80)] == ["simplified"] * 4


@settings(max_examples=6, deadline=None)
@given(cut=st.sampled_from(sorted(CUTS)), level=st.sampled_from([0, 5]),
       bound=st.integers(5, 70), example=st.integers(6, 30),
       calls=st.lists(st.integers(2, 90), min_size=2, max_size=3))
def test_every_call_is_the_code_function_or_refused(cut, level, bound, example, calls):
    """Any bound, example and call lengths: each call gives the code's function or is
    refused."""
    each_call_same_or_refused(lambda: GatedMomentum(cut, bound), level, example, calls)
