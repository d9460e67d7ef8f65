"""Sequences and generators made of the pieces a tensor was cut into, counted as the pieces are.

The run counts the pieces ``split``, ``chunk`` and ``unbind`` hand out (``_Run.count``), but
``len(list(x.split(C, 1)))``, ``len([c for c in x.split(C, 1)])``, ``len(tuple(x.chunk(n, 1)))``
and ``sum(1 for _ in x.unbind(1))`` count another object, which CPython counts as a plain
``int``: a decision on it converted with the run's branch at every length. A list or tuple whose
items are exactly the pieces, in order (the same tensors), has their count (``copied``); a
generator that yields one constant for each of them, with no condition, sums to that constant
times their count (``_sum``, ``sum`` to the user's modules during the run).
"""
from __future__ import annotations

import dis
import functools
import inspect
import types
from typing import Callable

import torch

from .size_uses import _RUN, _at, _wrap

#: what a generator expression ``c for _ in pieces`` runs, and nothing else (no condition)
_PLAIN_GENERATOR = frozenset({
    "RETURN_GENERATOR", "POP_TOP", "RESUME", "LOAD_FAST", "FOR_ITER", "STORE_FAST",
    "UNPACK_SEQUENCE", "LOAD_CONST", "LOAD_SMALL_INT", "YIELD_VALUE", "JUMP_BACKWARD",
    "RETURN_VALUE", "RETURN_CONST", "END_FOR", "POP_ITER", "NOP", "CACHE", "EXTENDED_ARG"})


def copied(pieces: dict[int, tuple], seq) -> Callable | None:
    """The count of ``seq`` where its items are exactly the pieces of one cut, in order
    (``pieces``: the first piece's id -> ``(the pieces, their count)``); ``None`` otherwise."""
    if not isinstance(seq, (list, tuple)) or not seq or not isinstance(seq[0], torch.Tensor):
        return None
    hit = pieces.get(id(seq[0]))
    if hit is None or len(hit[0]) != len(seq) or any(a is not b for a, b in zip(hit[0], seq)):
        return None
    return hit[1]


@functools.lru_cache(maxsize=256)
def yielded(code: types.CodeType):
    """The constant a generator expression yields once per item of what it iterates, with
    no condition and nothing else loaded (``1 for _ in pieces``); ``None`` otherwise."""
    ops = list(dis.get_instructions(code))
    if any(op.opname not in _PLAIN_GENERATOR or op.opname.startswith("LOAD_FAST")
           and op.argval != ".0" for op in ops):
        return None
    at = [i for i, op in enumerate(ops) if op.opname == "YIELD_VALUE"]
    if len(at) != 1 or at[0] == 0 or not ops[at[0] - 1].opname.startswith("LOAD_"):
        return None
    value = ops[at[0] - 1].argval
    return value if type(value) is int else None


def _generated(gen) -> tuple[int, Callable] | None:
    """``(c, count)``: a fresh generator expression yielding ``c`` once for each item of a
    counted sequence, the sequence's count; ``None`` otherwise."""
    run = _RUN[0]
    frame = gen.gi_frame
    if run is None or gen.gi_code.co_name != "<genexpr>" or \
            inspect.getgeneratorstate(gen) != inspect.GEN_CREATED:
        return None
    c = yielded(gen.gi_code)
    source = frame.f_locals.get(".0")
    if c is None or type(source) not in (type(iter(())), type(iter([]))):
        return None
    _, (seq,), *start = source.__reduce__()
    at = run.length_of(seq) if start == [0] else None
    return None if at is None else (c, at)


def _sum(iterable, /, start=0):
    """``sum`` to the user's modules during the run: ``sum(1 for _ in x.unbind(1))`` the
    count of the pieces, as a value of the sizes."""
    hit = _generated(iterable) if type(iterable) is types.GeneratorType else None
    out = sum(iterable, start)
    s = _at(start)
    if hit is None or s is None or type(out) is not int:
        return out
    c, at = hit
    return _wrap(out, lambda L, B: s(L, B) + c * at(L, B))


__all__ = ["copied", "yielded"]
