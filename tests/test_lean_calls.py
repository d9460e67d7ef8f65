"""``lean_calls``: a graph run once per chunk computes the same values, bit for bit, with its aten
overloads called through the torch functions that bind the same kernels."""
from __future__ import annotations

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from ttt2la.lowering.lean_calls import FAST_CALLS, at_shapes, lean_calls

aten = torch.ops.aten
_g = torch.Generator().manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, generator=_g)


#: One call of every overload in the table: (positional arguments, keyword arguments).
SAMPLES = {
    aten.view.default: ((_r(2, 6), [3, 4]), {}),
    aten._unsafe_view.default: ((_r(2, 6), [12]), {}),
    aten.reshape.default: ((_r(2, 6).t(), [3, 4]), {}),
    aten.expand.default: ((_r(1, 3), [4, 3]), {}),
    aten.transpose.int: ((_r(2, 3, 4), -1, -2), {}),
    aten.permute.default: ((_r(2, 3, 4), [2, 0, 1]), {}),
    aten.t.default: ((_r(2, 3),), {}),
    aten.unsqueeze.default: ((_r(2, 3), 1), {}),
    aten.squeeze.dim: ((_r(2, 1, 3), 1), {}),
    aten.select.int: ((_r(4, 3), 0, 2), {}),
    aten.clone.default: ((_r(3, 2).t(),), {"memory_format": torch.contiguous_format}),
    aten.mm.default: ((_r(3, 4), _r(4, 5)), {}),
    aten.bmm.default: ((_r(2, 3, 4), _r(2, 4, 5)), {}),
    aten.addmm.default: ((_r(5), _r(3, 4), _r(4, 5)), {"beta": 0.5, "alpha": 2.0}),
    aten.baddbmm.default: ((_r(2, 3, 5), _r(2, 3, 4), _r(2, 4, 5)), {"alpha": 0.5}),
    aten.add.Tensor: ((_r(3, 4), _r(4)), {"alpha": 2}),
    aten.sub.Tensor: ((_r(3, 4), _r(3, 1)), {}),
    aten.mul.Tensor: ((_r(3, 4), _r(3, 4)), {}),
    aten.div.Tensor: ((_r(3, 4), _r(4).abs() + 1), {}),
    aten.add.Scalar: ((_r(3), 1.5), {}),
    aten.sub.Scalar: ((_r(3), 1.5), {}),
    aten.mul.Scalar: ((_r(3), 1.5), {}),
    aten.div.Scalar: ((_r(3), 1.5), {}),
    aten.rsub.Scalar: ((_r(3), 1.0), {}),
    aten.neg.default: ((_r(3),), {}),
    aten.exp.default: ((_r(3),), {}),
    aten.sigmoid.default: ((_r(3),), {}),
    aten.tanh.default: ((_r(3),), {}),
    aten.pow.Tensor_Scalar: ((_r(3), 2),  {}),
    aten.sum.dim_IntList: ((_r(3, 4), [1], True), {}),
    aten.mean.dim: ((_r(3, 4), [0]), {}),
    aten.cat.default: (([_r(2, 3), _r(1, 3)], 0), {}),
    aten.stack.default: (([_r(2, 3), _r(2, 3)], 1), {}),
}


def test_every_fast_call_is_the_overloads_kernel():
    """Each torch function in the table gives its overload's value, shape, strides and dtype."""
    assert set(SAMPLES) == set(FAST_CALLS), "every entry of the table needs a sample here"
    for op, (args, kwargs) in SAMPLES.items():
        want, got = op(*args, **kwargs), FAST_CALLS[op](*args, **kwargs)
        assert torch.equal(got, want), op
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), op


def _chunk_step(W, k, v, q, e):
    """A mini-batch delta step on ``[B, H, d, d]`` memories, read before the step."""
    return W - k.transpose(-1, -2) @ ((k @ W - v) * e), q @ W


def _traced():
    B, H, C, d = 2, 3, 4, 5
    args = (_r(B, H, d, d), _r(B, H, C, d), _r(B, H, C, d), _r(B, H, C, d), _r(B, H, C, 1))
    return make_fx(_chunk_step)(*args), args


