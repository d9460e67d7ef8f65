"""Refusals that name what was found, the user's line and what converts instead: a loop that
starts at an offset, a stream read at a stride, an `if` on the loop's index, a state passed
to another layer, a call at length 0."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ttt2la

HERE = "test_refusal_messages.py"


def _line_of(fn, marker: str = "# <- named") -> int:
    """The line of ``fn``'s source that ends with ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    (i,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(marker)]
    return start + i


class TokenMemory(nn.Module):
    """A decayed outer-product memory read per token; ``d`` sets the state's shape."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            outs.append((q[:, t, :, None] * S).sum(1))
        return torch.stack(outs, 1)


def test_a_state_of_another_layer_at_the_same_batch_is_named_so():
    """A state whose sizes differ beyond the batch is another layer's, not a batch change."""
    torch.manual_seed(0)
    wide = ttt2la.convert(TokenMemory(8), level=0, example_inputs=(torch.randn(2, 12, 8),))
    narrow = ttt2la.convert(TokenMemory(6), level=0, example_inputs=(torch.randn(2, 12, 6),))
    _, state = wide(torch.randn(2, 5, 8), return_ttt_state=True)
    with pytest.raises(ttt2la.StreamingError) as refused:
        narrow(torch.randn(2, 5, 6), ttt_state=state)
    message = str(refused.value)
    assert "batch size changed" not in message, message
    assert "another layer" in message and "(2, 8, 8)" in message, message
    assert "Pass each layer the ttt_state that layer returned" in message, message


def test_a_state_at_another_batch_size_is_still_named_so():
    """A state whose sizes differ in the batch alone: the batch size changed."""
    torch.manual_seed(0)
    layer = ttt2la.convert(TokenMemory(8), level=0, example_inputs=(torch.randn(2, 12, 8),))
    _, state = layer(torch.randn(2, 5, 8), return_ttt_state=True)
    with pytest.raises(ttt2la.StreamingError, match="the batch size changed"):
        layer(torch.randn(3, 5, 8), ttt_state=state)


class BufferedTokenMemory(TokenMemory):
    """The same memory writing its outputs into a buffer: at length 0 it returns an empty one."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        o = torch.zeros_like(v)
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            o[:, t] = (q[:, t, :, None] * S).sum(1)
        return o


def test_an_empty_sequence_returns_what_the_layer_as_written_returns():
    """At length 0 the loop runs no iteration: an exact conversion returns the layer's own
    output for it (an empty sequence of outputs)."""
    torch.manual_seed(0)
    layer = BufferedTokenMemory(8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    x = torch.randn(2, 0, 8)
    assert converted(x).shape == layer(x).shape == (2, 0, 8)
