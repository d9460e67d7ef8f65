"""Why the iterations of a loop run different ops, where the cause is in the code rather than
the data: a sequence read at a stride (several tokens of one sequence taken by index in each
iteration), a Python ``if`` on the loop's index (an update every C tokens, a reset every R
chunks), or iterations that all take the same stretch of it (a schedule of steps). Each names the line and what converts instead; ``None`` where neither explains it.
"""
from __future__ import annotations

import ast
import difflib
import linecache

import torch.fx

from ..analysis.op_vocabulary import SELECT_TARGETS, SLICE_TARGETS
from ..ir import SourceLoc, describe_op
from .loops import LoopSite, _split_by_statement, iteration_key, loop_depth, node_frames


def _reads(nodes: list[torch.fx.Node], inside: set) -> dict[tuple, list[tuple[int, torch.fx.Node]]]:
    """The tokens or chunks each iteration takes of tensors from outside the loop, by
    ``(source, axis, width)``: ``(start, node)`` pairs (a ``select`` is one token wide)."""
    out: dict[tuple, list] = {}
    for n in nodes:
        if len(n.args) < 3 or not isinstance(n.args[0], torch.fx.Node) or n.args[0] in inside:
            continue
        if n.target in SELECT_TARGETS and isinstance(n.args[2], int) and n.args[2] >= 0:
            out.setdefault((n.args[0], n.args[1], 1), []).append((n.args[2], n))
        elif n.target in SLICE_TARGETS and len(n.args) >= 4 and \
                isinstance(n.args[2], int) and isinstance(n.args[3], int) and n.args[2] >= 0:
            width = n.args[3] - n.args[2]
            if width > 0:
                out.setdefault((n.args[0], n.args[1], width), []).append((n.args[2], n))
    return out


def strided_reads(nodes: list[torch.fx.Node], depth: int, loop: LoopSite) -> str | None:
    """``n`` consecutive tokens (or chunks) of one sequence taken by index in every iteration
    (``k[:, i * n + j]``, nested or unrolled), the next iteration taking the next ``n``: the
    refusal naming the read and the view that converts, or ``None``."""
    iters = _split_by_statement(nodes, loop)
    if len(iters) < 3:
        return None
    if [iteration_key(n, depth) for n in iters[1]] != [iteration_key(n, depth) for n in iters[2]]:
        return None
    inside = set(nodes)
    first, second = _reads(iters[1], inside), _reads(iters[2], inside)
    for key, taken in first.items():
        starts = sorted({s for s, _ in taken})
        width, m = key[2], len(starts)
        if m < 2 or starts != [starts[0] + i * width for i in range(m)]:
            continue
        if sorted({s for s, _ in second.get(key, [])}) != [s + m * width for s in starts]:
            continue
        node = min(taken, key=lambda p: p[0])[1]
        what = "tokens" if width == 1 else f"chunks of {width} tokens"
        return (f"{describe_op(node)} reads {m} {what} of one sequence by index in each "
                f"iteration (from token {starts[0]} in the loop's second iteration, "
                f"{starts[0] + m * width} in its third): ttt2la converts loops that take one "
                "token or one chunk of each sequence per iteration. View the sequence with "
                f"each iteration's {m} {what} on an axis of their own before the loop (`k.view(B, T, "
                f"{m}, ...)` for `k` of [B, T·{m}, ...]) and read `k[:, i, j]`")
    return None


def same_stretch(nodes: list[torch.fx.Node], loop: LoopSite) -> str | None:
    """Two or more iterations that all take one and the same stretch of the sequence (LaCT's
    novel-view schedules: an update on all tokens, another, then a read of them all): the
    refusal saying so, or ``None``."""
    iters = _split_by_statement(nodes, loop, through_blocks=True)
    if len(iters) < 2:
        return None
    inside = set(nodes)
    reads = [(start, key[2], node) for it in iters for key, pairs in _reads(it, inside).items()
             for start, node in pairs]
    if len({(start, width) for start, width, _ in reads}) > 1:
        return None
    if reads:
        start, width, node = reads[0]
        taken = f"takes the same {width} tokens of the sequence from token {start} " \
                f"({describe_op(node)})"
    else:
        taken = "reads the whole sequence, taking no chunk or token of it"
    return (f"the loop runs {len(iters)} or more iterations, and each {taken}: the steps of a "
            "schedule over the whole sequence, not a walk over its chunks. ttt2la converts "
            "loops whose iterations take successive chunks or tokens, and one update over all "
            "the tokens followed by reads of them all written without the loop")


