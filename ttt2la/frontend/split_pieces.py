"""Pieces of ``split`` and ``unbind`` read as slices where a loop reads them.

``for qc, kc in zip(q.split(C, 1), k.split(C, 1))`` and ``for x_t in x.unbind(1)`` cut the
sequence once, in the loop statement, and hand each iteration one piece. The loop recognizer
finds a chunk stream as a slice taken inside the loop whose offset moves by one chunk per
iteration (``x[:, s:s+C]``, ``x[:, t]``). A piece is exactly such a view, so every piece of a cut
made in a loop statement that the loop's body reads is rewritten as its slice (``split``) or
selection (``unbind``) of the tensor that was cut, placed before its first reader and attributed
to that reader's line. Values and layouts are unchanged.

The same holds for a cut made before the loop (``chunks = zip(*(t.split(C, 1) for t in (q, k,
v)))``, ``qs = q.split(C, 1)`` read as ``qs[i]``) when the loop's body reads its pieces one after
another, each piece done with before the next is read, as one piece per iteration is; pieces
every iteration reads (heads cut before a loop over chunks) are left as they are. And values a
generator in the loop statement makes as the loop asks for them (``for qc, kc in ((q[:, i:i+C],
k[:, i:i+C]) for i in range(0, L, C))``, or a generator function that yields chunks) are made
once per iteration: they are attributed to the line of the body that first reads them.
"""
from __future__ import annotations

import ast
import functools
import itertools
import linecache
import operator

import torch
import torch.fx

from ..ir import SRC
from .capture import FRAMES
from .loops import LoopSite, _loops_in_file, caller_depth, loops_of
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


def _one_per_iteration(pieces: list[torch.fx.Node], order: dict, made: torch.fx.Node,
                       outer: int) -> set[LoopSite]:
    """The loops whose body reads ``pieces`` (in their order) one after another, made outside
    them by ``made``: at least two pieces read, each one's first reader in the body, and every
    reader of a piece before the first reader of the next (empty when they are not so read)."""
    if len(pieces) < 2:
        return set()
    spans = [(min(order[u] for u in p.users), max(order[u] for u in p.users)) for p in pieces]
    if any(last >= spans[i + 1][0] for i, (_, last) in enumerate(spans[:-1])):
        return set()
    loops = set.intersection(*(loops_of(min(p.users, key=order.__getitem__), outer=outer)
                               for p in pieces))
    return loops - loops_of(made, outer=outer)


def _cuts_before_loops(gm: torch.fx.GraphModule, order: dict, outer: int) -> list[tuple]:
    """``(cut, piece views, loops, None)`` for every cut made outside the loop statements whose
    pieces a loop's body reads one per iteration (``_one_per_iteration``)."""
    found = []
    for node in gm.graph.nodes:
        views = _piece_views(node)
        if views is None or loops_of(node, LoopSite.header_contains):
            continue
        read = sorted((p for p in node.users if p.target is operator.getitem and p.users),
                      key=lambda p: p.args[1])
        loops = _one_per_iteration(read, order, node, outer)
        if loops:
            found.append((node, views, loops, None))
    return found


def _at_reader(meta: dict, reader: torch.fx.Node) -> dict:
    """``meta`` of a value moved to ``reader``: attributed to that reader's line."""
    return {**meta, FRAMES: reader.meta.get(FRAMES, ()), SRC: reader.meta.get(SRC),
            "stack_trace": reader.meta.get("stack_trace")}


#: Ops that only cut a tensor or lay it out: a loop that runs nothing else cuts the sequence
#: into pieces for another loop, as a comprehension would.
_CUTTING = {aten.slice.Tensor, aten.select.int, aten.view.default, aten._unsafe_view.default,
            aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
            aten.transpose.int, aten.permute.default, aten.t.default, aten.alias.default,
            aten.clone.default, operator.getitem, *_SPLITS, *_UNBINDS}


def _cutting_loops(gm: torch.fx.GraphModule, outer: int) -> set[LoopSite]:
    """The loops whose every op only cuts or lays out a tensor (``qs.append(q[:, i:i+C])``)."""
    loops, computing = set(), set()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            inside = loops_of(node, outer=outer)
            loops |= inside
            if node.target not in _CUTTING:
                computing |= inside
    return loops - computing


def _slices_before_loops(gm: torch.fx.GraphModule, order: dict, outer: int) -> bool:
    """Move every slice made before a loop whose body reads the slices of one tensor one per
    iteration (``[(q[:, i:i+C], ...) for i in range(0, L, C)]``, or a loop that only appends
    such slices to lists, then ``for qc, ... in``) to its first reader, attributed to that
    reader's line, as if the body took it; whether any moved."""
    moved_any = False
    families: dict[tuple, list[torch.fx.Node]] = {}
    cutting = _cutting_loops(gm, outer)
    for node in gm.graph.nodes:
        if node.target in (aten.slice.Tensor, aten.select.int) and node.users and len(node.args) >= 3 \
                and isinstance(node.args[0], torch.fx.Node) \
                and not loops_of(node, outer=outer) - cutting:
            size = node.args[3] - node.args[2] if node.target is aten.slice.Tensor and len(node.args) > 3 \
                else 1
            families.setdefault((node.args[0], node.args[1], node.target, size), []).append(node)
    for (source, *_), slices in families.items():
        slices.sort(key=lambda n: n.args[2])
        chains = [_laid_out(n, cutting, outer) for n in slices]
        loops = _one_per_iteration([c[-1] for c in chains], order, source, outer)
        for chain in chains if loops else ():
            _move_to_reader(gm, chain, order)
            moved_any = True
    return moved_any


