"""Find the Python loops of a traced graph and split their unrolled copies into iterations.

``make_fx`` unrolls a Python loop into one copy of its body per iteration. The frames recorded
on every node (``capture.FRAMES``) say which user line produced it; the ``for``/``while``
statements of the user's functions (read with ``ast``) say which lines are a loop body. A node
belongs to a loop when one of its frames is a line of that loop's body in that function.
"""
from __future__ import annotations

import ast
import functools
import linecache
from collections import Counter
from dataclasses import dataclass

import torch.fx

from ..ir import SourceLoc
from .capture import FRAMES


@dataclass(frozen=True)
class LoopSite:
    """A ``for``/``while`` statement in user code."""

    file: str
    function: str
    line: int          # the loop statement
    body_start: int
    body_end: int
    #: (first line, last line) of every statement directly in the loop body, in source order
    statements: tuple[tuple[int, int], ...] = ()
    #: the same, through the blocks of ``if``/``elif``/``else``, ``with`` and ``try`` statements
    #: (whose headers and blocks one iteration runs in source order), not into nested loops
    #: (which run their lines again)
    block_statements: tuple[tuple[int, int], ...] = ()

    def contains(self, frame: SourceLoc) -> bool:
        return (frame.file == self.file and frame.function == self.function
                and self.body_start <= frame.line <= self.body_end)

    def header_contains(self, frame: SourceLoc) -> bool:
        """Whether ``frame`` runs the loop statement itself (``for x in xs.split(C)``)."""
        return (frame.file == self.file and frame.function == self.function
                and self.line <= frame.line < self.body_start)

    def statement_index(self, line: int, through_blocks: bool = False) -> int | None:
        """Which statement directly in the loop body holds ``line`` (None when none does); with
        ``through_blocks``, which statement of ``block_statements``."""
        for i, (lo, hi) in enumerate(self.block_statements if through_blocks
                                     else self.statements):
            if lo <= line <= hi:
                return i
        return None

    @property
    def src(self) -> SourceLoc:
        return SourceLoc(self.file, self.line, self.function,
                         linecache.getline(self.file, self.line).strip())


def _first_line(stmt: ast.stmt) -> int:
    """A statement's first line, decorators included."""
    return min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])


def _span(stmt) -> tuple[int, int]:
    return _first_line(stmt), getattr(stmt, "end_lineno", stmt.lineno)


def _through_blocks(body: list) -> list[tuple[int, int]]:
    """The spans of ``body``'s statements, those of ``if``, ``with`` and ``try`` statements
    replaced by their headers' and their blocks' statements (see ``LoopSite.block_statements``):
    one pass through them runs the lines in source order, whichever branch it takes."""
    spans: list[tuple[int, int]] = []
    for stmt in body:
        if isinstance(stmt, ast.If):
            spans.append((stmt.lineno, stmt.test.end_lineno or stmt.lineno))
            spans += _through_blocks(stmt.body) + _through_blocks(stmt.orelse)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            spans.append((stmt.lineno, stmt.body[0].lineno - 1))
            spans += _through_blocks(stmt.body)
        elif isinstance(stmt, ast.Try):
            spans += _through_blocks(stmt.body)
            for handler in stmt.handlers:
                spans += _through_blocks(handler.body)
            spans += _through_blocks(stmt.orelse) + _through_blocks(stmt.finalbody)
        else:
            spans.append(_span(stmt))
    return spans


@functools.lru_cache(maxsize=256)
def _loops_in_file(file: str) -> tuple[LoopSite, ...]:
    lines = linecache.getlines(file)
    if not lines:
        return ()
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return ()
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            fn = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                fn = getattr(child, "name", "<lambda>")
            if isinstance(child, (ast.For, ast.While, ast.AsyncFor)) and function is not None:
                body = child.body
                stmts = tuple(_span(b) for b in body)
                found.append(LoopSite(file, function, child.lineno, body[0].lineno,
                                      max(hi for _lo, hi in stmts), stmts,
                                      tuple(_through_blocks(body))))
            visit(child, fn)

    visit(tree, None)
    return tuple(found)


@functools.lru_cache(maxsize=1 << 16)
def _loops_at(frame: SourceLoc) -> tuple[LoopSite, ...]:
    """The loops whose body holds ``frame``'s line: every node is asked about every one of its
    frames, and a trace's nodes share most of them."""
    return tuple(loop for loop in _loops_in_file(frame.file) if loop.contains(frame))


