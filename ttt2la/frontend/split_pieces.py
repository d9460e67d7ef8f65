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

import operator

import torch
import torch.fx

from ..ir import SRC
from .capture import FRAMES
from .loops import LoopSite, _loops_in_file, node_frames
from .source_names import PIECE_NAME, loop_targets

aten = torch.ops.aten

#: Where each cut op keeps its size (or sizes) and its dimension.
_SPLITS = {aten.split.Tensor: (1, 2), aten.split_with_sizes.default: (1, 2)}
_UNBINDS = {aten.unbind.int: 1}


def _loops(node: torch.fx.Node, where=LoopSite.contains) -> set[LoopSite]:
    """The loops whose body (or, with ``LoopSite.header_contains``, whose statement) holds
    one of ``node``'s frames."""
    return {loop for f in node_frames(node)
            for loop in _loops_in_file(f.file) if where(loop, f)}


def _piece_views(node: torch.fx.Node) -> list[tuple] | None:
    """For a cut op, one ``(op, dim, *bounds)`` per piece: ``slice.Tensor`` bounds or the
    ``select.int`` index; None for any other node."""
    if node.op != "call_function" or (node.target not in _SPLITS and node.target not in _UNBINDS) \
            or not isinstance(node.args[0], torch.fx.Node):
        return None
    val = node.args[0].meta.get("val")
    if val is None:
        return None
    if node.target in _SPLITS:
        size_at, dim_at = _SPLITS[node.target]
        sizes = node.args[size_at]
        dim = node.args[dim_at] if len(node.args) > dim_at else node.kwargs.get("dim", 0)
        dim %= val.dim()
        n = val.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, n - s) for s in range(0, n, sizes)] if sizes > 0 else None
        if sizes is None:
            return None
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [(aten.slice.Tensor, dim, s, s + c) for s, c in zip(starts, sizes)]
    if node.target in _UNBINDS:
        dim_at = _UNBINDS[node.target]
        dim = (node.args[dim_at] if len(node.args) > dim_at else node.kwargs.get("dim", 0))
        dim %= val.dim()
        return [(aten.select.int, dim, i) for i in range(val.shape[dim])]
    return None


def _piece_names(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Cut op -> the name its loop statement binds each piece to, where the statement binds
    one name per cut it iterates (``for qc, kc in zip(q.split(C), k.split(C))``)."""
    in_statement: dict = {}
    for node in gm.graph.nodes:
        if _piece_views(node) is not None:
            for loop in _loops(node, LoopSite.header_contains):
                in_statement.setdefault(loop, []).append(node)
    names = {}
    for loop, cuts in in_statement.items():
        targets = loop_targets(loop.src)
        if targets is not None and len(targets) == len(cuts):
            names.update(zip(cuts, targets))
    return names


def split_pieces_as_slices(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every piece of a ``split``/``unbind`` in a loop statement that the
    loop's body reads as the slice it is, at its first reader (``gm`` annotated with frames)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    names = _piece_names(gm)
    changed = False
    for node in list(gm.graph.nodes):
        views = _piece_views(node)
        if views is None:
            continue
        headers = _loops(node, LoopSite.header_contains)
        if not headers:
            continue
        for piece in list(node.users):
            if piece.target is not operator.getitem or not piece.users:
                continue
            first = min(piece.users, key=order.__getitem__)
            if not _loops(first) & headers:
                continue
            op, dim, *bounds = views[piece.args[1]]
            with gm.graph.inserting_before(first):
                view = gm.graph.call_function(op, (node.args[0], dim, *bounds))
            view.meta = {**piece.meta, FRAMES: first.meta.get(FRAMES, ()),
                         SRC: first.meta.get(SRC), "stack_trace": first.meta.get("stack_trace")}
            if node in names:
                view.meta[PIECE_NAME] = names[node]
            piece.replace_all_uses_with(view)
            gm.graph.erase_node(piece)
            changed = True
        if not node.users:
            gm.graph.erase_node(node)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


__all__ = ["split_pieces_as_slices"]
