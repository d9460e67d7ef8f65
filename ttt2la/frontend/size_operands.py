"""Values of the call's sizes that CPython reads without asking them, found at the user's line.

A ``SizeInt`` is an ``int``, and CPython reads an ``int`` subclass's value directly where a plain
``float`` is on the left of an operator (``0.5 * T``, ``1.0 / T``, ``2.5 < T``, and each float
item of ``T in [16.0, 32.0]``), where it indexes a list, tuple or string (``[3.0, 2.0][T % 2]``,
``names[:T]``), in ``'%d' % T``, and where ``list.sort()`` orders it among floats: no method of
the size runs, so the run of ``size_uses`` saw no decision, and a branch on the number, the item
picked or the text made was converted with the probe length's outcome at every length. Here,
during that run, the lines of the user's files that hold such an expression are watched
(``sys.settrace``, on the user's frames only): when one is reached, the operands that are plain
names, attributes, subscripts, dict displays, arithmetic, comparisons, conditional
expressions or ``and``/``or`` of them are read in its frame, and where one is a
value of the sizes in such a place, the expression's value is recorded as a decision of the
sizes at that line, as a function of them — conservatively, as text is (``size_text``); a
tuple or list written there whose items cannot be read (``(o + 2, o * 2)[T % 2]``) by the
position picked. An
operand that is a call (``0.5 * get_len(x)``) is read as the value it returns, when that
returns: the frame that computes it, one of a Python function, method or ``__call__`` named as
the call names it, is found by the caller's position in its line (Python 3.11 on); a method of
what a call returned (``0.5 * make(x).length()``), by its receiver's class. A call of
``abs``, ``round``, ``pow``, ``divmod``, ``sum``, ``int`` or ``float``, or of a function of the
``operator`` module, starts no frame; on numbers it runs only the sizes' own methods, so it is
called in the frame (``0.5 * abs(T)``, ``0.5 * int(T)``, ``0.5 * operator.mul(T, 2)``). A
tracer set already (a debugger, coverage) runs alongside and sees every event it would have
seen. An operand the reading cannot follow at all (a comprehension, a lambda) that names a value
of the sizes is taken, conservatively, for a decision of that value (``_unfollowed``).
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import functools
import operator
import sys
import types

import torch

from .size_uses import _RUN, SizeFloat, SizeInt, _iterating, _library
from .counted_pieces import _sum
from .size_conversions import _Float, _Int
from .size_order import order
from .size_text import _printed
from .user_code import parsed

#: the arithmetic operators whose float method reads an ``int`` operand's value directly
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
               ast.Mod: operator.mod, ast.Pow: operator.pow}
#: a list or tuple compares each item with the value looked up, a float item from its side
_MEMBERSHIP = {ast.In: lambda v, c: v in c, ast.NotIn: lambda v, c: v not in c}
_COMPARISONS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
                ast.GtE: operator.ge, ast.Eq: operator.eq, ast.NotEq: operator.ne}
#: the expressions read in the frame: they compute nothing a reader could notice
_PURE = (ast.Name, ast.Constant, ast.Attribute, ast.Subscript, ast.Slice, ast.BinOp,
         ast.UnaryOp, ast.Tuple, ast.List, ast.Load, ast.Store, ast.operator, ast.unaryop,
         ast.IfExp, ast.Compare, ast.cmpop, ast.BoolOp, ast.boolop, ast.Dict)
_SEQUENCES = (list, tuple, str, bytes, range)
#: where the interpreter says which expression an instruction computes (3.11 on)
_POSITIONS = hasattr(types.CodeType, "co_positions")
#: what the calls of a frame's current line returned so far, by frame and call
_RETURNED: dict[int, dict] = {}
#: builtins of numbers read in the frame by calling them there: they start no frame to read the
#: return of, and on numbers they run only the sizes' own methods (``int``, ``float`` and ``sum``
#: also as the run hands them to the user's modules)
_BUILTINS = {name: (getattr(builtins, name),) for name in ("abs", "round", "pow", "divmod")}
_BUILTINS.update(int=(int, _Int), float=(float, _Float), sum=(sum, _sum))
#: what is recorded where an operand the reading cannot follow names a value of the sizes
UNFOLLOWED = "computes, in an expression the run does not follow, a value of"
#: the ``operator`` module's functions of numbers, named as ``operator.mul`` or imported by name:
#: written in C, they start no frame either, and on numbers run only the sizes' own methods
_OPERATOR_FUNCTIONS = {name: (getattr(operator, name),) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "lt", "le",
    "gt", "ge", "eq", "ne")}


@contextlib.contextmanager
def operands_watched():
    """Inside the block, the user's lines that read a size without asking it record their
    decision in the run in progress; a tracer set already (a debugger, coverage) keeps seeing
    every event it saw, and is set again after."""
    theirs = sys.gettrace()
    sys.settrace(_calls if theirs is None else _alongside(theirs))
    try:
        yield
    finally:
        sys.settrace(theirs)
        _RETURNED.clear()


def _alongside(theirs):
    """A global tracer that calls ``theirs`` and then this module's, each frame's local
    tracers chained the same way; a tracer that sets itself again when called (coverage's C
    tracer does) is set back behind this one."""
    def tracer(frame, event, arg):
        their_local = theirs(frame, event, arg)
        if sys.gettrace() is not tracer:
            sys.settrace(tracer)
        ours, our_lines = _ours(frame)
        if ours is None:
            return their_local
        their_lines = frame.f_trace_lines and their_local is not None
        frame.f_trace_lines = their_lines or our_lines
        return _both(their_local, their_lines, ours)
    return tracer


def _both(theirs, their_lines: bool, ours):
    """A frame's local tracer calling both, each for as long as it asks to go on (``theirs``
    not with line events where it had turned them off)."""
    def local(frame, event, arg):
        nonlocal theirs, ours
        if theirs is not None and (their_lines or event != "line"):
            theirs = theirs(frame, event, arg)
        ours = ours(frame, event, arg)
        return local
    return local


def _calls(frame, event, arg):
    """The global tracer: see ``_ours``."""
    local, lines = _ours(frame)
    if local is not None and not lines:
        frame.f_trace_lines = False
    return local


def _ours(frame):
    """``(local tracer, whether it reads lines)`` for a new frame: one of the user's files with
    watched expressions gets its lines read, and a frame that computes a call the caller's line
    reads as an operand gets its return read (``None``: the frame is not watched)."""
    watch = _watched(frame.f_code.co_filename)
    operand = _operand_of(frame)
    if operand is None and not watch:
        return None, False
    lines = watch.lines

    def local(frame, event, arg):
        if event == "line":
            _RETURNED.pop(id(frame), None)
            nodes = lines.get(frame.f_lineno)
            if nodes:
                _read(frame, nodes)
        elif event == "return":
            _RETURNED.pop(id(frame), None)
            if operand is not None:
                _returned(*operand, arg)
        return local
    return local, bool(watch)


@dataclasses.dataclass(frozen=True)
class _Watch:
    """A file's watched expressions: those read at their line's start, by line, and those with
    an operand that is a call, by that call's position (line, end line, column, end column):
    read when it returns."""

    lines: dict
    calls: dict

    def __bool__(self) -> bool:
        return bool(self.lines or self.calls)


@functools.lru_cache(maxsize=256)
def _watched(file: str) -> _Watch:
    """The expressions of ``file`` that may read a size without asking it (none for a file that
    is not the user's)."""
    tree = None if _library(file) else parsed(file)
    lines: dict[int, list] = {}
    calls: dict[tuple, tuple] = {}
    for node in ast.walk(tree) if tree is not None else ():
        if not _candidate(node):
            continue
        operands = _operand_calls(node.func.value) if isinstance(node, ast.Call) else \
            _operand_calls(node)
        if all(map(_builtin_call, operands)) or _unfollowed(node):   # read at the line
            lines.setdefault(node.lineno, []).append(node)
        for call in operands if _POSITIONS else ():
            where = (call.lineno, call.end_lineno, call.col_offset, call.end_col_offset)
            calls.setdefault(where, (call, []))[1].append(node)
    return _Watch(lines, calls)


def _candidate(node) -> bool:
    """A float-capable operator (in place too: ``c *= T``), a comparison or a subscript whose
    operands are read in the frame, and whose other side is no constant; or one with an operand
    the reading cannot follow that names something (``_unfollowed``)."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else \
            (node.target, node.value)
        return type(node.op) in _ARITHMETIC and (
            _pure(left) and _pure(right) and not _constant(right) or bool(_unfollowed(node)))
    if isinstance(node, ast.Compare):
        return any(type(op) in _COMPARISONS or type(op) in _MEMBERSHIP for op in node.ops) and (
            _pure(node.left) and all(_pure(c) for c in node.comparators)
            and not all(_constant(c) for c in node.comparators) or bool(_unfollowed(node)))
    if isinstance(node, ast.Subscript):
        return isinstance(node.ctx, ast.Load) and (
            _pure(node.value) and _pure(node.slice) and not _constant(node.slice)
            or bool(_unfollowed(node)))
    return isinstance(node, ast.Call) and _sorts_in_place(node)


def _unfollowed(node) -> list:
    """The operands of an operator, comparison or subscript that the reading cannot follow (a
    comprehension, a lambda, a builtin called on one: ``0.5 * sum(1 for _ in range(T))``) and
    that name something: where a name among them holds a value of the sizes, the expression is
    taken, conservatively, for a decision of them (``_Reading.unfollowed``). An f-string is
    text, whose making the run records itself (``size_text``)."""
    operands = {ast.BinOp: ("left", "right"), ast.AugAssign: ("target", "value"),
                ast.Subscript: ("value", "slice")}.get(type(node))
    found = [getattr(node, a) for a in operands] if operands else \
        [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
    return [o for o in found if not _pure(o) and not isinstance(o, ast.JoinedStr)   # text: its own
            and any(isinstance(n, ast.Name) for n in ast.walk(o))]


def _sorts_in_place(node: ast.Call) -> bool:
    """``xs.sort()`` (``reverse=`` at most: a ``key`` would be the user's code to run)."""
    return isinstance(node.func, ast.Attribute) and node.func.attr == "sort" and not node.args \
        and all(k.arg == "reverse" for k in node.keywords) and _pure(node.func.value) \
        and all(_pure(k.value) for k in node.keywords)


def _pure(node) -> bool:
    """Only names, constants, attributes, subscripts, arithmetic, ``x.size(...)`` and calls of
    what such an expression names, a call's result's method too (read as the value they
    return)."""
    if isinstance(node, ast.Call):
        if _size_call(node):
            return _pure(node.func.value)
        if _builtin_call(node):
            return all(_pure(a) for a in node.args)
        return _pure(node.func)
    if not isinstance(node, (*_PURE, ast.expr_context, ast.keyword)):
        return False
    return all(_pure(child) for child in ast.iter_child_nodes(node))


def _size_call(node) -> bool:
    return isinstance(node.func, ast.Attribute) and node.func.attr == "size" \
        and all(isinstance(a, ast.Constant) for a in node.args) and not node.keywords


def _builtin_call(node) -> bool:
    """``abs``, ``round``, ``pow``, ``divmod``, ``sum``, ``int`` or ``float`` called by name, or
    a function of the ``operator`` module by name or as ``operator.mul``, positional arguments
    only (whether the name is that function is asked in the frame)."""
    return bool(_builtins_named(node.func)) and not node.keywords \
        and not any(isinstance(a, ast.Starred) for a in node.args)


def _builtins_named(func) -> tuple:
    """The functions of numbers a call's ``func`` may name (``()``: none)."""
    if isinstance(func, ast.Name):
        return _BUILTINS.get(func.id, ()) + _OPERATOR_FUNCTIONS.get(func.id, ())
    if isinstance(func, ast.Attribute) and _pure(func.value):
        return _OPERATOR_FUNCTIONS.get(func.attr, ())
    return ()


def _operand_calls(node) -> list:
    """The calls among ``node``'s operands (not inside another call) but ``x.size(...)``, and
    those inside a builtin's arguments (``abs(get_len(x))``)."""
    if isinstance(node, ast.Call):
        if _builtin_call(node):
            return [node, *(c for a in node.args for c in _operand_calls(a))]
        return [] if _size_call(node) else [node]
    return [c for child in ast.iter_child_nodes(node) for c in _operand_calls(child)]


def _constant(node) -> bool:
    return all(isinstance(n, (ast.Constant, ast.Slice, ast.Tuple, ast.UnaryOp, ast.Load,
                              ast.unaryop, ast.expr_context)) for n in ast.walk(node))


def _read(frame, nodes, returned: dict | None = None) -> None:
    """Record the decisions ``nodes`` (at the frame's line) make with a value of the sizes,
    reading their operands with the run's own recording off (``returned``: the values the
    line's calls returned)."""
    run = _RUN[0]
    if run is None or run._in_loop(frame) or _iterating(frame):
        return              # an iteration's decisions are the traces' (``_Run.record``)
    _RUN[0] = None          # reading the operands is no decision of the code's
    try:
        reading = _Reading(frame, returned or {})
        found = [d for d in map(reading.decision, nodes) if d is not None]
    finally:
        _RUN[0] = run
    for what, at in found:
        if what == "makes text of" and _printed(frame.f_code.co_filename, frame.f_lineno):
            continue
        run.record(frame, what, at)


def _operand_of(frame):
    """``(caller, call, expressions holding it)`` where ``frame`` is the call of what a watched
    call of the caller's line names (its return is that call's value), else ``None``."""
    caller = frame.f_back
    calls = None if caller is None else _watched(caller.f_code.co_filename).calls
    if not calls:
        return None
    positions = _positions(caller.f_code)
    i = caller.f_lasti // 2
    found = calls.get(positions[i]) if 0 <= i < len(positions) else None
    if found is None or not _runs(frame, caller, found[0].func):
        return None
    return caller, *found


def _returned(caller, call: ast.Call, nodes: list, value) -> None:
    """``call`` at the caller's line returned ``value``: the expressions holding it are read,
    with what the line's other calls returned so far."""
    returned = _RETURNED.setdefault(id(caller), {})
    returned[call] = value
    _read(caller, nodes, returned)


def _runs(frame, caller, func: ast.expr) -> bool:
    """Whether what ``func`` names in the caller runs ``frame``'s code first when called: a
    function, a method, or an object whose class's ``__call__`` is written in Python."""
    code = frame.f_code
    run, _RUN[0] = _RUN[0], None
    try:
        try:
            fn = _Reading(caller).value(func)
        except _Unread:
            fn = _method_of_receiver(frame, func)
        if isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif not isinstance(fn, (types.FunctionType, type)):
            fn = getattr(type(fn), "__call__", None)    # the class's: no instance's __getattr__
        return isinstance(fn, types.FunctionType) and fn.__code__ is code
    except Exception:       # a name that fails when read is no call followed
        return False
    finally:
        _RUN[0] = run


def _method_of_receiver(frame, func: ast.expr):
    """What ``func`` names where it is a method of what a call returned (``make(x).length``),
    which is not read: the method of that name of the class of ``frame``'s first argument, the
    object the method was called on, looked up on the class."""
    code = frame.f_code
    if not isinstance(func, ast.Attribute) or not code.co_argcount:
        raise _Unread
    return getattr(type(frame.f_locals[code.co_varnames[0]]), func.attr)


@functools.lru_cache(maxsize=1024)
def _positions(code: types.CodeType) -> tuple:
    """Each instruction's (line, end line, column, end column), by code unit."""
    return tuple(code.co_positions())


class _Unread(Exception):
    """An operand that is not read in the frame: it would compute on tensors, call code, or
    look up a container that may change when looked up."""


_OPERATORS = {**_ARITHMETIC, ast.BitAnd: operator.and_, ast.BitOr: operator.or_,
              ast.BitXor: operator.xor, ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert,
          ast.Not: operator.not_}


@dataclasses.dataclass(frozen=True)
class _Reading:
    """Expressions read in ``frame`` without running any code of the user's, a call's value
    being what it ``returned`` (by call node) where it returned already."""

    frame: types.FrameType
    returned: dict = dataclasses.field(default_factory=dict)

    def value(self, node):
        """``node``'s value: names, constants, attributes that are no property, items of plain
        sequences and dicts, dict displays, numbers' arithmetic and comparisons, conditional
        expressions, ``and``/``or``, a tensor's ``.size(...)`` and a call's return; ``_Unread``
        for anything else."""
        kind, value = type(node), self.value
        if kind is ast.Constant:
            return node.value
        if kind is ast.Name:
            return self.name(node.id)
        if kind is ast.Attribute:
            obj = value(node.value)
            if isinstance(getattr(type(obj), node.attr, None), property):
                raise _Unread
            return getattr(obj, node.attr)
        if kind is ast.Subscript:
            seq = value(node.value)
            if not isinstance(seq, _SEQUENCES) and type(seq) is not dict:
                raise _Unread
            return seq[value(node.slice)]
        if kind is ast.Slice:
            return slice(*(None if p is None else value(p)
                           for p in (node.lower, node.upper, node.step)))
        if kind in (ast.Tuple, ast.List):
            return (tuple if kind is ast.Tuple else list)(value(e) for e in node.elts)
        if kind is ast.Dict and None not in node.keys:
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        if kind is ast.BinOp and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](self.number(node.left), self.number(node.right))
        if kind is ast.UnaryOp and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self.number(node.operand))
        if kind is ast.IfExp:       # ``0.5 * (T if T > 0 else 1)``: the branch the code takes
            return value(node.body) if value(node.test) else value(node.orelse)
        if kind is ast.Compare and all(type(op) in _COMPARISONS for op in node.ops):
            return self.compared(node)
        if kind is ast.BoolOp:      # ``T or 1``: the operand Python returns
            for operand in node.values[:-1]:
                v = value(operand)
                if bool(v) == isinstance(node.op, ast.Or):
                    return v
            return value(node.values[-1])
        if kind is ast.Call:
            return self.call(node)
        raise _Unread

    def name(self, name: str):
        frame = self.frame
        for scope in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if name in scope:
                return scope[name]
        raise _Unread

    def call(self, node: ast.Call):
        if node in self.returned:
            return self.returned[node]
        if _size_call(node):
            t = self.value(node.func.value)
            if isinstance(t, torch.Tensor):
                return t.size(*(self.value(a) for a in node.args))
        if _builtin_call(node):
            fn = self.value(node.func)
            args = [self.value(a) for a in node.args]
            if any(fn is f for f in _builtins_named(node.func)) and all(map(_numbers, args)):
                return fn(*args)
        raise _Unread

    def compared(self, node: ast.Compare) -> bool:
        """A chain of comparisons of numbers, evaluated as Python does (left to right, stopping
        at the first that fails)."""
        left = self.number(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = self.number(right_node)
            if not _COMPARISONS[type(op)](left, right):
                return False
            left = right
        return True

    def number(self, node):
        """An operand of arithmetic: a number or text, never a tensor (that would compute)."""
        v = self.value(node)
        if not isinstance(v, (int, float, str, bytes, tuple)):
            raise _Unread
        return v

    def decision(self, node):
        """``(what, at)`` for the expression ``node`` where it reads a size without asking it,
        else ``None`` (also where an operand cannot be read now)."""
        value = self.value
        try:
            if isinstance(node, ast.BinOp):
                return _operator(value(node.left), type(node.op), value(node.right))
            if isinstance(node, ast.AugAssign):     # its target read as it is before the line
                return _operator(value(node.target), type(node.op), value(node.value))
            if isinstance(node, ast.Compare):
                values = [value(n) for n in (node.left, *node.comparators)]
                return next((d for d in map(_comparison, values, map(type, node.ops),
                                            values[1:]) if d is not None), None)
            if isinstance(node, ast.Call):          # xs.sort(), as it is before the line
                return _sorting(value(node.func.value),
                                *(value(k.value) for k in node.keywords))
            return _index(self.sequence(node.value), value(node.slice))
        except Exception:
            return self.unfollowed(node)

    def sequence(self, node):
        """What a subscript indexes; a tuple or list display whose items cannot be read
        (``(o + 2, o * 2)[T % 2]``: reading tensors' arithmetic would compute) as the range of
        its positions, the position picked standing for the item."""
        try:
            return self.value(node)
        except _Unread:
            if isinstance(node, (ast.Tuple, ast.List)) and \
                    not any(isinstance(e, ast.Starred) for e in node.elts):
                return range(len(node.elts))
            raise

    def unfollowed(self, node):
        """``(what, at)`` where an operand the reading cannot follow names a value of the sizes:
        it may compute anything of them, so the values of those names stand for it."""
        found = []
        for n in (n for o in _unfollowed(node) for n in ast.walk(o) if isinstance(n, ast.Name)):
            try:
                v = self.name(n.id)
            except _Unread:
                continue
            if isinstance(v, (SizeInt, SizeFloat)):
                found.append(v.at)
        if not found:
            return None
        return UNFOLLOWED, lambda L, B: tuple(f(L, B) for f in found)


def _numbers(v) -> bool:
    """A number, or a list or tuple of numbers: what a builtin of numbers may be called on
    without running anything but the sizes' own methods."""
    if type(v) in (list, tuple):
        return all(isinstance(x, (int, float)) for x in v)
    return isinstance(v, (int, float))


def _operator(left, op: type, right):
    if type(left) is float and isinstance(right, SizeInt):
        f, apply = right.at, _ARITHMETIC[op]
        return "computes a plain number of", lambda L, B: apply(left, f(L, B))
    if op is ast.Mod and isinstance(left, (str, bytes)) and _sized(right):
        return "makes text of", lambda L, B: left % _at_sizes(right, L, B)
    return None


def _comparison(left, op: type, right):
    if op in _COMPARISONS and type(left) is float and isinstance(right, SizeInt):
        f, compare = right.at, _COMPARISONS[op]
        return "compares", lambda L, B: compare(left, f(L, B))
    if op in _MEMBERSHIP and isinstance(left, SizeInt) and type(right) in (list, tuple) \
            and any(type(v) is float for v in right):
        f, member = left.at, _MEMBERSHIP[op]
        return "looks up", lambda L, B: member(f(L, B), right)
    return None


def _sorting(xs, reverse=False):
    at = order(xs, bool(reverse)) if type(xs) is list else None
    return None if at is None else ("sorts", at)


def _index(seq, i):
    if not isinstance(seq, _SEQUENCES):
        return None
    if isinstance(i, slice):
        parts = (i.start, i.stop, i.step)
        if not any(isinstance(p, SizeInt) for p in parts):
            return None
        return "indexes a sequence with", \
            lambda L, B: tuple(map(_item, seq[slice(*_at_sizes(parts, L, B))]))
    if not isinstance(i, SizeInt):
        return None
    f = i.at
    return "indexes a sequence with", lambda L, B: _item(seq[f(L, B)])


def _item(v):
    """An item picked, as the decision's value: itself for a number or text, else its
    identity (tensors compare elementwise)."""
    return v if isinstance(v, (int, float, str, bytes)) else id(v)


def _sized(x) -> bool:
    if isinstance(x, (SizeInt, SizeFloat)):
        return True
    if isinstance(x, (tuple, list)):
        return any(_sized(v) for v in x)
    return isinstance(x, dict) and any(_sized(v) for v in x.values())


def _at_sizes(x, L: int, B: int):
    """``x`` with every value of the sizes in it evaluated at ``(L, B)``."""
    if isinstance(x, (SizeInt, SizeFloat)):
        return x.at(L, B)
    if isinstance(x, (tuple, list)):
        return type(x)(_at_sizes(v, L, B) for v in x) if type(x) in (tuple, list) else \
            tuple(_at_sizes(v, L, B) for v in x)
    if isinstance(x, dict):
        return {k: _at_sizes(v, L, B) for k, v in x.items()}
    return x


__all__ = ["operands_watched"]
