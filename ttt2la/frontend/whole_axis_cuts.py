"""Cuts of a sized axis that take the whole axis at the run's shape: a constant bound past it.

``x[:, :128]`` on a sequence of fewer than 128 tokens takes every token; a trace records the
cut as the tensor itself (an alias), so the converted graph reads every token at any length,
where the code reads 128 from 129 tokens on — a silent difference no probe trace shows, at
every level. The same holds for ``x.split(128, 1)[0]`` (one piece, the whole axis) and for
``x[:, :32 * C]`` in a layer that takes whole chunks only. Here, during the run of
``size_uses``, each such cut of an axis whose size is a value of the length or the batch size
(``x[..., a:b:s]``, its pieces by ``split``/``chunk``), where it takes the whole axis at the
run's shape, is recorded as a decision at the user's line — "does this cut take the whole
axis?" — so the lengths where it does not are left to the code as written (an exact
conversion) or refused (a lossy one), as for any other decision of the sizes. A cut that takes
part of the axis at the run's shape is traced as a cut, which the graph computes at any shape.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch


def _axes(index, ndim: int) -> list[tuple[int, slice]]:
    """The slices of ``index`` (a ``__getitem__`` key) with the axis each cuts; items after an
    index tensor (whose axes are its own) are not followed."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for i in items if i is not Ellipsis and i is not None)
    out, axis = [], 0
    for item in items:
        if item is Ellipsis:
            axis += ndim - consumed
        elif item is None:              # a new axis of size one: none of the tensor's
            continue
        elif isinstance(item, slice):
            out.append((axis, item))
            axis += 1
        elif isinstance(item, (int, torch.SymInt)) and not isinstance(item, bool):
            axis += 1
        else:
            break
    return out


def _whole(cut: slice, n: int) -> bool:
    """Does ``cut`` take every item of an axis of ``n``, in order?"""
    return cut.indices(n) == (0, n, 1) if n else True


def number(bound):
    """A bound as Python reads it: a NumPy integer or a 0-d integer tensor as its ``int``."""
    if isinstance(bound, torch.Tensor):
        return int(bound) if bound.dim() == 0 and not bound.is_floating_point() else bound
    if not isinstance(bound, (int, float)) and hasattr(bound, "__index__"):
        return operator.index(bound)
    return bound


def slice_decisions(t: torch.Tensor, index, size_of: Callable, at_of: Callable,
                    as_number: Callable = number) -> list:
    """The decisions (functions of ``(L, B)``) ``t[index]`` makes: one per slice of an axis
    whose size is a value of the sizes (``size_of(t)`` gives each axis's function or ``None``),
    where the slice takes the whole axis at the run's shape. ``as_number`` reads a bound as a
    number, ``at_of`` that number as a function of the sizes (a constant for a plain one)."""
    cuts = [(axis, slice(*map(as_number, (c.start, c.stop, c.step))))
            for axis, c in _axes(index, t.dim())]
    cuts = [(axis, c) for axis, c in cuts if c != slice(None) and _whole(c, t.shape[axis])]
    sizes = size_of(t) if cuts else []
    out = []
    for axis, cut in cuts:
        n = sizes[axis] if axis < len(sizes) else None
        bounds = [at_of(b) if b is not None else (lambda L, B: None)
                  for b in (cut.start, cut.stop, cut.step)]
        if n is None or any(b is None for b in bounds):
            continue
        out.append(lambda L, B, n=n, s=bounds: _whole(
            slice(*(b(L, B) for b in s)), max(n(L, B), 0)))
    return out


def piece_decision(t: torch.Tensor, count: Callable, L: int, B: int) -> Callable | None:
    """The decision pieces cut by ``split``/``chunk`` make where there is one piece at the run's
    shape (the whole axis): is there one piece? ``count``: the pieces' number as a function of
    the sizes."""
    try:
        return (lambda L, B: count(L, B) == 1) if count(L, B) == 1 else None
    except Exception:
        return None
