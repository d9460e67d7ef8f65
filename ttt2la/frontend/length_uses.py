"""Python values of the length the layer's code computes, found by running it.

``length_values`` reads the source for the spellings it knows (``T = x.shape[1]``, ``if T % 8``);
code spelled otherwise — ``x.size(dim=1)``, ``B, T = x.shape[:2]``, a lambda or a
``functools.partial`` helper, ``o * (1 + T % 8)``, ``{0: a}.get(T % 8, b)`` — escapes it, and the
converted layer, fitted from traces at a few lengths, would compute another branch's function at
lengths where those values differ. Here the code runs once at a length ``L*`` no other size of
the layer is a multiple of, under a ``TorchFunctionMode`` that hands out every size that is a
multiple of ``L*`` as a ``LengthInt``: an ``int`` that remembers how it was computed from the
length, as a function of it. Python arithmetic on it keeps that function; what the code decides
with it — a branch, a comparison, a lookup, an index, a Python ``range`` — and every number it
passes to a torch op are recorded at the user's line. Each is then evaluated at many lengths: a
decision that changes, or a number that is no size the converted graph can compute at a new
length (``a + c·L + n·ceil(L / chunk)``), is a use of the length the probe traces cannot vouch for.
Decisions inside the loop itself (unrolled and compared by the traces) and guards that only
raise are left out, as ``length_values`` leaves them.
"""
from __future__ import annotations

import ast
import math
import operator
import os
import sys
import warnings
from fractions import Fraction
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .length_values import LengthValue, _function_at, _library_roots, _real, _source_lines, _tree

_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


class LengthInt(int):
    """An ``int`` computed from the call's length, with ``at(L)``: its value at length ``L``."""

    def __new__(cls, value: int, at: Callable[[int], object]):
        obj = int.__new__(cls, value)
        obj.at = at
        return obj


class LengthFloat(float):
    """A ``float`` computed from the call's length, with ``at(L)`` as for ``LengthInt``."""

    def __new__(cls, value: float, at: Callable[[int], object]):
        obj = float.__new__(cls, value)
        obj.at = at
        return obj


_TRACKED = (LengthInt, LengthFloat)


def _at(x) -> Callable[[int], object] | None:
    """``x`` as a function of the length (a constant for a plain number; ``None``: neither)."""
    if isinstance(x, _TRACKED):
        return x.at
    if isinstance(x, (int, float)):
        value = x.real if isinstance(x, bool) else x
        return lambda L: value
    return None


def _plain(x):
    if isinstance(x, LengthInt):
        return int.__int__(x)
    return float.__float__(x) if isinstance(x, LengthFloat) else x


def _wrap(value, at):
    """``value`` tracked as ``at`` (numbers only; anything else as it is)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return LengthInt(value, at)
    if isinstance(value, float):
        return LengthFloat(value, at)
    return value


#: the run in progress (decisions are recorded into it); ``None`` outside ``length_uses``
_RUN: list = [None]


def _binary(op, reflected: bool = False):
    def method(self, other):
        g = _at(other)
        if g is None:
            return NotImplemented
        f = self.at
        a, b = (_plain(other), _plain(self)) if reflected else (_plain(self), _plain(other))
        value = op(a, b)
        at = (lambda L: op(g(L), f(L))) if reflected else (lambda L: op(f(L), g(L)))
        return _wrap(value, at)
    return method


def _compare(op):
    def method(self, other):
        g = _at(other)
        if g is None:
            return NotImplemented
        f = self.at
        _decide("compares", lambda L: op(f(L), g(L)))
        return op(_plain(self), _plain(other))
    return method


def _unary(op):
    def method(self):
        f = self.at
        return _wrap(op(_plain(self)), lambda L: op(f(L)))
    return method


_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
               "pow": operator.pow, "lshift": operator.lshift, "rshift": operator.rshift,
               "and": operator.and_, "or": operator.or_, "xor": operator.xor}
_COMPARISONS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
                "eq": operator.eq, "ne": operator.ne}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
          "trunc": math.trunc, "floor": math.floor, "ceil": math.ceil, "round": round,
          "int": int, "float": float}


def _install(cls: type) -> None:
    for name, op in _ARITHMETIC.items():
        if hasattr(cls.__mro__[1], f"__{name}__"):
            setattr(cls, f"__{name}__", _binary(op))
            setattr(cls, f"__r{name}__", _binary(op, reflected=True))
    for name, op in _COMPARISONS.items():
        setattr(cls, f"__{name}__", _compare(op))
    for name, op in _UNARY.items():
        if hasattr(cls.__mro__[1], f"__{name}__"):
            setattr(cls, f"__{name}__", _unary(op))

    def divmod_(self, other):
        return self // other, self % other
    cls.__divmod__ = divmod_

    def bool_(self):
        f = self.at
        _decide("branches on", lambda L: bool(f(L)))
        return _plain(self) != 0

    def hash_(self):
        f = self.at
        _decide("looks up a value of", f)
        return hash(_plain(self))

    cls.__bool__, cls.__hash__ = bool_, hash_


_install(LengthInt)
_install(LengthFloat)


def _index(self):
    f = self.at
    _decide("indexes with", f)
    return int.__int__(self)


LengthInt.__index__ = _index


def _decide(what: str, at: Callable[[int], object]) -> None:
    """Record a decision the code made with a value of the length, at its caller's line (the
    library's own decisions, in torch or Python, are the op's, not the layer's)."""
    run = _RUN[0]
    if run is not None:
        frame = sys._getframe(2)
        if not _library(frame.f_code.co_filename):
            run.record(frame, what, at)


