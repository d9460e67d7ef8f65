"""Loops whose iterations return items of another count than their chunk's tokens, joined by
``cat``: one summary per chunk (its first token's output, its sum, its maximum), two items per
chunk where chunks are two tokens long (as many items as tokens, by coincidence), a chunk's
tokens with a summary beside them.

Each converts exactly at levels 0 and 2 — outputs and every gradient within the fp32 bound, at
lengths with a partial last chunk too — from an example of whole chunks and from one whose last
chunk is partial. The joined items are the loop's own count: cutting them back to the length in
tokens dropped the last item where a chunk's items were as many as its tokens (a silent wrong
shape), and the padding probe narrowed an item to the partial chunk's tokens (a refusal naming
ttt2la's own error). Where zero padding changes a chunk's items (a maximum over a zero-padded
chunk is not the tokens' maximum) or its probe cannot tell it inert (a sum, whose gradient in a
padded token is the state), calls with a partial chunk run as written — from an example with a
partial last chunk too, whose check refused it (or called the maximum's difference a bug).

References: the layer as written at each shape.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function

D = 8


class ChunkItems(nn.Module):
    """Additive fast weights read per chunk, each iteration's output a ``summary`` of the
    chunk's read."""

    def __init__(self, summary: str, chunk: int):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.summary, self.chunk = summary, chunk

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs, C = x.new_zeros(x.shape[0], D, D), [], self.chunk
        for s in range(0, x.shape[1], C):
            y = q[:, s:s + C] @ W
            if self.summary == "first":
                outs.append(y[:, :1])
            elif self.summary == "sum":
                outs.append(y.sum(1, keepdim=True))
            elif self.summary == "max":
                outs.append(y.amax(1, keepdim=True))
            elif self.summary == "two":         # first token and sum: as many as C = 2 tokens
                outs.append(torch.cat([y[:, :1], y.sum(1, keepdim=True)], 1))
            else:                               # "tokens+sum": the tokens, then their sum
                outs.append(torch.cat([y, y.sum(1, keepdim=True)], 1))
            W = W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


CASES = [("first", 4), ("sum", 4), ("max", 4), ("two", 2), ("tokens+sum", 4)]


@pytest.mark.parametrize("summary,chunk", CASES)
@pytest.mark.parametrize("partial_example", [False, True])
@pytest.mark.parametrize("level", [0, 2])
def test_items_per_chunk_are_the_loops_own_count(summary, chunk, partial_example, level):
    torch.manual_seed(0)
    layer = ChunkItems(summary, chunk)
    example = 4 * chunk + (chunk // 2 if partial_example else 0)
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, example, D),))
    assert conv.ttt2la_report.exact
    lengths = [example, 1, chunk + 1, 3 * chunk, 4 * chunk + 1, 8 * chunk + chunk - 1]
    assert_same_function(conv, layer, [torch.randn(2, L, D) for L in lengths])


def test_an_item_the_padding_leaves_alone_runs_the_plan_at_a_partial_chunk():
    """The first token's read is all a chunk's item holds: zero padding after it changes
    nothing, the padding probe judges each item whole, and a call with a partial last chunk runs
    the plan (the probe narrowed the item to the partial chunk's tokens, failed, and sent the call
    to the code as written)."""
    torch.manual_seed(0)
    layer = ChunkItems("first", 4)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 18, D, requires_grad=True)
    assert_same_function(conv, layer, x)
    runs = conv.ttt2la_report.layers[0].runs
    assert not any("partial last chunk" in key for key in runs), runs
