"""Names from the user's source: what a state, a stream or an invariant is called in the code.

The report and the converted program name each carried state, stream and invariant after the
statement that assigns it, read from the traced node's source frames: ``W = W - g`` gives ``W``,
``state["W"] = ...`` and dict literals give their keys, a tuple assignment its elements, a line
that slices several streams the variables it indexes. A helper called for several weights gives
the same name to each, so the caller's frame names them instead.
"""
from __future__ import annotations

import ast
import functools
import linecache

import torch
import torch.fx

from ..ir import SRC, SourceLoc
from .capture import FRAMES
from .user_code import is_users


def _statement(src: SourceLoc | None) -> ast.stmt | None:
    """The statement that ``src``'s line is part of: the simple statement of the file that
    holds the line (one written over several lines included), else the line itself parsed (a
    compound statement's header without its body: ``for ...:``)."""
    return _statement_at(src)[0]


def _statement_at(src: SourceLoc | None) -> tuple[ast.stmt | None, int | None]:
    """``_statement(src)`` and the line it starts on."""
    if src is None:
        return None, None
    held = [st for st in _simple_statements(src.file)
            if st.lineno <= src.line <= (st.end_lineno or st.lineno)]
    if held:
        stmt = max(held, key=lambda st: st.lineno)
        return stmt, stmt.lineno
    if not src.code:
        return None, None
    try:
        tree = ast.parse(src.code.strip().rstrip(":"))
    except SyntaxError:
        return None, None
    return (tree.body[0], src.line) if tree.body else (None, None)


_SIMPLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)


@functools.lru_cache(maxsize=256)
def _statements(file: str) -> tuple[ast.stmt, ...]:
    """Every statement of a source file (none when it cannot be read or parsed)."""
    lines = linecache.getlines(file)
    try:
        tree = ast.parse("".join(lines)) if lines else None
    except SyntaxError:
        return ()
    return tuple(n for n in ast.walk(tree) if isinstance(n, ast.stmt)) if tree else ()


@functools.lru_cache(maxsize=256)
def _simple_statements(file: str) -> tuple[ast.stmt, ...]:
    """Every assignment, expression and return statement of a source file."""
    return tuple(n for n in _statements(file) if isinstance(n, _SIMPLE))


def _target_name(target: ast.expr) -> str | None:
    """The name an assignment target gives its value: ``W`` for ``W``, the key for
    ``state["W"]``, the attribute for ``state.W``."""
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant) \
            and isinstance(target.slice.value, str) and target.slice.value.isidentifier():
        return target.slice.value
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _assigned_names(src: SourceLoc | None) -> list[str] | None:
    """The names a line assigns: ``[W]`` for ``W = ...`` (or ``state["W"] = ...``,
    ``state.W = ...``), ``[W, b]`` for ``W, b = ...`` and for ``W = ...; b = ...`` (statements
    a line holds in turn are told apart by their order only, as a tuple's elements are)."""
    stmt, start = _statement_at(src)
    together = [st for st in _simple_statements(src.file) if st.lineno == start] \
        if stmt is not None else []
    if len(together) > 1:
        each = [_names_of(st) for st in together]
        return [n[0] for n in each] if all(n is not None and len(n) == 1 for n in each) \
            else None
    return _names_of(stmt)


def _names_of(stmt: ast.stmt | None) -> list[str] | None:
    """The names one statement assigns (see ``_assigned_names``)."""
    if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        if isinstance(target, ast.Tuple):
            names = [_target_name(e) for e in target.elts]
            return names if names and all(names) else None
        name = _target_name(target)
        return [name] if name else None
    if isinstance(stmt, ast.Expr):
        name = _updated_in_place(stmt.value)
        return [name] if name else None
    return None


def _updated_in_place(call: ast.expr) -> str | None:
    """The variable a chain of in-place method calls updates: ``m`` for ``m.mul_(0.9).add_(g)``
    (every method's name ends in ``_``), else ``None``."""
    seen = False
    while isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
            and call.func.attr.endswith("_") and not call.func.attr.startswith("_"):
        call, seen = call.func.value, True
    return _target_name(call) if seen else None


def _dict_keys(src: SourceLoc | None) -> list[str] | None:
    """The keys of the dict literal a line assigns to one variable: ``state = {"W1": ...,
    "W2": ...}`` or ``dict(W1=..., W2=...)`` (None for any other line)."""
    stmt = _statement(src)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 \
            and isinstance(stmt.targets[0], ast.Name):
        value = stmt.value
        keys = None
        if isinstance(value, ast.Dict) and value.keys:
            keys = [k.value if isinstance(k, ast.Constant) else None for k in value.keys]
        elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                and value.func.id == "dict" and not value.args and value.keywords:
            keys = [kw.arg for kw in value.keywords]
        if keys and all(isinstance(k, str) and k.isidentifier() for k in keys):
            return keys
    return None