def test_a_traced_step_keeps_its_values_with_cheaper_calls():
    gm, args = _traced()
    lean = lean_calls(gm)
    for got, want in zip(lean(*args), gm(*args)):
        assert torch.equal(got, want)
    calls = lambda g: [n for n in g.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert len(calls(lean)) == len(calls(gm))
    assert not any(isinstance(n.target, torch._ops.OpOverload) for n in calls(lean)), lean.code
    assert all(isinstance(n.target, torch._ops.OpOverload) for n in calls(gm))


def test_arguments_the_torch_function_does_not_take_keep_the_overload():
    """``expand(implicit=True)`` and ``add.Scalar`` with a positional ``alpha``."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(1, 3)
    e = graph.call_function(aten.expand.default, (x, [4, 3]), {"implicit": True})
    a = graph.call_function(aten.add.Scalar, (e, 1.0, 2))
    graph.output(a)
    lean = lean_calls(torch.fx.GraphModule(torch.nn.Module(), graph))
    targets = [n.target for n in lean.graph.nodes if n.op == "call_function"]
    assert targets == [aten.expand.default, aten.add.Scalar]
    x = _r(1, 3)
    assert torch.equal(lean(x), x.expand(4, 3) + 2)


def _views(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch.Tensor.expand, torch.Tensor.reshape)]


def test_views_onto_their_inputs_own_shape_are_dropped_at_the_calls_shapes():
    """``k @ W`` on ``[B, H, d, d]`` memories traces as expands of each operand onto its own
    shape, a flattening view to ``[B·H, ·, ·]`` and the product viewed back: at the call's shapes
    the expands are no-ops and go, the flattening views stay, and the values are the same bit for
    bit. Each set of shapes gets its own graph, and the views of another are not dropped there."""
    gm, args = _traced()
    lean = lean_calls(gm)
    kept = {}
    fewer = at_shapes(lean, args, kept)
    assert not any(n.target is torch.Tensor.expand for n in fewer.graph.nodes), fewer.code
    assert 0 < len(_views(fewer)) < len(_views(lean))
    for got, want in zip(fewer(*args), gm(*args)):
        assert torch.equal(got, want)
    assert at_shapes(lean, args, kept) is fewer and len(kept) == 1

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.mul, (graph.call_function(torch.Tensor.reshape,
                                                                     (x, [2, 3])), 2)))
    flat = torch.fx.GraphModule(torch.nn.Module(), graph)
    same, other = _r(2, 3), _r(3, 2)
    assert _views(at_shapes(flat, [same], kept)) == []
    assert len(_views(at_shapes(flat, [other], kept))) == 1
    assert torch.equal(at_shapes(flat, [other], kept)(other), other.reshape(2, 3) * 2)


def test_a_graph_that_writes_or_draws_keeps_its_views():
    """Finding the shapes runs the graph once: one that writes in place or draws random numbers
    is left as it is."""
    for op, extra in ((aten.add_.Tensor, (1.0,)), (aten.bernoulli.p, (0.5,))):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        view = graph.call_function(torch.Tensor.reshape, (x, [2, 3]))
        graph.output(graph.call_function(op, (view, *extra)))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        assert at_shapes(gm, [_r(2, 3)], {}) is gm


def test_the_code_around_a_converted_loop_is_made_lean_once_for_every_length(monkeypatch):
    """A converted layer builds the code around its loop per length (its sizes are constants of
    its graph); the torch functions it calls do not depend on them, so that rewrite runs once,
    and every length computes what the layer as written does."""
    import ttt2la
    import ttt2la.converted as converted
    from ttt2la.testing import rel_rms_error
    from ttt2la.zoo import lact_layer

    torch.manual_seed(0)
    # two Newton–Schulz steps: the rewrite, not the iteration, is under test
    layer = lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4,
                       muon_steps=2).eval()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(1, 16, 16),))
    calls = []
    monkeypatch.setattr(converted, "lean_calls", lambda gm: calls.append(gm) or lean_calls(gm))
    with torch.no_grad(), ttt2la.race_as_written(False):
        for L in (8, 12, 20, 24):
            x = torch.randn(2, L, 16)
            assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    assert calls == []      # made lean once, at the conversion's own first call