#: ``id`` of a node's frames tuple -> (the tuple, kept alive so the id stays its own; the depth
#: of the first frame inside each loop)
_DEPTHS: dict[int, tuple[tuple, dict]] = {}


def _loop_depths(frames: tuple[SourceLoc, ...]) -> dict[LoopSite, int]:
    """Each loop some frame of ``frames`` is inside, with the index of the first such frame."""
    hit = _DEPTHS.get(id(frames))
    if hit is not None and hit[0] is frames:
        return hit[1]
    depths: dict[LoopSite, int] = {}
    for depth, frame in enumerate(frames):
        for loop in _loops_at(frame):
            depths.setdefault(loop, depth)
    if len(_DEPTHS) >= 1 << 15:
        _DEPTHS.clear()
    _DEPTHS[id(frames)] = (frames, depths)
    return depths


def node_frames(node: torch.fx.Node) -> tuple[SourceLoc, ...]:
    return node.meta.get(FRAMES, ())


def loops_of(node: torch.fx.Node, where=LoopSite.contains, outer: int = 0) -> set[LoopSite]:
    """The loops whose body (or, with ``LoopSite.header_contains``, whose statement) holds one
    of ``node``'s frames, the ``outer`` outermost frames left out."""
    if where is LoopSite.contains:
        return {loop for f in node_frames(node)[outer:] for loop in _loops_at(f)}
    return {loop for f in node_frames(node)[outer:]
            for loop in _loops_in_file(f.file) if where(loop, f)}


def caller_depth(gm: torch.fx.GraphModule) -> int:
    """How many outermost frames every op of ``gm`` shares: the stack that called the traced
    code (a script's or a test runner's loop around the call is no loop of the code)."""
    chains = {id(c): c for n in gm.graph.nodes if n.op == "call_function" and (c := node_frames(n))}
    chains = list(chains.values())      # nodes of one line share their frames' tuple
    if not chains:
        return 0
    depth = 0
    while all(len(c) > depth + 1 and c[depth] == chains[0][depth] for c in chains):
        depth += 1
    return depth


def loop_depth(node: torch.fx.Node, loop: LoopSite) -> int | None:
    """Index of the frame through which ``node`` is inside ``loop`` (None when it is not)."""
    return _loop_depths(node_frames(node)).get(loop)


def find_loops(gm: torch.fx.GraphModule) -> list[tuple[LoopSite, int]]:
    """Every loop some node of ``gm`` ran inside, with its frame depth, outermost first."""
    seen: dict[LoopSite, int] = {}
    chains = {id(frames): frames for frames in map(node_frames, gm.graph.nodes)}
    for frames in chains.values():      # nodes of one line share their frames' tuple
        for loop, depth in _loop_depths(frames).items():
            seen[loop] = min(seen.get(loop, depth), depth)
    return sorted(seen.items(), key=lambda kv: (kv[1], kv[0].line))


def iteration_key(node: torch.fx.Node, depth: int) -> tuple:
    """What identifies the 'same' op in two iterations: target and frames from the loop inward."""
    frames = node_frames(node)[depth:]
    return (node.target, tuple((f.file, f.line) for f in frames))


def count_iterations(nodes: list[torch.fx.Node]) -> int | None:
    """How many iterations read the sequence: distinct offsets of the slices the loop takes.

    Every iteration slices its chunk (or selects its token) of loop-invariant tensors at its
    own offset, so the number of distinct offsets on one tensor is the number of iterations.
    A slice of one head of such a tensor (``q[:, h, s:e]``, a ``select`` then a ``slice``) is
    read on the tensor, per head. Offsets that come back after others (heads ``0, 1, 0, 1``:
    a loop inside this one, walked again in every iteration) count only where no offsets walk
    forward once.
    """
    offsets = [[n.args[2] for n in group] for group in sequence_reads(nodes).values()]
    walks = [len(set(v)) for v in offsets if walks_once(v)]
    return max(walks or [len(set(v)) for v in offsets], default=None)


