"""Tensors computed after the sequence was cut into mini-batches, read as ``x[i]`` in the loop.

TTT-Linear's published code computes its rates after the cut (``get_eta``): from the
pre-chunked input ``X [B, N, K, d]`` it projects rates ``[B, H, N, 1, K]``, multiplies them by
a per-position ramp ``[B, H, N, K, 1]`` and scans the product ``η [B, H, N, K, K]`` with the
other inputs. Such a tensor ``E`` is no reshape of a whole sequence, so ``prechunked`` cannot
read its mini-batch ``E[i]`` as a chunk slice. It is rewritten here, exactly, by pushing the
``[i]`` down through the ops that made ``E`` until it reaches what ``prechunked`` reads:

* ``E`` has size 1 on the mini-batch axis (a broadcast parameter): ``E[i] = E[0]``;
* ``E`` is a pre-chunked reshape of a sequence: the chunk slice ``prechunked`` makes;
* ``E = f(A, B, …)`` for an elementwise or broadcasting ``f`` (``mul``, ``sigmoid``,
  ``unsqueeze``, ``expand``, a permute, …): ``E[i] = f(A[i], B[i], …)``;
* ``E = A @ W`` (traced as ``view(mm(view(A), W))`` or through ``bmm`` with ``W`` expanded,
  its rows laid out again as ``einsum`` lays them) with ``W`` shared by all mini-batches:
  ``E[i] = A[i] @ W``;
* ``E`` a reshape that keeps the mini-batch axis whole, or a ``repeat`` that does not repeat it.

Every op then runs per mini-batch inside the loop on sizes without the mini-batch count, so
the converted layer runs at any length. What no identity covers is refused by ``prechunked``,
naming the line that computes it.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from ..ir import describe_op
from .prechunked import _chunked_source, _emit, _rewrite_stream, _shape

aten = torch.ops.aten

#: ops applied elementwise (broadcasting their tensor arguments): ``f(A, B)[i] = f(A[i], B[i])``
ELEMENTWISE = {
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.mul.Scalar,
    aten.add.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.sigmoid.default, aten.exp.default,
    aten.neg.default, aten.tanh.default, aten.relu.default, aten.silu.default,
    aten.clamp_min.default, aten.clamp.default, aten.reciprocal.default, aten.abs.default,
    aten.pow.Tensor_Scalar, aten.softplus.default, aten.clone.default, aten.alias.default,
    aten._to_copy.default, aten.where.self,
}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


class NotRewritable(Exception):
    """No identity reads this tensor's mini-batches (the caller refuses it by name)."""


def _permutation(node: torch.fx.Node) -> list[int]:
    """The axes of ``node``'s input in the order a permute or transpose puts them."""
    rank = len(_shape(node))
    if node.target is aten.permute.default:
        return [x % rank for x in node.args[1]]
    perm = list(range(rank))
    d0, d1 = node.args[1] % rank, node.args[2] % rank
    perm[d0], perm[d1] = d1, d0
    return perm


def _rows(node: torch.fx.Node):
    """``(A, W)`` when ``node`` is ``A @ W`` as traced — ``view(mm(view(A, [R, C]), W), …)``,
    or ``view(bmm(view(A, [R, K, C]), expand(W, [R, C, n])), …)`` — giving ``A.shape[:-1] +
    [n]``: every row of ``A`` mapped by the one ``W [C, n]``."""
    mm = node.args[0]
    if not isinstance(mm, torch.fx.Node) or mm.target not in (aten.mm.default,
                                                              aten.bmm.default):
        return None
    flat, weight = mm.args
    if not isinstance(flat, torch.fx.Node) or flat.target not in _VIEWS \
            or not isinstance(weight, torch.fx.Node):
        return None
    a = flat.args[0]
    while a.target in (aten.clone.default, aten.alias.default) or \
            (a.target is aten.expand.default and _shape(a.args[0]) == _shape(a)):
        a = a.args[0]
    matrix = _shape(weight)[-2:]
    while weight.target in (*_VIEWS, aten.expand.default) and \
            _shape(weight.args[0])[-2:] == matrix:       # copies of one matrix, broadcast
        weight = weight.args[0]
    rows = _without_trailing_units(_shape(a))     # einsum's operands carry unit axes last
    if [n for n in _shape(weight) if n != 1] != [n for n in matrix if n != 1] \
            or not rows or rows[-1] != matrix[0] \
            or math.prod(rows[:-1]) * matrix[1] != math.prod(_shape(node)):
        return None
    return a, weight


