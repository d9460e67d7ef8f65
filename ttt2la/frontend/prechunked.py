"""Pre-chunked streams: loops over ``x[i]`` of a sequence reshaped into ``[N, …, K, …]`` chunks.

Code written as a scan (TTT-Linear's and TTT-MLP's published style) cuts the sequence into
``N`` mini-batches of ``K`` tokens *before* the loop — ``t.reshape(B, H, N, K, f)``, moved
mini-batch first — takes ``xs[i]`` in iteration ``i``, writes ``out[i] = y`` into a buffer
made for all mini-batches, and un-chunks the buffer after the loop (a permute and a reshape
that merges ``N`` with ``K``). The ``L % K`` remaining tokens are a second call of the same
loop on a reshape with ``N = 1``.

Both are rewritten here, on the traced graph, into the form the roll-up reads — chunk slices of
the whole sequence and per-iteration outputs joined by one ``cat``:

* ``select(chunked(T), d, i)`` becomes ``chunked₁(slice(T, a, i·K, (i+1)·K))`` selected at 0,
  where ``chunked₁`` is the same split with ``N = 1`` and the same moves, and a slice ``T`` of
  a longer tensor (``q[:, :, :N·K]``, ``q[:, :, -r:]``) is folded into the chunk slice, so the
  remainder call becomes a partial last chunk of the same sequence;
* ``out[i] = y`` into a buffer read back through ``unchunk(out)`` becomes ``unchunk₁(y)``
  per iteration, joined by ``cat`` along the merged axis; a ``cat`` of such joins is flattened.
  A buffer read back otherwise (its mini-batches put back in another order than the
  sequence's, or read twice) becomes ``stack(y_i)`` along its chunk axis, the value it holds
  after the loop, which the code after the loop reads as written.

``ChunkAxes`` is the eager counterpart: it follows the same reshapes during discovery so that
``x[i]`` on a pre-chunked tensor reports the chunk size ``K``, not 1.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import UnsupportedTTTError
from ..ir import SRC, describe_op
from .loops import LoopSite, loop_depth, walks_once

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MOVES = (aten.permute.default, aten.transpose.int)
_COPIES = (aten.clone.default, aten.alias.default)


# -- eager discovery --------------------------------------------------------------------------

def split_axis(before, after, axis: int | None = None) -> tuple[int, int] | None:
    """``(a, K)`` when ``after`` is ``before`` with axis ``a`` (``axis`` when given) split into
    ``(N, K)`` — the axes after it may be regrouped in the same view (``view(B, N, K, 3, H, D)``
    of ``[B, L, 3·H·D]``); ``None`` when it is not, or when more than one axis could be the
    split one."""
    before, after = list(before), list(after)
    if len(after) <= len(before) or (axis is not None and axis >= len(before)):
        return None
    axes = range(len(before)) if axis is None else [axis]
    if len(after) == len(before) + 1:
        hits = [(a, after[a + 1]) for a in axes if after[:a] == before[:a]
                and after[a] * after[a + 1] == before[a] and after[a + 2:] == before[a + 1:]]
    else:                           # the axes after the split regrouped too
        hits = [(a, after[a + 1]) for a in axes if a + 1 < len(before)
                and after[:a] == before[:a] and after[a] * after[a + 1] == before[a]
                and math.prod(after[a + 2:]) == math.prod(before[a + 1:])]
    return hits[0] if len(hits) == 1 else None


class ChunkAxes:
    """Which tensors of one eager run are pre-chunked: their chunk axis and chunk size ``K``.

    A reshape that splits an axis into ``(N, K)`` makes one; permutes, transposes and copies
    carry it along. Tensors are held weakly and looked up by identity.
    """

    _MOVE_NAMES = {"permute", "transpose", "swapaxes"}
    _COPY_NAMES = {"contiguous", "clone", "detach", "float", "to", "type_as"}

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, int, int]] = {}

    def of(self, t) -> tuple[int, int] | None:
        """``(chunk axis, K)`` of ``t`` when it is pre-chunked."""
        hit = self._known.get(id(t)) if isinstance(t, torch.Tensor) else None
        return hit[1:] if hit is not None and hit[0]() is t else None

    def _mark(self, t, axis: int, size: int) -> None:
        try:
            self._known[id(t)] = (weakref.ref(t), axis, size)
        except TypeError:
            pass

    def note(self, func, args, kwargs, out) -> None:
        """Follow one torch call of the eager run."""
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        name = getattr(func, "__name__", "")
        x = args[0]
        if name in ("reshape", "view") and out.dim() > x.dim():
            found = split_axis(x.shape, out.shape)
            if found is not None:
                self._mark(out, found[0], found[1])
            return
        if name == "unfold":                # windows that do not overlap: chunks, tokens last
            dim, size, step = (*args[1:4], *(kwargs.get(k) for k in ("dimension", "size",
                                                                      "step")))[:3]
            if isinstance(dim, int) and isinstance(size, int) and size == step:
                self._mark(out, dim % x.dim(), size)
            return
        known = self.of(x)
        if known is None:
            return
        axis, size = known
        if name in self._COPY_NAMES and out.shape == x.shape:
            self._mark(out, axis, size)
        elif name == "permute":
            dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            dims = [d % x.dim() for d in (dims or kwargs.get("dims", ()))]
            if axis in dims:
                self._mark(out, dims.index(axis), size)
        elif name in ("transpose", "swapaxes") and len(args) >= 3:
            d0, d1 = args[1] % x.dim(), args[2] % x.dim()
            self._mark(out, d1 if axis == d0 else d0 if axis == d1 else axis, size)

    def indexed(self, func, args) -> tuple[int, int, int] | None:
        """``(K, N·K, i·K)`` for chunk ``i`` taken on the chunk axis of a pre-chunked ``x`` —
        ``x[i]``, ``x[:, i]``, ``x.select(a, i)``: the chunk size, the length and the offset a
        chunk slice of the sequence would report."""
        name = getattr(func, "__name__", "")
        known = self.of(args[0]) if len(args) >= 2 else None
        if known is None:
            return None
        if name == "__getitem__":
            at = _int_index(args[1], args[0].dim())
        elif name == "select" and len(args) >= 3 and all(isinstance(a, int) for a in args[1:3]):
            at = (args[1] % args[0].dim(), args[2])
        else:
            return None
        if at is None or at[0] != known[0]:
            return None
        count = args[0].shape[known[0]]
        return known[1], count * known[1], (at[1] % count) * known[1]

    def cut(self, x, dim: int) -> tuple[int, int] | None:
        """``(K, N·K)`` when ``x.unbind(dim)`` (or iterating ``x``, ``dim`` 0) hands out the
        chunks of a pre-chunked ``x``: its chunk size and the length of the sequence."""
        known = self.of(x)
        if known is None or dim % x.dim() != known[0]:
            return None
        return known[1], x.shape[known[0]] * known[1]


def _int_index(idx, rank: int) -> tuple[int, int] | None:
    """``(axis, i)`` for an index that takes element ``i`` of one axis and whole slices before
    it (``i``, ``(slice(None), i)``, ``(..., i, slice(None))``); None for any other index."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    dim = 0
    for pos, item in enumerate(idx):
        if item is Ellipsis:
            dim = rank - (len(idx) - 1 - pos)
        elif isinstance(item, int) and not isinstance(item, bool):
            return dim, item
        elif isinstance(item, slice) and item == slice(None):
            dim += 1
        else:
            return None
    return None


