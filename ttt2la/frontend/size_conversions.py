"""Plain numbers made of a value of the call's sizes, and how the run of ``size_uses`` keeps them.

CPython makes a plain ``int`` or ``float`` of a ``SizeInt`` in ``int(T)``, ``float(T)`` and
``operator.index(T)`` (whatever ``__int__`` returns), and in the ``int`` methods ``T.bit_length()``,
``T.numerator``, ``T.as_integer_ratio()``: a branch on one (``if int(T) % 8``) would be
converted with the probe lengths' branch at every length. The methods here hand out the value
tracked as the method of the size's function. ``int``, ``float`` and ``operator.index`` are, to
the user's modules during the run (where they bind no name of their own to them), versions that
do the same: types that ``isinstance``, ``issubclass``, ``==`` and NumPy's ``dtype=`` take for
the builtins (torch's ``dtype=`` does not: the code then fails, and runs again as written). A
plain copy made elsewhere at a user line — ``np.int64(T)``, ``np.array(T)``, ``'%.1f' % T``, or
``int(T)`` in a run that does not hand out these versions (``_Run.plain``) — is recorded as a
decision, conservatively.
"""
from __future__ import annotations

import operator
import sys
import types

from .size_numpy import user_caller
from .size_text import digits
from .size_uses import _RUN, _TRACKED, SizeFloat, SizeInt, _decide, _plain, _wrap


def _plain_copy(self, convert):
    """``convert(self)`` (``int`` or ``float``) as CPython makes it: a plain number, recorded as
    a decision where the user's code (or NumPy, called from it) asked for it."""
    run, f = _RUN[0], self.at
    if run is not None:
        frame = user_caller(sys._getframe(2))
        if frame is not None:
            run.record(frame, "makes a plain number of", lambda L, B: convert(f(L, B)))
    return convert(_plain(self))


def _method(name: str, convert):
    """The method ``name`` of the plain number (read as ``convert`` of it), its result tracked
    as the method of the size's function; a ``bool`` it returns is a decision."""
    def method(self, *args):
        f = self.at
        out = getattr(convert(_plain(self)), name)(*args)

        def at(L, B):
            return getattr(convert(f(L, B)), name)(*args)
        if isinstance(out, bool):
            _decide("branches on", at)
            return out
        if isinstance(out, tuple):
            return tuple(_wrap(v, lambda L, B, i=i: at(L, B)[i]) for i, v in enumerate(out))
        return _wrap(out, at)
    method.__name__ = name
    return method


def _attribute(self, name: str, convert):
    """The attribute ``name`` (``numerator``, ``real``) of the plain number, tracked."""
    f = self.at
    return _wrap(getattr(convert(_plain(self)), name), lambda L, B: getattr(convert(f(L, B)), name))


def _install() -> None:
    for cls, convert in ((SizeInt, int), (SizeFloat, float)):
        cls.__int__ = lambda self: _plain_copy(self, int)
        cls.__float__ = lambda self: _plain_copy(self, float)
        cls.__copy__ = lambda self: self
        cls.__deepcopy__ = lambda self, memo: self
        for name in ("conjugate", "as_integer_ratio", "is_integer", "bit_length", "bit_count"):
            if hasattr(convert, name):
                setattr(cls, name, _method(name, convert))
        for name in ("real", "imag", "numerator", "denominator"):
            if hasattr(convert, name):
                setattr(cls, name, property(
                    lambda self, name=name, convert=convert: _attribute(self, name, convert)))
    SizeInt.__index__ = _method("__index__", int)


_install()


class _Builtin(type):
    """The type of ``int`` and ``float`` as the run hands them to the user's modules: taken for
    the builtin by ``isinstance``, ``issubclass``, ``==`` and hashing."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.builtin)

    def __subclasscheck__(cls, sub) -> bool:
        return isinstance(sub, type) and issubclass(sub, cls.builtin)

    def __eq__(cls, other) -> bool:
        return other is cls or other is cls.builtin

    def __hash__(cls) -> int:
        return hash(cls.builtin)

    def __repr__(cls) -> str:
        return repr(cls.builtin)


def _converted(builtin: type, args: tuple, kwargs: dict):
    out = builtin(*args, **kwargs)
    if len(args) == 1 and not kwargs and isinstance(args[0], _TRACKED):
        f = args[0].at
        return _wrap(out, lambda L, B: builtin(f(L, B)))
    return out


class _Int(int, metaclass=_Builtin):
    """``int`` to the user's modules during the run: ``int(T)`` of a value of the sizes is one."""

    builtin = int

    def __new__(cls, *args, **kwargs):
        return _converted(int, args, kwargs)


class _Float(float, metaclass=_Builtin):
    """``float`` to the user's modules during the run, as ``_Int``."""

    builtin = float

    def __new__(cls, *args, **kwargs):
        return _converted(float, args, kwargs)


for _cls, _name in ((_Int, "int"), (_Float, "float")):
    _cls.__name__ = _cls.__qualname__ = _name


def _index(n):
    """``operator.index`` handing out a value of the sizes tracked."""
    return n.__index__() if isinstance(n, SizeInt) else operator.index(n)


def _operator() -> types.ModuleType:
    proxy = types.ModuleType("operator", operator.__doc__)
    vars(proxy).update({k: v for k, v in vars(operator).items() if not k.startswith("__")})
    proxy.index = proxy.__index__ = _index
    return proxy


_OPERATOR = _operator()
_DIGITS = {name: digits(name) for name in ("hex", "oct", "bin")}


def replacements(scope: dict, plain: bool) -> dict[str, object]:
    """What to bind in a module's globals ``scope`` during the run: ``hex``, ``oct`` and ``bin``
    (the text of a size is a decision), and unless the run is ``plain``, ``int`` and ``float``
    where the module binds no name of its own to them, ``operator`` where it imported it and
    ``index`` where it imported that."""
    out = {name: f for name, f in _DIGITS.items() if name not in scope}
    if plain:
        return out
    out.update({name: t for name, t in (("int", _Int), ("float", _Float)) if name not in scope})
    for name, value in scope.items():
        if value is operator:
            out[name] = _OPERATOR
        elif value is operator.index:
            out[name] = _index
    return out


__all__ = ["replacements"]
