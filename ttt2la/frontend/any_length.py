"""A single test-time step at any length: sizes and constants of the length, read at run time.

A single step over all tokens has no chunk structure to keep, so its converted layer should take
any length the original takes. Its traces, though, bake the length into op arguments — view
sizes ``[B, H, N, D]``, the ``1/N`` of a mean, a ``v / float(N)`` scale — and the runtime
specialises a program's body per batch size only. Here the step is traced at three lengths
``L0 < L1 < L2`` (``probe_lengths``) and at the batch sizes the layer is fitted at; every
number argument, integer or float, that changes with the length is fitted as ``a + c·L`` from
``L0`` and ``L1``, checked at ``L2``, and replaced by that expression of ``L`` read off a
whole-sequence input when the graph runs (``aten.sym_size``). ``a`` and ``c`` stay literal,
so the batch-size template fits them like any size. Anything else — a different op at another
length, a number that is not affine in the length, a float that changes with the batch size, a
tensor constant made from the length — leaves the layer at its example's length
(``FixedLength`` says why).
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..ir import SRC, describe_op, torch_name

aten = torch.ops.aten

#: relative agreement asked of a float constant with its fitted ``a + c·L`` at the third length
FLOAT_AGREEMENT = 1e-9


class FixedLength(Exception):
    """Why a single step cannot run at other lengths than its example's (the message)."""


def probe_lengths(L0: int, sizes: set[int]) -> tuple[int, int, int]:
    """Three lengths ``(L, L + 1, L + 3)`` to trace the step at, ``L ≥ L0``, none of them (nor
    a product of two sizes) equal to a size of the parameters or inputs: the step's token axes
    are told from the others by their size, so a length that is also a head size would mix
    them up."""
    taken = set(sizes) | {a * b for a in sizes for b in sizes}
    L = max(L0, max(sizes, default=0) + 1)
    while {L, L + 1, L + 3} & taken:
        L += 1
    return L, L + 1, L + 3


def _scalars(args, path=()):
    """``(path, value)`` of every int or float inside nested ``args`` (bools excluded)."""
    if isinstance(args, bool):
        return
    if isinstance(args, (int, float)):
        yield path, args
    elif isinstance(args, (list, tuple)):
        for i, a in enumerate(args):
            yield from _scalars(a, path + (i,))
    elif isinstance(args, dict):
        for k, a in args.items():
            yield from _scalars(a, path + (k,))


def _put(args, path, value):
    """``args`` with the item at ``path`` replaced by ``value``."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(args, dict):
        return {**args, head: _put(args[head], rest, value)}
    seq = list(args)
    seq[head] = _put(seq[head], rest, value)
    return tuple(seq) if isinstance(args, tuple) else seq


def _aligned(graphs: dict, what: str) -> dict:
    """The graphs' node lists, after checking that they run the same ops in the same order."""
    nodes = {k: list(g.graph.nodes) for k, g in graphs.items()}
    keys = list(nodes)
    ref = nodes[keys[0]]
    for k in keys[1:]:
        other = nodes[k]
        for a, b in zip(ref, other):
            if a.op != b.op or (a.op not in ("placeholder", "get_attr") and a.target != b.target):
                raise FixedLength(f"the {what} runs different ops at different lengths "
                                  f"({describe_op(a)}, where another length runs "
                                  f"{torch_name(b)})")
        if len(other) != len(ref):
            raise FixedLength(f"the {what} has a different number of ops at different lengths")
    return nodes


def _fit(values: tuple, lengths: tuple, is_float: bool):
    """``(a, c)`` with ``a + c·L`` equal to ``values`` at ``lengths`` (the third a check), or
    ``None``."""
    (v0, v1, *more), (L0, L1, *rest) = values, lengths
    c = (v1 - v0) / (L1 - L0)
    a = v0 - c * L0
    if not is_float:
        if c != int(c) or a != int(a):
            return None
        a, c = int(a), int(c)
    for v, L in zip(more, rest):
        expect = a + c * L
        if (expect != v) if not is_float else \
                abs(expect - v) > FLOAT_AGREEMENT * max(abs(v), abs(expect), 1e-30):
            return None
    return a, c


def length_slots(at_b0: tuple, at_b1: tuple | None, lengths: tuple, what: str) -> dict:
    """The number arguments that change with the length, fitted: ``{(node index, "args" or
    "kwargs", path): ((a, c) at the first batch size, (a, c) at the second, is a float)}``.

    ``at_b0``: the graphs at ``lengths`` (three or more: the fit is made at the first two,
    checked at the others) for one batch size; ``at_b1``: the graphs at
    the first two lengths for the other batch size (``None`` when the layer runs at one batch
    size only)."""
    graphs = {("b0", i): g for i, g in enumerate(at_b0)}
    if at_b1 is not None:
        graphs.update({("b1", i): g for i, g in enumerate(at_b1)})
    nodes = _aligned(graphs, what)
    slots = {}
    for i, n0 in enumerate(nodes[("b0", 0)]):
        if n0.op == "get_attr":
            _same_constant(graphs, nodes, i, what)
            continue
        for where in ("args", "kwargs"):
            per = {k: dict(_scalars(getattr(ns[i], where))) for k, ns in nodes.items()}
            for path, v in per[("b0", 0)].items():
                got = {k: p.get(path) for k, p in per.items()}
                if any(g is None for g in got.values()):
                    raise FixedLength(f"the {what} changes structure with the length in the "
                                      f"arguments of {describe_op(n0)}")
                fitted = _slot(got, lengths, isinstance(v, float), at_b1 is not None)
                if fitted == "batch-float":
                    raise FixedLength(
                        f"the constant {v!r} of {describe_op(n0)} in the {what} "
                        "changes with the batch size")
                if fitted is None:
                    raise FixedLength(
                        f"the number {v!r} of {describe_op(n0)} in the {what} is "
                        f"not an affine function a + c·L of the length (at L = {lengths}: "
                        f"{[got[('b0', j)] for j in range(len(lengths))]})")
                if fitted != "same":
                    slots[(i, where, path)] = (*fitted, isinstance(v, float))
    return slots