# -- the traced graph -------------------------------------------------------------------------

def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _shape(node) -> list[int]:
    return list(_val(node).shape)


def _emit(graph: torch.fx.Graph, target, args, meta: dict, kwargs=None) -> torch.fx.Node:
    """A new node computing ``target(*args, **kwargs)``, with ``meta`` (frames) and its fake
    value."""
    kwargs = dict(kwargs or {})
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta.update({k: v for k, v in meta.items() if k != "val"})
    vals, kw = pytree.tree_map(lambda a: _val(a) if isinstance(a, torch.fx.Node) else a,
                               (list(args), kwargs))
    mode = next((v.fake_mode for v in pytree.tree_leaves(vals)
                 if getattr(v, "fake_mode", None) is not None), None)
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vals, **kw)
    return node


def _move_axis(node: torch.fx.Node, axis: int) -> int:
    """Where axis ``axis`` of ``node``'s output comes from in its input (permute/transpose)."""
    if node.target is aten.permute.default:
        return node.args[1][axis] % len(node.args[1])
    rank = len(_shape(node))
    d0, d1 = node.args[1] % rank, node.args[2] % rank
    return d1 if axis == d0 else d0 if axis == d1 else axis


def _chunked_source(src: torch.fx.Node, axis: int):
    """``(T, a, K, steps)`` when ``src`` is ``T`` with axis ``a`` split into ``(N, K)`` and moved
    (``steps``: the split, then the moves and copies, in order) so that the split's ``N`` is
    ``src``'s axis ``axis``; else ``None``."""
    steps = []
    node, indexed = src, axis
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target in _MOVES:
            axis = _move_axis(node, axis)
        elif node.target in _VIEWS:
            found = split_axis(_shape(node.args[0]), _shape(node), axis)
            if found is None or _token_axis(node, axis, found[1], indexed):
                return None
            return node.args[0], axis, found[1], [node, *reversed(steps)]
        elif node.target not in _COPIES:
            return None
        steps.append(node)
        node = node.args[0]
    return None


