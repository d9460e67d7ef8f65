"""A loop's statement as the user wrote it, and what its names hold.

The traces show the numbers of the iterations they ran; what the code computes from its loop
index on later iterations only its source says (``index_values``). This module reads the loop's
``for``/``while`` statement and the functions around it with ``ast``: which names are the loop's
index (a ``range`` target, an ``enumerate`` counter, a counter stepped in the body), which hold
sizes (the length, the number of chunks: what a test of the last iteration compares with), and
which hold Python numbers rather than tensors.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from .loops import LoopSite
from .user_code import parsed

#: calls whose result is a size: ``len(xs)``, ``x.size(1)``, ``x.numel()``, ``x.dim()``
SIZE_CALLS = frozenset({"len", "size", "numel", "dim"})
#: builtins and ``math`` functions of Python numbers that return Python numbers
SCALAR_CALLS = frozenset({"min", "max", "int", "float", "bool", "abs", "round", "pow", "divmod",
                          "floor", "ceil", "trunc", "sqrt", "exp", "log", "log2", "cos", "sin"})


def call_name(call: ast.Call) -> str:
    """The called function's last name: ``min`` for ``min(...)``, ``narrow`` for
    ``torch.narrow(...)`` and ``x.narrow(...)``."""
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def is_scalar_call(call: ast.Call) -> bool:
    """A builtin or ``math`` function of Python numbers (``min``, ``float``, ``math.floor``)."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id in SCALAR_CALLS
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
        and f.value.id == "math" and f.attr in SCALAR_CALLS


def appended_names(loop: ast.AST) -> set[str]:
    """Names of the lists ``loop`` grows (``outs.append(o)``, ``outs.extend(…)``,
    ``outs += [o]``): their length counts its iterations."""
    out = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("append", "extend", "insert") \
                and isinstance(node.func.value, ast.Name):
            out.add(node.func.value.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) \
                and isinstance(node.target, ast.Name) and isinstance(node.value, ast.List):
            out.add(node.target.id)
    return out


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _bound(target: ast.expr, value: ast.expr) -> list[tuple[str, ast.expr]]:
    """``(name, value)`` for each name an assignment binds, elementwise where both sides are
    tuples (``s, e = i * C, (i + 1) * C``), else every name to the whole value."""
    if isinstance(target, ast.Name):
        return [(target.id, value)]
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            return [p for t, v in zip(target.elts, value.elts) for p in _bound(t, v)]
        return [p for t in target.elts for p in _bound(t, value)]
    return []


def assignments(scope: ast.AST) -> list[tuple[str, ast.expr]]:
    """Every ``(name, value)`` an assignment in ``scope`` binds (``x += y`` binds ``x`` to
    ``x + y``), nested functions left out."""
    out = []
    for node in _walk_scope(scope):
        if isinstance(node, ast.Assign):
            out.extend(p for t in node.targets for p in _bound(t, node.value))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            out.extend(_bound(node.target, node.value))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            out.append((node.target.id, ast.BinOp(ast.Name(node.target.id, ast.Load()),
                                                  node.op, node.value)))
    return out


