"""The ``math`` module as the run of ``size_uses`` hands it to the layer's code.

``math.sqrt(T)``, ``math.log2(T)``, ``math.prod(x.shape)``: CPython reads a ``SizeInt`` or a
``SizeFloat`` as a plain number and returns a plain ``float``, so a value of the length computed
through ``math`` would leave the run untracked — ``o * math.sqrt(T)`` or
``if math.log2(T) < 5`` converted with the probe lengths' value or branch at every length.
``tracked(f)`` computes ``f`` on the plain numbers and hands out the result tracked as ``f`` of
its arguments' functions of the sizes; a ``bool`` it returns (``math.isclose``) is a decision.
``module()`` is ``math`` with each function so wrapped, for the layer's modules during the run.
"""
from __future__ import annotations

import functools
import math
import types

from .size_uses import _TRACKED, _at, _decide, _plain, _wrap


def _function_of(arg):
    """``arg`` (a number, or a list or tuple of them) as a function of the sizes: ``None``
    where it is neither."""
    if isinstance(arg, (list, tuple)):
        ats = [_at(a) for a in arg]
        return None if None in ats else (lambda L, B: [f(L, B) for f in ats])
    return _at(arg)


def _holds_size(arg) -> bool:
    if isinstance(arg, (list, tuple)):
        return any(isinstance(a, _TRACKED) for a in arg)
    return isinstance(arg, _TRACKED)


def tracked(f):
    """``f`` of ``math`` handing out a value of the sizes where an argument is one."""
    @functools.wraps(f)
    def call(*args, **kwargs):
        if not any(_holds_size(a) for a in args):
            return f(*args, **kwargs)
        plain = [[_plain(x) for x in a] if isinstance(a, (list, tuple)) else _plain(a)
                 for a in args]
        out = f(*plain, **kwargs)
        ats = [_function_of(a) for a in args]
        if None in ats:
            return out

        def at(L, B):
            return f(*(g(L, B) for g in ats), **kwargs)
        if isinstance(out, bool):
            _decide("compares", at)
            return out
        return _wrap(out, at)
    return call


@functools.lru_cache(maxsize=1)
def wrappers() -> dict[str, object]:
    """``{name: tracked function}`` for every function of ``math``."""
    return {name: tracked(f) for name, f in vars(math).items()
            if isinstance(f, types.BuiltinFunctionType)}


@functools.lru_cache(maxsize=1)
def module() -> types.ModuleType:
    """``math`` with its functions tracked (its constants as they are)."""
    proxy = types.ModuleType("math", math.__doc__)
    vars(proxy).update({k: v for k, v in vars(math).items() if not k.startswith("__")})
    vars(proxy).update(wrappers())
    return proxy


def replacements(scope: dict) -> dict[str, object]:
    """What to bind in a module's globals ``scope`` during the run: ``math`` where the module
    imported it, and each function it imported from it (``from math import sqrt``)."""
    out = {}
    functions = {id(getattr(math, name)): name for name in wrappers()}
    for name, value in scope.items():
        if value is math:
            out[name] = module()
        elif id(value) in functions and value is getattr(math, functions[id(value)]):
            out[name] = wrappers()[functions[id(value)]]
    return out


__all__ = ["tracked", "module", "replacements", "wrappers"]
