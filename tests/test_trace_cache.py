"""A layer's traces kept like compiles (``ttt2la/frontend/trace_cache.py``): the same layer
recognized from another example copies its traces and converts to the same function; every
recognition gets a graph of its own; what a trace depends on is part of its key."""
from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

import ttt2la
from equivalence import assert_same_function
from ttt2la.frontend import recognize, trace_cache
from ttt2la.frontend.trace_cache import LayerTraces
from ttt2la.zoo import ScanLinearTTTLayer


@pytest.fixture
def traces(monkeypatch) -> list:
    """Nothing cached before the test; the list gets an entry for every trace actually taken."""
    monkeypatch.setattr(trace_cache, "_TRACES", OrderedDict())
    monkeypatch.setattr(recognize, "_CACHE", OrderedDict())
    taken, real = [], trace_cache.trace
    monkeypatch.setattr(trace_cache, "trace", lambda *a, **k: taken.append(1) or real(*a, **k))
    return taken


def test_another_example_copies_the_traces_and_converts_the_same(traces):
    """The scan-style layer (its roll-up rewrites the traced graph in place) converted from a
    batch of 2 and then from a batch of 3 one chunk longer: the second conversion traces
    nothing, and both compute the layer's function."""
    torch.manual_seed(0)
    layer = ScanLinearTTTLayer(8, 2, 3)
    first = ttt2la.convert(copy.deepcopy(layer), level=2, example_inputs=(torch.randn(2, 10, 8),))
    taken = len(traces)
    assert taken >= 4
    second = ttt2la.convert(copy.deepcopy(layer), level=2,
                            example_inputs=(torch.randn(3, 13, 8),))
    assert len(traces) == taken
    xs = [torch.randn(b, n, 8, generator=torch.Generator().manual_seed(n)) for b, n in
          ((1, 1), (2, 7), (3, 14))]
    for converted in (first, second):
        assert_same_function(converted, layer, xs)


def _function(weights, x):
    return (x @ weights["w"]).relu().sum(-1)


def test_each_call_gets_a_graph_of_its_own(traces):
    fn = LayerTraces(_function, ("a layer",))
    w, x = {"w": torch.randn(4, 4)}, torch.randn(2, 4)
    mine = fn.trace(w, x)
    count = len(mine.graph.nodes)
    relu = next(n for n in mine.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])
    mine.graph.erase_node(relu)
    again = fn.trace(w, x)
    assert len(traces) == 1 and again is not mine
    assert len(again.graph.nodes) == count
    assert torch.equal(again(w, x), _function(w, x))


@pytest.mark.parametrize("change", ["shape", "dtype", "stride", "requires grad", "layer",
                                    "grad mode", "autocast", "default dtype"])
def test_what_a_trace_depends_on_keys_it(traces, change):
    """Each of these traces again; the same call does not."""
    w, x = {"w": torch.randn(4, 4)}, torch.randn(2, 4)
    fn = LayerTraces(_function, ("a layer",))
    fn.trace(w, x)
    fn.trace(w, x)
    assert len(traces) == 1
    previous = torch.get_default_dtype()
    try:
        if change == "shape":
            fn.trace(w, torch.randn(3, 4))
        elif change == "dtype":
            fn.trace({"w": w["w"].double()}, x.double())
        elif change == "stride":
            fn.trace(w, torch.randn(4, 2).t())
        elif change == "requires grad":
            fn.trace({"w": w["w"].clone().requires_grad_()}, x)
        elif change == "layer":
            LayerTraces(_function, ("another layer",)).trace(w, x)
        elif change == "grad mode":
            with torch.no_grad():
                fn.trace(w, x)
        elif change == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fn.trace(w, x)
        else:
            torch.set_default_dtype(torch.float64)
            fn.trace(w, x)
    finally:
        torch.set_default_dtype(previous)
    assert len(traces) == 2


def test_a_layer_without_a_key_is_traced_every_time(traces):
    fn = LayerTraces(_function, None)
    w, x = {"w": torch.randn(4, 4)}, torch.randn(2, 4)
    fn.trace(w, x)
    fn.trace(w, x)
    assert len(traces) == 2 and not trace_cache._TRACES


def test_clear_caches_forgets_what_was_traced(traces):
    """After ``ttt2la.clear_caches()`` the same conversion traces its layer again."""
    torch.manual_seed(0)
    layer, x = ScanLinearTTTLayer(8, 2, 3), torch.randn(2, 10, 8)
    ttt2la.convert(copy.deepcopy(layer), level=2, example_inputs=(x,))
    taken = len(traces)
    ttt2la.convert(copy.deepcopy(layer), level=2, example_inputs=(x,))
    assert len(traces) == taken
    ttt2la.clear_caches()
    ttt2la.convert(copy.deepcopy(layer), level=2, example_inputs=(x,))
    assert len(traces) == 2 * taken


_GAIN = 1.0


def _step_size(x):
    return 0.1 * x


class _ReadsFromOutside(torch.nn.Module):
    """A chunked layer whose step reads a module global (``_GAIN``), a class attribute
    (``SCALE``) and a module-level helper (``_step_size``), none of them held by the layer."""

    SCALE = 1.0

    def __init__(self, d=8, C=4):
        super().__init__()
        self.C = C
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        W, outs = self.w0.expand(x.shape[0], -1, -1), []
        for i in range(0, x.shape[1], self.C):
            outs.append(q[:, i:i + self.C] @ W)
            step = _step_size(_GAIN * self.SCALE * k[:, i:i + self.C])
            W = W + step.transpose(1, 2) @ v[:, i:i + self.C]
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("change", ["global", "class attribute", "helper"])
def test_what_the_code_reads_from_outside_the_layer_keys_its_traces(traces, monkeypatch, change):
    """Converted again after a global, a class attribute or a helper it calls changed, the
    layer is traced again and computes the new function (the kept traces held the old one)."""
    torch.manual_seed(0)
    layer, x = _ReadsFromOutside(), torch.randn(2, 12, 8)
    ttt2la.convert(layer, level=0, example_inputs=(x,))
    taken = len(traces)
    if change == "global":
        monkeypatch.setitem(globals(), "_GAIN", 3.0)
    elif change == "class attribute":
        monkeypatch.setattr(_ReadsFromOutside, "SCALE", 3.0)
    else:
        monkeypatch.setitem(globals(), "_step_size", lambda x: 0.3 * x)
    again = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert len(traces) > taken
    assert_same_function(again, layer, [x, torch.randn(1, 7, 8)])
