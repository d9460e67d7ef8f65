"""Gradients a loop stops are kept: the converted layer never lets through what the layer stops.

Truncated backpropagation through the inner loop (``W.detach()`` between chunks), an update under
``torch.no_grad()``, ``.data`` or ``torch.autograd.grad`` without ``create_graph=True`` leave the
outputs as they are and change the gradients; the plans compose the state with autograd through
every chunk. Each stop is found at conversion (a detach by its line; the others by the loop run
as traced, differentiated against the layer), the report says so, and an exact conversion runs
calls that record gradients as written — outputs and every gradient the layer's own — and calls
without gradients on its plan. A lossy conversion refuses calls that record gradients, and a
detach of the streams alone, which the plans keep, is no stop.
"""
from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function
from ttt2la.errors import StreamingError, UnsupportedTTTError
from ttt2la.testing import TOLERANCE, rel_rms_error

D, C = 8, 4
STOPS = ("detach_state", "no_grad_update", "data", "no_create_graph")


class StoppedMemory(nn.Module):
    """A fast weight updated chunk by chunk, its gradient stopped as ``how`` says; ``rate``
    gives each token a learnt step size (absorbed by the lossy ``absorb_lr``)."""

    def __init__(self, how: str, rate: bool = False):
        super().__init__()
        self.how, self.rate = how, rate
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.lr = nn.Linear(D, 1)
        self.W0 = nn.Parameter(torch.randn(D, D) * 0.1)

    def _step(self, W, kc, vc, eta):
        if self.how == "detach_state":
            return W.detach() + kc.mT @ (eta * vc)
        if self.how == "detach_values":
            return W + kc.mT @ (eta * vc).detach()
        if self.how == "no_grad_update":
            with torch.no_grad():
                return W + kc.mT @ (eta * vc)
        if self.how == "data":
            return W + (kc.mT @ (eta * vc)).data
        with torch.enable_grad():                   # no_create_graph: a loss's gradient step
            Wg = W.detach().requires_grad_()        # g, of a copy, holds no graph
            loss = -((kc @ Wg) * (eta * vc)).sum()
            g, = torch.autograd.grad(loss, Wg, create_graph=False)
        return W - g

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        eta = torch.sigmoid(self.lr(x)) if self.rate else torch.full_like(x[..., :1], 0.1)
        W = self.W0.expand(B, D, D)
        ys = []
        for s in range(0, T, C):
            ys.append(q[:, s:s + C] @ W)
            W = self._step(W, k[:, s:s + C], v[:, s:s + C], eta[:, s:s + C])
        return torch.cat(ys, 1)


def _converted(how, level=2, rate=False):
    torch.manual_seed(0)
    layer = StoppedMemory(how, rate)
    return layer, ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))


@pytest.mark.parametrize("how", STOPS)
def test_a_stopped_gradient_runs_as_written_when_recording_gradients(how):
    layer, conv = _converted(how)
    report, = conv.ttt2la_report.layers
    assert report.exact
    assert any(n.startswith("gradients:") and "run as written" in n for n in report.notes), \
        report.notes
    assert_same_function(conv, layer, [torch.randn(2, 16, D), torch.randn(3, 30, D)])
    assert any(k.endswith("gradients") and v.startswith("as written") for k, v in
               report.runs.items()), report.runs
    with torch.no_grad():                        # no gradients to stop: the plan
        x = torch.randn(2, 16, D)
        assert torch.allclose(conv(x), layer(x), rtol=1e-5, atol=1e-6)


def test_a_detach_is_named_by_its_line():
    _, conv = _converted("detach_state")
    note, = [n for n in conv.ttt2la_report.layers[0].notes if n.startswith("gradients:")]
    assert "W.detach()" in note and "test_gradient_stops.py:" in note, note


def test_a_detach_of_the_streams_alone_is_no_stop():
    """The plans compute the streams' features with the layer's own ops, detach included."""
    layer, conv = _converted("detach_values")
    report, = conv.ttt2la_report.layers
    assert not any(n.startswith("gradients:") for n in report.notes), report.notes
    assert_same_function(conv, layer, [torch.randn(2, 16, D)])
    assert not any(k.endswith("gradients") for k in report.runs), report.runs


@pytest.mark.parametrize("how", ["detach_state", "no_grad_update"])
def test_a_lossy_conversion_refuses_to_record_the_gradients_it_does_not_stop(how):
    _, conv = _converted(how, level=4, rate=True)
    report, = conv.ttt2la_report.layers
    assert not report.exact
    x = torch.randn(2, 16, D)
    with pytest.raises(UnsupportedTTTError, match="stops gradients inside its loop"):
        conv(x)
    with torch.no_grad():
        assert conv(x).shape == x.shape


def test_the_stop_survives_pickling_and_streaming_refuses_gradients():
    layer, conv = _converted("no_grad_update")
    again = pickle.loads(pickle.dumps(conv))
    assert again._ttt2la.gradient_stop == conv._ttt2la.gradient_stop != ""
    assert_same_function(again, layer, [torch.randn(2, 16, D)])
    with pytest.raises(StreamingError, match="stops gradients"):
        conv(torch.randn(2, 8, D), return_ttt_state=True)
    with torch.no_grad():
        y, _state = conv(torch.randn(2, 8, D), return_ttt_state=True)
    assert y.shape == (2, 8, D)