def sequence_reads(nodes: list[torch.fx.Node],
                   per_head: bool = True) -> dict[tuple, list[torch.fx.Node]]:
    """The ``slice``/``select`` ops among ``nodes`` that read a tensor computed before them,
    grouped by tensor and axis, in graph order: a slice of one head of such a tensor
    (``q[:, h, s:e]``) is grouped per head (with ``per_head``), else with every head's."""
    inside = set(nodes)
    out: dict[tuple, list[torch.fx.Node]] = {}
    for n in nodes:
        if n.target not in (torch.ops.aten.slice.Tensor, torch.ops.aten.select.int) \
                or len(n.args) < 3 or not isinstance(n.args[0], torch.fx.Node):
            continue
        key, src = (n.args[1],), n.args[0]
        while src in inside and src.target is torch.ops.aten.select.int and len(src.args) >= 3 \
                and isinstance(src.args[0], torch.fx.Node):
            key, src = (src.args[1], *((src.args[2],) if per_head else ()), *key), src.args[0]
        if src not in inside:
            out.setdefault((src, key), []).append(n)
    return out


def walks_once(seen: list) -> bool:
    """Offsets in graph order that take each value in one run (``0, 0, 8, 8, 16``)."""
    done: set = set()
    for a, b in zip(seen, seen[1:]):
        if a != b:
            done.add(a)
            if b in done:
                return False
    return True


def split_iterations(nodes: list[torch.fx.Node], depth: int, n_iter: int | None = None,
                     loop: LoopSite | None = None) -> list[list[torch.fx.Node]]:
    """Split the nodes of an unrolled loop (in graph order) into its iterations.

    An iteration runs the statements of the loop body in source order, so a new one begins
    where the statement of the loop body an op comes from goes *back* (``by_statement``). That
    holds whatever the first op of an iteration is, when a first iteration runs other ops, and
    when dead code removed a last iteration's first ops. A body whose ops all come from one
    statement shows no such step back; it is split at the op that occurs once per iteration.
    """
    if not nodes:
        return []
    if loop is not None:
        iters = _split_by_statement(nodes, loop)
        if len(iters) > 1 and (n_iter is None or len(iters) == n_iter):
            return iters
        if n_iter is not None and loop.block_statements != loop.statements:
            # a body that is one ``if`` (or ``with``, ``try``) statement steps back only
            # inside its blocks, which ops of one line can share keys across (the read and
            # the update of ``o = q @ W; W = W + k.mT @ v``), so no marker separates them
            iters = _split_by_statement(nodes, loop, through_blocks=True)
            if len(iters) == n_iter:
                return iters
    return _split_at_marker(nodes, depth, n_iter)


def _split_by_statement(nodes: list[torch.fx.Node], loop: LoopSite,
                        through_blocks: bool = False) -> list[list[torch.fx.Node]]:
    iters: list[list[torch.fx.Node]] = []
    previous = None
    for n in nodes:
        d = loop_depth(n, loop)
        index = loop.statement_index(node_frames(n)[d].line, through_blocks) \
            if d is not None else None
        if index is None:
            index = previous if previous is not None else 0
        if previous is None or index < previous:
            iters.append([])
        iters[-1].append(n)
        previous = index
    return iters


def _split_at_marker(nodes: list[torch.fx.Node], depth: int,
                     n_iter: int | None) -> list[list[torch.fx.Node]]:
    """The first op key that occurs exactly ``n_iter`` times marks each iteration; an iteration
    begins at the ops before its marker that the first iteration runs before its own (the
    first iteration's prefix, as a multiset, walked back from the marker), so a last
    iteration whose leading ops dead code removed (the token's key and value selected for an
    update nobody reads) does not reach back into the one before it. Without ``n_iter``, the
    most common occurrence count of the keys is taken for it."""
    keys = [iteration_key(n, depth) for n in nodes]
    counts = Counter(keys)
    if n_iter is None or n_iter not in counts.values():
        n_iter = Counter(counts.values()).most_common(1)[0][0]
    marker_pos = next(i for i, k in enumerate(keys) if counts[k] == n_iter)
    marker = keys[marker_pos]
    first_prefix = Counter(keys[:marker_pos])
    starts = [0]
    for at in [i for i, k in enumerate(keys) if k == marker][1:]:
        prefix = first_prefix.copy()
        start = at
        while start > starts[-1] + 1 and prefix[keys[start - 1]] > 0:
            prefix[keys[start - 1]] -= 1
            start -= 1
        starts.append(start)
    starts.append(len(nodes))
    return [nodes[a:b] for a, b in zip(starts, starts[1:])]


__all__ = ["LoopSite", "caller_depth", "find_loops", "loop_depth", "loops_of", "split_iterations",
           "count_iterations", "iteration_key", "node_frames", "sequence_reads", "walks_once"]