def _library(file: str) -> bool:
    real = _real(file)
    return real.startswith(_library_roots()) or real.startswith(_PACKAGE)


class _Run:
    """The decisions and values one run recorded, by user line."""

    def __init__(self, L: int, loop: tuple[str, int, int] | None):
        self.L, self.loop = L, loop
        self.entry = sys._getframe(1)        # ``length_uses``: no frame above it is the layer's
        self.found: dict[tuple[str, int], list] = {}

    def record(self, frame, what: str, at) -> None:
        if self._in_loop(frame):
            return
        seen = self.found.setdefault((frame.f_code.co_filename, frame.f_lineno), [])
        if len(seen) < 8:
            seen.append((what, at))

    def _in_loop(self, frame) -> bool:
        """Is ``frame`` (or a caller) at a line of the loop (its statement and body)?"""
        if self.loop is None:
            return False
        file, first, last = self.loop
        while frame is not None:
            if first <= frame.f_lineno <= last and _real(frame.f_code.co_filename) == file:
                return True
            frame = frame.f_back
        return False

    def user_frame(self):
        """The innermost frame of the layer's own code (``None``: none)."""
        frame = sys._getframe(2)
        while frame is not None and frame is not self.entry and \
                _library(frame.f_code.co_filename):
            frame = frame.f_back
        return None if frame is self.entry else frame