def _walk_scope(scope: ast.AST):
    """``ast.walk`` over ``scope`` that does not enter functions defined inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


@dataclass
class LoopSource:
    """The loop's statement, the functions around it (innermost first) and what their names
    hold; ``None`` from ``loop_source`` where the file cannot be read."""

    file: str
    stmt: ast.For | ast.While
    functions: list[ast.FunctionDef]
    sizes: set[str] = field(default_factory=set)      # names that hold a size
    tensors: set[str] = field(default_factory=set)    # names that may hold a tensor

    def is_size(self, expr: ast.expr) -> bool:
        """``expr`` reads a size: ``.shape``, ``len()``, ``.size()`` or a name that holds one."""
        for n in ast.walk(expr):
            if isinstance(n, ast.Attribute) and n.attr == "shape":
                return True
            if isinstance(n, ast.Call) and call_name(n) in SIZE_CALLS:
                return True
            if isinstance(n, ast.Name) and n.id in self.sizes:
                return True
        return False

    def is_number(self, e: ast.expr) -> bool:
        """``e`` computes a Python number (or may: an attribute, a parameter), not a tensor:
        sizes, constants, names bound to numbers, scalar functions and arithmetic of them."""
        if isinstance(e, ast.Constant):
            return True
        if isinstance(e, ast.Name):
            return e.id not in self.tensors
        if isinstance(e, ast.Attribute):
            return e.attr == "shape" or (isinstance(e.value, ast.Name) and e.value.id == "self") \
                or self.is_number(e.value)
        if isinstance(e, ast.Subscript):
            return isinstance(e.value, ast.Attribute) and e.value.attr == "shape"
        if isinstance(e, ast.Call):
            return call_name(e) in SIZE_CALLS or \
                (is_scalar_call(e) and all(self.is_number(a) for a in e.args))
        if isinstance(e, ast.BinOp):
            return not isinstance(e.op, ast.MatMult) and self.is_number(e.left) \
                and self.is_number(e.right)
        if isinstance(e, ast.UnaryOp):
            return self.is_number(e.operand)
        if isinstance(e, (ast.BoolOp, ast.Compare)):
            return all(self.is_number(x) for x in ast.iter_child_nodes(e) if isinstance(x, ast.expr))
        if isinstance(e, ast.IfExp):
            return self.is_number(e.body) and self.is_number(e.orelse)
        return False


def loop_source(loop: LoopSite) -> LoopSource | None:
    """The ``for``/``while`` statement at ``loop``'s line, the functions it is written in, the
    names that hold sizes and those that may hold tensors."""
    tree = parsed(loop.file)
    if tree is None:
        return None
    chain: list[ast.AST] = []

    def find(node, outer):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.For, ast.While)) and child.lineno == loop.line:
                return child, outer
            inner = [child] + outer if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else outer
            got = find(child, inner)
            if got:
                return got
        return None

    got = find(tree, chain)
    if got is None:
        return None
    src = LoopSource(loop.file, got[0], got[1])
    bound = [p for fn in src.functions for p in assignments(fn)]
    _classify(src, bound)
    return src


def _used_as_tensors(functions: list[ast.AST]) -> set[str]:
    """Names the code slices (``x[:, s:e]``), multiplies by ``@`` or calls a method of
    (``x.transpose(1, 2)``; ``x.size()`` and ``x.shape`` left out): tensors, whatever they
    were bound to."""
    out = set()
    for fn in functions:
        for n in _walk_scope(fn):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name):
                out.add(n.value.id)
            elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult):
                out |= {o.id for o in (n.left, n.right) if isinstance(o, ast.Name)}
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and isinstance(n.func.value, ast.Name) and n.func.attr not in SIZE_CALLS \
                    and n.func.value.id not in ("self", "math", "torch", "F", "nn"):
                out.add(n.func.value.id)
    return out


def _classify(src: LoopSource, bound: list[tuple[str, ast.expr]]) -> None:
    """Fill ``src.sizes`` (names bound to a size, read by the loop's ``range``, or parameters
    without a number as default: a helper's ``L``) and ``src.tensors`` (names bound to anything
    but a number), each to a fixed point."""
    stmt = src.stmt
    header = stmt.iter if isinstance(stmt, ast.For) else stmt.test
    src.sizes |= _names(header)
    src.tensors |= _used_as_tensors(src.functions)
    for fn in src.functions:
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.posonlyargs + fn.args.args) - len(fn.args.defaults)) \
            + list(fn.args.defaults) + list(fn.args.kw_defaults)
        for a, d in zip(args, defaults):
            if a.arg != "self" and not (isinstance(d, ast.Constant) and isinstance(d.value, (int, float))):
                src.sizes.add(a.arg)
    for _ in range(len(bound) + 1):
        before = (len(src.sizes), len(src.tensors))
        for name, value in bound:
            if src.is_size(value) and src.is_number(value):
                src.sizes.add(name)
            if not src.is_number(value):
                src.tensors.add(name)
        if (len(src.sizes), len(src.tensors)) == before:
            break
    src.sizes -= src.tensors


__all__ = ["LoopSource", "loop_source", "assignments", "call_name", "is_scalar_call",
           "appended_names"]