class InPlaceMemory(nn.Module):
    """Linear attention with a normaliser, both states updated in place (``S += …``): its
    forward runs, its own backward fails (a tensor autograd saved is overwritten)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).sigmoid().chunk(3, -1)
        S, z = x.new_zeros(x.shape[0], D, D), x.new_zeros(x.shape[0], D)
        o = torch.zeros_like(v)
        for t in range(x.shape[1]):
            S += k[:, t, :, None] * v[:, t, None, :]
            z += k[:, t]
            o[:, t] = torch.einsum("bf,bfv->bv", q[:, t], S) / \
                (torch.einsum("bf,bf->b", q[:, t], z)[:, None] + 1e-6)
        return o


def test_a_layer_whose_own_backward_fails_converts_and_refuses_the_backward():
    torch.manual_seed(0)
    layer, x = InPlaceMemory(), torch.randn(2, 6, D)
    with pytest.raises(RuntimeError, match="inplace"):
        layer(x).sum().backward()
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report, = conv.ttt2la_report.layers
    assert any("not checked" in n and "inplace" in n for n in report.notes), report.notes
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]
    y = conv(x)                                     # a forward recording gradients runs
    assert rel_rms_error(y.detach(), layer(x).detach()) <= TOLERANCE[torch.float32]
    with pytest.raises(UnsupportedTTTError, match="cannot be differentiated as written"):
        y.sum().backward()
    again = pickle.loads(pickle.dumps(conv))
    with pytest.raises(UnsupportedTTTError, match="cannot be differentiated"):
        again(x).sum().backward()
    with pytest.raises(StreamingError, match="records gradients"):
        conv(x, return_ttt_state=True)


class StateStopped(nn.Module):
    """A memory returning its output and its final fast weight, whose gradient it stops after
    the loop where a trace cannot see it (``how``: ``.data`` or ``torch.no_grad()``): the
    output's gradients are untouched, the returned state's are stopped."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], D, D)
        ys = []
        for s in range(0, x.shape[1], C):
            ys.append(q[:, s:s + C] @ W)
            W = W + 0.1 * k[:, s:s + C].mT @ v[:, s:s + C]
        if self.how == "data":
            W = W.data
        else:
            with torch.no_grad():
                W = W * 1.0
        return torch.cat(ys, 1), W


def _gradients_of_both(module, x):
    """The gradients of a random projection of both outputs, summed, w.r.t. ``x`` and every
    parameter (zero where unread), and the outputs."""
    xi = x.clone().requires_grad_()
    y, W = module(xi)
    gen = torch.Generator().manual_seed(0)
    loss = (y * torch.randn(y.shape, generator=gen)).sum() + (
        (W * torch.randn(W.shape, generator=gen)).sum() if W.requires_grad else 0)
    wrt = [xi, *module.parameters()]
    got = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [y, W], [torch.zeros_like(p) if g is None else g for p, g in zip(wrt, got)]


@settings(max_examples=4, deadline=None)
@given(how=st.sampled_from(["data", "no_grad"]), batch=st.integers(1, 3),
       length=st.integers(1, 20))
def test_a_stop_on_a_returned_state_alone_runs_as_written(how, batch, length):
    """The first output's gradients agree with the loop's; the returned state's do not, and
    that is a stop too: calls that record gradients run as written."""
    torch.manual_seed(0)
    layer = StateStopped(how)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    report, = conv.ttt2la_report.layers
    assert any(n.startswith("gradients:") and "(output 2)" in n for n in report.notes), \
        report.notes
    x = torch.randn(batch, length, D)
    (yc, Wc), gc = _gradients_of_both(conv, x)
    (yr, Wr), gr = _gradients_of_both(layer, x)
    assert Wc.requires_grad == Wr.requires_grad
    for got, want in zip([yc, Wc, *gc], [yr, Wr, *gr]):
        assert rel_rms_error(got, want) <= TOLERANCE[torch.float32]


class NormedToItsStart(nn.Module):
    """One step over all tokens on a weight-normalised fast weight whose rows are rescaled to the
    norms they started with, read off a detached copy (as LaCT's novel-view-synthesis code
    writes it): the detach is of the state the step starts from."""

    def __init__(self, norm: bool = True):
        super().__init__()
        self.norm = norm
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.W0 = nn.Parameter(torch.randn(D, D) * 0.3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = self.W0.expand(x.shape[0], D, D)
        start = W.detach().norm(dim=1, keepdim=True)
        W = W + 0.1 * k.mT @ v
        if self.norm:
            W = W / (W.norm(dim=1, keepdim=True) + 1e-5) * start
        return q @ W


def test_a_detach_the_passes_leave_dead_stops_nothing():
    """Level 2 drops the weight norm, and with it the only reader of the detached norms: the
    converted layer records gradients, those of the layer written without the norm."""
    torch.manual_seed(0)
    layer = NormedToItsStart()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, D),))
    report, = conv.ttt2la_report.layers
    assert not report.exact and not any(n.startswith("gradients:") for n in report.notes)
    twin = NormedToItsStart(norm=False)
    twin.load_state_dict(layer.state_dict())
    assert_same_function(conv, twin, [torch.randn(2, 16, D), torch.randn(3, 30, D)])
