"""The token axis follows the axis the loop walks: a layer whose input is laid out heads first
(``[B, H, L, D]``, as many published kernels take q, k and v), or whose first argument is no
sequence (an initial fast weight ``[B, D, D]``, a gate ``[B, 1]``), converts exactly, and a
``[B, L, D]`` layer keeps axis 1. The conversion is compared with the layer as written on its
outputs and the gradients of every parameter and input, at several batch sizes and lengths.
"""
from __future__ import annotations

import pytest
import module_scoped
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]
D, C, H = 8, 4, 3


class HeadsFirstTTT(nn.Module):
    """Linear fast weights per head, the input laid out ``[B, H, L, D]``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], x.shape[1], D, D)
        outs = []
        for s in range(0, x.shape[2], C):
            outs.append(q[:, :, s:s + C] @ W)
            W = W + 0.1 * k[:, :, s:s + C].mT @ v[:, :, s:s + C]
        return torch.cat(outs, 2)


class StateFirstTTT(nn.Module):
    """The initial fast weight passed first: ``forward(W0 [B, D, D], x [B, L, D])``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, W0, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = W0, []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + 0.1 * k[:, s:s + C].mT @ v[:, s:s + C]
        return torch.cat(outs, 1)


class GateFirstTTT(nn.Module):
    """A per-sequence gate passed first: ``forward(g [B, 1], x [B, L, D])``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, g, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + k[:, s:s + C].mT @ v[:, s:s + C] * g[:, :, None]
        return torch.cat(outs, 1)


class TokensFirstTTT(nn.Module):
    """``[B, L, D]`` whose loop slices the sequence behind two learned prefix tokens, as long as
    ``D`` at the example: that length is no axis the loop walks when it grows, so axis 1 stays
    the tokens."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.prefix = nn.Parameter(torch.randn(1, 2, D))

    def forward(self, x):
        x = torch.cat([self.prefix.expand(x.shape[0], -1, -1), x], 1)
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + 0.1 * k[:, s:s + C].mT @ v[:, s:s + C]
        return torch.cat(outs, 1)[:, 2:]


def _examples(kind: str, B: int, L: int) -> tuple:
    x = torch.randn(B, L, D)
    if kind == "heads":
        return (torch.randn(B, H, L, D),)
    if kind == "state":
        return (torch.randn(B, D, D) / D, x)
    if kind == "gate":
        return (torch.rand(B, 1), x)
    return (x,)


_LAYERS = {"heads": HeadsFirstTTT, "state": StateFirstTTT, "gate": GateFirstTTT,
           "tokens": TokensFirstTTT}
_converted = module_scoped.cache()


def _convert(kind: str):
    if kind not in _converted:
        torch.manual_seed(0)
        layer = _LAYERS[kind]()
        example = _examples(kind, 2, 12 if kind != "tokens" else 6)
        _converted[kind] = (layer, ttt2la.convert(layer, level=0, example_inputs=example))
    return _converted[kind]


def _assert_same(conv, layer, inputs):
    a = [x.clone().requires_grad_(True) for x in inputs]
    b = [x.clone().requires_grad_(True) for x in inputs]
    ya, yb = conv(*a), layer(*b)
    assert rel_rms_error(ya, yb) <= FP32
    g = torch.randn_like(yb)
    ga = torch.autograd.grad((ya * g).sum(), [*a, *conv.parameters()], allow_unused=True)
    gb = torch.autograd.grad((yb * g).sum(), [*b, *layer.parameters()], allow_unused=True)
    for u, v, x in zip(ga, gb, [*a, *layer.parameters()]):
        # one chunk only: the gate scales an update no output reads
        u, v = (torch.zeros_like(x) if t is None else t for t in (u, v))
        assert rel_rms_error(u, v) <= FP32


@pytest.mark.parametrize("kind", ["heads", "state", "gate"])
def test_a_layer_whose_axis_1_is_no_sequence_converts_exactly(kind):
    layer, conv = _convert(kind)
    (report,) = conv.ttt2la_report.layers
    assert report.exact and report.runtime != "kept as written (recurrent)"
    assert "as written" not in report.runtime


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(kind=st.sampled_from(["heads", "state", "gate"]), B=st.integers(1, 4),
       L=st.integers(1, 27))
def test_the_conversion_equals_the_layer_at_other_lengths_and_batches(kind, B, L):
    layer, conv = _convert(kind)
    _assert_same(conv, layer, _examples(kind, B, L))


def _token_axis(conv) -> int:
    layout = conv._ttt2la.layout
    return layout.token_axis[layout.ref]


def test_heads_first_reads_the_length_off_axis_2():
    layer, conv = _convert("heads")
    assert _token_axis(conv) == 2
    with pytest.raises(ttt2la.UnsupportedShapeError, match=r"axis 1 has size 5, not 3"):
        conv(torch.randn(2, 5, 9, D))


def test_a_tokens_first_layer_keeps_axis_1():
    """A loop slicing a stretch as long as the feature size, which does not grow with it, keeps
    axis 1 the tokens."""
    layer, conv = _convert("tokens")
    assert _token_axis(conv) == 1
    assert conv.ttt2la_report.layers[0].exact
    _assert_same(conv, layer, _examples("tokens", 2, 6))
