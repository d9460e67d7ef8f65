"""A sequence padded to a multiple of the chunk and viewed as chunks ("pad then reshape into
mini-batches"): the sizes around the loop are functions of the chunk count ``ceil(T / C)``, and
the converted layer computes them at each call — the same output shape and function as the
layer's own code at every length, longer or shorter than the example, never the traced one's."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ttt2la

from equivalence import assert_same_function

D, C = 8, 4


class PaddedChunks(nn.Module):
    """Linear attention over chunks of a padded sequence: padded at the end (``side="right"``,
    cut back with ``[:, :T]``) or at the front (cut with ``[:, -T:]`` or ``[:, pad:]``);
    ``heads`` splits two heads off the channels (``[B, H, N, C, d]``, ttt-lm's layout)."""

    def __init__(self, side="right", cut="neg", heads=False):
        super().__init__()
        self.side, self.cut, self.heads = side, cut, heads
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        pad = (-T) % C
        q, k, v = (F.pad(t, (0, 0, 0, pad) if self.side == "right" else (0, 0, pad, 0))
                   for t in self.proj(x).chunk(3, -1))
        N = (T + pad) // C
        if self.heads:
            return self._heads(q, k, v, B, N)[:, :T]
        q, k, v = (t.view(B, N, C, D) for t in (q, k, v))
        S = x.new_zeros(B, D, D)
        outs = []
        for n in range(N):
            outs.append(q[:, n] @ S)
            S = S + 0.1 * k[:, n].transpose(1, 2) @ v[:, n]
        o = torch.stack(outs, 1).reshape(B, N * C, D)
        if self.side == "right":
            return o[:, :T]
        return o[:, -T:] if self.cut == "neg" else o[:, pad:]

    def _heads(self, q, k, v, B, N):
        """The loop on ``[B, H, N, C, d]`` chunks, outputs back to ``[B, N·C, D]``."""
        q, k, v = (t.view(B, N, C, 2, D // 2).permute(0, 3, 1, 2, 4) for t in (q, k, v))
        S = q.new_zeros(B, 2, D // 2, D // 2)
        outs = []
        for n in range(N):
            outs.append(q[:, :, n] @ S)
            S = S + 0.1 * k[:, :, n].transpose(-1, -2) @ v[:, :, n]
        return torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, N * C, D)


LENGTHS = (1, 3, 4, 7, 13, 16, 17, 31, 40)


@pytest.mark.parametrize("side,cut,heads,example", [
    ("right", "neg", False, 16), ("left", "neg", False, 16), ("left", "pad", False, 14),
    ("right", "neg", True, 14)])
def test_every_length(side, cut, heads, example):
    torch.manual_seed(0)
    layer = PaddedChunks(side, cut, heads)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, example, D),))
    assert conv.ttt2la_report.exact
    xs = [torch.randn(B, T, D) for T in LENGTHS for B in (1, 3)]
    for x in xs:
        with torch.no_grad():
            assert conv(x).shape == layer(x).shape, tuple(x.shape)
    assert_same_function(conv, layer, [torch.randn(2, T, D) for T in (5, 21, 40)])


def test_size_of_the_chunk_count():
    """``a + c·L + n·ceil(L/C)`` (and its batch multiple) at lengths on and off the chunks."""
    from ttt2la.frontend.shapes import SizeExpr
    padded = SizeExpr(0, n=4, chunk=4)
    assert [padded(1, L) for L in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    pad = SizeExpr(0, c=-1, n=4, chunk=4)
    assert [pad(1, L) for L in (1, 4, 5, 8)] == [3, 0, 3, 0]
    assert SizeExpr(0, f=1, chunk=4)(3, 9) == 9
    assert "ceil(L/4)" in str(padded)


def test_size_neither_affine_nor_of_the_chunk_count_is_refused():
    """A size that moves at one chunk more but is no ``a + c·L + n·ceil(L/C)`` is refused."""
    from ttt2la.frontend.chunk_counts import _length_fit
    assert _length_fit([16, 16, 20, 20], (14, 15, 18, 20), 4) == (0, 0, 4)
    assert _length_fit([2, 1, 2, 0], (14, 15, 18, 20), 4) == (0, -1, 4)    # the pad
    assert _length_fit([16, 16, 20, 24], (14, 15, 18, 20), 4) is None      # floor + 1