def _held_names(src: SourceLoc | None) -> list[str] | None:
    """The names a line assigns, where one variable holds several values by name: the keys
    of a dict literal (``_dict_keys``), else ``_assigned_names``."""
    return _dict_keys(src) or _assigned_names(src)


def keyed_initial_names(initials: list[torch.fx.Node | None]) -> list[str | None]:
    """Each state's key where a dict literal's entries make the initial values (``params =
    {"W": ..., "b": ...}``): the literal's keys in the order it computes its entries, when it
    makes as many of the states as it has keys; None elsewhere."""
    lines: dict[tuple, list[int]] = {}
    for i, n in enumerate(initials):
        src = n.meta.get(SRC) if isinstance(n, torch.fx.Node) else None
        stmt, start = _statement_at(src)
        if stmt is not None:
            lines.setdefault((src.file, start), []).append(i)
    names: list[str | None] = [None] * len(initials)
    present = [n for n in initials if n is not None]
    order = {n: k for k, n in enumerate(present[0].graph.nodes)} if present else {}
    for members in lines.values():
        keys = _dict_keys(initials[members[0]].meta.get(SRC))
        if keys and len(keys) == len(members):
            for i, key in zip(sorted(members, key=lambda i: order.get(initials[i], 0)), keys):
                names[i] = key
    return names


def assigned_name(src: SourceLoc | None) -> str | None:
    names = _assigned_names(src)
    return "_".join(names) if names else None


def assigned_names(src: SourceLoc | None) -> list[str]:
    """Each name a line assigns, in order (``[Wp, W]`` for ``Wp, W = W, W + dW``); none where
    it assigns no plain name."""
    return _assigned_names(src) or []


#: Node meta: the name a loop statement binds a ``split``/``unbind`` piece to (``split_pieces``).
PIECE_NAME = "ttt2la_piece_name"


def loop_targets(src: SourceLoc | None) -> list[str] | None:
    """The names a ``for`` statement's header binds, one per sequence it iterates together:
    ``[qc, kc]`` for ``for qc, kc in zip(q.split(C, 1), k.split(C, 1))``, ``[x_t]`` for
    ``for x_t in x.unbind(1)`` (an ``enumerate`` around either is looked through)."""
    if src is None:
        return None
    held = [st for st in _statements(src.file) if isinstance(st, ast.For)
            and st.lineno <= src.line <= (st.iter.end_lineno or st.lineno)]
    if not held:
        return None
    stmt = max(held, key=lambda st: st.lineno)
    target, seq = stmt.target, stmt.iter
    if isinstance(seq, ast.Call) and isinstance(seq.func, ast.Name) and seq.func.id == "enumerate" \
            and isinstance(target, ast.Tuple) and len(target.elts) == 2 and seq.args:
        target, seq = target.elts[1], seq.args[0]
    zipped = isinstance(seq, ast.Call) and isinstance(seq.func, ast.Name) and seq.func.id == "zip"
    elements = target.elts if zipped and isinstance(target, ast.Tuple) else [target]
    names = [e.id if isinstance(e, ast.Name) else None for e in elements]
    return names if all(names) else None


def stream_name(loc: SourceLoc | None, k: int, n: int) -> str | None:
    """The name of the ``k``-th of ``n`` streams sliced on one line: the sliced tensor's name
    (``q[:, s:e]``) when the line names one per stream, else the name it is assigned to
    (``lr0, lr1, lr2 = (t[:, s:e] for t in lrs)``)."""
    sliced = _sliced_names(loc)
    if n <= len(sliced):
        return sliced[k]
    assigned = _assigned_names(loc) or []
    if n == len(assigned):
        return assigned[k]
    return sliced[k] if k < len(sliced) else assigned_name(loc)


