"""The order of a value of the call's sizes among plain floats: ``min``, ``max`` and ``sorted``.

``min(T, 40.5)`` compares ``40.5 < T``, which CPython's ``float`` answers from the ``int``'s value
without asking it: no decision is recorded, and the result — ``T`` itself at the run's length —
stays tracked as ``T``, so a layer that multiplies by it was converted as if it were ``T`` at
every length (it is 40.5 past 40); ``sorted([T, 30.5])[0]`` likewise. During the run of
``size_uses`` the user's modules see versions of the three that, where a plain ``float`` meets a
value of the sizes among their arguments, return ``min``'s or ``max``'s result tracked as the
extreme of the arguments' functions, and record ``sorted``'s order as a decision of the sizes;
given a ``key``, the values it returned are compared instead, and the item picked (or the
order) is recorded as a decision. ``list.sort()`` is read at its line (``size_operands``). Any
other call is the builtin's, whose comparisons of tracked numbers record their own decisions at
the caller's line, as they did without the stand-ins.
"""
from __future__ import annotations

import builtins
import functools

from .size_uses import _STAND_INS, SizeInt, _at, _decide, _plain, _wrap


def _mixed(items) -> list | None:
    """The functions of ``items`` where a plain float and a value of the sizes are among them
    (and every item is a number), else ``None``."""
    if not any(type(v) is float for v in items) or not any(isinstance(v, SizeInt) for v in items):
        return None
    ats = [_at(v) for v in items]
    return None if None in ats else ats


def _items(args) -> tuple | list:
    """The items ``min`` and ``max`` compare: their arguments, or the one list or tuple given."""
    if len(args) > 1:
        return args
    return args[0] if len(args) == 1 and type(args[0]) in (list, tuple) else ()


def _extreme(builtin):
    @functools.wraps(builtin)
    def call(*args, **kwargs):
        if kwargs.get("key") is not None:
            keys, kwargs["key"] = _remembered(kwargs["key"])
            out = builtin(*args, **kwargs)
            ats = _mixed(keys)
            if ats is not None:
                _decide("picks", lambda L, B: builtin(range(len(ats)),
                                                      key=lambda i: ats[i](L, B)))
            return out
        out = builtin(*args, **kwargs)
        ats = None if isinstance(out, bool) or not isinstance(out, (int, float)) else \
            _mixed(_items(args))
        if ats is None:
            return out
        return _wrap(_plain(out), lambda L, B: builtin(a(L, B) for a in ats))
    return call


@functools.wraps(builtins.sorted)
def _sorted(iterable, /, *, key=None, reverse=False):
    items = list(iterable)
    keys = items
    if key is not None:
        keys, key = _remembered(key)
    out = sorted(items, key=key, reverse=reverse)
    at = order(keys, reverse)
    if at is not None:
        _decide("sorts", at)
    return out


def _remembered(key) -> tuple[list, object]:
    """A list and a key function that calls ``key`` and appends what it returns to it: the
    values compared, each computed once, as the builtin computes them."""
    keys: list = []

    def remembering(item):
        k = key(item)
        keys.append(k)
        return k
    return keys, remembering


def order(keys: list, reverse: bool = False):
    """The order ``sorted`` puts items of these ``keys`` in, as a function of the sizes, where a
    plain float and a value of the sizes are among the keys (else ``None``)."""
    ats = _mixed(keys)
    if ats is None:
        return None
    return lambda L, B: tuple(sorted(range(len(ats)), key=lambda i: ats[i](L, B),
                                     reverse=reverse))


_MIN, _MAX = _extreme(builtins.min), _extreme(builtins.max)
_STAND_INS.update({_MIN.__code__, _sorted.__code__})   # their comparisons are their caller's


def replacements(scope: dict) -> dict[str, object]:
    """What to bind in a module's globals ``scope`` during the run: ``min``, ``max`` and
    ``sorted``, where the module binds no name of its own to them."""
    return {name: f for name, f in (("min", _MIN), ("max", _MAX), ("sorted", _sorted))
            if name not in scope}


__all__ = ["replacements", "order"]