def _laid_out(node: torch.fx.Node, cutting: set[LoopSite], outer: int) -> list[torch.fx.Node]:
    """``node`` and the layout ops a loop that only cuts applies to it, one after another
    (``k[:, i:i+C].transpose(1, 2)``): the piece the other loop reads is the last."""
    chain = [node]
    while len(chain[-1].users) == 1:
        (user,) = chain[-1].users
        inside = loops_of(user, outer=outer)
        if user.target not in _CUTTING or not inside or inside - cutting:
            break
        chain.append(user)
    return chain


def _move_to_reader(gm: torch.fx.GraphModule, chain: list[torch.fx.Node], order: dict) -> None:
    """Make ``chain`` (each node the only reader of the one before) again just before the
    first reader of its last node, attributed to that reader's line."""
    first = min(chain[-1].users, key=order.__getitem__)
    made = {}
    with gm.graph.inserting_before(first):
        for node in chain:
            made[node] = gm.graph.call_function(
                node.target, torch.fx.map_arg(node.args, lambda a: made.get(a, a)), node.kwargs)
            made[node].meta = _at_reader(node.meta, first)
    chain[-1].replace_all_uses_with(made[chain[-1]])
    for node in reversed(chain):
        gm.graph.erase_node(node)


def split_pieces_as_slices(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every piece of a ``split``/``unbind`` in a loop statement, or made
    before a loop that reads one piece per iteration, as the slice it is, at its first reader;
    move slices made before such a loop to their first reader; then attribute what a generator
    in a loop statement makes to its first reader's line (``gm`` annotated with frames)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    outer = caller_depth(gm)      # the frames that called the traced code hold no loop of it
    cuts = _cuts_in_loop_statements(gm) + _cuts_before_loops(gm, order, outer)
    if cuts:
        _rewrite_pieces(gm, cuts, order)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = _slices_before_loops(gm, order, outer)
    _attribute_generated_values(gm, outer)        # frames only: the code is unchanged
    if cuts or moved:
        gm.graph.lint()
        gm.recompile()
    return gm


def _rewrite_pieces(gm: torch.fx.GraphModule, cuts: list[tuple], order: dict) -> None:
    """Each piece the loops of ``cuts`` read replaced by its slice, placed before its first
    reader and attributed to that reader's line."""
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
            view.meta = _at_reader(piece.meta, first)
            if name is not None:
                view.meta[PIECE_NAME] = name
            piece.replace_all_uses_with(view)
            gm.graph.erase_node(piece)
        if not node.users:
            gm.graph.erase_node(node)


def _attribute_generated_values(gm: torch.fx.GraphModule, outer: int) -> None:
    """Give every value a generator in a loop statement makes, as the loop asks for it, the
    frames of its first reader (from the last node back, so a chain of such values follows the
    body's reader); cuts stay where they are made (their pieces are read as slices above)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or not node.users or _piece_views(node) is not None \
                or not _made_by_a_loop_statements_generator(node, outer):
            continue
        first = min(node.users, key=order.__getitem__)
        frames = first.meta.get(FRAMES, ())
        if frames and loops_of(first, outer=outer):
            node.meta = _at_reader(node.meta, first)


def _made_by_a_loop_statements_generator(node: torch.fx.Node, outer: int) -> bool:
    """Whether one of ``node``'s frames runs a loop statement and the next one a generator
    (a generator expression, or a function that yields) that the statement iterates."""
    frames = node.meta.get(FRAMES, ())[outer:]
    return any(_runs_a_loop_statement(f) and runs_a_generator(g) for f, g in zip(frames, frames[1:]))


def _runs_a_loop_statement(frame) -> bool:
    return any(loop.header_contains(frame) for loop in _loops_in_file(frame.file))


def runs_a_generator(frame) -> bool:
    """Whether ``frame`` runs in a generator: a generator expression, or a function of that
    name whose body yields."""
    return frame.function == "<genexpr>" or any(name == frame.function and lo <= frame.line <= hi
               for name, lo, hi in _generator_functions(frame.file))


@functools.lru_cache(maxsize=256)
def _generator_functions(file: str) -> tuple[tuple[str, int, int], ...]:
    """``(name, first line, last line)`` of every function of ``file`` whose own body yields."""
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except SyntaxError:
        return ()
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_nodes(fn)):
            found.append((fn.name, fn.lineno, fn.end_lineno or fn.lineno))
    return tuple(found)


def _own_nodes(fn: ast.AST):
    """The nodes of a function's body, nested functions and lambdas left out."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield n
        stack.extend(ast.iter_child_nodes(n))


__all__ = ["split_pieces_as_slices", "runs_a_generator"]
