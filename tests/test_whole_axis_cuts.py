"""Cuts with a constant bound past the traced lengths (``frontend.whole_axis_cuts``), of the
sequence or of an axis a few tokens longer or shorter (``frontend.size_witness``).

``torch.sigmoid(x[:, :40]).mean(1)`` traced at lengths under 40 takes every token, and a trace
records the cut as the tensor itself: a converted layer read every token at any length, off by
0.3-2 % from 41 tokens on with no error, at every level. Such a cut is a decision of the length
now: an exact conversion checks each other length against the code as written (and runs that
where they differ); a lossy one refuses the lengths where the cut takes part of the axis. An axis
of ``L + 3`` tokens (a causal convolution's padding) was read as no size of the length, or as one
of the batch where ``L* + 3`` was a multiple of the run's batch size; the code now runs at two
lengths, and a size that differs between them is the line through the two.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.frontend.size_witness import Witness

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
#: cuts of an axis of another size than the length (``size_witness``): four memory tokens before
#: the sequence, the sequence shifted by one, a causal convolution's left padding
CUTS["memory_tokens"] = lambda x, n: torch.cat([x.new_zeros(x.shape[0], 4, D), x], 1)[:, :n]
CUTS["shifted"] = lambda x, n: x[:, 1:][:, :n]
CUTS["padded"] = lambda x, n: F.pad(x, (0, 0, 3, 0))[:, :n]
#: bounds of other types than ``int``, and a cut in a generator before the loop (as LaCT reads
#: several tensors at once), which a decision there made an iteration's
CUTS["numpy_bound"] = lambda x, n: x[:, :np.int64(n)]
CUTS["tensor_bound"] = lambda x, n: x[:, :torch.tensor(n)]
CUTS["generator"] = lambda x, n: sum(t[:, :n] for t in (x, 2 * x))
#: a branch on such a size (a multiple of the run's batch size, or of nothing, at its length)
CUTS["padded_branch"] = lambda x, n: x * (0.5 if F.pad(x, (0, 0, 3, 0)).shape[1] > n else 1.0)
WORDS = {"padded_branch": "compares the length"}


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
        assert WORDS.get(cut, "takes a whole axis at some values, not all, of the") in notes, \
            notes
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


def test_a_tensor_made_of_the_length_bounds_a_cut_at_every_length():
    """``x[:, :torch.tensor(T)]`` takes the whole sequence at every length: its bound is the
    length, not the number it held at the run, so no length is held back, even lossy."""
    torch.manual_seed(0)
    layer = GatedMomentum("prefix", 0)
    layer.cut = lambda x, n: x[:, :torch.tensor(x.shape[1])]
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


def test_a_size_taken_for_the_batch_by_coincidence_is_settled_by_the_second_run():
    """At ``L* = 112``, ``B* = 5`` a convolution's ``L* + 3 = 115`` outputs are ``23·B*``: the
    run at another length reads 131, and the first run's size becomes ``L + 3``, for the
    decisions it made with it too."""
    first = Witness(112, 5)
    at = first.size(("f.py", 7, 0, 2), 115, lambda L, B: 23 * B)
    second = Witness(128, 5, other=first)
    again = second.size(("f.py", 7, 0, 2), 131, None)
    first.settle(second)
    assert [at(200, 5), again(200, 5), at(112, 3)] == [203, 203, 115]


def test_a_batch_reading_that_moves_with_the_length_is_one_of_the_length_unread():
    """``F.pad(x, (0, 0, 4, 0))[:, ::2]`` has 10 tokens at 16 (``2·B*`` at ``B* = 5``) and 16 at
    28: no line of whole tokens, and no size of the batch. Known at the two lengths only, every
    decision made with it is one of the length."""
    first, second = Witness(16, 5), Witness(28, 5)
    at = first.size(("f.py", 1, 0, 1), 10, lambda L, B: 2 * B)
    second.size(("f.py", 1, 0, 1), 16, None)
    first.settle(second)
    assert [at(16, 7), at(28, 2)] == [10, 16]
    with pytest.raises(ValueError):
        at(40, 5)


@pytest.mark.parametrize("sizes, guess, want", [
    ((115, 131), lambda L, B: 23 * B, 203),         # contradicted, whole tokens: the line
    ((112, 128), lambda L, B: L, 200),              # confirmed: the guess
    ((96, 96), None, None),                         # one size at both lengths: none of theirs
    ((120, 128), lambda L, B: L, 200),              # max(L, 120) bends: no line, the guess
])
def test_the_line_through_two_runs(sizes, guess, want):
    first, second = Witness(112, 5), Witness(128, 5)
    at = first.size(("f.py", 1, 0, 0), sizes[0], guess)
    second.size(("f.py", 1, 0, 0), sizes[1], None)
    first.settle(second)
    assert (at and at(200, 5)) == want
