"""NumPy on a value of the call's sizes, as the run of ``size_uses`` hands it to the layer's code.

``np.sqrt(T)``, ``np.ceil(T / 8)``, ``np.clip(T % 8, 1, 5)``: NumPy reads a ``SizeInt`` or a
``SizeFloat`` as a plain number and returns a plain NumPy scalar, so a branch on it
(``if np.sqrt(T) % 1``) would be converted with the probe lengths' branch at every length. The
two types take part in NumPy's own protocols (``__array_ufunc__``, ``__array_function__``): the
ufunc or function runs on the plain numbers, and a number it returns is handed out tracked as that
ufunc or function of its arguments' functions of the sizes, a Python ``int`` or ``float`` from then
on. What is no such number — a ``bool`` (``np.isclose``), an array (``np.arange(4) < T``), a
result written to ``out`` — is recorded as a decision at the user's line, conservatively, as is
every NumPy value of the sizes in a run that does not track them (``_Run.plain``: the code failed
with tracked values and runs again as written).
"""
from __future__ import annotations

import os
import sys

from .size_uses import _RUN, _TRACKED, SizeFloat, SizeInt, _library, _plain, _wrap


def _leaves_at(x, L: int, B: int):
    """``x`` (an argument: a number, or lists, tuples and dicts of them; other containers as
    they are) with each tracked number its value at ``L`` and ``B``."""
    if isinstance(x, _TRACKED):
        return x.at(L, B)
    if type(x) in (list, tuple):
        return type(x)(_leaves_at(y, L, B) for y in x)
    if type(x) is dict:
        return {k: _leaves_at(y, L, B) for k, y in x.items()}
    return x


def _plain_leaves(x):
    """``x`` with each tracked number plain, as NumPy would read it."""
    if isinstance(x, _TRACKED):
        return _plain(x)
    if type(x) in (list, tuple):
        return type(x)(_plain_leaves(y) for y in x)
    if type(x) is dict:
        return {k: _plain_leaves(y) for k, y in x.items()}
    return x


def _python(value):
    """A NumPy result as Python numbers or lists of them (compared and judged as such)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _number(value):
    """The Python ``int`` or ``float`` a NumPy result is (``None``: an array, a ``bool``, a
    complex number or anything else)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if getattr(value, "ndim", None) != 0 or getattr(value, "dtype", None) is None:
        return None
    if value.dtype.kind in "iu":
        return int(value)
    return float(value) if value.dtype.kind == "f" else None


def numpy_call(func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` on the plain numbers; a number it returns tracked as ``func`` of
    the arguments' functions of the sizes, anything else as NumPy returns it, recorded as a
    decision at the user's line."""
    out = func(*_plain_leaves(args), **_plain_leaves(kwargs))
    run = _RUN[0]
    if run is None:
        return out

    def at(L, B):
        return _python(func(*_leaves_at(args, L, B), **_leaves_at(kwargs, L, B)))
    number = None if run.plain or "out" in kwargs else _number(out)
    if number is not None:
        return _wrap(number, at)
    frame = user_caller(sys._getframe(2))
    if frame is not None:
        kind = getattr(getattr(out, "dtype", None), "kind", "")
        what = "compares" if kind == "b" and getattr(out, "ndim", 1) == 0 else \
            "makes a NumPy array of" if getattr(out, "ndim", 0) else "passes NumPy a value of"
        run.record(frame, what, at)
    return out


def _in_numpy(file: str) -> bool:
    numpy = sys.modules.get("numpy")
    root = os.path.dirname(getattr(numpy, "__file__", None) or "/nonexistent/")
    return file.startswith(root + os.sep)


def user_caller(frame):
    """The user's frame that called NumPy: ``frame`` or the first above NumPy's own frames
    (``None``: another library's)."""
    while frame is not None and _in_numpy(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None or _library(frame.f_code.co_filename):
        return None
    return frame


def _array_ufunc(self, ufunc, method, *inputs, **kwargs):
    return numpy_call(getattr(ufunc, method), inputs, kwargs)


def _array_function(self, func, types, args, kwargs):
    return numpy_call(func, args, kwargs)


for _cls in (SizeInt, SizeFloat):
    _cls.__array_ufunc__ = _array_ufunc
    _cls.__array_function__ = _array_function


__all__ = ["numpy_call", "user_caller"]
