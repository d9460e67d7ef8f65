"""A layer that takes whole chunks only and cuts its sequence into them before the loop, as
ttt-video-dit's TTT layers do (``assert L % C == 0``, then ``x.reshape(B, L // C, C, D)``): its
sizes are counts of chunks, ``L / C``, which no affine function of the length with integer
coefficients gives between the whole-chunk lengths it is traced at. They are fitted as counts of
chunks, and checked at two more lengths, so the layer converts exactly (outputs and every
gradient within the fp32 bound at other batch sizes and numbers of chunks; other lengths fail in
its own assertion) — while a size such as ``L // 3``, which moves with the chunks between the
lengths traced and not beyond, is refused, the message telling the code's own failure (its
assertion) from the conversion's (that size).

References: the layer as written at each shape.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function

D = 8


class WholeChunksOnly(nn.Module):
    """Additive fast weights over mini-batches cut before the loop, its values gated per
    mini-batch; ``third`` adds the mean of the first ``L // 3`` values to every value (a size
    the chunk count does not give)."""

    def __init__(self, chunk: int, third: bool = False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.chunk, self.third = chunk, third

    def forward(self, x):
        B, L, _ = x.shape
        assert L % self.chunk == 0, "the length must be a multiple of the mini-batch size"
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.third:
            v = v + v[:, :L // 3].mean(1, keepdim=True)
        n = L // self.chunk
        # a gate per mini-batch, computed before the loop on the sequence cut into them
        gate = torch.sigmoid(x.reshape(B, n, self.chunk, D).mean(2, keepdim=True))
        v = v * gate.expand(B, n, self.chunk, D).reshape(B, L, D)
        qs, ks, vs = (t.reshape(B, n, self.chunk, D) for t in (q, k, v))
        W, outs = x.new_zeros(B, D, D), []
        for i in range(n):
            outs.append(qs[:, i] @ W)
            W = W + ks[:, i].transpose(1, 2) @ vs[:, i]
        return torch.stack(outs, 1).reshape(B, L, D)


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    layer = WholeChunksOnly(4)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))


def test_the_whole_chunk_layer_converts_exactly_for_whole_chunks(converted):
    layer, conv = converted
    assert conv.ttt2la_report.exact
    notes = " ".join(conv.ttt2la_report.layers[0].notes)
    assert "converted for lengths leaving 0" in notes, notes


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 3), n=st.integers(1, 12))
def test_it_is_the_same_function_at_other_shapes(converted, B, n):
    layer, conv = converted
    assert_same_function(conv, layer, torch.randn(B, 4 * n, D))


def test_other_lengths_fail_in_its_own_assertion(converted):
    _, conv = converted
    with pytest.raises(ttt2la.ConversionError, match="multiple of the mini-batch size"):
        conv(torch.randn(2, 18, D))


@pytest.mark.parametrize("chunk,example", [(4, 16), (8, 64)])
def test_a_size_that_moves_with_the_chunks_only_between_the_traced_lengths_is_no_count(
        chunk, example):
    """Refused, naming the size's line as what ttt2la cannot convert and the assertion as the
    code's own failure at the other lengths (not "its own code fails at every shape")."""
    torch.manual_seed(0)
    layer = WholeChunksOnly(chunk, third=True)
    with pytest.raises(ttt2la.UnsupportedTTTError) as e:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, example, D),))
    msg = str(e.value)
    assert "own code fails at the shapes ttt2la traces first" in msg, msg
    assert "AssertionError: the length must be a multiple of the mini-batch size" in msg, msg
    assert "ttt2la cannot convert it: the size argument" in msg and "L // 3" in msg, msg
