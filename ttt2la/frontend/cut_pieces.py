"""Pieces of a cut made before a loop, read one per iteration: chunks the eager run can see.

``chunks = zip(*(t.split(C, 1) for t in (q, k, v)))`` or ``qs = q.split(C, 1)`` cut the sequence
before the loop; the body then reads a piece per iteration through Python, with no torch call
that slices. Loop discovery finds a loop's chunks by the slices its body takes, so it follows
the pieces instead: every piece of a ``split``/``unbind`` is remembered (weakly, by identity)
with its offset, and every read of one in a loop body is noted in order. A cut whose pieces a
loop reads in order, each piece before the next (``0, 0, 1, 1, 2``), hands out chunks; one read
in every iteration (heads cut before a loop over chunks: ``0, 1, 0, 1``) does not. Slices of one
tensor taken before the loop (a list of chunks) count as the pieces of one cut.
"""
from __future__ import annotations

import itertools
import weakref
from collections import defaultdict

import torch

#: The cuts whose pieces have a fixed size (what ``discover._cut_info`` calls them).
SIZED_CUTS = ("split", "unbind")


class CutPieces:
    """The pieces of every sized cut of one eager run, and the order each loop reads them in."""

    def __init__(self) -> None:
        self._pieces: dict[int, tuple[weakref.ref, object, int, int, int, int]] = {}
        self._reads: dict[tuple, list[tuple[int, int, int, int]]] = defaultdict(list)
        self._cuts = itertools.count()

    def note(self, cut: tuple[str, int, int] | None, out) -> None:
        """Remember the pieces ``out`` of a cut ``(op, size, length)``."""
        if cut is None or cut[0] not in SIZED_CUTS or not isinstance(out, (tuple, list)) or len(out) < 2:
            return
        _op, size, length = cut
        cut_id = next(self._cuts)
        for i, piece in enumerate(out):
            if isinstance(piece, torch.Tensor):
                try:
                    self._pieces[id(piece)] = (weakref.ref(piece), cut_id, i, size, length, i * size)
                except TypeError:
                    pass

    def note_slice(self, info: tuple[int, int, int] | None, source, out) -> None:
        """Remember a slice ``out`` of ``source`` (``info``: ``(size, length, start)``) as a
        piece of the cut that the slices of ``source`` of that size make together."""
        if info is None or not isinstance(out, torch.Tensor) or not isinstance(source, torch.Tensor):
            return
        size, length, start = info
        try:
            self._pieces[id(out)] = (weakref.ref(out), ("slices", id(source), size), start, size, length, start)
        except TypeError:
            pass

    def read(self, key, args) -> None:
        """Note which pieces a call inside the loop ``key`` reads."""
        for a in args:
            for t in (a if isinstance(a, (tuple, list)) else (a,)):
                hit = self._pieces.get(id(t)) if isinstance(t, torch.Tensor) else None
                if hit is not None and hit[0]() is t:
                    self._reads[(key, hit[1])].append(hit[2:])

    def chunks(self, key) -> list[tuple[int, int, int]]:
        """``(size, length, start)`` of every piece the loop ``key`` reads one per iteration."""
        out = []
        for (k, _cut), reads in self._reads.items():
            order = [r[0] for r in reads]
            if k == key and len(set(order)) >= 2 and order == sorted(order):
                out.extend(sorted({r[1:] for r in reads}))
        return out


__all__ = ["CutPieces"]
