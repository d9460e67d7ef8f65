"""Where a loop's index values flow in its body: through Python arithmetic into new names, into
positions, or into a condition or a tensor.

``IndexFlow`` walks the loop body's statements in source order, giving every expression a kind:
``Index`` (moves with the index in every iteration: ``i * C``, ``min(s + C, T)``), ``Step`` (made
from the index by a comparison, ``%``, ``//`` or a clamp, so it can stay put over the traced
iterations and move later), or nothing (a tensor, a constant, a position read). A ``Step`` that
reaches an ``if``/``while`` test, an operand beside a tensor, a call's argument, a range or a
write is a ``Finding``; one used as a position is not (what a slice picks is traced).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from .loop_source import LoopSource, assignments, call_name, is_scalar_call

#: calls whose arguments are positions: what they pick is in the trace, whatever the index
POSITION_CALLS = frozenset({"narrow", "select", "slice", "index_select"})
#: operators that make a step of an index: the same value over runs of iterations
STEP_OPS = (ast.Mod, ast.FloorDiv, ast.BitAnd, ast.BitOr, ast.BitXor, ast.RShift)
#: calls that only show a value (logging)
_SHOWN = frozenset({"print", "debug", "info", "warning", "warn"})


@dataclass(frozen=True)
class Index:
    """A Python value that moves with the loop index ``root`` in every iteration."""

    root: str


@dataclass(frozen=True)
class Step:
    """A Python value of the loop index ``root`` that can stay the same over iterations and
    change later: the expression ``origin`` makes it."""

    root: str
    origin: ast.expr


@dataclass(frozen=True)
class Finding:
    """A ``Step`` reaching what a trace keeps as a constant of each iteration: ``use`` says how,
    in words, at ``line``."""

    step: Step
    use: str
    line: int
    test: str = ""      # "`if`" or "`while`" where a test reads it


class IndexFlow:
    """The kinds of the values in one loop body, from its index variables (``taint``)."""

    def __init__(self, src: LoopSource, taint: dict[str, Index | Step],
                 ran: frozenset[int] | None = None, grown: frozenset[str] = frozenset()):
        self.src, self.taint, self.ran, self.grown = src, dict(taint), ran, grown
        self.found: Finding | None = None
        self.aliases = {}
        for fn in src.functions:
            for name, value in assignments(fn):
                self.aliases.setdefault(name, []).append(value)
        self.loop_range = _first_range(src.stmt)

    def run(self) -> Finding | None:
        """Walk the body until the kinds of its names settle (a value an iteration binds late
        is read early by the next), and return the first finding of the last walk."""
        for _ in range(4):
            before, self.found = dict(self.taint), None
            self.block(self.src.stmt.body)
            if self.taint == before:
                break
        return self.found

    def find(self, step: Step, use: str, line: int, test: str = "") -> None:
        if self.found is None:
            self.found = Finding(step, use, line, test)

    # -- statements -------------------------------------------------------------------------

    def block(self, stmts: list[ast.stmt]) -> None:
        for s in stmts:
            self.statement(s)

    def statement(self, s: ast.stmt) -> None:
        """Give every expression of ``s`` its kind, bind the names it assigns, and record a
        step that reaches a test, a write or a return."""
        if isinstance(s, ast.Assign):
            for t in s.targets:
                self.bind(t, s.value, s.lineno)
        elif isinstance(s, (ast.AnnAssign, ast.AugAssign)) and s.value is not None:
            value = ast.BinOp(ast.Name(s.target.id, ast.Load()), s.op, s.value) \
                if isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) else s.value
            ast.copy_location(value, s)
            self.bind(s.target, value, s.lineno)
        elif isinstance(s, ast.Expr):
            self.kind(s.value)
        elif isinstance(s, ast.Return) and s.value is not None:
            self.reaches(self.kind(s.value), "which the loop returns", s.lineno)
        elif isinstance(s, (ast.If, ast.While)):
            what = "`if`" if isinstance(s, ast.If) else "`while`"
            test = self.kind(s.test)
            if isinstance(test, Step):
                self.find(test, f"which the {what} tests", s.lineno, what)
            for arm in self.arms(s, test):
                self.block(arm)
        elif isinstance(s, ast.For):
            self.inner_loop(s)
        elif isinstance(s, (ast.With, ast.Try)):
            for item in getattr(s, "items", []):
                self.kind(item.context_expr)
            for part in ("body", "handlers", "orelse", "finalbody"):
                for child in getattr(s, part, []):
                    self.block(child.body if isinstance(child, ast.ExceptHandler) else [child])

    def arms(self, s: ast.If | ast.While, test) -> list[list[ast.stmt]]:
        """The arms of ``s`` to walk: both, but where its test reads no index value (a switch
        of the configuration) and the traces ran ops in one arm only, that one."""
        arms = [s.body, s.orelse]
        if test is None and self.ran is not None:
            live = [arm for arm in arms if arm and any(
                line in self.ran for line in range(arm[0].lineno, arm[-1].end_lineno + 1))]
            if len(live) == 1:
                return live
        return arms

    def reaches(self, kind, use: str, line: int) -> None:
        if isinstance(kind, Step):
            self.find(kind, use, line)

    def bind(self, target: ast.expr, value: ast.expr, line: int) -> None:
        """Assign ``value``'s kind to the names of ``target`` (elementwise for tuples); a step
        written into a tensor or an attribute is a finding."""
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v, line)
            return
        kind = self.kind(value)
        if isinstance(target, ast.Name):
            if kind is not None and not isinstance(self.taint.get(target.id), Step):
                self.taint[target.id] = kind
        elif isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                if isinstance(t, ast.Name) and kind is not None:
                    self.taint.setdefault(t.id, kind)
        elif isinstance(target, (ast.Subscript, ast.Attribute)):
            self.kind(target.value)
            self.reaches(kind, "which is written into a tensor", line)

    def inner_loop(self, s: ast.For) -> None:
        """A loop inside the body: a ``range`` over the index's values walks them (its target
        moves with the index), over a step is a finding; then its body."""
        if isinstance(s.iter, ast.Call) and call_name(s.iter) == "range":
            kinds = [self.kind(a) for a in s.iter.args]
            for k in kinds:
                self.reaches(k, "which bounds the `range` of a loop", s.lineno)
            moving = next((k for k in kinds if isinstance(k, Index)), None)
            if moving is not None and isinstance(s.target, ast.Name):
                self.taint.setdefault(s.target.id, moving)
        else:
            self.kind(s.iter)
        self.block(s.body)

    # -- expressions ------------------------------------------------------------------------

    def kind(self, e: ast.expr | None):
        """``Index``, ``Step`` or ``None`` for expression ``e``; steps that reach a tensor or a
        call inside ``e`` are recorded on the way."""
        if isinstance(e, ast.Name):
            return self.taint.get(e.id)
        if isinstance(e, ast.BinOp):
            return self.binop(e)
        if isinstance(e, ast.UnaryOp):
            k = self.kind(e.operand)
            return None if isinstance(e.op, ast.Not) and isinstance(k, Index) else k
        if isinstance(e, ast.BoolOp):
            return _first_step([self.kind(v) for v in e.values])    # an index's truth: j != 0
        if isinstance(e, ast.Compare):
            return self.compare(e)
        if isinstance(e, ast.IfExp):
            test = self.kind(e.test)
            values = [self.kind(e.body), self.kind(e.orelse)]
            return test if isinstance(test, Step) else _first(values)
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, (ast.Subscript, ast.Attribute, ast.Starred)):
            k = self.kind(e.value)                     # a position read picks a traced value
            return k if isinstance(k, Step) else None
        if isinstance(e, (ast.Tuple, ast.List, ast.Set)):
            return _first([self.kind(x) for x in e.elts])
        if isinstance(e, ast.Dict):
            return _first([self.kind(x) for x in e.values])
        if isinstance(e, ast.NamedExpr):
            self.bind(e.target, e.value, e.lineno)
            return self.taint.get(e.target.id)
        return None

    def binop(self, e: ast.BinOp):
        """An arithmetic op: a step op of an index makes a ``Step`` (``s // C`` by the loop's
        own step is the counter again); a step beside a tensor is a finding; ``@`` reads
        tensors only."""
        left, right = self.kind(e.left), self.kind(e.right)
        if isinstance(e.op, ast.MatMult):
            for k in (left, right):
                self.reaches(k, "which enters a matrix product", e.lineno)
            return None
        step = _first_step([left, right])
        if step is None and isinstance(e.op, STEP_OPS) and (left or right):
            if isinstance(e.op, ast.FloorDiv) and isinstance(left, Index) and right is None \
                    and self.same(e.right, _arg(self.loop_range, 2)):
                return left
            return Step((left or right).root, e)
        if step is not None:
            for k, other in ((left, e.right), (right, e.left)):
                if k is step and not self.src.is_number(other):
                    self.find(step, "which enters tensor arithmetic", e.lineno)
            return step
        return left or right

    def compare(self, e: ast.Compare):
        """A comparison of an index is a ``Step`` unless it tests the first iteration (against
        0, 1, the loop's start or step) or the last (against a size); two index values compare
        their distance, the same in every iteration."""
        sides = [e.left] + list(e.comparators)
        kinds = [self.kind(x) for x in sides]
        step = _first_step(kinds)
        if step is not None or not any(kinds):
            return step
        root = next(k for k in kinds if k).root
        for (a, ka), op, (b, kb) in zip(zip(sides, kinds), e.ops, zip(sides[1:], kinds[1:])):
            if isinstance(op, (ast.Is, ast.IsNot)):
                continue                                  # `x is None`: no number compared
            if isinstance(op, (ast.In, ast.NotIn)) and (ka or kb):
                return Step(root, e)
            other = b if ka else a
            if bool(ka) != bool(kb) and self.src.is_number(other) and not self.boundary(other):
                return Step(root, e)              # (against a tensor: a traced mask)
        return None

    def call(self, e: ast.Call):
        """A call: positions take any index; the length of a list the loop grows (``grown``)
        counts its iterations, an index; scalar functions pass an index on, ``min``/``max``
        against other than a size and rounding make a ``Step``; any other call taking a step
        (a tensor op, a helper, ``range``) is a finding."""
        name = call_name(e)
        if isinstance(e.func, ast.Attribute):
            self.kind(e.func.value)
        if name in POSITION_CALLS:
            return None
        if name == "len" and len(e.args) == 1 and isinstance(e.args[0], ast.Name) \
                and e.args[0].id in self.grown:
            return Index(f"len({e.args[0].id})")      # a list grown once per iteration
        args = list(e.args) + [kw.value for kw in e.keywords]
        kinds = [self.kind(a) for a in args]
        if not is_scalar_call(e):
            if name not in _SHOWN:
                for k in kinds:
                    self.reaches(k, f"which is passed to `{ast.unparse(e.func)}`", e.lineno)
            return None
        step, index = _first_step(kinds), _first(kinds)
        if step is not None or index is None:
            return step
        if name in ("min", "max"):
            others = [a for a, k in zip(args, kinds) if k is None]
            return index if all(self.boundary(a) for a in others) else Step(index.root, e)
        if name in ("round", "floor", "ceil", "trunc") or (name == "int" and _fractional(args)):
            return Step(index.root, e)
        return None if name == "bool" else index

    # -- what an index is compared with -----------------------------------------------------

    def boundary(self, other: ast.expr) -> bool:
        """``other`` marks an end of the loop: 0 or 1, the loop's start or step (the first
        iteration), or a size (the last)."""
        if isinstance(other, ast.UnaryOp) and isinstance(other.op, ast.USub):
            other = other.operand
        if isinstance(other, ast.Constant) and other.value in (0, 1):
            return True
        return self.src.is_size(other) or self.same(other, _arg(self.loop_range, 0)) \
            or self.same(other, _arg(self.loop_range, 2))

    def same(self, a: ast.expr | None, b: ast.expr | None) -> bool:
        """``a`` and ``b`` are the same expression, a name read as the one value the code binds
        it to (``C = self.chunk`` then ``range(0, T, self.chunk)``)."""
        if a is None or b is None:
            return False
        forms = [{ast.dump(x)} | {ast.dump(v) for v in self._alias(x)} for x in (a, b)]
        return bool(forms[0] & forms[1])

    def _alias(self, x: ast.expr) -> list[ast.expr]:
        values = self.aliases.get(x.id, []) if isinstance(x, ast.Name) else []
        return values if len(values) == 1 else []


def _first(kinds: list):
    """The first ``Step`` of ``kinds``, else the first ``Index``, else ``None``."""
    return _first_step(kinds) or next((k for k in kinds if k is not None), None)


def _first_step(kinds: list) -> Step | None:
    return next((k for k in kinds if isinstance(k, Step)), None)


def _first_range(stmt: ast.AST) -> ast.Call | None:
    """The ``range(...)`` call of a ``for`` statement's header (inside ``enumerate``, ``zip``,
    ``reversed`` too), or ``None``."""
    header = getattr(stmt, "iter", None)
    return next((n for n in ast.walk(header) if isinstance(n, ast.Call)
                 and call_name(n) == "range"), None) if header is not None else None


def _arg(call: ast.Call | None, i: int) -> ast.expr | None:
    """Argument ``i`` of ``range(start, stop, step)`` (a one-argument range starts at 0 with
    step 1: ``None`` for both)."""
    if call is None or len(call.args) < 2:
        return None
    return call.args[i] if i < len(call.args) else None


def _fractional(args: list[ast.expr]) -> bool:
    """``int(...)`` of a true division or a float: a floor, not the integer it was."""
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)
               or isinstance(n, ast.Constant) and isinstance(n.value, float)
               for a in args for n in ast.walk(a))


__all__ = ["Finding", "Index", "IndexFlow", "Step", "POSITION_CALLS"]
