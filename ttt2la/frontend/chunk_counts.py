"""Sizes of the chunk count: a sequence padded to a multiple of the chunk, then viewed as chunks.

The "pad then reshape into mini-batches" style (``pad = (-T) % C``, ``x.view(B, N, C, D)`` with
``N = ceil(T / C)``, outputs ``reshape(B, N * C, D)[:, :T]``) computes sizes that are no affine
function of the length: two lengths one token apart inside one chunk see the same ``N`` and the
same padded length, and an affine fit from them freezes both (a longer call was cropped to the
traced length by a negative pad, silently). ``ChunkCountCheck`` checks every size argument of
the fitted template at one chunk more; a size that moved there is refitted as
``a + c·L + n·ceil(L/C)`` from the lengths ``L0``, ``L0 + 1`` and ``L0 + C``, and checked at a
fourth, a multiple of ``C`` (where ``ceil`` and ``floor + 1`` differ), traced only then.
Sizes that fit neither form are refused (the probe goes on to lengths of the example's
remainder, where the converted layer takes those lengths only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx

from ..errors import UnsupportedTTTError
from ..ir import describe_op, torch_name
from .shapes import SizeExpr, _int_slots, size_argument

aten = torch.ops.aten


@dataclass
class ChunkCountCheck:
    """The graph around the loop at more lengths (batch ``B0``): ``next_graph`` traced at
    ``L0 + chunk``, ``trace_at(L)`` tracing it at another length on demand."""

    chunk: int
    next_graph: torch.fx.GraphModule
    trace_at: Callable[[int], torch.fx.GraphModule]
    _traced: dict = field(default_factory=dict)

    def _nodes(self, L: int, L0: int, n0: list, what: str) -> list:
        """The nodes of the graph at length ``L``, after checking it runs the ops of ``n0``."""
        if L not in self._traced:
            gm = self.next_graph if L == L0 + self.chunk else self.trace_at(L)
            self._traced[L] = list(gm.graph.nodes)
        nodes = self._traced[L]
        for a, b in zip(n0, nodes):
            if (a.op, a.target) != (b.op, b.target) and not _whole_slice(a, b):
                raise UnsupportedTTTError(
                    f"the {what} runs different ops at length {L} than at length {L0} "
                    f"({describe_op(a)}, {torch_name(b)} at length {L}): its code branches on "
                    "the length")
        if len(nodes) != len(n0):
            raise UnsupportedTTTError(f"the {what} has a different number of ops at length {L} "
                                      f"than at length {L0}: its code branches on the length")
        return nodes

    def refit(self, n0: list, nL: list, nB: list, slots: dict, *, B0: int, L0: int, L1: int,
              B1: int, what: str) -> dict:
        """``slots`` checked at one chunk more, those that moved otherwise refitted with the
        chunk count (``SizeExpr.n``); raises ``UnsupportedTTTError`` where neither holds."""
        C = self.chunk
        LN = L0 + C
        nN = self._nodes(LN, L0, n0, what)
        moved = [key for key, v0 in _slots(n0)
                 if _value(nN, key) != (slots[key](B0, LN) if key in slots else v0)]
        if not moved:
            return slots
        if C == 1 or L1 - L0 != 1:
            raise UnsupportedTTTError(_not_affine(n0, moved[0], what, (L0, L1, LN), (n0, nL, nN)))
        Lm = C * (-(-L1 // C) + 1)              # a multiple of C past the others
        nm = self._nodes(Lm, L0, n0, what)
        lengths, graphs = (L0, L1, LN, Lm), (n0, nL, nN, nm)
        out = dict(slots)
        for key, v0 in _slots(n0):
            if key not in moved:
                expr = slots.get(key, SizeExpr(v0))
                if expr(B0, Lm) != _value(nm, key, n0):
                    raise UnsupportedTTTError(_not_affine(n0, key, what, lengths, graphs))
                continue
            fitted = _length_fit([_value(g, key, n0) for g in graphs], lengths, C)
            if fitted is None:
                raise UnsupportedTTTError(_not_affine(n0, key, what, lengths, graphs))
            out[key] = _with_batch(fitted, v0, _value(nB, key), B0, B1, C)
        return out


def _slots(nodes: list):
    """``((node index, "args" or "kwargs", path), value)`` of every int argument of ``nodes``."""
    for i, node in enumerate(nodes):
        for where in ("args", "kwargs"):
            for path, v in _int_slots(getattr(node, where)):
                yield (i, where, path), v


def _value(nodes: list, key: tuple, n0: list | None = None):
    """The int at ``key`` in ``nodes`` (``None`` where it has none); where ``nodes`` holds an
    alias for the slice of ``n0`` (``_whole_slice``), a ``_Whole`` that equals every bound that
    keeps the whole axis."""
    i, where, path = key
    if n0 is not None and _whole_slice(n0[i], nodes[i]):
        dim = n0[i].args[1]
        # the alias has its input's shape; a loop's output read by ``getitem`` has no value
        x = nodes[i].meta.get("val")
        return _Whole(path, x.shape[dim] if isinstance(x, torch.Tensor) else None)
    return dict(_int_slots(getattr(nodes[i], where))).get(path)


def _whole_slice(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """``b`` an alias where ``a`` slices: a slice that keeps the whole axis (``o[:, :T]`` at a
    length the padding leaves unchanged) traces to an alias."""
    return a.target is aten.slice.Tensor and b.target is aten.alias.default


@dataclass(frozen=True)
class _Whole:
    """The bound at ``path`` of a slice that kept the whole axis of ``size`` tokens."""

    path: tuple
    size: int | None

    def __eq__(self, v) -> bool:
        if not isinstance(v, int) or self.size is None:
            return False
        if self.path == (2,):                   # start
            return v == 0 or v <= -self.size
        if self.path == (3,):                   # end
            return v >= self.size
        return self.path in ((1,), (4,))        # the axis and the step stay as traced


def _length_fit(values: list, lengths: tuple, C: int) -> tuple[int, int, int] | None:
    """``(a, c, n)`` with ``a + c·L + n·ceil(L/C)`` equal to ``values`` at ``lengths`` (the
    first two one token apart in one chunk, the third one chunk on, the fourth a check)."""
    if any(v is None for v in values):
        return None
    v0, v1, vN, vm = values
    L0, _, _, Lm = lengths
    c = v1 - v0
    n = vN - v0 - c * C
    a = v0 - c * L0 - n * -(-L0 // C)
    return (a, c, n) if a + c * Lm + n * (Lm // C) == vm else None


def _with_batch(fitted: tuple, v0: int, vB: int | None, B0: int, B1: int, C: int) -> SizeExpr:
    """The size at batch ``B0`` (``a + c·L + n·N``) extended to every batch size: unchanged
    where the batch trace agrees, proportional to ``B`` where its value is (a flattened
    ``[B·N, C, d]``), else plus ``b·B``."""
    a, c, n = fitted
    if vB is None or vB == v0:
        return SizeExpr(a, 0, c, 0, n, 0, C)
    if vB * B0 == v0 * B1 and not (a % B0 or c % B0 or n % B0):
        return SizeExpr(0, a // B0, 0, c // B0, 0, n // B0, C)
    b, rest = divmod(vB - v0, B1 - B0)
    if rest:
        raise UnsupportedTTTError(f"a size {v0} of the chunk count changes with the batch size "
                                  f"in a way ttt2la cannot fit ({vB} at batch {B1})")
    return SizeExpr(a - b * B0, b, c, 0, n, 0, C)


def _not_affine(n0: list, key: tuple, what: str, lengths: tuple, graphs: tuple) -> str:
    """The refusal of a size that is no function ``a + c·L + n·ceil(L/C)`` of the length."""
    node = n0[key[0]]
    seen = ", ".join(f"{_value(g, key)} at length {L}" for L, g in zip(lengths, graphs))
    return (f"the size argument {size_argument(node, key[2])} "
            f"of {describe_op(node)} in the {what} is "
            f"neither an affine function of the length nor one of the number of chunks "
            f"({seen})")


__all__ = ["ChunkCountCheck"]