def state_names(outs: list[torch.fx.Node], depth: int, first: list[str | None],
                keyed: list[str | None] | None = None) -> list[str | None]:
    """A name per carried state, from the statement that assigns its new value.

    The innermost frame that assigns a name gives it, unless it gives the same name to
    several states (a helper's ``W = W - g`` called for each weight): those take the next
    frame out that assigns, and where none is left, their name numbered in the order they are
    computed (``w = step(*w)`` -> ``w0, w1``). A state assigned by a tuple (``W, b = step(W, b,
    ...)``) or by a dict literal (``state = {"W": ..., "b": ...}``) takes the name its initial
    value was assigned to when that is one of the line's (``first``), else the element at its
    place when the states that line assigns are as many as its names (their values are
    computed in the line's order). States whose initial values a dict literal makes take its
    keys (``keyed``) where the lines that update them would number them or name them by place.
    """
    keyed = keyed or [None] * len(outs)
    chains = [_assigning_frames(out, depth) for out in outs]
    level, shared = _distinguishing_frames(chains)
    order = {n: k for k, n in enumerate(outs[0].graph.nodes)} if outs else {}
    names: list[str | None] = [None] * len(outs)
    tuples: dict[tuple, list[int]] = {}
    for i, chain in enumerate(chains):
        if level[i] >= len(chain):
            continue
        place, got = chain[level[i]]
        if len(got) == 1:
            names[i] = got[0]
        else:
            tuples.setdefault((*place, got), []).append(i)
    for members in shared.values():
        if len(members) > 1 and _by_key(members, keyed, names):
            continue
        if len(members) > 1 and all(names[i] == names[members[0]] for i in members):
            members.sort(key=lambda i: order.get(outs[i], 0))
            for k, i in enumerate(members):
                names[i] = f"{names[i]}{k}"
    for (_f, _l, got), members in tuples.items():
        members.sort(key=lambda i: order.get(outs[i], 0))
        if _by_key(members, keyed, names):
            continue
        if all(first[i] in got for i in members) and \
                len({first[i] for i in members}) == len(members):
            for i in members:
                names[i] = first[i]
        elif len(members) == len(got):
            for i, name in zip(members, got):
                names[i] = name
        else:
            for i in members:
                names[i] = "_".join(got)
    return names


def _by_key(members: list[int], keyed: list[str | None], names: list[str | None]) -> bool:
    """Name ``members`` by their dict keys when each has one and they differ; whether done."""
    keys = [keyed[i] for i in members]
    if any(k is None for k in keys) or len(set(keys)) != len(keys):
        return False
    for i, key in zip(members, keys):
        names[i] = key
    return True


def _distinguishing_frames(chains: list[list]) -> tuple[list[int], dict[tuple, list[int]]]:
    """Which frame of its chain names each state (an index into ``chains[i]``): the innermost,
    moved out for states that share one name there while every one of them has a frame
    further out; and the states that share a single name at the frames chosen."""
    level = [0] * len(chains)
    while True:
        shared: dict[tuple, list[int]] = {}
        for i, chain in enumerate(chains):
            if level[i] < len(chain) and len(chain[level[i]][1]) == 1:
                place, got = chain[level[i]]
                shared.setdefault((*place, got[0]), []).append(i)
        moved = False
        for members in shared.values():
            if len(members) > 1 and all(level[i] + 1 < len(chains[i]) for i in members):
                for i in members:
                    level[i] += 1
                moved = True
        if not moved:
            return level, shared


def _assigning_frames(out: torch.fx.Node, depth: int) -> list[tuple[tuple, tuple]]:
    """``((file, line), names)`` of the statements that assign ``out``'s value in its frames
    from ``depth`` in, innermost first (``line``: where the statement starts)."""
    frames = out.meta.get(FRAMES, ())[depth:] or ((out.meta.get(SRC),) if SRC in out.meta
                                                  else ())
    outside = [i for i, f in enumerate(frames) if f is not None and not is_users(f.file)]
    if outside:             # the code that called the layer (ttt2la's tracing) names nothing
        frames = frames[outside[-1] + 1:]
    chain = []
    for frame in reversed(frames):
        got = _held_names(frame)
        if got:
            chain.append(((frame.file, _statement_at(frame)[1]), tuple(got)))
    return chain


def _sliced_names(src: SourceLoc | None) -> list[str]:
    """The variables a line reads by indexing, in the order it reads them (left to right, as
    Python evaluates): ``y = (v[:, i] - p) * b[:, i]`` -> [v, b]; ``o[:, i] = q[:, i] @ S`` ->
    [q] (a subscript assigned to is written, not read)."""
    if src is None or not src.code:
        return []
    try:
        tree = ast.parse(src.code.strip().rstrip(":"))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Store):
            value = node.value
            name = value.id if isinstance(value, ast.Name) else \
                value.attr if isinstance(value, ast.Attribute) else None
            if name is not None:
                moving = any(isinstance(n, ast.Name) for n in ast.walk(node.slice))
                found.append(((node.lineno, node.col_offset), moving, name))
    # a stream's index moves with the loop (``k[:, i]``); ``decay[None, :]`` only reshapes
    if sum(moving for _, moving, _ in found) >= 1:
        found = [f for f in found if f[1]]
    return [name for _, _, name in sorted(found)]


def unique(name: str, taken: set[str]) -> str:
    base, i = name, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


__all__ = ["assigned_name", "keyed_initial_names", "stream_name", "state_names", "unique"]
