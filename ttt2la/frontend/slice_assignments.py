"""Slice assignments read as the values they write.

Functionalization turns ``a[:, i, :i] = y`` into ``slice_scatter(a, copy(a[:, i, :i], y), …)``.
``aten.copy`` has no derivative in torch, so a converted layer whose code assigns into a slice —
outside the loop (``k[:, :, :4] = …``) or inside it (the forward substitution of a chunk's UT
transform) — would fail in every backward, and in any forward that differentiates. Its value is
simply ``y``, broadcast to the slice's shape and cast to its dtype and device, so each ``copy`` is
rewritten as that value: ``y`` itself, or ``y`` expanded and cast. Values are unchanged; the scatter
that writes it back into ``a`` is differentiable.

A loop body's ``select_scatter`` (``a[:, i] = y``) is further written as the ``slice_scatter`` of
``y`` unsqueezed: torch differentiates ``select_scatter`` wrongly under ``vmap`` (the gradient
reaching ``y`` is off, silently), and the executors run loop bodies vmapped over chunks.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def _emit(graph: torch.fx.Graph, target, args, kwargs, like: torch.fx.Node, val) -> torch.fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta = {**like.meta, "val": val}
    return node


def _written_value(graph: torch.fx.Graph, copy: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding the value ``copy`` writes (inserted before it); None when the shapes
    are unknown."""
    dst, src = copy.args[0], copy.args[1]
    dv, sv = dst.meta.get("val"), src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    if dv is None or sv is None:
        return None
    value = src
    with graph.inserting_before(copy):
        if tuple(sv.shape) != tuple(dv.shape):
            value = _emit(graph, aten.expand.default, (value, list(dv.shape)), {}, copy,
                          sv.expand(dv.shape))
        if sv.dtype != dv.dtype or sv.device != dv.device:
            value = _emit(graph, aten._to_copy.default, (value,),
                          {"dtype": dv.dtype, "device": dv.device}, copy, copy.meta.get("val"))
    return value


def slice_assignments_as_values(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every ``aten.copy`` of ``gm`` (a functionalized trace) as the value it
    writes, so that the graph differentiates."""
    changed = False
    for copy in [n for n in gm.graph.nodes if n.target is aten.copy.default]:
        value = _written_value(gm.graph, copy)
        if value is None:
            continue
        copy.replace_all_uses_with(value)
        gm.graph.erase_node(copy)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


def select_writes_as_slice_writes(graph: torch.fx.Graph) -> None:
    """Rewrite, in place, every ``select_scatter(a, y, d, i)`` of ``graph`` as
    ``slice_scatter(a, y.unsqueeze(d), d, i, i + 1)``: the same value, differentiated right
    under ``vmap``."""
    for write in [n for n in graph.nodes if n.target is aten.select_scatter.default]:
        base, src, dim, index = write.args[:4]
        sv = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        if sv is None:
            continue
        dim %= sv.dim() + 1
        with graph.inserting_before(write):
            one = _emit(graph, aten.unsqueeze.default, (src, dim), {}, write, sv.unsqueeze(dim))
            new = _emit(graph, aten.slice_scatter.default,
                        (base, one, dim, index, index + 1 if index != -1 else None), {}, write,
                        write.meta.get("val"))
        write.replace_all_uses_with(new)
        graph.erase_node(write)


__all__ = ["slice_assignments_as_values", "select_writes_as_slice_writes"]