def _for_statement(loop: LoopSite) -> ast.For | None:
    try:
        tree = ast.parse("".join(linecache.getlines(loop.file)))
    except SyntaxError:
        return None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.For) and n.lineno == loop.line),
                None)


def _index_ifs(loop: LoopSite) -> list[tuple[ast.If, str]]:
    """The ``if`` statements of the loop's body whose test reads the loop's variable, with the
    variable's name."""
    stmt = _for_statement(loop)
    if stmt is None:
        return []
    names = {n.id for n in ast.walk(stmt.target) if isinstance(n, ast.Name)}
    found = []
    for node in (n for body in stmt.body for n in ast.walk(body)):
        if isinstance(node, ast.If):
            read = sorted(n.id for n in ast.walk(node.test)
                          if isinstance(n, ast.Name) and n.id in names)
            if read:
                found.append((node, read[0]))
    return found


def _unlike(a: list[torch.fx.Node], b: list[torch.fx.Node], depth: int,
            extra_only: bool) -> list[torch.fx.Node]:
    """The ops iteration ``b`` runs and ``a`` does not, then (unless ``extra_only``) those ``a``
    runs and ``b`` does not."""
    ka = [iteration_key(n, depth) for n in a]
    kb = [iteration_key(n, depth) for n in b]
    extra, missing = [], []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ka, kb, autojunk=False).get_opcodes():
        if tag != "equal":
            extra.extend(b[j1:j2])
            missing.extend(a[i1:i2])
    return extra if extra_only else extra + missing


def _in_index_if(nodes: list[torch.fx.Node], ifs: list, loop: LoopSite):
    """The first of ``nodes`` written inside one of the ``ifs`` on the loop's index, with the
    innermost such ``if`` and the variable it tests."""
    for node in nodes:
        d = loop_depth(node, loop)
        if d is None:
            continue
        line = node_frames(node)[d].line
        inner = [(s, name) for s, name in ifs if s.lineno <= line <= s.end_lineno]
        if inner:
            return (node, *max(inner, key=lambda p: p[0].lineno))
    return None


def index_branch(iters: list[list[torch.fx.Node]], j: int, depth: int, loop: LoopSite,
                 later: bool = False) -> str | None:
    """Iteration ``j`` runs other ops than iteration 1 because of a Python ``if`` on the loop's
    variable (with ``later``, or a later iteration runs ops of such an ``if`` that iteration 1
    does not: a reset that makes the update before it dead code): the refusal naming that
    ``if`` and the loop that converts, or ``None``."""
    ifs = _index_ifs(loop)
    if not ifs:
        return None
    found = _in_index_if(_unlike(iters[1], iters[j], depth, False), ifs, loop)
    for jj in range(j + 1, len(iters) if later else j + 1):
        found = found or _in_index_if(_unlike(iters[1], iters[jj], depth, True), ifs, loop)
    if found is None:
        return None
    node, stmt, name = found
    where = SourceLoc(loop.file, stmt.lineno, loop.function,
                      linecache.getline(loop.file, stmt.lineno).strip())
    return (f"the loop's iterations run different ops depending on their index: the `if` at "
            f"{where.at()} tests the loop variable `{name}`, so {describe_op(node)} runs in "
            "some iterations and not in others. ttt2la converts loops whose iterations all run "
            "the same ops. Make the period the loop's step: for an update every C tokens, a "
            "loop over chunks of C tokens (`for s in range(0, T, C)`) that reads the chunk's "
            "tokens and updates at the end of each chunk; for a state reset every R chunks, a "
            "product by a tensor made before the loop, one value per token (`keep = "
            "(torch.arange(T, device=x.device) // C % R != 0).to(x.dtype)`, then `S = "
            "keep[s:e].amax() * S`), or one call of the layer per stretch of R chunks")


__all__ = ["strided_reads", "index_branch"]
