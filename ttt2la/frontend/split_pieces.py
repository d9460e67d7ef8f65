"""Pieces of ``split`` and ``unbind`` read as slices where a loop reads them.

``for qc, kc in zip(q.split(C, 1), k.split(C, 1))`` and ``for x_t in x.unbind(1)`` cut the
sequence once, in the loop statement, and hand each iteration one piece. The loop recognizer
finds a chunk stream as a slice taken inside the loop whose offset moves by one chunk per
iteration (``x[:, s:s+C]``, ``x[:, t]``). A piece is exactly such a view, so every piece of a cut
made in a loop statement that the loop's body reads is rewritten as its slice (``split``) or
selection (``unbind``) of the tensor that was cut, placed before its first reader and attributed
to that reader's line. Values and layouts are unchanged.
"""
from __future__ import annotations

import itertools
import operator

import torch
import torch.fx

from ..ir import SRC
from .capture import FRAMES
from .loops import LoopSite, loops_of
from .source_names import PIECE_NAME, loop_targets

aten = torch.ops.aten

#: Where each cut op keeps its size (or sizes) and its dimension.
_SPLITS = {aten.split.Tensor: (1, 2), aten.split_with_sizes.default: (1, 2)}
_UNBINDS = {aten.unbind.int: 1}


def _piece_views(node: torch.fx.Node) -> list[tuple] | None:
    """For a cut op, one ``(op, dim, *bounds)`` per piece: ``slice.Tensor`` bounds or the
    ``select.int`` index; None for any other node."""
    if node.op != "call_function" or (node.target not in _SPLITS and node.target not in _UNBINDS) \
            or not isinstance(node.args[0], torch.fx.Node) or node.args[0].meta.get("val") is None:
        return None
    val = node.args[0].meta["val"]
    size_at, dim_at = _SPLITS.get(node.target, (None, _UNBINDS.get(node.target)))
    dim = node.args[dim_at] if len(node.args) > dim_at else node.kwargs.get("dim", 0)
    dim %= val.dim()
    n = val.shape[dim]
    if size_at is None:
        return [(aten.select.int, dim, i) for i in range(n)]
    sizes = node.args[size_at]
    if isinstance(sizes, int):
        if sizes <= 0:
            return None
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    starts = itertools.accumulate(sizes, initial=0)
    return [(aten.slice.Tensor, dim, s, s + c) for s, c in zip(starts, sizes)]


def _cuts_in_loop_statements(gm: torch.fx.GraphModule) -> list[tuple]:
    """``(cut, piece views, loops whose statement makes it, piece name)`` for every cut op a
    loop statement makes; the name is the one the statement binds each piece to, where it binds
    one name per cut it iterates (``for qc, kc in zip(q.split(C), k.split(C))``)."""
    found, per_loop = [], {}
    for node in gm.graph.nodes:
        views = _piece_views(node)
        headers = loops_of(node, LoopSite.header_contains) if views is not None else set()
        if headers:
            found.append((node, views, headers))
            for loop in headers:
                per_loop.setdefault(loop, []).append(node)
    names = {}
    for loop, cuts in per_loop.items():
        targets = loop_targets(loop.src)
        if targets is not None and len(targets) == len(cuts):
            names.update(zip(cuts, targets))
    return [(node, views, headers, names.get(node)) for node, views, headers in found]


def split_pieces_as_slices(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every piece of a ``split``/``unbind`` in a loop statement that the
    loop's body reads as the slice it is, at its first reader (``gm`` annotated with frames)."""
    cuts = _cuts_in_loop_statements(gm)
    if not cuts:
        return gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node, views, headers, name in cuts:
        for piece in list(node.users):
            if piece.target is not operator.getitem or not piece.users:
                continue
            first = min(piece.users, key=order.__getitem__)
            if not loops_of(first) & headers:
                continue
            op, dim, *bounds = views[piece.args[1]]
            with gm.graph.inserting_before(first):
                view = gm.graph.call_function(op, (node.args[0], dim, *bounds))
            view.meta = {**piece.meta, FRAMES: first.meta.get(FRAMES, ()),
                         SRC: first.meta.get(SRC), "stack_trace": first.meta.get("stack_trace")}
            if name is not None:
                view.meta[PIECE_NAME] = name
            piece.replace_all_uses_with(view)
            gm.graph.erase_node(piece)
        if not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["split_pieces_as_slices"]
