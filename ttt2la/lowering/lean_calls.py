"""A graph run once per chunk, called with less Python per op.

A loop over chunks calls the same small graph once per chunk, and for a small state the Python
cost of the calls is most of a step's time. A traced graph calls ``torch.ops.aten`` overloads:
about 5 µs each from Python, against about 2.5 µs for the torch function that binds the same
kernel. ``lean_calls`` calls each op whose torch function takes the same arguments through that
function; the kernels, and so the values, are the same. Expands and views onto a tensor's own
shape stay: a graph re-sized to another batch size keeps its trace's shape metadata, so which
ones are no-ops cannot be read off it; ``at_shapes`` drops them for the shapes a call runs on.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.fx

from ..ir import copy_graph, graph_module

aten = torch.ops.aten

#: aten overloads and the torch functions that take the same arguments (positional and keyword)
#: and run the same kernel. ``view`` and ``_unsafe_view`` become ``reshape``, a view wherever one
#: is valid: the trace chose its views for the strides it saw, and the chunks a graph runs on may
#: be laid out otherwise (a stream sliced out of a wider projection).
FAST_CALLS = {
    aten.view.default: torch.Tensor.reshape,
    aten._unsafe_view.default: torch.Tensor.reshape,
    aten.reshape.default: torch.Tensor.reshape,
    aten.expand.default: torch.Tensor.expand,
    aten.transpose.int: torch.transpose,
    aten.permute.default: torch.permute,
    aten.t.default: torch.t,
    aten.unsqueeze.default: torch.unsqueeze,
    aten.squeeze.dim: torch.squeeze,
    aten.select.int: torch.select,
    aten.clone.default: torch.clone,
    aten.mm.default: torch.mm,
    aten.bmm.default: torch.bmm,
    aten.addmm.default: torch.addmm,
    aten.baddbmm.default: torch.baddbmm,
    aten.add.Tensor: torch.add,
    aten.sub.Tensor: torch.sub,
    aten.mul.Tensor: torch.mul,
    aten.div.Tensor: torch.div,
    aten.add.Scalar: torch.add,
    aten.sub.Scalar: torch.sub,
    aten.mul.Scalar: torch.mul,
    aten.div.Scalar: torch.div,
    aten.rsub.Scalar: torch.rsub,
    aten.neg.default: torch.neg,
    aten.exp.default: torch.exp,
    aten.sigmoid.default: torch.sigmoid,
    aten.tanh.default: torch.tanh,
    aten.pow.Tensor_Scalar: torch.pow,
    aten.sum.dim_IntList: torch.sum,
    aten.mean.dim: torch.mean,
    aten.cat.default: torch.cat,
    aten.stack.default: torch.stack,
}

#: Keyword arguments the torch function does not take, and how many arguments it takes
#: positionally where the overload takes more: a node that passes more keeps its overload.
_NOT_TAKEN = {aten.expand.default: {"implicit"}}
_POSITIONAL = {aten.add.Scalar: 2, aten.sub.Scalar: 2, aten.rsub.Scalar: 2}


def _has_fast_call(node: torch.fx.Node) -> bool:
    op = node.target
    return node.op == "call_function" and op in FAST_CALLS \
        and not set(node.kwargs) & _NOT_TAKEN.get(op, set()) \
        and len(node.args) <= _POSITIONAL.get(op, len(node.args))


def lean_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that computes the same values with cheaper Python calls."""
    graph = copy_graph(gm.graph)
    for node in graph.nodes:
        if _has_fast_call(node):
            node.target = FAST_CALLS[node.target]
    return graph_module(gm, graph)


#: The views ``lean_calls`` calls through the tensor's methods that, onto their input's own
#: shape, return its elements as they are.
_SHAPE_VIEWS = frozenset({torch.Tensor.expand, torch.Tensor.reshape})


def at_shapes(gm: torch.fx.GraphModule, args: Sequence, kept: dict) -> torch.fx.GraphModule:
    """``gm`` without the expands and reshapes that leave their input's shape as it is when
    called on tensors shaped as ``args`` are: the no-ops a trace keeps (``expand(W, [B, K, V])``
    of a ``[B, K, V]`` memory before its ``bmm``, the ``bmm``'s result viewed as itself), a
    Python call each per chunk, which in a loop over small chunks is much of a step's time.
    The trace's metadata cannot say which views are no-ops (``lean_calls``); a call's inputs
    can. Built once per graph, shapes and dtypes, in ``kept``. ``gm`` itself under a compiler,
    for a graph that writes in place or draws random numbers, and where running it on ``args``
    fails (the call's own run then raises as it would)."""
    if torch.compiler.is_compiling():
        return gm
    key = (gm, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a)
                     for a in args))
    lean = kept.get(key)
    if lean is None:
        lean = kept[key] = _without_own_shape_views(gm, args)
    return lean


def _without_own_shape_views(gm: torch.fx.GraphModule, args: Sequence) -> torch.fx.GraphModule:
    nodes = list(gm.graph.nodes)
    if any(_writes_or_draws(n) for n in nodes):
        return gm
    shapes: dict[torch.fx.Node, torch.Size] = {}

    class _Shapes(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n] = out.shape
            return out

    try:
        with torch.no_grad():
            _Shapes(gm).run(*args)
    except Exception:
        return gm
    graph = copy_graph(gm.graph)
    dropped = False
    for old, node in zip(nodes, list(graph.nodes)):
        if node.op == "call_function" and node.target in _SHAPE_VIEWS \
                and isinstance(old.args[0], torch.fx.Node) and old in shapes \
                and shapes.get(old.args[0]) == shapes[old]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            dropped = True
    return graph_module(gm, graph) if dropped else gm


def _writes_or_draws(node: torch.fx.Node) -> bool:
    """Does ``node`` write a tensor in place or draw random numbers (which running the graph
    once more would change)?"""
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


__all__ = ["FAST_CALLS", "at_shapes", "lean_calls"]
