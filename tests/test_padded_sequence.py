"""A layer that pads its sequence to a multiple of its chunk, loops over the padded chunks and
slices its output back converts for every length and batch size, from an example of length 6
and chunk 4: its outputs match the layer as written (float32, relative RMS <= 1e-5) at
lengths 1..40 and batches 1..3, where the plan runs every call (the report's runs name
nothing run instead).

The sizes of the padded sequence (``[B * (L + pad), d]`` once flattened) are no product of
batch and length; they are fitted from a fourth trace, where both change. A layer whose own
code takes only its example's remainder modulo the chunk is traced at lengths of that
remainder, where those sizes look affine in each, and is exact at every batch size too.

Where the converted graphs fail on a call the layer as written runs (planted here: every
size of the code around the loop computed at another batch size), the error is not the
user's: an exact conversion answers with the code as written and warns, a lossy one refuses
saying that the layer as written runs the call.

A single-step layer (one step over the whole sequence, no loop) that pads and flattens its
sequence the same way is exact at every batch size and length too, converted from batch 2 or 1.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from ttt2la.frontend.sized_graph import SizedCall, SizedGraph, Sizes
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer

D, CHUNK, EXAMPLE = 16, 4, 6


class PaddedChunks(nn.Module):
    """Pads to a multiple of the chunk, updates ``W`` once per padded chunk, crops back."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.chunk, self.lr = CHUNK, 0.1

    def forward(self, x):
        B, L, _ = x.shape
        xp = F.pad(x, (0, 0, 0, (-L) % self.chunk))
        q, k, v = self.q(xp), self.k(xp), self.v(xp)
        W = x.new_zeros(B, D, D)
        outs = []
        for i in range(0, xp.shape[1], self.chunk):
            outs.append(q[:, i:i + self.chunk] @ W)
            W = W + self.lr * k[:, i:i + self.chunk].mT @ v[:, i:i + self.chunk]
        return torch.cat(outs, dim=1)[:, :L]


class ExampleRemainderOnly(PaddedChunks):
    """The same layer, whose own code refuses lengths of another remainder than the example's."""

    def forward(self, x):
        if x.shape[1] % self.chunk != EXAMPLE % self.chunk:
            raise ValueError(f"lengths leaving {EXAMPLE % self.chunk} modulo {self.chunk} only")
        return super().forward(x)


def _converted(cls):
    torch.manual_seed(0)
    layer = cls().eval()
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, EXAMPLE, D),))


@pytest.fixture(scope="module")
def padded():
    return _converted(PaddedChunks)


@pytest.fixture(scope="module")
def remainder_only():
    return _converted(ExampleRemainderOnly)


def _assert_exact(layer, converted, B: int, L: int) -> None:
    x = torch.randn(B, L, D)
    with torch.no_grad():
        want, got = layer(x), converted(x)
    assert got.shape == want.shape
    if want.abs().max() == 0:               # no whole chunk before the last: all zeros
        assert got.abs().max() == 0
    else:
        assert rel_rms_error(got, want) <= TOLERANCE[torch.float32], (B, L)
    runs = converted.ttt2la_report.layers[0].runs      # the plan ran: nothing ran instead
    assert not any("failed" in key for key in runs), runs


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 40))
def test_a_padded_sequence_is_exact_at_every_length(padded, B, L):
    layer, converted = padded
    _assert_exact(layer, converted, B, L)


def test_a_padded_sequence_converts_for_every_remainder(padded):
    """No note of lengths the layer's code was found to fail at: it fails at none."""
    _, converted = padded
    assert "failed at lengths" not in str(converted.ttt2la_report)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 3), chunks=st.integers(0, 9))
def test_the_examples_remainder_is_exact_at_every_batch_size(remainder_only, B, chunks):
    layer, converted = remainder_only
    _assert_exact(layer, converted, B, EXAMPLE % CHUNK + CHUNK * chunks)


class PaddedStep(nn.Module):
    """One test-time step of ``W`` over the whole sequence (no loop over chunks), its input
    padded by two tokens and projected flattened as ``[B * (L + 2), d]``, then cropped back."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D, bias=False)
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.w0 = nn.Parameter(torch.randn(D, D) * 0.1)

    def forward(self, x):
        B, L, _ = x.shape
        h = F.pad(x, (0, 0, 0, 2)).reshape(B * (L + 2), D)
        h = self.proj(h).reshape(B, L + 2, D)[:, :L]
        q, k, v = self.q(h), self.k(h), self.v(h)
        W = self.w0.unsqueeze(0)
        W = W - 0.1 * k.mT @ (k @ W - v) / L
        return q @ W


@pytest.fixture(scope="module", params=[(2, EXAMPLE), (1, 5)], ids=["batch 2", "batch 1"])
def padded_step(request):
    torch.manual_seed(0)
    layer = PaddedStep().eval()
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(*request.param, D),))


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 4), L=st.integers(2, 30))
def test_a_padded_single_step_is_exact_at_every_batch_size_and_length(padded_step, B, L):
    """A single step's ``B * (L + 2)`` is fitted from its trace where batch and length both
    change, as a loop's is: it was fitted as ``b·B + c·L`` from three traces, so the converted
    graphs failed at other batch sizes (run as written, with a warning), and a conversion from
    a batch of 1 was refused."""
    layer, converted = padded_step
    _assert_exact(layer, converted, B, L)


def _sizes_of_another_batch(monkeypatch) -> None:
    """Every size of the code around the loop computed at batch ``B + 1``: a fault of the
    converted graphs, not of the layer's code."""
    def at(self, B, L):
        return SizedCall(self.gm, Sizes(e(B + 1, L) for e in self.exprs))
    monkeypatch.setattr(SizedGraph, "at", at)


def test_a_fault_of_the_converted_graphs_is_answered_by_the_code_as_written(monkeypatch):
    layer, converted = _converted(PaddedChunks)
    _sizes_of_another_batch(monkeypatch)
    x = torch.randn(3, 10, D)
    with pytest.warns(RuntimeWarning, match="converted code around the loop .* failed"):
        with torch.no_grad():
            got = converted(x)
    with torch.no_grad():
        assert rel_rms_error(got, layer(x)) <= TOLERANCE[torch.float32]
    runs = converted.ttt2la_report.layers[0].runs
    assert any("the converted graphs failed" in key for key in runs), runs


def test_a_lossy_conversion_refuses_a_fault_of_its_graphs_saying_whose_it_is(monkeypatch):
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, 4, muon=False)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(1, 16, 8),))
    assert not converted.ttt2la_report.exact
    _sizes_of_another_batch(monkeypatch)
    with pytest.raises(ttt2la.UnsupportedShapeError,
                       match="although the layer as written runs this call") as refused:
        converted(torch.randn(2, 16, 8))
    assert "fails on this call too" not in str(refused.value)