def _slot(got: dict, lengths: tuple, is_float: bool, two_batches: bool):
    """One slot's fit: ``"same"`` when it does not change with the length, else the two
    ``(a, c)`` pairs, ``None`` when not affine, ``"batch-float"`` for a float of the batch."""
    b0 = tuple(got[("b0", j)] for j in range(len(lengths)))
    b1 = tuple(got[("b1", j)] for j in range(2)) if two_batches else None
    if is_float and b1 is not None and b1[0] != b0[0]:
        return "batch-float"
    if len(set(b0)) == 1 and (b1 is None or b1[0] == b1[1]):
        return "same"
    first = _fit(b0, lengths, is_float)
    second = _fit(b1, lengths[:2], is_float) if b1 is not None else first
    if first is None or second is None:
        return None
    return first, second


def _same_constant(graphs, nodes, i, what) -> None:
    """A tensor constant must be the same at every length (a ``torch.tensor`` made from the
    length would be baked into the graph)."""
    values = []
    for k, g in graphs.items():
        values.append(getattr(g, nodes[k][i].target, None))
    first = values[0]
    for v in values[1:]:
        if not isinstance(v, torch.Tensor) or not isinstance(first, torch.Tensor) \
                or v.shape != first.shape or not torch.equal(v, first):
            n = nodes[next(iter(nodes))][i]
            raise FixedLength(f"the {what} holds a tensor constant ({n.target}) that changes "
                              "with the length")


def rewrite(gm: torch.fx.GraphModule, slots: dict, which: int, carrier: torch.fx.Node,
            axis: int) -> None:
    """Replace every fitted slot of ``gm`` by ``a + c·L`` (``which``: the batch size's pair),
    ``L`` the size of ``carrier``'s ``axis`` when the graph runs."""
    if not slots:
        return
    graph = gm.graph
    nodes = list(graph.nodes)
    first = next(n for n in nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        length = graph.call_function(aten.sym_size.int, (carrier, axis))
    length.meta["val"] = carrier.meta["val"].shape[axis]
    for (i, where, path), pairs in slots.items():
        node = nodes[i]
        a, c = pairs[which]
        with graph.inserting_before(node):
            scaled = graph.call_function(operator.mul, (length, c))
            value = graph.call_function(operator.add, (scaled, a))
        scaled.meta["val"] = length.meta["val"] * c
        value.meta["val"] = scaled.meta["val"] + a
        if where == "args":
            node.args = _put(node.args, path, value)
        else:
            node.kwargs = _put(node.kwargs, path, value)
    graph.lint()
    gm.recompile()


#: below this many tokens a traced graph may mean something else (``squeeze`` of a token axis)
SHORTEST = 2
_BIG = 1 << 62


def _reach(node: torch.fx.Node) -> int:
    """How many tokens a slice, select or narrow with fixed bounds on a token axis needs."""
    if node.target is aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else _BIG
        return max(abs(start), 0 if end >= _BIG else abs(end))
    if node.target is aten.select.int:
        idx = node.args[2]
        return idx + 1 if idx >= 0 else -idx
    start, length = node.args[2], node.args[3]
    return (start if start >= 0 else -start) + length


def shortest_length(pairs: list, L0: int) -> tuple[int, str]:
    """The fewest tokens the fitted graphs run at, and why: ``SHORTEST``, or more where a slice
    (select, narrow) of a token axis has bounds that do not move with the length (``k[:, :8]``
    needs 8 tokens; a shorter sequence would be clamped, another function). ``pairs``: the
    same graph traced at ``L0`` and at a longer length."""
    need, why = SHORTEST, "a sequence of one token may trace to other ops (a squeezed axis)"
    for g0, g1 in pairs:
        for a, b in zip(g0.graph.nodes, g1.graph.nodes):
            if a.op != "call_function" or a.target not in (
                    aten.slice.Tensor, aten.select.int, aten.narrow.default):
                continue
            x0, x1 = a.args[0].meta.get("val"), b.args[0].meta.get("val")
            dim = a.args[1] % x0.dim() if isinstance(x0, torch.Tensor) else None
            if dim is None or x0.shape[dim] == x1.shape[dim] or a.args[2:] != b.args[2:]:
                continue
            reach = _reach(a)
            if reach > need:
                need = min(reach, L0)
                src = a.meta.get(SRC)
                what = f"`{src.code}` at {src.file}:{src.line}" if src is not None else \
                    describe_op(a)
                why = (f"{what} reaches a fixed {reach} tokens into the sequence, and a "
                       "shorter one would be clamped there (another function)")
    return need, why


def changing_axis(vals: tuple) -> int:
    """The one axis whose size differs between the fake values ``vals`` (traced at different
    lengths): the token axis."""
    shapes = [tuple(v.shape) for v in vals]
    axes = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    if len(axes) != 1:
        raise FixedLength(f"no single token axis in shapes {shapes}")
    return axes[0]


__all__ = ["FixedLength", "length_slots", "rewrite", "changing_axis", "shortest_length",
           "probe_lengths"]