def _token_axis(view: torch.fx.Node, axis: int, size: int, indexed: int) -> bool:
    """Whether ``view``'s axis ``axis``, "split" into ``(N, 1)``, is just a token axis followed
    by a unit axis (``view(B, L, 1, D)`` for one head) that the loop indexes in place
    (``x[:, t]``, ``indexed > 0``): a per-token stream as written, and the code between the view
    and the loop (norms, scales) stays on whole sequences. A unit split is a cut when the loop
    takes mini-batches laid out first (``xs[i]``, scan style), or when ``N`` is 1 (a remainder
    call of one token, whose ``x[0]`` reads the sequence's last token only as a mini-batch)."""
    return size == 1 and _shape(view)[axis] > 1 and indexed > 0


def _folded_slice(t: torch.fx.Node, axis: int) -> tuple[torch.fx.Node, int]:
    """``(base, offset)``: ``t`` is ``base`` from ``offset`` on along ``axis`` (a step-1 slice,
    or an alias: ``q[:, :N·K]`` of a sequence of exactly ``N·K`` tokens traces to one)."""
    while t.op == "call_function" and t.target in _COPIES and _shape(t.args[0]) == _shape(t):
        t = t.args[0]
    if t.target is aten.slice.Tensor and len(t.args) >= 3 and t.args[1] % len(_shape(t)) == axis \
            and (len(t.args) < 5 or t.args[4] == 1) and isinstance(t.args[2], (int, type(None))):
        start = t.args[2] or 0
        size = _shape(t.args[0])[axis]
        start = max(start + size, 0) if start < 0 else min(start, size)
        return t.args[0], start
    return t, 0


def _permutation(steps, rank: int) -> list[int]:
    """The one permutation the moves among ``steps`` make together (copies and views aside)."""
    dims = list(range(rank))
    for step in steps:
        if step.target is aten.permute.default:
            dims = [dims[p % rank] for p in step.args[1]]
        elif step.target is aten.transpose.int:
            d0, d1 = step.args[1] % rank, step.args[2] % rank
            dims[d0], dims[d1] = dims[d1], dims[d0]
    return dims


def _rewrite_stream(graph: torch.fx.Graph, sel: torch.fx.Node, found) -> torch.fx.Node:
    """``select(chunked(T), d, i)`` -> ``chunked₁(slice(T, a, i·K, (i+1)·K))[d = 0]``; returns
    the new node."""
    t, axis, size, steps = found
    base, offset = _folded_slice(t, axis)
    count = _shape(steps[0])[axis]
    start = offset + (sel.args[2] % count) * size
    one = _shape(steps[0])               # the split's shape, with one chunk
    one[axis] = 1
    with graph.inserting_before(sel):
        chunk = _emit(graph, aten.slice.Tensor, (base, axis, start, start + size), sel.meta)
        split = _emit(graph, aten.view.default, (chunk, one), sel.meta)
        moved = _emit(graph, aten.permute.default, (split, _permutation(steps, len(one))),
                      sel.meta)
        new = _emit(graph, aten.select.int, (moved, sel.args[1], 0), sel.meta)
    sel.replace_all_uses_with(new)
    graph.erase_node(sel)
    return new


def _merge_axis(before, after, axis: int) -> bool:
    """Whether ``after`` is ``before`` with axes ``axis`` and ``axis + 1`` merged (the axes
    after them may be regrouped)."""
    before, after = list(before), list(after)
    return len(before) > axis + 1 and len(after) > axis and after[:axis] == before[:axis] \
        and after[axis] == before[axis] * before[axis + 1] \
        and math.prod(after[axis + 1:]) == math.prod(before[axis + 2:])


def _unchunked(buffer: torch.fx.Node, axis: int):
    """``(steps, result, merged axis)`` when the final ``buffer`` is read only through moves
    and copies ending in a view that merges its chunk axis with the next one."""
    steps, node = [], buffer
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function" or user.args[0] is not node:
            return None
        if user.target in _MOVES:
            rank = len(_shape(user))
            axis = next(j for j in range(rank) if _move_axis(user, j) == axis)
        elif user.target in _VIEWS:
            if not _merge_axis(_shape(node), _shape(user), axis):
                return None
            return [*steps, user], user, axis
        elif user.target not in _COPIES:
            return None
        steps.append(user)
        node = user
    return None


