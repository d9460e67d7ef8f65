"""The order of a value of the call's sizes among plain floats: ``min``, ``max`` and ``sorted``.

``min(T, 40.5)`` compares ``40.5 < T``, which CPython's ``float`` answers from the ``int``'s value
without asking it: no decision is recorded, and the result — ``T`` itself at the run's length —
stays tracked as ``T``, so a layer that multiplies by it was converted as if it were ``T`` at
every length (it is 40.5 past 40); ``sorted([T, 30.5])[0]`` likewise. During the run of
``size_uses`` the user's modules see versions of the three that, where a plain ``float`` meets a
value of the sizes among their arguments (and no ``key`` is given), return ``min``'s or
``max``'s result tracked as the extreme of the arguments' functions, and record ``sorted``'s
order as a decision of the sizes. Any other call is the builtin's, whose comparisons of tracked
numbers record their own decisions at the caller's line, as they did without the stand-ins.
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
        out = builtin(*args, **kwargs)
        ats = None if kwargs.get("key") is not None or isinstance(out, bool) or \
            not isinstance(out, (int, float)) else _mixed(_items(args))
        if ats is None:
            return out
        return _wrap(_plain(out), lambda L, B: builtin(a(L, B) for a in ats))
    return call


@functools.wraps(builtins.sorted)
def _sorted(iterable, /, *, key=None, reverse=False):
    items = list(iterable)
    ats = None if key is not None else _mixed(items)
    if ats is not None:
        _decide("sorts", lambda L, B: tuple(sorted(range(len(ats)), key=lambda i: ats[i](L, B),
                                                   reverse=reverse)))
    return sorted(items, key=key, reverse=reverse)


_MIN, _MAX = _extreme(builtins.min), _extreme(builtins.max)
_STAND_INS.update({_MIN.__code__, _sorted.__code__})   # their comparisons are their caller's


def replacements(scope: dict) -> dict[str, object]:
    """What to bind in a module's globals ``scope`` during the run: ``min``, ``max`` and
    ``sorted``, where the module binds no name of its own to them."""
    return {name: f for name, f in (("min", _MIN), ("max", _MAX), ("sorted", _sorted))
            if name not in scope}


__all__ = ["replacements"]
