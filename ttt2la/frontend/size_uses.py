"""Python values of the call's length and batch size the layer's code computes, found by running it.

``length_values`` reads the source for the spellings it knows (``T = x.shape[1]``, ``if T % 8``);
code spelled otherwise — ``x.size(dim=1)``, ``B, T = x.shape[:2]``, a lambda or a
``functools.partial`` helper, ``o * (1 + T % 8)``, ``{0: a}.get(T % 8, b)`` — escapes it, and
nothing reads the batch size (``if x.shape[0] == 1``) at all. The converted layer, fitted from
traces at a few shapes, would then compute another branch's function at shapes where those
values differ. Here the code runs once at a length ``L*`` and a batch size ``B*`` of which no
other size of the layer is a multiple, under a ``TorchFunctionMode`` that hands out every size
that is a multiple of ``L*``, ``B*`` or ``B*·L*`` as a ``SizeInt``: an ``int`` that remembers how
it was computed from the two, as a function of them. Python arithmetic on it keeps that
function; what the code decides with it — a branch, a comparison, a lookup, the number of
items of a ``range`` or of a tensor's pieces — and every number it passes to a torch op are
recorded at the user's line. Each is
then evaluated at many lengths and batch sizes: a decision that changes, or a number that is no
size the converted graph can compute at a new shape (affine in each), is a use of that size the
probe traces cannot vouch for. Decisions inside the loop itself (unrolled and compared by the
traces) and guards that only raise are left out, as ``length_values`` leaves them. A decision
of the length alone whose outcome is one of the chunked plan's own cases (a whole chunk, a
partial last chunk: ``chunking_cases``) says so (``LengthValue.chunking``), for
``chunking_decisions`` to check against the code as written and drop. A cut whose constant
bound takes a whole axis of the sizes at the run's shape (``x[:, :128]``), which a trace records
as the tensor itself, is a decision too (``whole_axis_cuts``). The user's modules (the
loop's and every other file of the user's) see ``len``, ``range``, ``math``, ``int``, ``float`` and
``operator.index`` during the run as versions that keep the sizes' functions (``_counting``,
``size_math``, ``size_conversions``): CPython's own make plain numbers of them. NumPy on a
value of the sizes keeps its function too (``size_numpy``); text made of one (``f"mask_{T}"``,
``str(T)``) is a decision (``size_text``), as is a plain copy no version keeps
(``np.float64(T)``). Where the code fails with the tracked versions (``dtype=float`` to torch,
a NumPy scalar's own method), it runs again with them plain, each plain copy of a size a
decision. What CPython computes from an ``int`` subclass's value without calling a method of
it still escapes: a plain ``float`` on the left of an operator (``0.5 * T``), an index into a
list, tuple or string (``[a, b][T % 2]``) and ``'%d' % T``.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import math
import operator
import sys
import warnings
import weakref
from fractions import Fraction
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .chunking_cases import chunking_case
from .length_values import LengthValue, _module_of
from .size_witness import Witness
from .whole_axis_cuts import number, piece_decision, slice_decisions
from .loop_source import appended_names
from .user_code import function_at, is_users, parsed, real_path, source_lines


class SizeInt(int):
    """An ``int`` computed from the call's sizes, with ``at(L, B)``: its value at length ``L``
    and batch size ``B``."""

    def __new__(cls, value: int, at: Callable[[int, int], object]):
        obj = int.__new__(cls, value)
        obj.at = at
        return obj


class SizeFloat(float):
    """A ``float`` computed from the call's sizes, with ``at(L, B)`` as for ``SizeInt``."""

    def __new__(cls, value: float, at: Callable[[int, int], object]):
        obj = float.__new__(cls, value)
        obj.at = at
        return obj


_TRACKED = (SizeInt, SizeFloat)


def _at(x) -> Callable[[int, int], object] | None:
    """``x`` as a function of the sizes (a constant for a plain number; ``None``: neither)."""
    if isinstance(x, _TRACKED):
        return x.at
    if isinstance(x, (int, float)):
        value = x.real if isinstance(x, bool) else x
        return lambda L, B: value
    return None


def _plain(x):
    if isinstance(x, SizeInt):
        return int.__int__(x)
    return float.__float__(x) if isinstance(x, SizeFloat) else x