def _without_trailing_units(shape: list) -> list:
    while len(shape) > 1 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _kept_axis(before: list, after: list, d: int) -> int | None:
    """The axis of a reshape's input that is axis ``d`` of its output: the same size, as many
    elements before it (``None`` where the reshape merges or splits that axis)."""
    outer = math.prod(after[:d])
    for j, n in enumerate(before):
        if math.prod(before[:j]) == outer and n == after[d]:
            return j
    return None


def mini_batch(graph: torch.fx.Graph, node: torch.fx.Node, d: int | None, i: int,
               meta: dict, count: int) -> torch.fx.Node:
    """A node computing ``node[i]`` along axis ``d`` (``None``: ``node`` has no such axis, it
    broadcasts) of a loop call over ``count`` mini-batches, emitted at the graph's insertion
    point with ``meta``'s frames; raises ``NotRewritable`` when no identity applies.

    With one mini-batch (the remainder call) an axis of size 1 is the mini-batch axis itself
    as far as it can be followed down, so that the call reads the sequence like the others."""
    if d is None:
        return node
    if _shape(node)[d] == 1 and count > 1:
        return _broadcast(graph, node, d, meta)
    found = _chunked_source(node, d)
    if found is not None:
        sel = _emit(graph, aten.select.int, (node, d, i), meta)
        return _rewrite_stream(graph, sel, found)
    try:
        if node.op != "call_function":
            raise NotRewritable(f"{describe_op(node)} is not computed by an op")
        return _through_op(graph, node, d, i, meta, count)
    except NotRewritable:
        if _shape(node)[d] != 1:
            raise
        return _broadcast(graph, node, d, meta)


def _through_view(graph, node, d, i, meta, count) -> torch.fx.Node:
    """``view(x)[i]``: rows mapped by one matrix ``A @ W`` (as traced, also when the product's
    rows are laid out again, as ``einsum("bnkc,hdc->bhnkd", X, w)`` traces), the mini-batch
    axis among the rows' leading axes; or a reshape that keeps that axis whole."""
    shape, rows = _shape(node), _rows(node)
    if rows is not None:
        a, weight = rows
        *leading, c = _without_trailing_units(_shape(a))
        if d < len(leading) and leading[:d + 1] == shape[:d + 1]:
            x = mini_batch(graph, a, d, i, meta, count)
            n = _shape(weight)[-1]
            flat = _emit(graph, aten.reshape.default, (x, [-1, c]), meta)
            if _shape(weight) != [c, n]:
                weight = _emit(graph, aten.reshape.default, (weight, [c, n]), meta)
            out = _emit(graph, aten.mm.default, (flat, weight), meta)
            return _emit(graph, aten.reshape.default, (out, shape[:d] + shape[d + 1:]), meta)
    source = node.args[0]
    dj = _kept_axis(_shape(source), shape, d) if isinstance(source, torch.fx.Node) else None
    if dj is None:
        raise NotRewritable(f"{describe_op(node)} merges or splits the mini-batch axis")
    x = mini_batch(graph, source, dj, i, meta, count)
    return _emit(graph, aten.reshape.default, (x, shape[:d] + shape[d + 1:]), meta)


