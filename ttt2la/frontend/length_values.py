"""Python values the layer's code computes from the call's length, read off its source.

The converted layer generalises over lengths from traces at a few probe lengths. A Python value
of the length that branches (``if T < 20:``), clamps (``min(8, T // 2)``), or sets the chunk size
(``range(0, T, C)`` with ``C`` a function of ``T``) can take another value at a length the probes
never showed, where the traces say nothing. Here the source of the function that holds the loop
is read with ``ast``: names bound from the length (``B, T, D = x.shape`` at the token axis,
``x.size(1)``, ``x.shape[1]``) and every name computed from them are followed through the
statements before the loop (and, for the converted layer's vouching, after it: a branch
there picks the code around the loop, which the probe traces show at their lengths only), and
each use that can change the structure is returned with its line, so the converted layer can
vouch for other lengths by checking them (``converted.py``) and a refusal can name the line.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
from dataclasses import dataclass, field

from .user_code import function_at, library_roots, parsed, real_path, source_lines

from .loop_source import appended_names

#: what a length is called where a shape of another rank than the input's is unpacked
_LENGTH_NAMES = {"T", "L", "N", "S", "seq_len", "seqlen", "length", "num_tokens", "n_tokens"}

#: functions whose value of an integer is no affine function of it (nor a chunk count)
_NONLINEAR = {"sqrt", "log", "log2", "exp", "pow", "isqrt"}


@dataclass(frozen=True)
class LengthValue:
    """One use of a value of the length that the probe traces cannot vouch for."""

    file: str
    line: int
    code: str
    what: str               # "branches on", "clamps", …
    of: str = "the length"  # or "the batch size"
    chunking: str = ""      # the plan's own case the decision tells apart (``size_uses``)
    #: each use the run recorded there (``size_uses``): ``(judged, at)``, ``at(L, B)`` its
    #: value at length ``L`` and batch size ``B`` (``judged``: a number passed to torch, else a
    #: decision); none for a use read off the source only
    outcomes: tuple = field(default=(), compare=False, repr=False)

    def describe(self) -> str:
        return f"`{self.code}` at {self.file}:{self.line} {self.what} {self.of}"


def _length_source(expr: ast.expr, axes: tuple[int, ...]) -> bool:
    """``x.shape[i]`` or ``x.size(i)`` with ``i`` a token axis (``axes[:2]``)."""
    axes = axes[:2]
    if isinstance(expr, ast.Subscript) and _is_shape(expr.value):
        return isinstance(expr.slice, ast.Constant) and expr.slice.value in axes
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and \
            expr.func.attr == "size" and len(expr.args) == 1:
        arg = expr.args[0]
        return isinstance(arg, ast.Constant) and arg.value in axes
    return False


def _is_shape(expr: ast.expr) -> bool:
    """``x.shape`` or ``x.size()``."""
    if isinstance(expr, ast.Attribute) and expr.attr == "shape":
        return True
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and \
        expr.func.attr == "size" and not expr.args


def _derives(expr: ast.AST, derived: set[str], axes: tuple[int, ...], me: str = "") -> bool:
    """Is ``expr`` a Python number computed from the length: a source, a name bound from one,
    arithmetic, comparisons and calls of plain functions (``int``, ``min``, ``math.ceil``, a
    method of the layer ``me``) on one? A tensor op (``x.view(B, T, D)``) is not followed: the
    traces see what it makes at every length."""
    if isinstance(expr, ast.Name):
        return expr.id in derived and expr.id not in _looping(derived)
    if any(isinstance(n, ast.Name) and n.id in _looping(derived) for n in ast.walk(expr)):
        return False                    # a value of the iteration: the traces unroll it
    if _length_source(expr, axes) or _counted_len(expr, derived, axes, me):
        return True
    parts: list = []
    if isinstance(expr, (ast.BinOp,)):
        parts = [expr.left, expr.right]
    elif isinstance(expr, ast.UnaryOp):
        parts = [expr.operand]
    elif isinstance(expr, ast.BoolOp):
        parts = expr.values
    elif isinstance(expr, ast.Compare):
        parts = [expr.left, *expr.comparators]
    elif isinstance(expr, ast.IfExp):
        parts = [expr.test, expr.body, expr.orelse]
    elif isinstance(expr, (ast.Tuple, ast.List)):
        parts = expr.elts
    elif isinstance(expr, ast.Call) and _plain_call(expr, me):
        parts = [*expr.args, *(k.value for k in expr.keywords)]
    return any(_derives(p, derived, axes, me) for p in parts)


class _Derived(set):
    """Names bound from the length, with ``looping``: the targets of the loops that hold the
    loop (their values per iteration are unrolled in the traces), and ``counted``: sequences
    whose number of items is a value of the length (lists the loop grows, pieces of the
    token axis)."""

    looping: set
    where: dict                         # name -> the line that binds it from the length
    counted: set


#: calls that cut a tensor into pieces, and where their axis argument is (after the tensor)
_CUTS = {"split": 1, "chunk": 1, "unbind": 0, "tensor_split": 1}


def _counting(expr: ast.AST, derived: set[str], axes, me: str) -> bool:
    """Is ``expr`` a sequence whose number of items is a value of the length: a name of
    ``derived.counted``, a ``range`` of the length, or pieces of a tensor cut along the token
    axis (``x.split(C, 1)``, ``x.unbind(dim=1)``) or by a size of the length?"""
    if isinstance(expr, ast.Name):
        return expr.id in getattr(derived, "counted", ())
    if not isinstance(expr, ast.Call):
        return False
    f = expr.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name == "range":
        return any(_derives(a, derived, axes, me) for a in expr.args)
    if name not in _CUTS:
        return False
    args = expr.args[1:] if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
        and f.value.id == "torch" else expr.args
    dim = next((k.value for k in expr.keywords if k.arg == "dim"), None)
    if dim is None and len(args) > _CUTS[name]:
        dim = args[_CUTS[name]]
    along = isinstance(dim, ast.Constant) and dim.value in axes[:2]
    return along or any(_derives(a, derived, axes, me) for a in args)


def _counted_len(expr: ast.AST, derived: set[str], axes, me: str) -> bool:
    """``len(seq)`` of a sequence whose number of items is a value of the length."""
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and \
        expr.func.id == "len" and len(expr.args) == 1 and \
        _counting(expr.args[0], derived, axes, me)


def _looping(derived: set) -> set:
    return getattr(derived, "looping", set())


def _plain_call(call: ast.Call, me: str) -> bool:
    """A call of a plain function (``int(…)``, ``helper(…)``), of ``math`` or of the layer's own
    method (``self.chunk(T)``): not a tensor op."""
    f = call.func
    if isinstance(f, ast.Name):
        return True
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
        f.value.id in ("math", me)


def _bind(stmt: ast.stmt, derived: set[str], axes: tuple[int, ...], me: str) -> None:
    """Add the names ``stmt`` binds from the length to ``derived`` (those it binds from an
    iteration's values to ``derived.looping``)."""
    looping = _looping(derived)
    if looping and any(isinstance(n, ast.Name) and n.id in looping for n in ast.walk(stmt)):
        for target in getattr(stmt, "targets", [getattr(stmt, "target", None)]):
            if target is not None:
                looping |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        return
    if isinstance(stmt, ast.Assign):
        value = stmt.value
        for target in stmt.targets:
            if isinstance(target, ast.Tuple) and _is_shape(value):
                n = len(target.elts)
                for i, elt in enumerate(target.elts):
                    if isinstance(elt, ast.Name) and (
                            (i in axes or i - n in axes) if n == axes[-1] else
                            elt.id in _LENGTH_NAMES):
                        derived.add(elt.id)
            elif _derives(value, derived, axes, me):
                names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
                derived |= names
                derived.where.update(dict.fromkeys(names, stmt.lineno))
            elif isinstance(target, ast.Name) and _counting(value, derived, axes, me):
                derived.counted.add(target.id)
    elif isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) and stmt.value is not None \
            and _derives(stmt.value, derived, axes, me) and isinstance(stmt.target, ast.Name):
        derived.add(stmt.target.id)