def _buffer_writes(first: torch.fx.Node, in_loop: set) -> list[torch.fx.Node] | None:
    """The chain of ``select_scatter`` writes that starts at ``first``, when it writes every
    slot of the buffer once, in order (``out[i] = y`` for ``i = 0 … N−1``)."""
    chain, node = [first], first
    while True:
        nxt = [u for u in node.users if u.target is aten.select_scatter.default
               and u.args[0] is node and u in in_loop]
        if not nxt:
            break
        if len(nxt) > 1:
            return None
        node = nxt[0]
        chain.append(node)
    dim = first.args[2]
    count = _shape(first)[dim]
    if len(chain) != count or [w.args[3] % count for w in chain] != list(range(count)) \
            or any(w.args[2] != dim for w in chain):
        return None
    return chain


def _rewrite_buffer(graph: torch.fx.Graph, writes: list[torch.fx.Node]) -> torch.fx.Node | None:
    """Replace the un-chunked buffer by ``cat(unchunk₁(y_i))``; returns that ``cat``."""
    dim = writes[0].args[2]
    found = _unchunked(writes[-1], dim)
    if found is None:
        return None
    steps, result, merged = found
    perm = _permutation(steps, len(_shape(writes[-1])))
    shape = _shape(result)
    shape[merged] //= len(writes)
    pieces = []
    for w in writes:
        y = w.args[1]
        if y.target is aten.copy.default:
            y = y.args[1]
        with graph.inserting_before(w.next):       # the same ops for every buffer and size
            one = _emit(graph, aten.expand.default, (y, _shape(w.args[1])), w.meta)
            one = _emit(graph, aten.unsqueeze.default, (one, dim), w.meta)
            one = _emit(graph, aten.permute.default, (one, perm), w.meta)
            one = _emit(graph, aten.clone.default, (one,), w.meta,
                        {"memory_format": torch.contiguous_format})
            pieces.append(_emit(graph, aten._unsafe_view.default, (one, shape), w.meta))
    with graph.inserting_after(result):
        cat = _emit(graph, aten.cat.default, (pieces, merged), result.meta)
    result.replace_all_uses_with(cat)
    return cat


def _stacked_buffer(graph: torch.fx.Graph, writes: list[torch.fx.Node],
                    in_loop: set) -> torch.fx.Node | None:
    """Replace the buffer after its last write by ``stack(y_i, d)``, ``y_i`` what iteration
    ``i`` writes into slot ``i`` of axis ``d`` (every slot is written, once, in order), when no
    written value reads the buffer; returns that ``stack`` (None: the buffer stays)."""
    dim = writes[0].args[2]
    chain = {writes[0].args[0], *writes}
    last = writes[-1]
    if not last.users or any(u in in_loop for u in last.users) \
            or any(u not in chain for n in chain - {last} for u in n.users):
        return None                      # a buffer the loop reads: the roll-up names the read
    pieces = []
    for w in writes:
        y = w.args[1]
        if y.target is aten.copy.default:
            y = y.args[1]
        if _reads_any(y, chain, in_loop):
            return None
        with graph.inserting_before(w.next):
            pieces.append(_emit(graph, aten.expand.default, (y, _shape(w.args[1])), w.meta))
    order = {n: i for i, n in enumerate(graph.nodes)}
    reader = min(last.users, key=order.__getitem__)     # the first read, after the loop
    with graph.inserting_before(reader):
        stack = _emit(graph, aten.stack.default, (pieces, dim), reader.meta)
    last.replace_all_uses_with(stack)
    return stack


