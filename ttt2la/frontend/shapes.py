"""Make traced graphs valid at every batch size and sequence length.

A trace bakes sizes into op arguments (``view(x, [B*L, d])``, ``expand(w, [B, -1, -1])``). The
recognizer traces each layer at three small shapes — ``(B0, L0)``, ``(B0, L1)``, ``(B1, L0)`` —
and every integer argument that differs between them is fitted exactly by
``a + b·B + c·L + e·B·L`` (two differences determine it; a cross term ``B·L`` is preferred when
both sizes move it, as in a flattened ``[B*L, d]``). A size both move that no such product
gives (``[B*(L + pad), d]``, a padded sequence flattened) is fitted from a fourth trace at
``(B1, L1)``, which the three cannot tell from ``b·B + c·L``. ``GraphTemplate.instantiate(B, L)``
then writes the sizes of any shape into a copy of the graph — a recompile, not a re-trace, so a
converted model never unrolls the user's loop again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx

from ..errors import UnsupportedTTTError
from ..ir import SRC, copy_graph, describe_op, graph_module, torch_name

if TYPE_CHECKING:
    from .chunk_counts import ChunkCountCheck


@dataclass(frozen=True)
class SizeExpr:
    """``a + b·B + c·L + e·B·L + n·N + f·B·N``, ``N = ceil(L / chunk)`` the number of chunks a
    sequence padded to a multiple of ``chunk`` holds (``chunk_counts``)."""

    a: int
    b: int = 0
    c: int = 0
    e: int = 0
    n: int = 0
    f: int = 0
    chunk: int = 1

    def __call__(self, B: int, L: int) -> int:
        N = -(-L // self.chunk)
        return self.a + self.b * B + self.c * L + self.e * B * L + self.n * N + self.f * B * N

    def __str__(self) -> str:
        terms = [f"{k}{'' if v == 1 else f'*{v}'}" if k else str(v)
                 for k, v in (("", self.a), ("B", self.b), ("L", self.c), ("B*L", self.e),
                              (f"ceil(L/{self.chunk})", self.n),
                              (f"B*ceil(L/{self.chunk})", self.f)) if v]
        return " + ".join(terms) or "0"


def _int_slots(args, path=()):
    """Yield (path, value) for every int inside nested args (bools excluded)."""
    if isinstance(args, bool):
        return
    if isinstance(args, int):
        yield path, args
    elif isinstance(args, (list, tuple)):
        for i, a in enumerate(args):
            yield from _int_slots(a, path + (i,))
    elif isinstance(args, dict):
        for k, a in args.items():
            yield from _int_slots(a, path + (k,))


def size_argument(node: torch.fx.Node, path: tuple) -> str:
    """The size at ``path`` in ``node``'s arguments in words: the argument's name where the op
    has a schema (``k``, ``dim``), an item of it by position (``item 2 of size``)."""
    schema = getattr(node.target, "_schema", None)
    head, rest = (path[0], path[1:]) if path else (None, ())
    if schema is not None and isinstance(head, int) and head < len(schema.arguments):
        name = f"`{schema.arguments[head].name}`"
    elif isinstance(head, str):
        name = f"`{head}`"
    else:
        name = f"#{head}"
    return " of ".join([*(f"item {i}" for i in reversed(rest)), name])


def _set(args, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(args, dict):
        out = dict(args)
        out[head] = _set(args[head], rest, value)
        return out
    seq = list(args)
    seq[head] = _set(seq[head], rest, value)
    return type(args)(seq) if isinstance(args, tuple) else seq


def set_slot(node: torch.fx.Node, where: str, path: tuple, value) -> None:
    """Put ``value`` at ``path`` in ``node``'s ``args`` or ``kwargs`` (``where``)."""
    if where == "args":
        node.args = _set(node.args, path, value)
    else:
        node.kwargs = _set(node.kwargs, path, value)