def _uses(stmt: ast.stmt, derived: set[str], axes, me: str) -> list[tuple[ast.AST, str]]:
    """The nodes of ``stmt`` that branch on, clamp or take a nonlinear function of the length
    (an ``if``'s test only: its body is followed statement by statement)."""
    of = lambda e: _derives(e, derived, axes, me)   # noqa: E731
    found = []
    if isinstance(stmt, (ast.If, ast.While)):
        guard = isinstance(stmt, ast.If) and not stmt.orelse and \
            all(isinstance(b, ast.Raise) for b in stmt.body)
        if of(stmt.test) and not guard:     # a guard that raises changes no structure
            found.append((stmt.test, "branches on"))
        roots = [stmt.test]
    else:
        roots = [stmt]
    for node in (n for r in roots for n in ast.walk(r)):
        if isinstance(node, ast.IfExp) and of(node.test):
            found.append((node, "branches on"))
        elif isinstance(node, ast.Call) and _plain_call(node, me) and of(node):
            name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if name in ("min", "max"):
                found.append((node, "clamps"))
            elif name in _NONLINEAR:
                found.append((node, "takes a nonlinear function of"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and of(node):
            found.append((node, "takes a power of"))
    return found


def _chunk_step(loop: ast.stmt, derived: set[str], axes, me: str) -> ast.AST | None:
    """The step of ``range(start, stop, step)`` (or the size of ``split``) in the loop
    statement, where it reads the length."""
    if not isinstance(loop, ast.For):
        return None
    it = loop.iter
    if isinstance(it, ast.Call):
        name = it.func.id if isinstance(it.func, ast.Name) else \
            it.func.attr if isinstance(it.func, ast.Attribute) else ""
        size = it.args[2] if name == "range" and len(it.args) == 3 else \
            it.args[0] if name == "split" and it.args else None
        if size is not None and _derives(size, derived, axes, me):
            return size
    return None


def length_values(file: str, loop_line: int, axes: tuple[int, ...], *,
                  after: bool = False, owner: type | None = None) -> list[LengthValue]:
    """The uses of a value of the length in the function holding the loop at
    ``file:loop_line``, before the loop and in the loop statement; with ``after``, in the
    statements after the loop too (a branch there changes the code around the loop, which the
    probe traces show at their lengths only). ``axes``: the input's token axis, counted from
    the front and from the back, then its rank (a shape of that rank unpacked gives the length
    at the token axis; another rank, at a name like ``T``). A ``loop_line`` on the function's
    own ``def`` (a single step, which runs no loop) makes every statement one after it. The
    plain functions and methods of the layer those statements call are read too
    (``_helper_calls``; ``owner``: the layer's class, whose methods ``self.helper(…)`` calls):
    a branch in a helper is the code's branch all the same."""
    out: dict[tuple[str, int], LengthValue] = {}
    _read(file, loop_line, axes, after, set(), out, set(), 0, True, owner)
    return sorted(out.values(), key=lambda v: (v.file != file, v.file, v.line))


#: how deep calls of helpers from the code around the loop are followed
_HELPER_DEPTH = 3


def _read(file: str, loop_line: int, axes: tuple[int, ...], after: bool, given: set[str],
          out: dict, seen: set, depth: int, method: bool, owner: type | None) -> None:
    """``length_values`` of one function into ``out`` (keyed by file and line), its names
    ``given`` bound from the length already (a helper's parameters passed a value of it)."""
    fn = function_at(file, loop_line)
    if fn is None:
        return
    reader = _FunctionReader(file, fn, loop_line, axes, given, out, seen, depth, method, owner)
    reader.walk(fn.body)
    if after:
        reader.rest(fn.body)


class _FunctionReader:
    """One function's statements read for uses of the length: up to the loop statement
    (``walk``), binding the names derived from the length, and after it (``rest``)."""

    def __init__(self, file: str, fn: ast.FunctionDef, loop_line: int, axes: tuple[int, ...],
                 given: set[str], out: dict, seen: set, depth: int, method: bool,
                 owner: type | None):
        self.file, self.fn, self.loop_line, self.axes = file, fn, loop_line, axes
        self.out, self.seen, self.depth, self.owner = out, seen, depth, owner
        self.lines = source_lines(file)
        self.derived = _Derived(given)
        self.derived.looping, self.derived.where, self.derived.counted = set(), {}, set()
        self.loop_end = loop_line
        self.me = fn.args.args[0].arg if fn.args.args and method else ""

    def add(self, node: ast.AST, what: str) -> None:
        value = _value(self.file, self.lines, node, what)
        self.out.setdefault((value.file, value.line), value)

    def found(self, stmt: ast.stmt) -> None:
        """The uses in ``stmt`` (an ``if``'s or ``while``'s test only), and in the helpers it
        calls."""
        derived, axes, me = self.derived, self.axes, self.me
        for node, what in _uses(stmt, derived, axes, me):
            self.add(node, what)
        if self.depth < _HELPER_DEPTH:
            for helper, names, is_method in _helper_calls(self.file, self.fn, stmt, derived,
                                                          axes, me, self.owner):
                if (helper, frozenset(names)) not in self.seen:
                    self.seen.add((helper, frozenset(names)))
                    _read(*helper, axes, True, names, self.out, self.seen, self.depth + 1,
                          is_method, self.owner)

    def _loop_statement(self, stmt: ast.stmt) -> None:
        """The loop statement itself: its chunk step, and the lists it appends to."""
        derived = self.derived
        self.loop_end = stmt.end_lineno or stmt.lineno
        derived.counted |= appended_names(stmt)     # after it: one per iteration
        step = _chunk_step(stmt, derived, self.axes, self.me)
        if step is not None:
            bound = derived.where.get(step.id) if isinstance(step, ast.Name) else None
            if bound is not None:
                self.add(bound, f"computes the chunk size {step.id} from")
            self.add(step, "sets the chunk size from")

    def walk(self, body: list[ast.stmt]) -> bool:
        """Follow ``body`` up to the loop statement; ``True`` once it is reached."""
        for stmt in body:
            end = stmt.end_lineno or stmt.lineno
            if stmt.lineno >= self.loop_line:
                if stmt.lineno == self.loop_line:
                    self._loop_statement(stmt)
                return True
            if isinstance(stmt, (ast.For, ast.While)):
                if end >= self.loop_line:            # the loop is nested in this one
                    if isinstance(stmt, ast.For):
                        self.derived.looping |= {n.id for n in ast.walk(stmt.target)
                                                 if isinstance(n, ast.Name)}
                    return self.walk(stmt.body)
                continue
            if isinstance(stmt, _DEFINITIONS):
                continue
            self.found(stmt)
            if isinstance(stmt, ast.If):
                if self.walk(stmt.body) or self.walk(stmt.orelse):
                    return True
            elif isinstance(stmt, (ast.With, ast.Try)):
                if self.walk(stmt.body):
                    return True
            else:
                _bind(stmt, self.derived, self.axes, self.me)
        return False

    def rest(self, body: list[ast.stmt]) -> None:
        """Follow the statements of ``body`` after the loop (those holding it: into them)."""
        for stmt in body:
            end = stmt.end_lineno or stmt.lineno
            if end <= self.loop_end or isinstance(stmt, _DEFINITIONS):
                continue
            if stmt.lineno > self.loop_end and isinstance(stmt, (ast.If, ast.While)):
                self.found(stmt)
            blocks = [getattr(stmt, k, None) for k in ("body", "orelse", "finalbody")] + \
                [h.body for h in getattr(stmt, "handlers", [])]
            if isinstance(stmt, (ast.If, ast.While, ast.For, ast.With, ast.Try)):
                for block in blocks:
                    if block:
                        self.rest(block)
                continue
            self.found(stmt)
            _bind(stmt, self.derived, self.axes, self.me)


#: statements that define rather than run: their bodies are not the function's steps
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _helper_calls(file: str, fn: ast.FunctionDef, stmt: ast.stmt, derived: set[str], axes,
                  me: str, owner: type | None) -> list[tuple[tuple[str, int], set[str], bool]]:
    """The helpers ``stmt`` calls (in an ``if``'s or ``while``'s test only: its blocks are
    statements of their own) whose source can be read: each as its file and ``def`` line, the
    names of its parameters passed a value of the length, and whether it is a method."""
    roots = [stmt.test] if isinstance(stmt, (ast.If, ast.While)) else [stmt]
    calls = []
    for node in (n for r in roots for n in ast.walk(r)):
        if not (isinstance(node, ast.Call) and _plain_call(node, me)):
            continue
        where = _callee(file, fn, node, me, owner)
        helper = None if where is None else function_at(*where)
        if helper is None:
            continue
        is_method = isinstance(node.func, ast.Attribute)
        params = [a.arg for a in (*helper.args.posonlyargs, *helper.args.args)]
        params = params[1:] if is_method else params
        names = {p for p, a in zip(params, node.args)
                 if not isinstance(a, ast.Starred) and _derives(a, derived, axes, me)}
        names |= {k.arg for k in node.keywords
                  if k.arg is not None and _derives(k.value, derived, axes, me)}
        calls.append((where, names, is_method))
    return calls


def _callee(file: str, fn: ast.FunctionDef, call: ast.Call, me: str,
            owner: type | None) -> tuple[str, int] | None:
    """The file and ``def`` line of the function ``call`` calls: a name of the module that
    defines ``fn``, or a method (``self.helper(…)``) of ``owner`` where ``fn`` is one of its
    methods (a subclass's override is the one that runs), else of the class holding ``fn``;
    ``None`` where it is no Python function of the user's code (a builtin, ``math``, torch, a
    library)."""
    scope = _module_of(file)
    if scope is None:
        return None
    f = call.func
    if isinstance(f, ast.Name):
        obj = vars(scope).get(f.id)
    elif isinstance(f, ast.Attribute) and me and f.value.id == me:
        name = _class_of(file, fn)
        cls = owner if owner is not None and name in {c.__name__ for c in owner.__mro__} \
            else vars(scope).get(name) if name else None
        obj = inspect.getattr_static(cls, f.attr, None) if isinstance(cls, type) else None
        obj = getattr(obj, "__func__", obj)         # a staticmethod or classmethod
    else:
        return None
    try:
        obj = inspect.unwrap(obj)
    except ValueError:
        return None
    if not inspect.isfunction(obj) or obj.__name__ == "<lambda>":
        return None
    code = obj.__code__
    if real_path(code.co_filename).startswith(library_roots()):
        return None
    return _def_line(code.co_filename, obj.__name__, code.co_firstlineno)


#: imported modules by the real path of their source, filled as ``_module_of`` looks
_MODULES: dict = {}


def _module_of(file: str):
    """The imported module whose source is ``file`` (``None``: none is)."""
    want = real_path(file)
    module = _MODULES.get(want)
    if module is not None and sys.modules.get(module.__name__) is module:
        return module
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if isinstance(source, str):
            _MODULES[real_path(source)] = module
    return _MODULES.get(want)


def _class_of(file: str, fn: ast.FunctionDef) -> str:
    """The name of the top-level class of ``file`` whose body defines ``fn`` ("" for none)."""
    tree = parsed(file)
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.ClassDef) and fn in node.body:
            return node.name
    return ""


@functools.lru_cache(maxsize=256)
def _def_line(file: str, name: str, first: int) -> tuple[str, int] | None:
    """``file`` and the ``def`` line of the function ``name`` whose code starts at ``first``
    (its first decorator's line, where it has decorators)."""
    tree = parsed(file)
    if tree is None:
        return None
    defs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name == name and n.lineno >= first]
    return (file, min(defs, key=lambda n: n.lineno).lineno) if defs else None


def _value(file: str, lines: tuple[str, ...], node, what: str) -> LengthValue:
    """The use at ``node`` (or at the line ``node``)."""
    line = node if isinstance(node, int) else node.lineno
    code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return LengthValue(file, line, code, what)


def describe(values: list[LengthValue]) -> str:
    """The uses in words, for a note or a refusal ("" for none)."""
    return "; ".join(v.describe() for v in values)


__all__ = ["LengthValue", "length_values", "describe"]
