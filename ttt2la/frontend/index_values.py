"""Python values a loop derives from its index by a step: the same on every traced iteration,
other ones later.

The traces see a loop's first few iterations only. A value the code computes from the loop
index by a comparison, ``%``, ``//`` or a clamp (``lr = 0.1 if j < 10 else 0.01``,
``if j % R == 0: W = 0``, ``keep = float(j % R != 0)``) can be the same in every traced iteration
and change after them, and the rolled-up body would run every chunk with the traced value: a
wrong answer at longer sequences that no trace can show. So the loop's source is read
(``loop_source``): the index variables are followed through Python arithmetic, and the first
such step that reaches a condition or a tensor is refused, naming its line and the variable.
Positions are left alone (slice bounds, ``narrow``/``select``/``slice`` arguments, indices), and
so are tests of the first iteration (against 0, 1 or the loop's start or step) and of the last
(against a size: the length, the number of chunks): the traces see both ends.
"""
from __future__ import annotations

import ast
import functools
import linecache

from ..errors import UnsupportedTTTError
from ..ir import SourceLoc
from .index_flow import POSITION_CALLS, Finding, Index, IndexFlow
from .loop_source import LoopSource, appended_names, assignments, call_name, loop_source
from .loops import LoopSite


def index_names(src: LoopSource) -> set[str]:
    """The loop's index variables (the lengths of lists it grows are read as indices too, by
    ``IndexFlow``): ``range`` targets (in ``enumerate``, ``zip``, ``reversed``),
    ``enumerate`` counters, targets the body slices with, and counters started at a number
    before the loop and stepped by a number in it (``n += C``; a ``while`` loop's included)."""
    stmt, found = src.stmt, set()
    if isinstance(stmt, ast.For):
        found |= _range_targets(stmt.target, stmt.iter)
        found |= {n for n in _target_names(stmt.target) if n in _sliced_with(stmt)}
    started = {name for fn in src.functions for name, v in assignments(fn)
               if isinstance(v, ast.Constant) and type(v.value) in (int, float)}
    for node in ast.walk(stmt):
        if isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Add, ast.Sub)) \
                and isinstance(node.target, ast.Name) and node.target.id in started \
                and src.is_number(node.value):
            found.add(node.target.id)
    return found


def _target_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _range_targets(target: ast.expr, it: ast.expr) -> set[str]:
    if not isinstance(it, ast.Call):
        return set()
    name = call_name(it)
    if name == "range" and isinstance(target, ast.Name):
        return {target.id}
    if name == "reversed" and it.args:
        return _range_targets(target, it.args[0])
    if isinstance(target, (ast.Tuple, ast.List)) and name == "enumerate" and it.args \
            and len(target.elts) == 2:
        first = {target.elts[0].id} if isinstance(target.elts[0], ast.Name) else set()
        return first | _range_targets(target.elts[1], it.args[0])
    if isinstance(target, (ast.Tuple, ast.List)) and name == "zip" \
            and len(target.elts) == len(it.args):
        return {n for t, a in zip(target.elts, it.args) for n in _range_targets(t, a)}
    return set()


def _sliced_with(stmt: ast.AST) -> set[str]:
    """Names read in a slice's bounds (``k[:, s:e]``), an index beside other axes
    (``x[:, t]``) or a position call's arguments inside ``stmt``: positions, where a lookup
    ``d[key]`` is none."""
    out = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Slice):
            out |= {n for part in (node.lower, node.upper, node.step) if part is not None
                    for n in _target_names(part)}
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
            out |= {n for e in node.slice.elts if not isinstance(e, ast.Slice)
                    for n in _target_names(e)}
        elif isinstance(node, ast.Call) and call_name(node) in POSITION_CALLS:
            out |= {n for a in node.args for n in _target_names(a)}
    return out


def index_step(loop: LoopSite, ran: frozenset[int] | None = None) -> Finding | None:
    """The first value of ``loop``'s index made by a step (``Step``) that reaches a condition
    or a tensor, in source order; ``None`` when there is none or the source cannot be read.
    ``ran``: the lines of the loop body the traces ran ops at (a branch of the configuration
    the traces never took is not read)."""
    read = _index_reading(loop)
    if read is None:
        return None
    src, roots, grown = read
    return IndexFlow(src, {name: Index(name) for name in roots}, ran, grown).run()


@functools.lru_cache(maxsize=256)
def _index_reading(loop: LoopSite) -> tuple[LoopSource, set[str], frozenset[str]] | None:
    """``loop``'s source, its index names and the lists it grows (``None``: nothing to follow):
    read once per loop, as ``parsed`` reads a file once, not at each of a conversion's traces."""
    src = loop_source(loop)
    if src is None or _fixed_count(src.stmt):
        return None
    roots, grown = index_names(src), frozenset(appended_names(src.stmt))
    return (src, roots, grown) if roots or grown else None


def _fixed_count(stmt: ast.AST) -> bool:
    """A ``for`` over ``range`` of numbers written out (``range(3)``): it runs as often at every
    length, so the traces run all its iterations."""
    header = getattr(stmt, "iter", None)
    return isinstance(header, ast.Call) and call_name(header) == "range" and \
        all(isinstance(a, ast.Constant) for a in header.args)


def _code(file: str, line: int) -> str:
    return linecache.getline(file, line).strip()


def _variable(root: str) -> str:
    """The index ``root`` in words: a loop variable, or the length of a list the loop grows."""
    return f"the iteration count `{root}`" if root.startswith("len(") else \
        f"the loop variable `{root}`"


def index_step_message(found: Finding, loop: LoopSite) -> str:
    """The refusal for ``found``: the line that makes the step and the one that uses it, the
    index variable, why the traces cannot run it, and the per-token tensor that converts."""
    step, file = found.step, loop.file
    origin = SourceLoc(file, step.origin.lineno, loop.function, _code(file, step.origin.lineno))
    use = SourceLoc(file, found.line, loop.function, _code(file, found.line))
    expr = ast.unparse(step.origin)
    if found.test:
        what = (f"the {found.test} at {use.at()} tests {_variable(step.root)} "
                f"through `{expr}`" + ("" if use.line == origin.line else f", computed at {origin.at()}"))
    else:
        what = (f"it computes `{expr}` from {_variable(step.root)} at {origin.at()}, "
                f"{found.use}" + ("" if use.line == origin.line else f" at {use.at()}"))
    return (f"the loop at {loop.src}: {what}. A value of the index made "
            "by a comparison, `%`, `//` or a clamp can be the same in every iteration ttt2la "
            "traces (the first few chunks) and change in later ones, so one traced body cannot "
            "run every chunk. Compute it before the loop as a tensor of one value per token, "
            "from the token positions (for a reset every R chunks of C tokens, "
            "`keep = (torch.arange(T, device=x.device) // C % R != 0).to(x.dtype)`), and read it "
            "in the loop like the keys and values: the chunk's value as `keep[s:e].amax()`, a "
            "token's as `keep[t]`, so that a reset is a product (`S = keep[s:e].amax() * S`) "
            "rather than an `if`. For an update every C tokens, loop over chunks of C tokens "
            "(`for s in range(0, T, C)`) and update at the end of each")


def refuse_index_steps(loop: LoopSite, ran: frozenset[int] | None = None) -> None:
    """Raise ``UnsupportedTTTError`` when the loop computes a value of its index by a step that
    reaches a condition or a tensor (``index_step``)."""
    found = index_step(loop, ran)
    if found is not None:
        raise UnsupportedTTTError(index_step_message(found, loop))


__all__ = ["index_names", "index_step", "index_step_message", "refuse_index_steps"]
