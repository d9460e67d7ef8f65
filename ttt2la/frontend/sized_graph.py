"""One graph for every sequence length: size arguments read from a tuple passed with each call.

``GraphTemplate.instantiate(B, L)`` writes a shape's sizes into a copy of the traced graph as
constants, and each copy is a new ``GraphModule``: Python code generated and compiled again,
several milliseconds at every new length. ``sized_graph`` builds the graph once instead: every
size argument reads its value from a trailing argument, the tuple of the distinct ``SizeExpr``
values at the call's ``(B, L)``, which ``SizedGraph.at`` computes (a few integer products). A
call at any length then runs the same code, and nothing is written into the graph per call,
so threads share it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from ..ir import copy_graph, graph_module
from .shapes import GraphTemplate, SizeExpr, set_slot

#: The name of the trailing argument that carries a call's sizes.
SIZES = "ttt_sizes"


class Sizes(tuple):
    """A call's sizes: a tuple that ``torch.utils._pytree`` takes as one leaf (only the exact
    ``tuple`` type is a node to it), so flattening a call's arguments — the graph's own code,
    an interpreter re-running it — passes it whole."""

    __slots__ = ()


@dataclass(frozen=True)
class SizedCall:
    """``gm`` at one ``(B, L)``: called with the graph's own arguments, it passes ``sizes``."""

    gm: torch.fx.GraphModule
    sizes: Sizes

    def forward(self, *args):
        return self.gm.forward(*args, self.sizes)

    def inputs(self, args: list) -> list:
        """The arguments ``gm`` itself takes for the call of ``args`` (to interpret it)."""
        return [*args, self.sizes]


class SizedGraph:
    """A graph whose size arguments are the items of its last argument, ``exprs`` at (B, L)."""

    def __init__(self, gm: torch.fx.GraphModule, exprs: tuple[SizeExpr, ...]):
        self.gm = gm
        self.exprs = exprs
        self._calls: dict[tuple[int, int], SizedCall] = {}

    def at(self, B: int, L: int) -> SizedCall:
        """The graph called at ``(B, L)``; immutable, so threads may share it."""
        call = self._calls.get((B, L))
        if call is None:    # sizes from a list: TorchDynamo cannot rebuild a tuple made lazily
            call = self._calls[(B, L)] = SizedCall(self.gm, Sizes([e(B, L) for e in self.exprs]))
        return call


def sized_graph(template: GraphTemplate) -> SizedGraph:
    """``template``'s graph taking its sizes as a trailing tuple: one ``getitem`` of that tuple
    per distinct ``SizeExpr``, in the place of every size slot."""
    graph = copy_graph(template.gm.graph)
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1] if placeholders else None):
        sizes = graph.placeholder(SIZES)
    exprs = tuple(dict.fromkeys(template.slots.values()))
    reads, after = {}, sizes
    for k, expr in enumerate(exprs):
        with graph.inserting_after(after):
            after = reads[expr] = graph.call_function(operator.getitem, (sizes, k))
    for (i, where, path), expr in template.slots.items():
        set_slot(nodes[i], where, path, reads[expr])
    _take_trailing_leaf(graph, sizes.name)
    return SizedGraph(graph_module(template.gm, graph), exprs)


def _take_trailing_leaf(graph: torch.fx.Graph, name: str) -> None:
    """Where the graph's code flattens its arguments (a pytree signature), add one argument, a
    leaf named ``name`` after the others: the sizes tuple, passed whole."""
    codegen = graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        return
    info = codegen.pytree_info
    args = pytree.tree_unflatten([0] * info.in_spec.num_leaves, info.in_spec)
    in_spec = pytree.tree_structure([*args, 0])
    codegen.pytree_info = _PyTreeInfo([*info.orig_args, name], in_spec, info.out_spec)


__all__ = ["SizedGraph", "SizedCall", "Sizes", "sized_graph", "SIZES"]