def _reads_any(node: torch.fx.Node, values: set, in_loop: set) -> bool:
    """Whether ``node`` is computed, inside the loop, from any of ``values``."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in values:
            return True
        if n in seen or n not in in_loop:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _flatten_cats(graph: torch.fx.Graph, joins: set[torch.fx.Node]) -> None:
    """``cat([cat(a), cat(b)])`` along one axis -> ``cat(a + b)`` for the joins made here."""
    for node in list(graph.nodes):
        if node.target is not aten.cat.default or node in joins:
            continue
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        parts = list(node.args[0])
        if not any(p in joins for p in parts):
            continue
        flat = []
        for p in parts:
            if p in joins and len(p.users) == 1 and p.args[1] == dim:
                flat.extend(p.args[0])
            else:
                flat.append(p)
        node.args = (flat, *node.args[1:])


def _computed_at(node: torch.fx.Node) -> str:
    """``file:line (`code`)`` of the nearest op behind ``node`` that computes, not relays."""
    while node.op == "call_function" and node.target in (*_MOVES, *_COPIES, *_VIEWS,
                                                         aten.unsqueeze.default):
        node = node.args[0]
    src = node.meta.get(SRC)
    return src.at() if src is not None else describe_op(node)


def _computed_selects(graph: torch.fx.Graph, in_loop: set) -> list[torch.fx.Node]:
    """The loop's ``x[i]`` of tensors made outside it that are neither a rewritten stream nor
    an output buffer (``out[i] = y``'s slot): tensors computed after the cut."""
    return [sel for sel in graph.nodes
            if sel in in_loop and sel.target is aten.select.int
            and isinstance(sel.args[0], torch.fx.Node) and sel.args[0] not in in_loop
            and isinstance(_val(sel.args[0]), torch.Tensor)
            and not sel.meta.get("ttt2la_broadcast")      # one slice of a broadcast axis
            and not any(u.target is aten.select_scatter.default for u in sel.args[0].users)]


def _refuse_chunked_computations(graph: torch.fx.Graph, in_loop: set) -> None:
    """Raise when, beside the rewritten streams, the loop still takes ``x[i]`` of a tensor
    computed from the chunked inputs that no identity of ``chunked_computations`` rewrites:
    its chunk is not a slice of one sequence, so no chunk of the converted loop can read it."""
    for sel in _computed_selects(graph, in_loop):
        src = sel.meta.get(SRC)
        where = f" at {src.file}:{src.line}" if src is not None else ""
        unread = sel.meta.get("ttt2la_unread")
        stopped = f" (reading it back, ttt2la stopped at {unread})" if unread else ""
        raise UnsupportedTTTError(
            f"the loop takes mini-batch {sel.args[2]} of a tensor{where} that was computed "
            f"after the sequence was cut into mini-batches, at {_computed_at(sel.args[0])}"
            f"{stopped}, and ttt2la cannot read its mini-batches there (it reads reshapes of "
            "whole sequences, and elementwise ops, permutes and row-wise matrix products of them). "
            "Compute that tensor on the whole sequence ([B, ..., L, ...]) and reshape it into "
            "mini-batches with the others, or, where it mixes the tokens of a mini-batch (a "
            "matrix per mini-batch, such as a UT transform's), compute it inside the loop from "
            "the mini-batch the loop takes.")


def _loop_nodes(graph: torch.fx.Graph, loop: LoopSite) -> set[torch.fx.Node]:
    return {n for n in graph.nodes if n.op == "call_function" and loop_depth(n, loop) is not None}


def unchunk_streams(gm: torch.fx.GraphModule, loop: LoopSite) -> bool:
    """Rewrite the pre-chunked streams and output buffers of ``loop`` (see the module
    docstring) in place; returns whether anything was rewritten."""
    graph = gm.graph
    in_loop = _loop_nodes(graph, loop)
    changed = False
    selects = [n for n in graph.nodes if n in in_loop and n.target is aten.select.int]
    indices: dict[tuple, list] = {}
    for sel in selects:
        indices.setdefault((sel.args[0], sel.args[1]), []).append(sel.args[2])
    for sel in selects:
        src = sel.args[0]
        if not isinstance(src, torch.fx.Node) or src in in_loop:
            continue
        taken = indices.get((src, sel.args[1]))     # None: its source is a rewritten stream's
        if taken is None or not walks_once(taken):   # q[:, h] of a loop over heads inside
            continue
        found = _chunked_source(src, sel.args[1] % len(_shape(src)))
        if found is not None:
            _rewrite_stream(graph, sel, found)
            changed = True
    if changed:
        from .chunked_computations import rewrite_computed
        in_loop = _loop_nodes(graph, loop)
        rewrite_computed(graph, _computed_selects(graph, in_loop))
        in_loop = _loop_nodes(graph, loop)
        _refuse_chunked_computations(graph, in_loop)
    joins, prechunked = set(), changed
    for w in [n for n in graph.nodes if n in in_loop and n.target is aten.select_scatter.default
              and n.args[0] not in in_loop]:
        writes = _buffer_writes(w, in_loop)
        if writes is None:
            continue
        if _unchunked(writes[-1], writes[0].args[2]) is None:
            # read otherwise after the loop: a buffer of the mini-batches the loop took from
            # pre-chunked streams is their stack; any other stays for the roll-up to read
            if prechunked and _stacked_buffer(graph, writes, in_loop) is not None:
                changed = True
            continue
        cat = _rewrite_buffer(graph, writes)
        if cat is not None:
            joins.add(cat)
    if joins:
        _flatten_cats(graph, joins)
        changed = True
    if changed:
        graph.eliminate_dead_code()
        gm.recompile()
    return changed


__all__ = ["ChunkAxes", "split_axis", "unchunk_streams"]
