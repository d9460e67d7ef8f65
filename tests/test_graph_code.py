"""Graph modules a conversion builds generate their Python code when they first run or are read
(``ir.graph_module``, ``ir.lazy_graph_modules``), and behave as fx's own modules do otherwise: the
same values, copies and pickles that run, and no printout of generated code when one raises."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.fx
from torch.fx import _lazy_graph_module
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import make_fx

from ttt2la.ir import _CodeOnFirstUse, graph_module, lazy_graph_modules


def _graph(fn) -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(fn)


def _affine(x):
    return x * 2 + 1


def test_the_code_is_generated_at_the_first_run_and_computes_the_graph():
    gm = graph_module(torch.nn.Module(), _graph(_affine).graph)
    assert type(gm)._needs_recompile()              # nothing generated yet
    x = torch.randn(3)
    assert torch.equal(gm.forward(x), x * 2 + 1)
    assert not type(gm)._needs_recompile()
    assert torch.equal(gm(x), x * 2 + 1)


def test_reading_the_code_generates_it():
    gm = graph_module(torch.nn.Module(), _graph(_affine).graph)
    assert "mul" in gm.code and not type(gm)._needs_recompile()


def test_a_rewritten_graph_runs_its_new_code():
    gm = graph_module(torch.nn.Module(), _graph(_affine).graph)
    x = torch.randn(3)
    gm(x)
    add, = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor
            or n.target == "add" or getattr(n.target, "__name__", "") == "add"]
    add.args = (add.args[0], 5)
    gm.recompile()
    assert torch.equal(gm(x), x * 2 + 5)


def test_a_graph_that_raises_at_its_first_run_prints_nothing(capfd):
    """Called through ``forward`` (as converted layers call their graphs), the first run raises
    the graph's own error and writes nothing to stderr, as every later run does."""
    gm = graph_module(torch.nn.Module(), _graph(lambda a, b: a @ b).graph)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            gm.forward(torch.randn(2, 3), torch.randn(4, 5))
    assert capfd.readouterr().err == ""


def test_copies_and_pickles_run():
    gm = graph_module(torch.nn.Module(), _graph(_affine).graph)
    x = torch.randn(4)
    for other in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert torch.equal(other(x), x * 2 + 1)
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=False)(x), x * 2 + 1)


def test_make_fx_inside_makes_them_and_fx_is_set_back_after():
    original = _lazy_graph_module._LazyGraphModule
    with lazy_graph_modules():
        gm = make_fx(_affine)(torch.randn(3))
    assert isinstance(gm, _CodeOnFirstUse) and type(gm)._needs_recompile()
    assert _lazy_graph_module._LazyGraphModule is original
    assert not _lazy_graph_module._use_lazy_graph_module_flag
    with pytest.raises(ZeroDivisionError), lazy_graph_modules():
        1 / 0
    assert _lazy_graph_module._LazyGraphModule is original
    assert not isinstance(make_fx(_affine)(torch.randn(3)), _LazyGraphModule)   # fx's own