def _through_repeat(graph, node, d, i, meta, count) -> torch.fx.Node:
    """``repeat(x, reps)[i]`` where the mini-batch axis is not repeated: a broadcast spelt as
    copies (``eta.repeat(1, 1, 1, K, 1)`` of a unit axis)."""
    reps = list(node.args[1])
    if reps[d] != 1:
        raise NotRewritable(f"{describe_op(node)} repeats the mini-batch axis")
    dj = d - (len(reps) - len(_shape(node.args[0])))
    x = mini_batch(graph, node.args[0], dj if dj >= 0 else None, i, meta, count)
    del reps[d]
    return _emit(graph, aten.repeat.default, (x, reps), meta)


#: marks the selects that take the one slice of a broadcast axis (no mini-batch is read)
BROADCAST = "ttt2la_broadcast"
#: on a select no identity rewrites: why, naming the op the mini-batch could not be read through
UNREAD = "ttt2la_unread"


def _broadcast(graph, node, d, meta) -> torch.fx.Node:
    """``node[0]`` along an axis of size 1: the same for every mini-batch."""
    sel = _emit(graph, aten.select.int, (node, d, 0), meta)
    sel.meta[BROADCAST] = True
    return sel


def _through_op(graph, node, d, i, meta, count) -> torch.fx.Node:
    """``f(args)[i]`` as ``f`` of the arguments' mini-batches (see the module docstring)."""
    rank, target, args = len(_shape(node)), node.target, list(node.args)
    if target in ELEMENTWISE:
        for j, a in enumerate(node.args):
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                dj = d - (rank - len(_shape(a)))
                args[j] = mini_batch(graph, a, dj if dj >= 0 else None, i, meta, count)
        return _emit(graph, target, args, meta, node.kwargs)
    if target in (aten.permute.default, aten.transpose.int):
        perm = _permutation(node)
        src = perm[d]
        x = mini_batch(graph, node.args[0], src, i, meta, count)
        reduced = [p if p < src else p - 1 for p in perm if p != src]
        return _emit(graph, aten.permute.default, (x, reduced), meta)
    if target in _VIEWS:
        return _through_view(graph, node, d, i, meta, count)
    if target is aten.unsqueeze.default:
        u = node.args[1] % rank
        x = mini_batch(graph, node.args[0], d if d < u else d - 1, i, meta, count)
        return _emit(graph, target, (x, u if u < d else u - 1), meta)
    if target is aten.repeat.default:
        return _through_repeat(graph, node, d, i, meta, count)
    if target is aten.expand.default:
        dj = d - (rank - len(_shape(node.args[0])))
        x = mini_batch(graph, node.args[0], dj if dj >= 0 else None, i, meta, count)
        sizes = list(node.args[1])
        del sizes[d]
        return _emit(graph, target, (x, sizes), meta)
    raise NotRewritable(f"{describe_op(node)} is not an op whose mini-batches are read here")


def rewrite_computed(graph: torch.fx.Graph, selects: list[torch.fx.Node]
                     ) -> list[torch.fx.Node]:
    """Rewrite every ``select(E, d, i)`` of ``selects`` (inside the loop) by the identities
    above; returns the selects left as they were (no identity applies: the caller refuses
    them). A select that cannot be rewritten leaves no new node behind."""
    left = []
    for sel in selects:
        src = sel.args[0]
        d = sel.args[1] % len(_shape(src))
        count = _shape(src)[d]
        before = set(graph.nodes)
        try:
            with graph.inserting_before(sel):
                new = mini_batch(graph, src, d, sel.args[2] % count, sel.meta, count)
        except NotRewritable as e:
            for n in reversed([n for n in graph.nodes if n not in before]):
                if not n.users:
                    graph.erase_node(n)
            sel.meta[UNREAD] = str(e)       # the op the refusal names, where the reading stopped
            left.append(sel)
            continue
        sel.replace_all_uses_with(new)
        graph.erase_node(sel)
    return left


__all__ = ["rewrite_computed", "mini_batch", "ELEMENTWISE", "NotRewritable", "BROADCAST",
           "UNREAD"]