def _spelled(func) -> str:
    """``func`` as the user's code spells it: ``Tensor.mul``, ``torch.cat``, ``F.pad``."""
    name = getattr(func, "__name__", str(func))
    owner = getattr(func, "__qualname__", name).split(".")[0]
    if owner in ("TensorBase", "Tensor"):
        return f"Tensor.{name}"
    if getattr(func, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    return f"torch.{name}"


def _is_shape_get(func) -> bool:
    return getattr(func, "__self__", None) is torch._C.TensorBase.shape


_SIZES = {torch._C.TensorBase.size, torch._C.TensorBase.numel, torch._C.TensorBase.nelement}
_TENSOR_MAKERS = {torch.tensor, torch.as_tensor, torch.scalar_tensor,
                  torch._C.TensorBase.new_tensor}


class _Tracking(TorchFunctionMode):
    """Sizes that are multiples of ``L*`` come out as ``LengthInt``; numbers of the length
    passed to torch are recorded."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SIZES or _is_shape_get(func):
            return self._sizes(out)
        if func is torch.Tensor.__len__:
            if isinstance(self._sizes(out), LengthInt):     # ``len`` makes a plain int of it
                frame = self.run.user_frame()
                if frame is not None:
                    self.run.record(frame, "takes len() of", lambda L: L)
            return out
        tracked = [x for x in _leaves((args, kwargs)) if isinstance(x, _TRACKED)]
        if tracked:
            frame = self.run.user_frame()
            if frame is not None:
                what = "makes a tensor of" if func in _TENSOR_MAKERS else \
                    f"passes `{_spelled(func)}` a number of"
                for x in tracked:
                    self.run.record(frame, what, _Sized(x.at, isinstance(x, LengthFloat)))
        return out

    def _sizes(self, out):
        L = self.run.L

        def one(n):
            if type(n) is int and n and n % L == 0:
                k = n // L
                return LengthInt(n, lambda T: k * T)
            return n
        if isinstance(out, torch.Size):
            return torch.Size([one(n) for n in out])
        return one(out)


class _Sized:
    """A number passed to a torch op: fine where it is a size the converted graph computes at
    any length (``a + c·L + n·ceil(L / chunk)`` for an int, ``a + c·L`` for a float)."""

    def __init__(self, at, is_float: bool):
        self.at, self.is_float = at, is_float


def _leaves(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _leaves(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _leaves(y)
    elif isinstance(x, slice):
        yield from _leaves((x.start, x.stop, x.step))
    else:
        yield x


def probe_length(sizes: set[int], chunk: int) -> int:
    """``L* = chunk·m``, at least two chunks and 16 tokens, of which no size in ``sizes`` (the
    layer's weights' and its inputs' other axes) is a multiple: a size of the run that is one
    is a size of the length."""
    m = max(2, -(-16 // chunk))
    while any(s and s % (chunk * m) == 0 for s in sizes):
        m += 1
    return chunk * m


def _lengths(chunk: int, L: int) -> list[int]:
    """The lengths each recorded use is evaluated at: every length up to two chunks (at most
    512), lengths around multiples of the chunk, powers of two, and the run's."""
    near = {chunk * m + r for m in (2, 3, 4, 5, 7, 8, 16, 33, 64, 100, 1000)
            for r in {0, 1, 2, 3, chunk // 2, chunk - 1} if 0 <= r < chunk}
    return sorted(set(range(1, min(2 * chunk, 512) + 2)) | near |
                  {1 << k for k in range(1, 21)} | {L})


def _varies(at, lengths: list[int]) -> bool:
    try:
        first = at(lengths[0])
        return any(at(L) != first for L in lengths[1:])
    except Exception:                   # fails somewhere: not one value at every length
        return True


def _not_a_size(used: _Sized, chunk: int, lengths: list[int]) -> bool:
    """Is ``used`` no affine function ``a + c·L`` of the whole-chunk lengths ``L`` (where
    ``ceil(L / chunk)`` is ``L / chunk``, and code that cuts the sequence into whole chunks by a
    reshape runs at all)? The converted graph computes sizes of that kind at any length."""
    try:
        values = {L: Fraction(used.at(L)) for L in lengths if L % chunk == 0}
    except Exception:
        return True
    c = (values[2 * chunk] - values[chunk]) / chunk
    a = values[chunk] - c * chunk
    return any(a + c * L != v for L, v in values.items())


def _guard(file: str, line: int) -> bool:
    """Is the statement at ``file:line`` a guard that only raises (an ``assert``, an ``if``
    whose body raises, ``torch._assert``)? It changes no structure."""
    tree = _tree(file)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or not node.lineno <= line <= (node.end_lineno or 0):
            continue
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.If) and node.test.lineno <= line <= node.test.end_lineno:
            return not node.orelse and all(isinstance(s, ast.Raise) for s in node.body)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            f = node.value.func
            if getattr(f, "attr", getattr(f, "id", "")) == "_assert":
                return True
    return False


def _loop_span(file: str, line: int) -> tuple[str, int, int] | None:
    """The lines of the loop statement at ``file:line`` and its body (``None``: no loop
    there, as for a single step)."""
    fn = _function_at(file, line)
    if fn is None:
        return None
    for node in ast.walk(fn):
        if isinstance(node, (ast.For, ast.While, ast.AsyncFor)) and node.lineno == line:
            return _real(file), line, node.end_lineno or line
    return None


def length_uses(run: Callable[[], object], L: int, chunk: int,
                loop: tuple[str, int]) -> list[LengthValue]:
    """The uses of the length that change the code's function from length to length: ``run()``
    (the layer's code as written at length ``L``, see ``probe_length``) is called once, and
    every decision it makes with a value of the length, and every number of the length it
    passes to torch, is judged at many lengths. ``loop``: the loop's file and line, whose body
    the traces unroll. Returns nothing where the code does not run at ``L``."""
    rec = _Run(L, _loop_span(*loop))
    _RUN[0] = rec
    try:
        with warnings.catch_warnings(), _Tracking(rec):
            warnings.simplefilter("ignore")
            run()
    except Exception:                   # the code does not run there: the source reading stands
        return []
    finally:
        _RUN[0] = None
    return _judged(rec.found, chunk, L)


def _judged(found: dict, chunk: int, L: int) -> list[LengthValue]:
    lengths = _lengths(chunk, L)
    out = []
    for (file, line), uses in found.items():
        for what, at in uses:
            bad = _not_a_size(at, chunk, lengths) if isinstance(at, _Sized) else \
                _varies(at, lengths) and not _guard(file, line)
            if bad:
                lines = _source_lines(file)
                code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
                out.append(LengthValue(file, line, code, what))
                break
    return sorted(out, key=lambda v: (v.file, v.line))


__all__ = ["LengthInt", "LengthFloat", "length_uses", "probe_length"]