def _fit(v0, vL, vB, B0, L0, L1, B1, corner=None, chunk: int | None = None
         ) -> SizeExpr | None:
    """The size through ``v0``, ``vL`` and ``vB`` at (B0,L0), (B0,L1) and (B1,L0); where both
    sizes move it and no product ``e·B·L`` does, ``corner()`` (its value at (B1,L1), where the
    caller can trace there) decides between ``b·B + c·L`` and a product with other terms.
    ``chunk``: the lengths are whole chunks apart, and a size moving by less than a token per
    token is a count of chunks (``L // C`` of a layer that takes whole chunks only)."""
    dL, dB = vL - v0, vB - v0
    if dL == 0 and dB == 0:
        return SizeExpr(v0)
    if dL and dB:
        e, rem = divmod(dL, B0 * (L1 - L0))
        if rem == 0 and e * L0 * (B1 - B0) == dB:
            return SizeExpr(v0 - e * B0 * L0, 0, 0, e)
        if corner is not None:
            return _bilinear(v0, vL, vB, corner(), B0, L0, L1, B1)
    b, rb = divmod(dB, B1 - B0)
    c, rc = divmod(dL, L1 - L0)
    if rc and not rb and chunk and (L1 - L0) % chunk == 0:
        n, rn = divmod(dL, (L1 - L0) // chunk)
        if not rn:
            return SizeExpr(v0 - b * B0 - n * -(-L0 // chunk), b, n=n, chunk=chunk)
    if rb or rc:
        return None
    return SizeExpr(v0 - b * B0 - c * L0, b, c, 0)


def _bilinear(v0, vL, vB, vC, B0, L0, L1, B1) -> SizeExpr | None:
    """``a + b·B + c·L + e·B·L`` through the four values at the corners (B0,L0), (B0,L1),
    (B1,L0) and (B1,L1), or ``None`` where no integer coefficients give them."""
    if vC is None:
        return None
    e, re = divmod(vC - vL - vB + v0, (B1 - B0) * (L1 - L0))
    b, rb = divmod(vB - v0 - e * L0 * (B1 - B0), B1 - B0)
    c, rc = divmod(vL - v0 - e * B0 * (L1 - L0), L1 - L0)
    if re or rb or rc:
        return None
    return SizeExpr(v0 - b * B0 - c * L0 - e * B0 * L0, b, c, e)


class GraphTemplate:
    """A graph whose integer size arguments are functions of the batch size and length."""

    def __init__(self, gm: torch.fx.GraphModule, slots: dict[tuple[int, str, tuple], SizeExpr]):
        self.gm = gm
        self.slots = slots

    @property
    def generic(self) -> bool:
        return any(e.b or e.c or e.e for e in self.slots.values())

    def instantiate(self, B: int, L: int, fresh: bool = False) -> torch.fx.GraphModule:
        if not self.slots and not fresh:
            return self.gm
        graph = copy_graph(self.gm.graph)
        nodes = list(graph.nodes)
        for (i, where, path), expr in self.slots.items():
            set_slot(nodes[i], where, path, expr(B, L))
        gm = graph_module(self.gm, graph)
        return gm

    def sized(self):
        """One graph for every shape, taking its sizes at each call (``sized_graph``)."""
        from .sized_graph import sized_graph
        return sized_graph(self)

    def rewritten(self, rewrite) -> "GraphTemplate":
        """This template over ``rewrite(gm)``: a copy of the graph whose nodes stay in their
        places (only what they call changes), so each size is set in the same node."""
        gm = rewrite(self.gm)
        assert len(gm.graph.nodes) == len(self.gm.graph.nodes)
        return GraphTemplate(gm, self.slots)


def _first_difference(*graphs: list[torch.fx.Node]) -> str:
    """`` from the op at file:line (`code`)``: the source of the first op the traces disagree
    on (empty when it has none)."""
    for nodes in zip(*graphs):
        if len({(n.op, n.target) for n in nodes}) > 1:
            src = next((n.meta.get(SRC) for n in nodes if n.meta.get(SRC) is not None), None)
            return f" from the op at {src.at()} on" if src else ""
    longest = max(graphs, key=len)
    extra = longest[min(len(g) for g in graphs):]
    src = next((n.meta.get(SRC) for n in extra if n.meta.get(SRC) is not None), None)
    return f" from the op at {src.at()} on" if src else ""


class _Corner:
    """The graph at (B1,L1), traced by ``trace`` when a size first needs it."""

    def __init__(self, trace, n0: list, what: str):
        self.trace, self.n0, self.what, self.nodes = trace, n0, what, None

    def value(self, i: int, where: str, path: tuple):
        if self.nodes is None:
            self.nodes = list(self.trace().graph.nodes)
            n0 = self.n0
            if len(self.nodes) != len(n0) or any(
                    (a.op, a.target) != (b.op, b.target) for a, b in zip(n0, self.nodes)):
                raise UnsupportedTTTError(
                    f"the {self.what} runs other ops when batch size and length both change"
                    f"{_first_difference(n0, self.nodes)}: its code branches on the input shape")
        return dict(_int_slots(getattr(self.nodes[i], where))).get(path)


def fit_template(g0: torch.fx.GraphModule, gL: torch.fx.GraphModule, gB: torch.fx.GraphModule,
                 *, B0: int, L0: int, L1: int, B1: int, what: str,
                 longer: ChunkCountCheck | None = None,
                 corner: Callable[[], torch.fx.GraphModule] | None = None,
                 whole_chunks: tuple[int, Callable[[int], torch.fx.GraphModule]] | None = None
                 ) -> GraphTemplate:
    """Fit a ``GraphTemplate`` from the same graph traced at (B0,L0), (B0,L1) and (B1,L0);
    with ``longer``, check every size at one chunk more and fit the sizes of the chunk count
    (``chunk_counts``); ``corner`` traces it at (B1,L1), only for a size both move that no
    product of batch and length gives; ``whole_chunks``: ``(C, trace_at)``, the lengths traced
    (and the lengths the layer takes) whole chunks of ``C`` apart, whose count a size may be,
    checked at a third length traced by ``trace_at``."""
    n0, nL, nB = (list(g.graph.nodes) for g in (g0, gL, gB))
    at_corner = _Corner(corner, n0, what)
    if not (len(n0) == len(nL) == len(nB)):
        raise UnsupportedTTTError(
            f"the {what} has a different number of ops at different lengths or batch sizes "
            f"({len(n0)}, {len(nL)}, {len(nB)}){_first_difference(n0, nL, nB)}: its code "
            "branches on the input shape, or loops over a size (a second loop over the sequence "
            "does: one loop per module call converts, so put each loop in a submodule of its own)")
    slots: dict = {}
    for i, (a, b, c) in enumerate(zip(n0, nL, nB)):
        if (a.op, a.target) != (b.op, b.target) or (a.op, a.target) != (c.op, c.target):
            raise UnsupportedTTTError(
                f"the {what} runs different ops at different shapes "
                f"({torch_name(a)} vs "
                f"{torch_name(b if (a.op, a.target) != (b.op, b.target) else c)})"
                f"{_first_difference(n0, nL, nB)}: its code branches on the input shape")
        for where in ("args", "kwargs"):
            xa, xb, xc = getattr(a, where), getattr(b, where), getattr(c, where)
            sa = list(_int_slots(xa))
            sb, sc = dict(_int_slots(xb)), dict(_int_slots(xc))
            if len(sa) != len(sb) or len(sa) != len(sc):
                raise UnsupportedTTTError(f"the {what} changes structure with the input shape "
                                          f"in the arguments of {describe_op(a)}")
            for path, v0 in sa:
                vL, vB = sb.get(path), sc.get(path)
                if vL is None or vB is None:
                    raise UnsupportedTTTError(f"the {what} changes structure with the input "
                                              f"shape in the arguments of {describe_op(a)}")
                if v0 == vL == vB:
                    continue
                expr = _fit(v0, vL, vB, B0, L0, L1, B1, corner=None if corner is None else
                            lambda: at_corner.value(i, where, path),
                            chunk=whole_chunks and whole_chunks[0])
                if expr is None:
                    raise UnsupportedTTTError(
                        f"the size argument {size_argument(a, path)} of {describe_op(a)} in "
                        f"the {what} is not an affine function of batch size and length "
                        f"({v0}, {vL}, {vB} at B,L = ({B0},{L0}), ({B0},{L1}), ({B1},{L0}))")
                slots[(i, where, path)] = expr
    if longer is not None:
        slots = longer.refit(n0, nL, nB, slots, B0=B0, L0=L0, L1=L1, B1=B1, what=what)
    if whole_chunks is not None and any(e.n for e in slots.values()):
        for L2 in (2 * L1 - L0, L0 + 7 * (L1 - L0)):
            _check_chunk_counts(n0, slots, whole_chunks, B0, L2, what)
    return GraphTemplate(g0, slots)


def _check_chunk_counts(n0: list, slots: dict, whole_chunks: tuple, B0: int, L2: int,
                        what: str) -> None:
    """Two lengths fit any size as a count of chunks; others, one and six chunks further, check
    every size (``L // 3`` moves as a count of chunks of 8 between 33 and 41, not on to 49;
    as one of chunks of 4 from 12 to 16 and 20, not on to 40)."""
    nodes = list(whole_chunks[1](L2).graph.nodes)
    if len(nodes) != len(n0) or any((a.op, a.target) != (b.op, b.target)
                                    for a, b in zip(n0, nodes)):
        raise UnsupportedTTTError(f"the {what} runs other ops at length {L2}"
                                  f"{_first_difference(n0, nodes)}: its code branches on the "
                                  "length")
    for i, (a, b) in enumerate(zip(n0, nodes)):
        for where in ("args", "kwargs"):
            seen = dict(_int_slots(getattr(b, where)))
            for path, v0 in _int_slots(getattr(a, where)):
                expr = slots.get((i, where, path), SizeExpr(v0))
                if seen.get(path) != expr(B0, L2):
                    raise UnsupportedTTTError(
                        f"the size argument {size_argument(a, path)} of {describe_op(a)} in the "
                        f"{what} is not an affine function of batch size and length, nor of the "
                        f"number of chunks ({expr} fits the lengths traced before, and gives "
                        f"{expr(B0, L2)} at length {L2}, where the code gives {seen.get(path)})")


__all__ = ["GraphTemplate", "SizeExpr", "fit_template"]
