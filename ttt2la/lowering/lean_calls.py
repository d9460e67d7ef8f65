"""A graph run once per chunk, called with less Python per op.

A loop over chunks calls the same small graph once per chunk, and for a small state the Python
cost of the calls is most of a step's time. A traced graph calls ``torch.ops.aten`` overloads:
about 5 µs each from Python, against about 2.5 µs for the torch function that binds the same
kernel. ``lean_calls`` calls each op whose torch function takes the same arguments through that
function; the kernels, and so the values, are the same. (Expands and views onto a tensor's own
shape stay: a graph re-sized to another batch size keeps its trace's shape metadata, so which
ones are no-ops cannot be read off it.)
"""
from __future__ import annotations

import torch
import torch.fx

from ..ir import copy_graph

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
    return torch.fx.GraphModule(gm, graph)


__all__ = ["FAST_CALLS", "lean_calls"]
