"""Views made again in every iteration, after an in-place write before the loop.

Functionalization gives a tensor written in place (``q *= scale``, ``eta[:, -1] = …``, as
flash-linear-attention's naive references write them) a new value, and makes every view of it
again wherever the view is read: a chunk-first view ``_q = q.reshape(B, N, C, D).permute(…)``
read as ``_q[i]`` in the loop is traced as the same ``view``/``permute`` in every iteration, so
the ``select`` reads no tensor computed before the loop and the loop's chunks look like no
stream. The same views of one write are one value: ``hoist_remade_views`` keeps the first,
moved to just after the write (outside the loop), and reads it in every iteration.
"""
from __future__ import annotations

import operator
import re
from collections import Counter

import torch
import torch.fx

from ..ir import describe_op
from .capture import FRAMES
from .loops import LoopSite, loop_depth

aten = torch.ops.aten

#: An in-place write as the code spells it: an augmented assignment or a ``_`` method.
_IN_PLACE = re.compile(r"\(`[^`]*([-+*/@]=|\w_\()[^`]*`\)")


def _written_in_place(node: torch.fx.Node) -> bool:
    """Is ``node`` the new value of a tensor written in place (a functionalized slice
    assignment's scatter, or an in-place op the trace wrote out of place)?"""
    return node.op == "call_function" and ("scatter" in str(node.target)
                                           or bool(_IN_PLACE.search(describe_op(node))))


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False) \
        and bool(node.args) and isinstance(node.args[0], torch.fx.Node)


#: Views that take one part of a tensor: an iteration's read of its chunk, never hoisted (a
#: split into every part, ``q, k, v = qkv.chunk(3, -1)``, is the same in every iteration).
_PARTS = frozenset({aten.select.int, aten.slice.Tensor, aten.narrow.default,
                    aten.as_strided.default, aten.diagonal.default, aten.unfold.default})


def hoist_remade_views(gm: torch.fx.GraphModule, loop: LoopSite) -> bool:
    """Read each chain of views ``loop`` makes again in several iterations from a tensor
    written in place before it from the chain's first copy, moved out of the loop; returns
    whether anything was rewritten. A view made once (the iteration's own ``select`` of its
    chunk) stays where it is."""
    graph = gm.graph
    inside = {n for n in graph.nodes
              if n.op == "call_function" and loop_depth(n, loop) is not None}
    first: dict[tuple, torch.fx.Node] = {}
    keys: dict[torch.fx.Node, tuple] = {}
    copies: Counter = Counter()
    for n in graph.nodes:
        part = n.target is operator.getitem and n.args[0] in keys     # one piece of a split
        if n not in inside or not (part or _is_view(n) and n.target not in _PARTS):
            continue
        source = first.get(keys.get(n.args[0]))
        if source is None and (n.args[0] in inside or not _written_in_place(n.args[0])):
            continue
        key = (source or n.args[0], n.target, n.args[1:], tuple(sorted(n.kwargs.items())))
        keys[n] = key
        first.setdefault(key, n)
        copies[key] += 1
    again = []
    for n, key in keys.items():
        if copies[key] < 2:
            continue
        if first[key] is not n:
            again.append(n)
            continue
        source = first.get(keys.get(n.args[0]), n.args[0])
        source.append(n)                    # just after what it views, before the loop
        n.meta[FRAMES] = source.meta.get(FRAMES, ())
        n.args = (source, *n.args[1:])
    for n in reversed(again):
        n.replace_all_uses_with(first[keys[n]])
        graph.erase_node(n)
    if again:
        gm.recompile()
    return bool(again)


__all__ = ["hoist_remade_views"]
