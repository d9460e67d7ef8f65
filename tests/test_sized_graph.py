"""The code around a converted loop as one graph per batch size, its sizes passed per call.

``sized_graph`` replaces every size argument of the traced graph by an item of a tuple passed
with the call, so a new length computes a few integers instead of generating and compiling a
graph. One graph called at any (B, L) must compute what a graph instantiated at that shape
computes, and what the layer as written computes; a new length must build no graph; threads
calling it at different lengths must each get their own length's answer.
"""
from __future__ import annotations

import threading
import warnings

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la import zoo
from ttt2la.ir import LOOP_MODULE, params_and_buffers
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import lact_layer

D = 16


def _layers():
    torch.manual_seed(0)
    # LaCT with two Newton–Schulz steps: the graph's sizes, not the iteration, are under test
    return {
        "lact": (lact_layer("folded", variant=2, d_model=D, num_heads=2, chunk_size=4,
                            muon_steps=2).eval(), 2, 1),
        "gated": (zoo.GatedChunkMemory(D, 2, 4).eval(), 0, 4),
    }


_CONVERTED = module_scoped.cache()


def _converted(name: str):
    """``(layer, converted, the step its lengths take)``, converted once at length 16."""
    if name not in _CONVERTED:
        layer, level, step = _layers()[name]
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 16, D),))
        _CONVERTED[name] = layer, conv, step
    return _CONVERTED[name]


def _instantiated(state, B: int, L: int):
    """The code around the loop written for (B, L) alone, as a converted layer built it before
    its sizes were passed per call."""
    gm = state.outer.instantiate(B, L, fresh=True)
    setattr(gm, LOOP_MODULE, state.loop_for(B))
    return gm


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["lact", "gated"]),
       shapes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 12)), min_size=2, max_size=4))
def test_one_graph_at_any_shape_computes_what_a_graph_per_shape_and_the_layer_compute(name,
                                                                                    shapes):
    layer, conv, step = _converted(name)
    state = conv._ttt2la
    weights = params_and_buffers(conv)
    with torch.no_grad(), ttt2la.race_as_written(False), warnings.catch_warnings():
        warnings.simplefilter("error")          # no call falls back to the code as written
        for B, chunks in shapes:
            L = chunks * step
            x = torch.randn(B, L, D)
            y = state.outer_for(B, L).forward(weights, x)
            assert rel_rms_error(y, _instantiated(state, B, L).forward(weights, x)) <= 1e-5
            assert rel_rms_error(conv(x), layer(x)) <= 1e-5, (B, L)


def test_a_new_length_builds_no_graph(monkeypatch):
    """Every length at one batch size runs the same graph module; none is made per length."""
    layer, conv, step = _converted("lact")
    state = conv._ttt2la
    with torch.no_grad(), ttt2la.race_as_written(False):
        conv(torch.randn(2, 9, D))
        built = []
        init = torch.fx.GraphModule.__init__
        monkeypatch.setattr(torch.fx.GraphModule, "__init__",
                            lambda self, *a, **k: built.append(1) or init(self, *a, **k))
        for L in (5, 13, 22, 31):
            x = torch.randn(2, L, D)
            assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    assert built == []
    assert state.outer_for(2, 5).gm is state.outer_for(2, 31).gm
    assert state.outer_for(2, 5).sizes != state.outer_for(2, 31).sizes


def test_threads_at_different_lengths_each_get_their_own():
    """The graph is shared and nothing is written into it per call: threads calling it at
    different lengths at once each compute their own length's output."""
    layer, conv, step = _converted("gated")
    lengths = [step * n for n in (1, 2, 3, 5, 7, 9)]
    inputs = {L: torch.randn(2, L, D) for L in lengths}
    with torch.no_grad():
        expected = {L: layer(x) for L, x in inputs.items()}
    errors: list = []

    def run(L):
        try:
            with torch.no_grad(), ttt2la.race_as_written(False):
                for _ in range(20):
                    assert rel_rms_error(conv(inputs[L]), expected[L]) <= 1e-5
        except BaseException as e:      # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(L,)) for L in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("name", ["lact", "gated"])
def test_a_failing_call_still_names_the_line(name):
    """A call the code around the loop cannot take is re-run node by node on the graph with
    its sizes, to name the failing op (``rejected_call``)."""
    _layer, conv, step = _converted(name)
    with torch.no_grad(), ttt2la.race_as_written(False), \
            pytest.raises(ttt2la.errors.RejectedCallError) as info:
        conv(torch.randn(2, 2 * step, D, dtype=torch.float64))
    assert info.value.where and ".py:" in info.value.where