def _wrap(value, at):
    """``value`` tracked as ``at`` (numbers only; anything else as it is)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return SizeInt(value, at)
    if isinstance(value, float):
        return SizeFloat(value, at)
    return value


#: the run in progress (decisions are recorded into it); ``None`` outside ``size_uses``
_RUN: list = [None]


def _binary(op, reflected: bool = False):
    def method(self, other):
        g = _at(other)
        if g is None:
            return NotImplemented
        f = self.at
        a, b = (_plain(other), _plain(self)) if reflected else (_plain(self), _plain(other))
        value = op(a, b)
        at = (lambda L, B: op(g(L, B), f(L, B))) if reflected else \
            (lambda L, B: op(f(L, B), g(L, B)))
        return _wrap(value, at)
    return method


def _compare(op):
    def method(self, other):
        g = _at(other)
        if g is None:
            return NotImplemented
        f = self.at
        _decide("compares", lambda L, B: op(f(L, B), g(L, B)))
        return op(_plain(self), _plain(other))
    return method


def _unary(op):
    def method(self):
        f = self.at
        return _wrap(op(_plain(self)), lambda L, B: op(f(L, B)))
    return method


_ARITHMETIC = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
               "lshift": operator.lshift, "rshift": operator.rshift,
               "and": operator.and_, "or": operator.or_, "xor": operator.xor}
_COMPARISONS = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
                "eq": operator.eq, "ne": operator.ne}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": abs, "invert": operator.invert,
          "trunc": math.trunc, "floor": math.floor, "ceil": math.ceil}


def _round(self, ndigits=None):
    """``round(x)`` and ``round(x, n)``."""
    f, g = self.at, _at(ndigits)
    if ndigits is None:
        return _wrap(round(_plain(self)), lambda L, B: round(f(L, B)))
    return _wrap(round(_plain(self), _plain(ndigits)), lambda L, B: round(f(L, B), g(L, B)))


def _power(reflected: bool):
    """``x ** y`` and ``pow(x, y, m)`` (the modulus too may be a value of the sizes)."""
    def method(self, other, mod=None):
        g, h = _at(other), _at(mod)
        if g is None or mod is not None and h is None:
            return NotImplemented
        f = self.at
        args = (other, self) if reflected else (self, other)
        fs = (g, f) if reflected else (f, g)
        if mod is None:
            return _wrap(pow(*map(_plain, args)), lambda L, B: pow(*(a(L, B) for a in fs)))
        return _wrap(pow(*map(_plain, args), _plain(mod)),
                     lambda L, B: pow(*(a(L, B) for a in fs), h(L, B)))
    return method


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
    cls.__round__, cls.__pow__, cls.__rpow__ = _round, _power(False), _power(True)

    def bool_(self):
        f = self.at
        _decide("branches on", lambda L, B: bool(f(L, B)))
        return _plain(self) != 0

    def hash_(self):
        f = self.at
        _decide("looks up a value of", f)
        return hash(_plain(self))

    cls.__bool__, cls.__hash__ = bool_, hash_


_install(SizeInt)
_install(SizeFloat)


#: the code of the builtins' stand-ins the user's modules see during the run (``size_extremes``):
#: a decision made inside one is its caller's, as it is inside the builtin
_STAND_INS: set = set()


def _decide(what: str, at: Callable[[int], object]) -> None:
    """Record a decision the code made with a value of the sizes, at its caller's line (the
    library's own decisions, in torch or Python, are the op's, not the layer's)."""
    run = _RUN[0]
    if run is not None:
        frame = sys._getframe(2)
        while frame.f_code in _STAND_INS:
            frame = frame.f_back
        if not _library(frame.f_code.co_filename):
            run.record(frame, what, at)


def _library(file: str) -> bool:
    return not is_users(file)


