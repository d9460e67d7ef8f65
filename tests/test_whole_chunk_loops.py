"""Loops over whole chunks only (``for i in range(L // C)``), as layers written for lengths that
are multiples of their chunk often are: here in einsum style, with outputs written into a
preallocated buffer and a decay gate computed from each chunk (``ttt2la.zoo.GatedChunkMemory``).

Traced at the probe's usual lengths (three and a half chunks) such a loop runs three times and its
last update, which nothing reads, is traced away; one chunk longer it leaves the last tokens out.
The probe then traces at lengths that keep the example's chunk structure, the layer converts
exactly, and it is converted for multiples of its chunk only: another length is refused by name,
never run on a partial chunk the source would have left out.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function
from ttt2la.errors import UnsupportedShapeError, UnsupportedTTTError
from ttt2la.zoo import GatedChunkMemory


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 2), D=st.sampled_from([2, 4]),
       C=st.integers(2, 5), n=st.integers(1, 6), level=st.sampled_from([0, 2]))
def test_whole_chunk_loops_convert_exactly_for_multiples_of_their_chunk(B, H, D, C, n, level):
    torch.manual_seed(C * 10 + n)
    layer = GatedChunkMemory(H * D, H, C)
    example = torch.randn(B, n * C, H * D)
    converted = ttt2la.convert(layer, level=level, example_inputs=(example,))
    (report,) = converted.ttt2la_report.layers
    assert report.exact and report.chunk_size == C
    assert any(f"multiples of {C}" in note for note in report.notes)
    assert_same_function(converted, layer, [example, torch.randn(B + 1, (n + 2) * C, H * D)])


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    layer = GatedChunkMemory(8, 2, 4)
    return layer, ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 8),))


def test_a_length_the_loop_would_cut_short_is_refused_naming_the_loop(converted):
    _, layer = converted
    with pytest.raises(UnsupportedShapeError, match=r"length 18.*whole chunks of 4.*last 2 out"):
        layer(torch.randn(2, 18, 8))
    with pytest.raises(UnsupportedShapeError, match=r"gated_memory\.py:\d+ in forward"):
        layer(torch.randn(1, 5, 8))


def test_an_example_that_is_not_whole_chunks_is_refused_saying_so():
    layer = GatedChunkMemory(8, 2, 4)
    with pytest.raises(UnsupportedTTTError, match=r"leaving the last \d tokens out.*multiple of 4"):
        ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 18, 8),))


def test_a_loop_over_every_chunk_is_not_restricted():
    """The same layer looping ``range(0, L, C)`` (a partial last chunk) converts for any length."""
    class EveryChunk(GatedChunkMemory):
        def forward(self, x):
            B, L, D = x.shape
            q, k, v = (t.view(B, L, self.h, self.dh).transpose(1, 2)
                       for t in (self.q(x), self.k(x), self.v(x)))
            W, ys = torch.zeros(B, self.h, self.dh, self.dh), []
            for s in range(0, L, self.chunk):
                ys.append(q[:, :, s:s + self.chunk] @ W)
                W = W + k[:, :, s:s + self.chunk].transpose(-1, -2) @ v[:, :, s:s + self.chunk]
            return self.out(torch.cat(ys, dim=2).transpose(1, 2).reshape(B, L, D))

    torch.manual_seed(1)
    layer = EveryChunk(8, 2, 4)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 8),))
    assert not any("whole chunks" in note for note in converted.ttt2la_report.layers[0].notes)
    assert_same_function(converted, layer, [torch.randn(2, 18, 8), torch.randn(1, 5, 8)])


class ReshapedToTheLength(nn.Module):
    """A loop over whole chunks whose outputs are reshaped to the call's length: the code as
    written fails at any other length (``reshape(B, L, -1)`` of fewer tokens), so the probe's usual
    lengths fail and the layer is traced at lengths keeping its example's remainder."""

    def __init__(self, d: int = 16, chunk: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.C = chunk

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for i in range(L // self.C):
            s = slice(i * self.C, (i + 1) * self.C)
            S = 0.9 * S + k[:, s].transpose(1, 2) @ v[:, s]
            outs.append(q[:, s] @ S)
        return torch.cat(outs, 1).reshape(B, L, -1)


class WholeChunksOut(ReshapedToTheLength):
    """``ReshapedToTheLength`` without the reshape: its code runs at every length."""

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for i in range(L // self.C):
            s = slice(i * self.C, (i + 1) * self.C)
            S = 0.9 * S + k[:, s].transpose(1, 2) @ v[:, s]
            outs.append(q[:, s] @ S)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("whose", ["code", "conversion"])
def test_the_untraced_lengths_say_whose_failure_restricted_them(whose, monkeypatch):
    """A layer traced only at its example's remainder says why: its own code failed at the
    usual probe lengths, or — where that code runs there, and the conversion's trace failed
    (here made to fail at the other remainders) — the conversion could not trace them. Both
    were said to be the code's failure."""
    from ttt2la.frontend import recognize

    if whose == "conversion":
        roll_at = recognize._roll_at

        def failing_roll_at(cand, fn, flat, layout, B, L):
            if L % 8:
                raise RuntimeError("a trace made to fail")
            return roll_at(cand, fn, flat, layout, B, L)

        monkeypatch.setattr(recognize, "_roll_at", failing_roll_at)
    torch.manual_seed(0)
    layer = ReshapedToTheLength() if whose == "code" else WholeChunksOut()
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 32, 16),))
    monkeypatch.undo()
    (report,) = converted.ttt2la_report.layers
    (note,) = [n for n in report.notes if "converted for lengths leaving 0" in n]
    converted._ttt2la.as_written = None          # a lossy conversion's refusal says why too
    with pytest.raises(UnsupportedShapeError, match="traced at lengths leaving 0 only") as refused:
        converted(torch.randn(1, 20, 16))
    said = str(refused.value)
    if whose == "code":
        assert note.startswith("the layer's own code failed"), note
        assert "its own code failed at the others (RuntimeError: shape" in said, said
    else:
        assert "could not trace the layer, whose code runs there" in note, note
        assert "own code" not in note and "own code" not in said, said
        assert "the conversion could not trace the others, where its code runs " \
               "(RuntimeError: a trace made to fail)" in said, said


def test_a_length_the_code_could_not_be_traced_at_runs_as_written_or_is_refused():
    """Lengths with the example's remainder run the plan, exactly; another length never runs the
    graphs (they hold no such length): an exact conversion runs the code as written, whose own
    error names its line, and a lossy one refuses saying which lengths it takes."""
    torch.manual_seed(0)
    layer = ReshapedToTheLength()
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 32, 16),))
    (report,) = converted.ttt2la_report.layers
    assert report.exact and any("converted for lengths leaving 0" in n for n in report.notes)
    assert_same_function(converted, layer, [torch.randn(2, 32, 16), torch.randn(1, 48, 16)])
    with pytest.raises(ttt2la.ConversionError, match="test_whole_chunk_loops.py:") as failed:
        converted(torch.randn(1, 20, 16))
    assert "leaves 4 token(s) after the last whole chunk of 8" in str(failed.value)
    with pytest.raises(UnsupportedShapeError, match="cannot carry its fast-weight state"):
        converted(torch.randn(1, 20, 16), return_ttt_state=True)    # no code as written carries state
    converted._ttt2la.as_written = None          # what a lossy conversion holds: nothing to run
    with pytest.raises(UnsupportedShapeError, match="traced at lengths leaving 0 only"):
        converted(torch.randn(1, 20, 16))