class _Run:
    """The decisions and values one run recorded, by user line."""

    def __init__(self, L: int, B: int, loop: tuple[str, int, int] | None,
                 grown: frozenset[str] = frozenset(), plain: bool = False,
                 other: Witness | None = None):
        self.L, self.B, self.loop, self.grown = L, B, loop, grown
        self.witness = Witness(L, B, other)     # the sizes read, checked against ``other``
        self.plain = plain      # the code as written: plain NumPy, ``int`` and ``float``
        self.entry = sys._getframe(1)        # ``size_uses``: no frame above it is the layer's
        self.found: dict[tuple[str, int], list] = {}
        self.counts: dict[int, tuple[object, Callable]] = {}   # id -> (sequence, its length)
        self.pieces: dict[int, tuple[object, Callable]] = {}   # first piece's id -> same
        self.iterations: Callable | None = None     # the loop's count of iterations
        self.loop_frame = None                      # the frame that runs the loop
        self.before: dict[int, tuple[list, int]] = {}   # its lists as the loop began: id -> (list, len)

    def count(self, seq, at, frame) -> None:
        """``seq`` (a ``range`` or the pieces of a tensor) has ``at(L, B)`` items; made at the
        loop statement's line, it is what the loop iterates over."""
        self.counts[id(seq)] = (seq, at)
        if isinstance(seq, (tuple, list)) and seq and isinstance(seq[0], torch.Tensor):
            self.pieces[id(seq[0])] = (seq, at)
        if self.loop is not None and frame is not None and frame.f_lineno == self.loop[1] \
                and real_path(frame.f_code.co_filename) == self.loop[0]:
            self.iterations, self.loop_frame = at, frame
            self.before = {id(v): (v, len(v)) for v in frame.f_locals.values()
                           if type(v) is list}

    def length_of(self, seq) -> Callable | None:
        """The number of items of ``seq`` as a function of the sizes: a counted sequence's, or
        for a list the loop appends to (``grown``, by name in the loop's frame), its items
        before the loop and after it plus those of each iteration (``_appended``), or a list or
        tuple of exactly a tensor's counted pieces; ``None``: none of them."""
        hit = self.counts.get(id(seq))
        if hit is not None and hit[0] is seq:
            return hit[1]
        if self.pieces:                 # a copy of a tensor's counted pieces (``counted_pieces``)
            from .counted_pieces import copied
            copy = copied(self.pieces, seq)
            if copy is not None:
                return copy
        it, frame = self.iterations, self.loop_frame
        if it is None or not isinstance(seq, list):
            return None
        k = it(self.L, self.B)
        if not any(frame.f_locals.get(name) is seq for name in self.grown):
            return self._grown_elsewhere(seq, it, k)
        return self._appended(seq, it, k)

    def _appended(self, seq: list, it: Callable, k: int) -> Callable:
        """The number of items of a list the loop's source appends to: its items as the loop
        began, a whole number per iteration, and the rest appended besides (after the loop).
        Where it grew by fewer than one per iteration the count is unknown: right at the run's
        sizes only, and raising elsewhere, so a decision on it is a use no shape vouches for."""
        n, hit = len(seq), self.before.get(id(seq))
        n0 = hit[1] if hit is not None and hit[0] is seq else 0
        if k <= 0 or n - n0 < k:
            L0, B0 = self.L, self.B
            return lambda L, B: n if (L, B) == (L0, B0) else _unknown()
        per, rest = divmod(n - n0, k)
        return lambda L, B: n0 + rest + it(L, B) * per

    def _grown_elsewhere(self, seq: list, it: Callable, k: int) -> Callable | None:
        """The number of items of a list of the loop's frame that the loop's source does not
        append to by name (a helper of another file does, ``grow(outs, y)``): where it grew by
        a whole number of items per iteration since the loop began, its items then plus that
        many per iteration; ``None`` otherwise (a list appended to once after the loop)."""
        hit = self.before.get(id(seq))
        if hit is None or hit[0] is not seq:
            return None
        n0, grew = hit[1], len(seq) - hit[1]
        if not k or grew <= 0 or grew % k:
            return None
        return lambda L, B: n0 + it(L, B) * (grew // k)

    def record(self, frame, what: str, at, iterations: bool = False) -> None:
        """Record a use at ``frame``'s line; one made in another loop or comprehension than
        the TTT loop is an iteration's (the traces unroll it) unless it is a number passed to
        torch or ``iterations`` says it holds for every iteration (a constant bound)."""
        if self._in_loop(frame) or not (isinstance(at, _Sized) or iterations) and \
                _iterating(frame):
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
            if first <= frame.f_lineno <= last and real_path(frame.f_code.co_filename) == file:
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


def _multiple(n: int, L: int, B: int) -> Callable | None:
    """``n`` as a multiple of the run's ``B·L``, ``L`` or ``B`` (``None``: none)."""
    if n % (L * B) == 0:
        k = n // (L * B)
        return lambda L, B: k * L * B
    if n % L == 0:
        k = n // L
        return lambda L, B: k * L
    if n % B == 0:
        k = n // B
        return lambda L, B: k * B
    return None


def _unknown():
    raise ValueError("a count the run cannot tell at other sizes")


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


_SIZES = {torch._C.TensorBase.size, torch._C.TensorBase.numel, torch._C.TensorBase.nelement,
          torch._C.TensorBase.stride}
_STRIDE = torch._C.TensorBase.stride
_TENSOR_MAKERS = {torch.tensor, torch.as_tensor, torch.scalar_tensor,
                  torch._C.TensorBase.new_tensor}
#: what cuts a tensor into pieces, and the names of its arguments after the tensor
_PIECES = {"split": ("split_size", "dim"), "chunk": ("chunks", "dim"), "unbind": ("dim",)}
#: what reads or writes a tensor at an index (``whole_axis_cuts``)
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class _Tracking(TorchFunctionMode):
    """Sizes that are multiples of ``L*``, ``B*`` or ``B*·L*`` come out as ``SizeInt``; numbers
    of the sizes passed to torch are recorded."""

    def __init__(self, run: _Run):
        from .inferred_sizes import RESHAPES, shaped

        super().__init__()
        self.run, self.reshapes, self.shape_of = run, RESHAPES, shaped
        self.shaped: dict[int, tuple] = {}  # id -> (weakref to a reshape's output, its sizes)
        self.made: dict[int, tuple] = {}    # id -> (weakref to a 0-d tensor, the size it holds)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _SIZES or _is_shape_get(func):
            shaped = self._shaped(args[0]) if func is not _STRIDE else None
            if shaped is None:
                return self._sizes(out)
            return self._of_reshape(out, shaped, args[0], func, args, kwargs)
        if func in self.reshapes and isinstance(out, torch.Tensor):
            self._reshaped(out, args, kwargs)
        if func is torch.Tensor.__len__:
            size = self._sizes(out)
            if isinstance(size, SizeInt):       # ``len`` makes a plain int of it
                frame = self.run.user_frame()
                if frame is not None:
                    self.run.record(frame, "takes len() of", size.at)
            return out
        if isinstance(out, (tuple, list)) and getattr(func, "__name__", "") in _PIECES:
            at = self._pieces(func.__name__, args, kwargs)
            if at is not None:
                self.run.count(out, at, self.run.user_frame())
                self._whole_cut([piece_decision(args[0], at, self.run.L, self.run.B)])
        if func in _INDEXING and isinstance(args[0], torch.Tensor) and len(args) > 1:
            self._whole_cut(slice_decisions(args[0], args[1], self._axis_sizes, _at,
                                            self._number))
        tracked = [x for x in _leaves((args, kwargs)) if isinstance(x, _TRACKED)]
        if tracked and func in _TENSOR_MAKERS and isinstance(out, torch.Tensor) and \
                out.dim() == 0 and len(tracked) == 1:     # ``torch.tensor(T)``: a bound, maybe
            self.made[id(out)] = (weakref.ref(out), tracked[0])
        if tracked:
            frame = self.run.user_frame()
            if frame is not None and func in _TENSOR_MAKERS and _shaped(args, kwargs):
                shape = [_at(n) for n in _leaves((args, kwargs)) if _at(n) is not None]
                self.run.record(frame, "makes a tensor of", lambda L, B: [f(L, B) for f in shape])
            elif frame is not None:
                what = "makes a tensor of" if func in _TENSOR_MAKERS else \
                    f"passes `{_spelled(func)}` a number of"
                for x in tracked:
                    self.run.record(frame, what, _Sized(x.at))
        return out

    def _whole_cut(self, decisions: list) -> None:
        """Record the decisions of cuts that take a whole sized axis (``whole_axis_cuts``)."""
        decisions = [d for d in decisions if d is not None]
        frame = self.run.user_frame() if decisions else None
        for d in decisions if frame is not None else ():
            self.run.record(frame, "takes a whole axis at some values, not all, of", d,
                            iterations=True)

    def _number(self, bound):
        """A cut's bound as a number: a 0-d tensor made of a value of the sizes is that value
        (``torch.tensor(T)``), tracked; any other as ``whole_axis_cuts`` reads it."""
        hit = self.made.get(id(bound)) if isinstance(bound, torch.Tensor) else None
        return hit[1] if hit is not None and hit[0]() is bound else number(bound)

    def _axis_sizes(self, t: torch.Tensor) -> list:
        """Each axis's size of ``t`` as a function of the call's sizes (``None``: not one)."""
        return self._shaped(t) or [n.at if isinstance(n, SizeInt) else None
                                   for n in self._sizes(t.shape)]

    def _pieces(self, name: str, args, kwargs) -> Callable | None:
        """The number of pieces ``split``/``chunk``/``unbind`` cut a tensor into, as a function
        of the sizes, where the axis cut is a size of the length or the batch (or the piece
        size is a value of them); ``None`` otherwise."""
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        given = dict(zip(_PIECES[name], args[1:]))
        given.update({"split_size" if k == "split_size_or_sections" else k: v
                      for k, v in kwargs.items()})
        try:
            n = self._sizes(args[0].shape[given.get("dim", 0)])
        except (IndexError, TypeError):
            return None
        by = given.get(_PIECES[name][0], 1)
        if isinstance(by, bool) or not isinstance(by, int) or \
                not isinstance(n, SizeInt) and not isinstance(by, SizeInt):
            return None
        size, k = _at(n), _at(by)
        if name == "unbind":
            return size
        if name == "split":
            return lambda L, B: -(-size(L, B) // k(L, B))
        return lambda L, B: -(-size(L, B) // -(-size(L, B) // k(L, B)))

    def _shaped(self, t) -> list | None:
        """The sizes of ``t`` as functions of the call's sizes, where a reshape made it
        (``inferred_sizes``); ``None`` otherwise."""
        hit = self.shaped.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def _reshaped(self, out: torch.Tensor, args, kwargs) -> None:
        """Remember the sizes of a reshape's or view's output as functions of the call's."""
        if not isinstance(args[0], torch.Tensor):
            return
        dims = self._axis_sizes(args[0])
        got = self.shape_of(args, kwargs, dims)
        if got is not None and len(got) == out.dim():
            self.shaped[id(out)] = (weakref.ref(out), got)

    def _sizes(self, out):
        """``out`` (a size, a shape or strides) with each size of the length or the batch
        a ``SizeInt``: a multiple of ``L*`` or ``B*``, as the run at another length confirms
        (``size_witness``)."""
        L, B = self.run.L, self.run.B
        read = self._read()

        def one(i, n):
            if type(n) is not int or not n:
                return n
            at = _multiple(n, L, B)
            if read is not None:
                at = self.run.witness.size((*read, i), n, at)
            return n if at is None else SizeInt(n, at)
        if isinstance(out, torch.Size):
            return torch.Size([one(i, n) for i, n in enumerate(out)])
        if isinstance(out, tuple):                  # ``stride()``
            return tuple(one(i, n) for i, n in enumerate(out))
        return one(0, out)

    def _read(self) -> tuple[str, int, int] | None:
        """This read of sizes as the witness keys it — the user's line and the read's order
        there — outside the loop and every other loop (whose reads differ in number from one
        length to another); ``None`` there."""
        frame = self.run.user_frame()
        if frame is None or self.run._in_loop(frame) or _iterating(frame):
            return None
        file, line = frame.f_code.co_filename, frame.f_lineno
        return file, line, self.run.witness.read(file, line)

    @staticmethod
    def _of_reshape(out, shaped: list, t: torch.Tensor, func, args, kwargs):
        """``out`` (``shape``, ``size()``, ``size(d)`` or ``numel()`` of ``t``, a reshape's
        output) with the sizes ``shaped`` computes from the call's."""
        ats = [at or _at(n) for at, n in zip(shaped, t.shape)]
        if isinstance(out, torch.Size):
            return torch.Size([n if at is None else SizeInt(n, at)
                               for n, at in zip(out, shaped)])
        if func is not torch._C.TensorBase.size:
            return SizeInt(out, lambda L, B: math.prod(f(L, B) for f in ats))
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        at = shaped[dim] if isinstance(dim, int) and -len(ats) <= dim < len(ats) else None
        return out if at is None else SizeInt(out, at)


def _shaped(args, kwargs) -> bool:
    """Is a shape of the sizes (a ``torch.Size`` holding one) among a tensor maker's arguments?
    The tensor made of it holds the sizes where no run follows them (``int(t[1])``): a use,
    conservatively."""
    return any(isinstance(a, torch.Size) and any(isinstance(n, SizeInt) for n in a)
               for a in (*args, *kwargs.values(), *(x for a in args if isinstance(a, list)
                                                    for x in a)))


class _RangeType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, range)

    def __subclasscheck__(cls, sub) -> bool:
        return isinstance(sub, type) and issubclass(sub, range)


class _Range(metaclass=_RangeType):
    """``range`` to the layer's module during the run: a real ``range``, whose number of items
    ``_len`` hands out as a ``SizeInt`` where its bounds are values of the sizes (CPython
    reads an ``int`` subclass's value without calling ``__index__``: nothing else sees them)."""

    def __new__(cls, *args):
        out = range(*args)
        run, ats = _RUN[0], [_at(a) for a in args]
        if run is not None and None not in ats and any(isinstance(a, SizeInt) for a in args):
            run.count(out, lambda L, B: len(range(*(f(L, B) for f in ats))), sys._getframe(1))
        return out


def _len(obj):
    """``len`` to the layer's module during the run: a ``SizeInt`` for a sequence whose
    number of items is a value of the sizes (CPython's ``len`` makes a plain ``int``)."""
    n = len(obj)
    run = _RUN[0]
    at = run.length_of(obj) if run is not None else None
    return n if at is None else SizeInt(n, at)


@contextlib.contextmanager
def _counting(file: str, plain: bool = False):
    """Inside the block, ``len`` and ``range`` are ``_len`` and ``_Range`` to the loop's module
    (``file``) and every other module of the user's, where it binds no name of its own to
    them, ``math`` and the functions imported from it track values of the sizes
    (``size_math``), and unless ``plain``, so do ``int``, ``float`` and ``operator.index``
    (``size_conversions``): a helper in another file of the user's counts, and computes, as
    the loop's own code does."""
    from .counted_pieces import _sum
    from .size_conversions import replacements as conversions
    from .size_order import replacements as order
    from .size_math import replacements

    patched = []
    for scope in _user_scopes(file):
        mine = {name: f for name, f in (("len", _len), ("range", _Range), ("sum", _sum))
                if name not in scope}
        mine.update(replacements(scope))
        mine.update(order(scope))
        mine.update(conversions(scope, plain))
        kept = {name: scope[name] for name in mine if name in scope}
        scope.update(mine)
        patched.append((scope, mine, kept))
    try:
        yield
    finally:
        for scope, mine, kept in patched:
            for name, f in mine.items():
                if scope.get(name) is f:
                    if name in kept:
                        scope[name] = kept[name]
                    else:
                        del scope[name]


def _user_scopes(file: str) -> list[dict]:
    """The globals of the loop's module (``file``) and of every imported module of the
    user's (``user_code.is_users``)."""
    module = _module_of(file)
    scopes = {id(vars(module)): vars(module)} if module is not None else {}
    for m in _user_modules(len(sys.modules)):
        scopes.setdefault(id(vars(m)), vars(m))
    return list(scopes.values())


@functools.lru_cache(maxsize=1)
def _user_modules(count: int) -> tuple:
    """The imported modules of the user's while ``sys.modules`` holds ``count`` (looking at
    every module costs milliseconds; a conversion runs the code several times)."""
    out = []
    for m in list(sys.modules.values()):
        source = getattr(m, "__file__", None)
        if isinstance(source, str) and is_users(source):
            out.append(m)
    return tuple(out)


#: the frames Python runs a comprehension's body in
_COMPREHENSIONS = frozenset({"<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>"})


def _iterating(frame) -> bool:
    """Is ``frame`` in the body of a loop or a comprehension? A decision there is one of an
    iteration (the end of the last chunk, ``min(s + C, T)``), which the traces unroll at the
    probe lengths, as the source reading leaves out the values of an iteration. A loop or
    comprehension over a display of constants (``any(t == T for t in (12, 36))``) makes the
    same iterations at every length: a decision there is the length's like any other."""
    file = frame.f_code.co_filename
    if frame.f_code.co_name in _COMPREHENSIONS:
        return frame.f_lineno not in _constant_comprehension_lines(file)
    return any(first <= frame.f_lineno <= last for first, last in _loop_bodies(file))


def _constant_iterable(node) -> bool:
    """A tuple, list or set display of constants: the same items at every size."""
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and \
        all(isinstance(e, ast.Constant) for e in node.elts)


@functools.lru_cache(maxsize=256)
def _loop_bodies(file: str) -> tuple[tuple[int, int], ...]:
    """The lines of every ``for`` and ``while`` body in ``file``, but those of a ``for`` over a
    display of constants."""
    tree = parsed(file)
    if tree is None:
        return ()
    return tuple((node.body[0].lineno, node.end_lineno or node.body[0].lineno)
                 for node in ast.walk(tree)
                 if isinstance(node, (ast.While, ast.AsyncFor))
                 or isinstance(node, ast.For) and not _constant_iterable(node.iter))


@functools.lru_cache(maxsize=256)
def _constant_comprehension_lines(file: str) -> frozenset[int]:
    """The lines of ``file`` whose every comprehension iterates displays of constants only."""
    tree = parsed(file)
    if tree is None:
        return frozenset()
    constant, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
            lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
            fixed = all(_constant_iterable(g.iter) for g in node.generators)
            (constant if fixed else other).update(lines)
    return frozenset(constant - other)


class _Sized:
    """A number passed to a torch op: fine where it is a size the converted graph computes at
    any shape (affine in the length at whole chunks, and in the batch size)."""

    def __init__(self, at):
        self.at = at


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


def probe_sizes(sizes: set[int], chunk: int, unit: int) -> tuple[int, int]:
    """``(L*, B*)``: a length of whole chunks (at least two, and 16 tokens) and a batch size of
    whole units (at least two), neither a multiple of the other, of which no size in ``sizes``
    (the layer's weights' and its inputs' other axes) is a multiple: a size of the run that is
    one is a size of the length or the batch."""
    m = max(2, -(-16 // chunk))
    while any(s and s % (chunk * m) == 0 for s in sizes):
        m += 1
    L = chunk * m
    b = 2
    while any(s and s % (unit * b) == 0 for s in sizes | {L}) or (unit * b) % L == 0:
        b += 1
    return L, unit * b


def _lengths(chunk: int, L: int) -> list[int]:
    """The lengths each recorded use is evaluated at: every length up to 512 (two chunks,
    where longer), lengths around multiples of the chunk, powers of two, and the run's."""
    near = {chunk * m + r for m in (2, 3, 4, 5, 7, 8, 16, 33, 64, 100, 1000)
            for r in {0, 1, 2, 3, chunk // 2, chunk - 1} if 0 <= r < chunk}
    return sorted(set(range(1, max(2 * chunk, 512) + 2)) | near |
                  {1 << k for k in range(1, 21)} | {L})


def _batches(unit: int, B: int) -> list[int]:
    """The batch sizes each use is evaluated at: whole units up to 64 of them, powers of two
    of them, and the run's."""
    return sorted({unit * m for m in range(1, 65)} | {unit << k for k in range(7, 15)} | {B})


def _varies(values) -> bool:
    """Do the values (an iterator that may raise) differ anywhere?"""
    try:
        first = next(values)
        return any(v != first for v in values)
    except Exception:                   # fails somewhere: not one value at every size
        return True


def _exact(v) -> int | Fraction:
    """``v`` as an exact number (a float's own binary value): sizes are mostly ints, whose
    arithmetic is exact and fast as it is."""
    return v if type(v) is int else Fraction(v)


def _not_affine(points) -> bool:
    """Are the ``(x, value)`` points (an iterator that may raise) on no line ``a + c·x``?
    (Compared cross-multiplied, ``(v − v0)·Δx = Δv·(x − x0)``, so ints stay ints.)"""
    try:
        (x0, v0), (x1, v1), *rest = ((x, _exact(v)) for x, v in points)
    except Exception:
        return True
    dv, dx = v1 - v0, x1 - x0
    try:
        return any((_exact(v) - v0) * dx != dv * (x - x0) for x, v in rest)
    except Exception:
        return True


def _changes(at, judged: bool, chunk: int, lengths: list[int], batches: list[int],
             L: int, B: int) -> list[str]:
    """Which of the sizes ``at`` (a decision, or with ``judged`` a number passed to an op) is
    a use of: a decision that changes with it, or a number that is not affine in it (the
    length at whole chunks, where ``ceil(L / chunk)`` is ``L / chunk`` and code that cuts the
    sequence into whole chunks by a reshape runs at all). The converted graph computes sizes
    of that kind at any shape."""
    if judged:
        length = _not_affine((n, at(n, B)) for n in lengths if n % chunk == 0)
        batch = _not_affine((b, at(L, b)) for b in batches)
    else:
        length = _varies(at(n, B) for n in lengths)
        batch = _varies(at(L, b) for b in batches)
    return [of for of, yes in (("the length", length), ("the batch size", batch)) if yes]


@functools.lru_cache(maxsize=4096)
def _guard(file: str, line: int) -> bool:
    """Is the statement at ``file:line`` a guard that only raises (an ``assert``, an ``if``
    whose body raises, ``torch._assert``)? It changes no structure. (Read once per line, as
    ``parsed`` reads a file once.)"""
    tree = parsed(file)
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


def _loop_statement(file: str, line: int) -> ast.stmt | None:
    """The loop statement at ``file:line`` (``None``: no loop there, as for a single step)."""
    fn = function_at(file, line)
    if fn is None:
        return None
    return next((node for node in ast.walk(fn) if isinstance(
        node, (ast.For, ast.While, ast.AsyncFor)) and node.lineno == line), None)


def _loop_span(file: str, line: int) -> tuple[str, int, int] | None:
    """The lines of the loop statement at ``file:line`` and its body (``None``: no loop
    there)."""
    node = _loop_statement(file, line)
    return None if node is None else (real_path(file), line, node.end_lineno or line)


def size_uses(run: Callable[[], object], L: int, B: int, chunk: int, unit: int,
              loop: tuple[str, int]) -> list[LengthValue]:
    """The uses of the length and batch size one run of the code finds (``size_uses_at``)."""
    return size_uses_at([(run, L, B)], chunk, unit, loop)


def size_uses_at(runs: list[tuple[Callable[[], object], int, int]], chunk: int, unit: int,
                 loop: tuple[str, int]) -> list[LengthValue]:
    """The uses of the length and batch size that change the code's function from shape to
    shape: each ``run()`` (the layer's code as written at length ``L`` and batch size ``B``,
    see ``probe_sizes``; ``unit``: what the batch size is a multiple of) is called once
    (``_recorded``), its sizes checked against the other runs' (``size_witness``), and every
    decision it made with a value of the two, and every number of them it passed to torch, is
    judged at many lengths and batch sizes. ``loop``: the loop's file and line, whose body the
    traces unroll. Returns nothing from a run where the code does not run at its shape."""
    recorded, before = [], None
    for run, L, B in runs:
        rec = _recorded(run, L, B, loop, before)
        if rec is None:
            continue
        if before is not None:
            before.settle(rec.witness)
        before = rec.witness
        recorded.append(rec)
    return [v for rec in recorded for v in _judged(rec.found, chunk, unit, rec.L, rec.B)]


def _recorded(run: Callable[[], object], L: int, B: int, loop: tuple[str, int],
              other: Witness | None) -> _Run | None:
    """One run of ``run()`` (the layer's code as written at length ``L`` and batch size
    ``B``) recording every decision it makes with a value of the two and every number of them
    it passes to torch, its sizes checked against ``other`` (the run at another length). Where
    the code fails with the values tracked through NumPy, ``int`` and ``float``
    (``np.sqrt(T).item()``, ``dtype=float``), it runs again with them plain, each plain copy of
    a size a decision. ``None`` where the code does not run at that shape."""
    stmt = _loop_statement(*loop)
    for plain in (False, True):
        rec = _Run(L, B, _loop_span(*loop), frozenset(appended_names(stmt) if stmt else ()),
                   plain, other)
        _RUN[0] = rec
        try:
            with warnings.catch_warnings(), _counting(loop[0], plain), _Tracking(rec), \
                    size_operands.operands_watched():
                warnings.simplefilter("ignore")
                run()
        except Exception:               # the code does not run there: the source reading stands
            continue
        finally:
            _RUN[0] = None
        return rec
    return None


def _judged(found: dict, chunk: int, unit: int, L: int, B: int) -> list[LengthValue]:
    """The uses among the recorded ones, one per line and size; a line whose every use of the
    length is a decision of one of the plan's own cases (``chunking_case``) says which."""
    lengths, batches = _lengths(chunk, L), _batches(unit, B)
    out, cases, outcomes = {}, {}, {}
    for (file, line), uses in found.items():
        for what, at in uses:
            judged = isinstance(at, _Sized)
            if not judged and _guard(file, line):
                continue
            changes = _changes(at.at if judged else at, judged, chunk, lengths, batches, L, B)
            for of in changes:
                case = "" if judged or changes != ["the length"] else \
                    chunking_case(lambda n: at(n, B), chunk, lengths)
                cases.setdefault((file, line, of), set()).add(case)
                outcomes.setdefault((file, line, of), []).append(
                    (judged, at.at if judged else at))
                if (file, line, of) not in out:
                    lines = source_lines(file)
                    code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
                    out[(file, line, of)] = LengthValue(file, line, code, what, of)
    out = {key: dataclasses.replace(
        v, outcomes=tuple(outcomes[key]),
        **({"chunking": next(iter(cases[key]))} if len(cases[key]) == 1 else {}))
        for key, v in out.items()}
    return sorted(out.values(), key=lambda v: (v.file, v.line, v.of))


# NumPy, text and plain numbers of the sizes (each module adds its methods to the two types)
from . import size_conversions, size_numpy, size_operands, size_text  # noqa: E402,F401

__all__ = ["SizeInt", "SizeFloat", "size_uses", "size_uses_at", "probe_sizes"]
