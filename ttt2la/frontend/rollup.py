"""Roll an unrolled loop back up: from a traced layer to a ``TTTProgram`` plus its outer graph.

Given the aten graph of a layer's forward (``capture.trace``) and the loop site that holds the
TTT inner loop, ``roll_up`` finds, from the copies of the loop body:

* the **carried states** — values iteration j produces and iteration j+1 reads;
* the **chunk streams** — ``slice``/``select`` of a loop-invariant tensor whose offset moves by
  the chunk size (or by one token) from one iteration to the next;
* the **invariants** — values every iteration reads unchanged (loop-invariant code inside the
  loop is hoisted);
* the **chunk outputs** — what each iteration hands to code after the loop (``cat``/``stack``,
  or writes into a buffer allocated before it: ``out[:, s:e] = y``, ``out[:, t] = y``);
* a **peeled last chunk** — LaCT applies the last chunk without updating, either after the loop
  (a *tail* that repeats the body's apply ops) or in a last iteration whose update is skipped.

The body of iteration 1 becomes ``TTTProgram.body``; the rest of the layer becomes the *outer
graph*, in which the whole loop is one ``call_module`` to ``LOOP_MODULE`` taking
``(*initial_states, *invariants)`` and returning ``(output, *final_states)`` (the conventions
are stated in ``ttt2la.ir``). ``roll_up`` runs one phase per step: ``unroll`` (the iterations),
``classify_inputs``, ``carried_states``, ``split_buffer`` and ``chunk_output``,
``order_and_tail``, ``extract_body``, ``rewrite_outer``.
"""
from __future__ import annotations

import dataclasses
import difflib
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..analysis.op_vocabulary import (EMPTY_FILLS, SELECT_TARGETS, SLICE_TARGETS,
                                      TENSOR_SHAPED_FILLS, calls, fill_value)
from ..errors import LaggedStateError, UnsupportedTTTError
from ..ir import (INPUT_FREE, KIND, LOOP_MODULE, NAME, SKIPPED_FIRST, SRC, describe_op,
                  graph_module, op_at, placeholder, InvariantSpec, OutputSpec, StateSpec,
                  StreamSpec, TTTProgram, memory_order, reshape_views)
from .index_values import refuse_index_steps
from .iteration_numbers import refuse_iteration_numbers
from .partial_chunk import length_dependent_number
from .loops import (LoopSite, count_iterations, iteration_key, loop_depth, loops_of, node_frames,
                    sequence_reads, split_iterations, walks_once)
from .slice_assignments import select_writes_as_slice_writes
from .source_names import (PIECE_NAME, assigned_name, assigned_names, keyed_initial_names,
                           state_names, stream_name, unique)
from .unlike_iterations import index_branch, same_stretch, strided_reads

aten = torch.ops.aten
ZERO = object()   # initial value of a state the first iteration does not read: zeros


@dataclass
class RolledLoop:
    """The result of rolling a loop up: the program and the graph around it."""

    program: TTTProgram
    outer: torch.fx.GraphModule            # with a ``call_module`` node targeting LOOP_MODULE
    n_iterations: int
    tail: bool                             # last chunk applied after the loop
    notes: list[str] = field(default_factory=list)


class LengthDependent(UnsupportedTTTError):
    """A refusal that a trace at another sequence length may not meet: the shape probe tries
    its other lengths before it gives up."""


class TooFewIterations(LengthDependent):
    """The loop ran three iterations at the traced length and its last differs from the one
    before: it may only be cut short (an update nothing reads is traced away), so a longer trace
    can tell. The shape probe traces one chunk longer."""


class WholeChunksOnly(LengthDependent):
    """The loop ran once per whole chunk (``L // C``), leaving the tokens after the last one:
    the layer is written for lengths that are multiples of its chunk, where it covers every
    token. The shape probe traces at lengths that keep the example's chunk structure."""


def _fail(msg: str, loop: LoopSite,
          kind: type[UnsupportedTTTError] = UnsupportedTTTError) -> UnsupportedTTTError:
    return kind(f"{msg} (loop at {loop.src}). ttt2la recognizes loops over chunks or tokens that "
                "carry fast weights from one iteration to the next.")


def _align(a: list[torch.fx.Node], b: list[torch.fx.Node], depth: int) -> dict:
    """Map nodes of iteration ``a`` to the same op in iteration ``b``.

    Iterations run the same statements, but the ops a statement decomposes into can differ when
    the layouts of its inputs do (a first iteration reading an ``expand``-ed parameter traces a
    ``matmul`` into more ops than one reading a contiguous state), so the op keys are aligned as
    sequences (longest matching blocks) rather than position by position.
    """
    ka = [iteration_key(n, depth) for n in a]
    kb = [iteration_key(n, depth) for n in b]
    if ka == kb:
        return dict(zip(a, b))
    matcher = difflib.SequenceMatcher(None, ka, kb, autojunk=False)
    out = {}
    for block in matcher.get_matching_blocks():
        for i in range(block.size):
            out[a[block.a + i]] = b[block.b + i]
    return out


def _flat_args(node: torch.fx.Node) -> list:
    out: list = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), out.append)
    return out


def _input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in _flat_args(node) if isinstance(a, torch.fx.Node)]


def roll_up(gm: torch.fx.GraphModule, loop: LoopSite, depth: int, *,
            module_path: str = "") -> RolledLoop:
    """Roll the unrolled ``loop`` of ``gm`` (its nodes inside the loop at frame ``depth``) up
    into a ``TTTProgram``; ``gm`` becomes the outer graph, rewritten in place (the caller passes
    a copy). Each phase below reads the ones before it and refuses what it cannot explain."""
    u = unroll(gm, loop, depth)
    refuse_index_steps(loop, u.lines_run())
    if u.n_iter > 3:            # with three, iteration 2 is the last, which may be partial
        refuse_iteration_numbers(u.in_iteration(2), loop.src)
    inputs = classify_inputs(u)
    states = split_buffer(u, inputs, carried_states(u, inputs))
    out_node = chunk_output(u, states)
    tail = order_and_tail(u, inputs, states, out_node)
    program = extract_body(u, inputs, states, out_node, tail, module_path)
    program.partial_chunk = length_dependent_number(u.in_iteration(u.n_iter - 1))
    rewrite_outer(u, inputs, states, tail)
    program.notes.extend(states.notes)
    return RolledLoop(program=program, outer=gm, n_iterations=u.n_iter, tail=tail.peeled,
                      notes=states.notes)


# -- the iterations ---------------------------------------------------------------------------

@dataclass
class Unrolled:
    """The unrolled copies of one loop in a traced graph, split into iterations.

    Iteration 1 stands for the body: iteration 0 may initialise states or skip a first use,
    the last one may be cut short, so only iterations 1 and 2 must run the very same ops.
    """

    gm: torch.fx.GraphModule
    loop: LoopSite
    depth: int
    order: dict[torch.fx.Node, int]          # graph position of every node
    in_loop: set[torch.fx.Node]
    first_pos: int                           # graph position of the loop's first node
    iters: list[list[torch.fx.Node]]
    to2: dict[torch.fx.Node, torch.fx.Node]  # iteration-1 node -> the same op in iteration 2
    to0: dict[torch.fx.Node, torch.fx.Node]  # iteration-1 node -> the same op in iteration 0
    _maps: dict = field(default_factory=dict)

    @property
    def n_iter(self) -> int:
        return len(self.iters)

    def before_loop(self, n: torch.fx.Node) -> bool:
        """``n`` is computed before the loop starts, or is a constant of the graph (a
        ``torch.tensor(...)`` of Python numbers in the body is one constant per iteration)."""
        if n.op == "get_attr":
            return True
        return n not in self.in_loop and self.order[n] < self.first_pos

    def in_iteration(self, j: int) -> dict[torch.fx.Node, torch.fx.Node]:
        """Iteration-1 node -> the same op in iteration ``j`` (where it has one)."""
        if j not in self._maps:
            self._maps[j] = _align(self.iters[1], self.iters[j], self.depth)
        return self._maps[j]

    def fail(self, msg: str,
             kind: type[UnsupportedTTTError] = UnsupportedTTTError) -> UnsupportedTTTError:
        return _fail(msg, self.loop, kind)

    def lines_run(self) -> frozenset[int]:
        """The lines of the loop's body some traced op comes from (a helper's ops by the line
        that calls it)."""
        return frozenset(node_frames(n)[d].line for n in self.in_loop
                         if (d := loop_depth(n, self.loop)) is not None)


def unroll(gm: torch.fx.GraphModule, loop: LoopSite, depth: int) -> Unrolled:
    """The iterations of ``loop`` in ``gm``, with iteration 1's ops matched to 0's and 2's."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    loop_nodes = [n for n in nodes if n.op == "call_function" and loop_depth(n, loop) is not None]
    iters = split_iterations(loop_nodes, depth, count_iterations(loop_nodes), loop)
    if len(iters) < 3:
        raise _fail(same_stretch(loop_nodes, loop) or
                    f"the loop ran {len(iters)} iteration(s) at the traced shape; at least 3 "
                    "are needed to tell carried state from streams", loop)
    I0, I1, I2 = iters[0], iters[1], iters[2]
    keys1 = [iteration_key(n, depth) for n in I1]
    if keys1 != [iteration_key(n, depth) for n in I2]:
        why = strided_reads(loop_nodes, depth, loop) or \
            (index_branch(iters, 2, depth, loop, later=True) if len(iters) > 3 else None)
        if why:
            raise _fail(why, loop)
        if len(iters) == 3:         # iteration 2 is also the last one
            raise _fail("the loop ran 3 iterations at the traced length and the last one runs "
                        "other ops than the one before", loop, TooFewIterations)
        raise _fail(f"iterations 1 and 2 run different ops ({_first_difference(I1, I2, depth)}): "
                    "ttt2la reads one body that every iteration runs, and a branch or an inner "
                    "loop that runs otherwise from one iteration to the next (on the data, or an "
                    "inner loop over a group of chunks whose last group is shorter) has none. "
                    "Make every iteration run the same code, or convert from an example whose "
                    "length gives every iteration the same work", loop)
    _same_ops_between(iters, keys1, depth, loop)
    return Unrolled(gm, loop, depth, order, set(loop_nodes), order[loop_nodes[0]], iters,
                    to2=dict(zip(I1, I2)),
                    to0={v: k for k, v in _align(I0, I1, depth).items()})


def _same_ops_between(iters: list[list[torch.fx.Node]], keys1: list, depth: int,
                      loop: LoopSite) -> None:
    """Refuse a loop whose iterations between the second and the last run other ops than the
    second because of a Python ``if`` on the loop's index (an update every C tokens)."""
    for j in range(3, len(iters) - 1):
        if [iteration_key(n, depth) for n in iters[j]] != keys1:
            why = index_branch(iters, j, depth, loop)
            if why:
                raise _fail(why, loop)
            return


# -- phase 1: inputs --------------------------------------------------------------------------

class ChunkStream(NamedTuple):
    """A chunk stream: iteration j reads chunk j of ``source`` along ``axis``."""

    source: torch.fx.Node
    axis: int
    chunk: int
    per_token: bool                          # ``select`` of one token rather than a slice


@dataclass
class Inputs:
    """Iteration 1's ops that read no carried state, by what they are."""

    hoisted: set[torch.fx.Node]              # the same in every iteration: loop-invariant code
    streams: dict[torch.fx.Node, ChunkStream]  # slices that move by one chunk per iteration
    body_nodes: list[torch.fx.Node]          # the rest of iteration 1: the loop body

    @property
    def first(self) -> ChunkStream:
        return next(iter(self.streams.values()))


def classify_inputs(u: Unrolled) -> Inputs:
    """Sort iteration 1's ops that read only values from before the loop (or hoisted ones):
    the same op on the same arguments in iteration 2 is hoisted; a slice whose offset moves by
    one chunk is a stream; anything else that changes between iterations is refused."""
    hoisted: set[torch.fx.Node] = set()
    streams: dict[torch.fx.Node, ChunkStream] = {}
    for n in u.iters[1]:
        if not all(u.before_loop(a) or a in hoisted for a in _input_nodes(n)):
            continue
        a1, a2 = _flat_args(n), _flat_args(u.to2[n])
        moved = hoisted | streams.keys()
        if len(a1) == len(a2) and all(_same_in_both(u, x, y, moved) for x, y in zip(a1, a2)):
            hoisted.add(n)
            continue
        src = n.args[0] if n.args else None
        head = src in hoisted and src.target in SELECT_TARGETS      # q[:, h], then its chunks
        stream = _chunk_slice(n, u.to2[n], u.to2.get(src) if head else None)
        if stream is None:
            raise u.fail(_not_a_stream(n, u.to2[n], u.loop))
        chunk = next(iter(streams.values())).chunk if streams else None
        if chunk not in (None, stream.chunk):
            raise u.fail(_mixed_streams(n, stream, streams))
        streams[n] = stream
    if not streams:
        raise u.fail("no chunk streams: the loop does not slice the sequence")
    body_nodes = [n for n in u.iters[1] if n not in hoisted and n not in streams]
    return Inputs(hoisted, streams, body_nodes)


def _same_in_both(u: Unrolled, a1, a2, moved: set) -> bool:
    """Argument ``a1`` of an iteration-1 op and ``a2`` of its iteration-2 copy are the same
    value: equal numbers, one node, equal graph constants, or the iteration-2 copy of a
    hoisted op or stream."""
    if isinstance(a1, torch.fx.Node):
        if a1 in moved:
            return u.to2.get(a1) is a2
        return a1 is a2 or _equal_constants(u.gm, a1, a2)
    return a1 == a2


def _equal_constants(gm: torch.fx.GraphModule, a: torch.fx.Node, b) -> bool:
    """``a`` and ``b`` are graph constants holding equal tensors: each iteration's copy of one
    ``torch.tensor(...)`` of Python numbers, the same value every time."""
    if not (isinstance(b, torch.fx.Node) and a.op == b.op == "get_attr"):
        return False
    ta, tb = getattr(gm, a.target, None), getattr(gm, b.target, None)
    return (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)
            and ta.shape == tb.shape and ta.dtype == tb.dtype and ta.device == tb.device
            and bool(torch.equal(ta, tb)))


def _not_a_stream(n: torch.fx.Node, n2: torch.fx.Node, loop: LoopSite) -> str:
    """Why iteration input ``n`` (``n2`` the next iteration's) of ``loop`` is refused, and what
    to do."""
    what = describe_op(n)
    nested = _nested_loops([n], loop)
    if nested:
        return (f"{what} is taken inside the loop at {nested[0].src}, which runs inside the TTT "
                "loop (over heads or rows, one slice each), so the TTT loop's iterations differ "
                "in more than the chunk or token they take, and ttt2la cannot line them up. "
                "Vectorise the inner loop: take every head at once (`k[:, :, t]`, the heads a "
                "batch axis) and keep one state with a heads axis")
    if n.target in (*SLICE_TARGETS, *SELECT_TARGETS) and n2.args[0] is n.args[0] and \
            isinstance(n.args[2], int) and isinstance(n2.args[2], int) and n2.args[2] < n.args[2]:
        return (f"{what} reads the sequence's chunks in reverse order (a scan from its end): "
                "ttt2la converts loops that walk the sequence forward. Flip the sequence before "
                "the loop and its outputs after (x.flip(1)), so that the loop runs forward")
    offset = _offset_start(n, n2)
    if offset:
        return _starts_at_offset(what, offset, loop)
    window = _overlapping(n, n2)
    if window:
        (a, b), (c, d) = window
        return (f"{what} reads overlapping spans of the sequence (tokens {a} to {b - 1}, then "
                f"{c} to {d - 1}): tokens read by several iterations — the prefix so far, a "
                "window over the last tokens or tokens ahead — which no chunk stream has. "
                "Carry what the loop takes from the tokens so far as a state updated with each "
                "chunk (`S = S + k_c.mT @ v_c`), or compute each window's sums before the loop "
                "(a Gram matrix Σ γ_i k_iᵀ k_i over the last tokens, as a cumulative sum "
                "differenced or a convolution along the sequence) and read those one token or "
                "chunk at a time")
    if n.target in SELECT_TARGETS and n2.args[0] is n.args[0] and len(n.args) > 2 and \
            isinstance(n.args[2], int) and isinstance(n2.args[2], int) and \
            n2.args[2] - n.args[2] > 1:
        step = n2.args[2] - n.args[2]
        return (f"{what} reads one token of every chunk (index {n.args[2]}, then "
                f"{n2.args[2]}: {step} apart) straight from the sequence. Take the chunk first "
                "and index inside it — `g[:, s:e][:, -1]` for the chunk's last token, not "
                "`g[:, e - 1]` — so the loop reads the chunk as a stream")
    return (f"{what} changes between iterations, and is neither the next chunk or token of the "
            "sequence nor a state carried from the last iteration")


def _first_difference(first: list, second: list, depth: int) -> str:
    """Where iteration 2 first runs another op than iteration 1 did, as the ops' lines."""
    a = [iteration_key(n, depth) for n in first]
    b = [iteration_key(n, depth) for n in second]
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if i < len(a) and i < len(b):
        return f"iteration 1 runs {describe_op(first[i])} where iteration 2 runs " \
               f"{describe_op(second[i])}"
    longer, which, n = (first, 1, len(b)) if len(a) > len(b) else (second, 2, len(a))
    return f"iteration {which} runs more ops, from {describe_op(longer[n])} on"


def _nested_loops(nodes, loop: LoopSite) -> list:
    """The loops inside ``loop``'s body (same function, within its lines) that ``nodes`` run
    in, innermost last by line."""
    return sorted({inner for n in nodes for inner in loops_of(n)
                   if inner != loop and inner.file == loop.file
                   and inner.function == loop.function
                   and loop.body_start <= inner.line <= loop.body_end},
                  key=lambda inner: inner.line)


def _offset_start(n: torch.fx.Node, n2: torch.fx.Node) -> tuple[int, int] | None:
    """``(offset, step)`` when ``n`` and its next-iteration copy ``n2`` take consecutive
    tokens or chunks of one tensor, ``offset`` tokens later than iteration 1 would from a loop
    starting at the sequence's first token (``range(1, T)``, token 0 handled before it)."""
    src = n.args[0]
    if n2.args[0] is not src or len(n.args) < 3 or len(n2.args) < 3:
        return None
    if n.target in SELECT_TARGETS and isinstance(n.args[2], int) and \
            isinstance(n2.args[2], int) and n2.args[2] == n.args[2] + 1 and n.args[2] > 1:
        return n.args[2] - 1, 1
    if n.target in SLICE_TARGETS and len(n.args) >= 4 and len(n2.args) >= 4 and \
            all(isinstance(a, int) for a in (*n.args[2:4], *n2.args[2:4])):
        c = n2.args[2] - n.args[2]
        if c > 0 and n.args[3] - n.args[2] == c == n2.args[3] - n2.args[2] and n.args[2] > c:
            return n.args[2] - c, c
    return None


def _overlapping(n: torch.fx.Node, n2: torch.fx.Node) -> tuple | None:
    """The token spans ``((a, b), (c, d))`` when ``n`` and its next-iteration copy ``n2`` slice
    one tensor along one axis into spans that overlap, the later one advancing (a window over
    the last tokens); ``None`` otherwise."""
    if n.target not in SLICE_TARGETS or n2.args[0] is not n.args[0] or len(n.args) < 4 or \
            len(n2.args) < 4 or n.args[1] != n2.args[1]:
        return None
    spans = (n.args[2], n.args[3]), (n2.args[2], n2.args[3])
    if not all(isinstance(i, int) and i >= 0 for span in spans for i in span):
        return None
    (a, b), (c, d) = spans
    return spans if a <= c < b and d > b else None


def _starts_at_offset(what: str, offset: tuple[int, int], loop: LoopSite) -> str:
    """The refusal of a loop whose iterations take the sequence ``offset`` tokens late, and the
    loop from 0 to write instead."""
    tokens, step = offset
    if step == 1:
        unit, read, start, first = "token", f"token {tokens + 1}", f"token {tokens}", "token 0"
        written, whole = f"range({tokens}, T)", "for t in range(T)"
    else:
        unit, read = "chunk", f"the chunk at tokens {tokens + step}:{tokens + 2 * step}"
        start = f"chunk {tokens // step} (token {tokens})" if tokens % step == 0 \
            else f"token {tokens}"
        first = f"the first {tokens} tokens"
        written, whole = f"range({tokens}, T, {step})", f"for s in range(0, T, {step})"
    return (f"{what} reads {read} of the sequence in the loop's second iteration: the loop at "
            f"{loop.src} starts at {start}, not at the sequence's start (`{written}` "
            f"with {first} handled before the loop, or a read that far ahead of the loop's "
            f"index). ttt2la converts loops whose first iteration takes the sequence's first "
            f"{unit}. Write one loop from 0 over every {unit} (`{whole}`), its state "
            f"starting from its initial value (zeros), and {first} handled by the loop like the "
            "others")


def _mixed_streams(n: torch.fx.Node, stream: ChunkStream,
                   streams: dict[torch.fx.Node, ChunkStream]) -> str:
    """Why stream ``n``, whose step differs from the earlier ``streams``', is refused, and what
    to do."""
    first, earlier = next(iter(streams.items()))
    rows = [(m, s) for m, s in ((n, stream), (first, earlier)) if s.per_token]
    if rows:
        (row, _), = rows[:1]
        chunk = max(stream.chunk, earlier.chunk)
        return (f"{describe_op(row)} takes one row per iteration beside chunks of {chunk} "
                "tokens: a value per chunk computed before the loop (a gate or rate per chunk), "
                "which ttt2la cannot line up with the chunks' tokens. Compute it inside the loop "
                "from the chunk (e.g. gate(x[:, s:e].mean(1))), or give it one value per token")
    return (f"streams are sliced with chunk sizes {earlier.chunk} and {stream.chunk} "
            f"({describe_op(first)} and {describe_op(n)})")


def _chunk_slice(n: torch.fx.Node, n2: torch.fx.Node, src2=None) -> ChunkStream | None:
    """The stream ``n`` reads when it and its next-iteration copy ``n2`` slice one tensor at
    offsets one chunk apart (chunk 1 at offset C, chunk 2 at 2C), or select tokens 1 and 2.
    The tensor may be a hoisted value of the loop's body (one head, ``q[:, h]``), which the
    next iteration computes again as ``src2``."""
    src = n.args[0]
    same = n2.args[0] is src or (src2 is not None and n2.args[0] is src2)
    if n.target in SLICE_TARGETS and same:
        start1, end1, start2, end2 = n.args[2], n.args[3], n2.args[2], n2.args[3]
        c = start2 - start1
        if c > 0 and end1 - start1 == c and end2 - start2 == c and start1 == c:
            return ChunkStream(src, n.args[1], c, False)
    if n.target in SELECT_TARGETS and same and n.args[2] == 1 and n2.args[2] == 2:
        return ChunkStream(src, n.args[1], 1, True)
    return None


# -- phase 2: carried states ------------------------------------------------------------------

@dataclass
class States:
    """What the body carries and reads: its states, their initial values, its invariants."""

    body_nodes: list[torch.fx.Node]
    carried: dict[torch.fx.Node, torch.fx.Node]    # iteration-0 producer -> iteration-1 state-out
    initial: dict[torch.fx.Node, object]           # producer -> initial value (node or ZERO)
    invariants: list[torch.fx.Node]                # values from before the loop the body reads
    init_nodes: set[torch.fx.Node]                 # first-iteration code that only initialises
    notes: list[str]
    buffer: "Buffer | None" = None                 # an output written chunk by chunk


def carried_states(u: Unrolled, inputs: Inputs) -> States:
    """Sort what the body reads: its own values, invariants (values from before the loop,
    hoisted code) and carried states (what iteration 0 produced, whose iteration-2 copy reads
    iteration 1's value in the same place); then where each state starts."""
    first, body = set(u.iters[0]), set(u.iters[1])
    carried: dict[torch.fx.Node, torch.fx.Node] = {}
    initial: dict[torch.fx.Node, object] = {}
    invariants: list[torch.fx.Node] = []
    for n in inputs.body_nodes:
        for pos, a in enumerate(_flat_args(n)):
            if not isinstance(a, torch.fx.Node):
                continue
            if a in inputs.hoisted:
                _no_lag_later(u, n, pos, lambda j, a=a: (a, u.in_iteration(j).get(a)))
                _add(invariants, a)
            elif a in body:
                continue
            elif a in first:
                _carry(u, n, pos, a, carried, initial)
            elif u.before_loop(a):
                _no_lag_later(u, n, pos, lambda j, a=a: (a,))
                _add(invariants, a)
            elif a in u.in_loop:
                raise _lagged(u, n, a, 2, None, "")
            else:
                raise u.fail(f"{_named(n)} reads {_named(a)}, defined after the loop")
    init_nodes, notes = _initialisations(u, inputs, initial)
    for s in inputs.streams.values():
        _add(invariants, s.source)
    return States(inputs.body_nodes, carried, initial, invariants, init_nodes, notes)


def _add(values: list, a) -> None:
    if a not in values:
        values.append(a)


def _carry(u: Unrolled, n: torch.fx.Node, pos: int, a: torch.fx.Node, carried: dict,
           initial: dict) -> None:
    """Body op ``n`` reads iteration 0's ``a`` at argument ``pos``: record ``a`` as a carried
    state, its value out of iteration 1, and what iteration 0 read in its place (its start)."""
    got2 = _flat_args(u.to2[n])[pos]
    if isinstance(got2, torch.fx.Node) and got2 in u.iters[0]:
        raise _lagged(u, n, got2, 2, 2, "that one too")
    if not (isinstance(got2, torch.fx.Node) and got2 in u.to2):
        raise u.fail(f"{_named(a)} is read from the previous iteration at {_where(n)}, but the "
                     "next iteration reads something else there")
    if carried.get(a, got2) is not got2:
        raise u.fail(f"{_named(a)} is carried into two different values")
    _no_lag_later(u, n, pos, lambda j: (u.in_iteration(j - 1).get(got2),))
    carried[a] = got2
    c0 = u.to0.get(n)
    v0 = ZERO if c0 is None else _flat_args(c0)[pos]
    if v0 is ZERO and a in initial:
        return
    if a in initial and initial[a] is not ZERO and initial[a] is not v0:
        raise u.fail("a carried value starts from two different initial values")
    initial[a] = v0


def _iteration_of(u: Unrolled, x: torch.fx.Node) -> int | None:
    """The traced iteration whose ops include ``x``, or ``None`` (before or after the loop)."""
    return next((j for j, ops in enumerate(u.iters) if x in ops), None)


def _no_lag_later(u: Unrolled, n: torch.fx.Node, pos: int, expected) -> None:
    """No later traced iteration reads, at argument ``pos`` of its copy of body op ``n``, a value
    made two or more iterations before it, where ``expected(j)`` lists what iteration ``j`` may
    read there (what iteration 1's read stands for; ``None`` entries are ignored). Iteration 1
    alone cannot tell a value carried from two iterations back (``Wp, W = W, W + dW``, read as
    ``W + Wp``) from a value made before the loop, as its ``Wp`` is still the initial one; the
    iterations after it can, and such a loop is refused instead of converted with the first one.
    Other reads that differ from the expected node — a stream's token or an invariant
    recomputed in the iteration itself — are the same values by other nodes, and pass."""
    for j in range(2, u.n_iter):
        nj = u.in_iteration(j).get(n)
        if nj is None:
            continue
        args = _flat_args(nj)
        if pos >= len(args) or not isinstance(got := args[pos], torch.fx.Node):
            continue
        allowed = [x for x in expected(j) if x is not None]
        if not allowed or any(got is x or _equal_constants(u.gm, x, got) for x in allowed):
            continue
        k = _iteration_of(u, got)
        if k is not None and k < j - 1:
            first = _flat_args(n)[pos]
            raise _lagged(u, n, got, j - k, j, "the initial value" if u.before_loop(first)
                          else f"{_named(first)}")


def _lagged(u: Unrolled, n: torch.fx.Node, made: torch.fx.Node, lag: int, j: int | None,
            first: str) -> LaggedStateError:
    """The refusal of body op ``n``, whose copy in iteration ``j`` reads ``made``, a value made
    ``lag`` iterations back where the loop's second iteration reads ``first`` (in words): a
    chunk-parallel plan carries each state from one iteration to the next only."""
    names = assigned_names(made.meta.get(SRC))
    value = f"`{names[0]}`" if len(names) == 1 else "a value"
    back = {2: "two", 3: "three", 4: "four"}.get(lag, str(lag))
    seen = (f" (iteration {j} reads the one iteration {j - lag} made, where the loop's second "
            f"iteration reads {first})" if j is not None else "")
    error = _fail(
        f"{_where(n)} reads {value} made {back} iterations back, at {_where(made)}{seen}: the fast "
        "weights before the last update (`Wp, W = W, W + dW`, or an earlier element of a list "
        "of states). ttt2la carries each state from one iteration to the next only, so this "
        "loop has no chunk-parallel form it can vouch for; keep the layer as written (inside a "
        "model it is left unconverted and runs as written), or read only the latest state, or "
        "carry what the read needs as a state the iteration itself makes (such as the last "
        "update dW, reading W - dW)", u.loop, LaggedStateError)
    src = n.meta.get(SRC)
    error.where = f"{src.file}:{src.line}" if src is not None else None
    error.value, error.lag = value.strip("`"), lag
    return error


def _initialisations(u: Unrolled, inputs: Inputs,
                     initial: dict) -> tuple[set[torch.fx.Node], list[str]]:
    """The first-iteration code that only computes initial states (it runs before the loop in
    the outer graph), and notes on states whose first use the first iteration skips."""
    first = set(u.iters[0])
    first_slices = {u.to0[x] for x in inputs.streams if x in u.to0}
    init_nodes: set[torch.fx.Node] = set()
    notes: list[str] = []
    for p, v0 in initial.items():
        if v0 is ZERO:
            notes.append(f"the first iteration skips the use of {p.name}: it starts at zero")
        if isinstance(v0, torch.fx.Node) and (v0 in u.in_loop and v0 not in inputs.hoisted):
            made = _initialisation(v0, first, u.in_loop, inputs.hoisted, first_slices)
            if made is None:
                raise u.fail("the initial value of a carried state is computed inside the loop "
                             "from the first chunk")
            init_nodes |= made
            notes.append(f"the first iteration initialises {p.name}; that code runs before "
                         "the loop")
    return init_nodes, notes


# -- phase 3: buffers and outputs -------------------------------------------------------------

@dataclass
class Buffer:
    """An output buffer ``out[:, s:e] = y`` (or ``out[:, t] = y`` per token): a carried tensor
    each iteration writes its output into."""

    producer: torch.fx.Node                  # the buffer as iteration 0 leaves it
    write: torch.fx.Node                     # iteration 1's ``slice_scatter``/``select_scatter``
    written: torch.fx.Node                   # what iteration 1 writes: the chunk output
    axis: int
    plumbing: set[torch.fx.Node]             # the write's own ops (not part of the body)

    @property
    def stacked(self) -> bool:
        """One token per iteration written by ``out[:, t] = y`` (``y`` has no token axis)."""
        return self.write.target is aten.select_scatter.default


_WRITES = (aten.slice_scatter.default, aten.select_scatter.default)


def _writes_next_slot(write: torch.fx.Node, buf: torch.fx.Node, step: int) -> bool:
    """Iteration 1's ``write`` puts its output into slot 1 of ``buf``: ``out[:, C:2C] = y``
    for chunks of ``C`` (or ``out[:, 1:2]``), ``out[:, 1] = y`` for single tokens."""
    if write.args[0] is not buf:
        return False
    if write.target is aten.slice_scatter.default:
        return len(write.args) >= 5 and write.args[3] == step and write.args[4] == 2 * step \
            and (len(write.args) < 6 or write.args[5] == 1)
    return write.target is aten.select_scatter.default and step == 1 and write.args[3] == 1


def split_buffer(u: Unrolled, inputs: Inputs, states: States) -> States:
    """``states`` with an output buffer taken out of the carried states (at most one): a
    carried tensor whose update writes iteration j's chunk (or token) at offset j, and which
    nothing inside the loop reads."""
    step = 1 if inputs.first.per_token else inputs.first.chunk
    buffers = []
    for p, o1 in states.carried.items():
        if o1.target in _WRITES and _writes_next_slot(o1, p, step):
            y, plumbing = _written_value(o1)
            buffers.append(Buffer(p, o1, y, o1.args[2], plumbing))
    if len(buffers) > 1:
        raise u.fail("more than one output buffer is written inside the loop")
    if not buffers:
        return states
    (buf,) = buffers
    body_nodes = [n for n in states.body_nodes if n not in buf.plumbing]
    _refuse_buffer_reads(u, buf, body_nodes)
    return dataclasses.replace(
        states, buffer=buf,
        carried={p: o for p, o in states.carried.items() if p is not buf.producer},
        initial={p: v for p, v in states.initial.items() if p is not buf.producer},
        body_nodes=body_nodes)


def _refuse_buffer_reads(u: Unrolled, buf: Buffer, body_nodes: list[torch.fx.Node]) -> None:
    """Refuse a buffer the loop also reads (``out[:, t - 1]``, ``out.sum()``): its values are
    then carried state, which the converted loop does not keep."""
    buffer_values = buf.plumbing | {buf.producer}
    for n in body_nodes:
        if any(a in buffer_values for a in _input_nodes(n)):
            raise UnsupportedTTTError(
                f"the output buffer {_where_assigned(buf.producer, u)} is also read inside the "
                f"loop, at {_where(n)}; ttt2la converts a buffer that each iteration only writes "
                f"its output into (written at {_where(buf.write)}). Keep what the loop reads "
                "in its own carried variable (e.g. `prev = y`), or collect the outputs in a list "
                "and `torch.cat`/`torch.stack` them after the loop "
                f"(loop at {u.loop.src}).")


def _where(n: torch.fx.Node) -> str:
    """``file:line (`code`)`` of the statement that made ``n``."""
    src = n.meta.get(SRC)
    return src.at() if src is not None else describe_op(n)


def _where_assigned(producer: torch.fx.Node, u: Unrolled) -> str:
    """The buffer's name and where the loop writes it first, for messages."""
    first_write = producer
    while first_write.op == "call_function" and first_write.target in _WRITES \
            and isinstance(first_write.args[0], torch.fx.Node) \
            and first_write.args[0] in u.in_loop:
        first_write = first_write.args[0]
    made = first_write.args[0] if first_write.target in _WRITES else first_write
    name = assigned_name(made.meta.get(SRC)) if isinstance(made, torch.fx.Node) else None
    return f"`{name}`" if name else "written in the loop"


def _written_value(write: torch.fx.Node) -> tuple[torch.fx.Node, set[torch.fx.Node]]:
    """What ``slice_scatter``/``select_scatter`` node ``write`` writes (behind the ``copy`` a
    functionalized ``out[...] = y`` makes), and the write's own nodes."""
    written = write.args[1]
    if isinstance(written, torch.fx.Node) and written.target is aten.copy.default:
        return written.args[1], {write, written, written.args[0]}
    return written, {write}


def _output_fed_back(u: Unrolled, states: States, stored: list) -> str:
    """Why a loop carrying its own output into the next iteration is refused, or ``""``: a
    stored value computed from another state's new value (``y = q @ W``, kept as ``prev = y``)
    is the chunk's output, read again by the next chunk, not a state the loop updates."""
    outs = set(states.carried.values())
    body = set(u.iters[1])
    for y in stored:
        if not any(_reaches(w, y) for w in outs if w is not y):
            continue
        previous = next(p for p, out in states.carried.items() if out is y)
        reads = [n for n in previous.users if n in body]
        where = f" at {_where(reads[0])}" if reads else ""
        return (f"every chunk's output {_named(y)} is both collected after the loop and "
                f"carried into the next iteration, which reads it{where}: the state's update then "
                "depends on the outputs before it, which no linear-attention update does. "
                "ttt2la converts loops whose chunks take their inputs from the sequence; "
                "compute each chunk's inputs without the previous chunk's output")
    return ""


def chunk_output(u: Unrolled, states: States) -> torch.fx.Node:
    """The one value of iteration 1 that code after the loop gathers: what it writes into the
    output buffer, else the body value read outside the loop that is not a state."""
    if states.buffer is not None:
        return states.buffer.written
    state_outs = set(states.carried.values())
    outs = [n for n in states.body_nodes
            if any(x not in u.in_loop for x in n.users) and n not in state_outs]
    if not outs:
        stored = [n for n in state_outs if any(x not in u.in_loop for x in n.users)]
        fed_back = _output_fed_back(u, states, stored)
        if fed_back:
            raise u.fail(fed_back)
        if stored:
            raise u.fail(
                f"no iteration output is used after the loop, but every iteration's state "
                f"{_named(stored[0])} is: the code after the loop reads the stored states "
                "(a list of them, stacked). ttt2la converts loops that read their state inside "
                "the loop: compute each chunk's output there from the state (o = q S) and "
                "collect the outputs instead of the states")
        nested = _nested_loops(u.iters[1], u.loop)
        if nested:
            raise u.fail(f"no iteration output is used after the loop, which "
                         f"{_around(nested[0])}")
        final = [n for n in u.iters[-1] if any(x not in u.in_loop for x in n.users)]
        if final:
            raise u.fail(
                f"no chunk is read inside the loop: it only accumulates its state, and the code "
                f"after it reads the final state {_named(final[0])} for every token — one step "
                "over the whole sequence (non-causal, as ViTTT's), written chunk by chunk. "
                "ttt2la converts such a step written without the loop (W = W + kᵀ·v over all "
                "tokens, then q·W), or a loop whose chunks read the state inside it")
        raise u.fail("no iteration output is used after the loop")
    if len(outs) != 1:
        named = "; ".join(_named(n) for n in outs)
        raise u.fail(
            f"{len(outs)} values of each iteration are used after the loop ({named}), where "
            "ttt2la converts loops with one per-chunk output beside the states they carry. Drop "
            "the others from the layer you convert (an inner loss kept for logging can come from "
            "the original layer, run on a sample), or leave this layer unconverted")
    return outs[0]


def _around(inner: LoopSite) -> str:
    """Why a loop that runs the loop over the sequence (``inner``) once per iteration is
    refused, and what to write instead."""
    return (f"runs the loop at {inner.src} once per iteration: a loop over heads (or "
            "rows) around the loop over the sequence. ttt2la converts the loop over the "
            "sequence: make the heads a batch axis of one loop over the tokens or chunks "
            "(`k[:, t]` or `k[:, s:e]` with every head, one state with a heads axis)")


def refuse_loop_around(gm: torch.fx.GraphModule, loop: LoopSite, length: int) -> None:
    """Refuse ``loop`` when a loop inside it walks the sequence of ``length`` tokens again in
    every iteration (a loop over heads around the loop over chunks): the same slices of one
    tensor's token axis come back, iteration after iteration, from inside the inner loop."""
    nodes = [n for n in gm.graph.nodes
             if n.op == "call_function" and loop_depth(n, loop) is not None]
    for group in sequence_reads(nodes, per_head=False).values():
        n = group[0]
        shape = getattr(n.args[0].meta.get("val"), "shape", None)
        if shape is None or not isinstance(n.args[1], int) or shape[n.args[1]] != length:
            continue
        starts = [m.args[2] for m in group]
        if len(set(starts)) > 1 and not walks_once(starts):
            nested = _nested_loops(group, loop)
            if nested:
                raise _fail(f"the loop takes the same tokens again in every iteration, which "
                            f"{_around(nested[0])}", loop)


def _named(node: torch.fx.Node) -> str:
    """A body value by the name its line gives it, and its op, as "`losses` (`torch.sum` at
    f.py:12)"."""
    name = assigned_name(node.meta.get(SRC))
    return f"`{name}` ({op_at(node)})" if name else describe_op(node)


# -- phase 4: order and the peeled last chunk -------------------------------------------------

@dataclass
class Tail:
    """How the chunk outputs leave the loop, and what happens to the last chunk."""

    order: str                               # "exclusive" | "inclusive" (``TTTProgram.order``)
    truncated: bool                          # the last iteration skips the update
    peeled: bool                             # the last chunk is applied after the loop
    collector: torch.fx.Node                 # the cat/stack/buffer that gathers the outputs
    axis: int                                # the axis they are joined along
    stacked: bool                            # one token per iteration, stacked
    tail_nodes: list[torch.fx.Node]          # the peeled apply after the loop
    removable: set[torch.fx.Node]            # gathering code that goes with the loop

    @property
    def last_chunk(self) -> str:
        return "apply_only" if (self.peeled or self.truncated) else "update"


def order_and_tail(u: Unrolled, inputs: Inputs, states: States,
                   out_node: torch.fx.Node) -> Tail:
    """The body's order (does its output read the updated states?), how the chunk outputs are
    gathered, and whether the last chunk is only applied — in a last iteration that skips the
    update, or after the loop — checked against the number of chunks the tokens make."""
    updated = _update_dependents(states)
    truncated = [iteration_key(n, u.depth) for n in u.iters[-1]] != \
        [iteration_key(n, u.depth) for n in u.iters[1]]
    map_last = u.in_iteration(u.n_iter - 1)
    if truncated and all(o in map_last for o in states.carried.values()):
        raise u.fail(_last_iteration_differs(u))
    if states.buffer is not None:
        collector, axis, y_tail, removable = _gathered_in_buffer(u, states.buffer)
        stacked = states.buffer.stacked
        _check_buffer_shape(u, states.buffer, collector, inputs.first)
    else:
        collector, axis, y_tail, removable = _gathered_by_cat(u, out_node)
        stacked = collector.target is aten.stack.default
    removable.add(collector)
    tail_nodes = [] if y_tail is None else _peeled_apply(u, inputs, states, updated, out_node,
                                                         y_tail)
    _check_count(u, inputs, peeled=y_tail is not None)
    return Tail("inclusive" if out_node in updated else "exclusive", truncated,
                y_tail is not None, collector, axis, stacked, tail_nodes, removable)


def _last_iteration_differs(u: Unrolled) -> str:
    """Why the last iteration is not the others' body with the update dropped: the first op
    where it departs from iteration 1, its line, and what to do."""
    last = [(iteration_key(n, u.depth), n) for n in u.iters[-1]]
    first = [(iteration_key(n, u.depth), n) for n in u.iters[1]]
    at = next((i for i, (a, b) in enumerate(zip(last, first)) if a[0] != b[0]),
              min(len(last), len(first)))
    longer = last if at < len(last) else first
    node = longer[at][1] if at < len(longer) else None
    where = f", the first of them {describe_op(node)}" if node is not None else ""
    return ("the last iteration runs other ops than the others" + where + ". That is code for "
            "a partial last chunk (padding it, an `if` on its length) or a last step of its own: "
            "ttt2la pads a partial last chunk itself, so drop that code and let the loop take "
            "the short slice as it comes")


def _update_dependents(states: States) -> set[torch.fx.Node]:
    """The body nodes that are, or read, a state's updated value."""
    state_outs = set(states.carried.values())
    dependents: set[torch.fx.Node] = set()
    for n in states.body_nodes:
        if n in state_outs or any(a in dependents for a in _input_nodes(n)):
            dependents.add(n)
    return dependents


def _gathered_in_buffer(u: Unrolled, buf: Buffer):
    """The buffer after the last write (a write after the loop is the peeled last chunk),
    its axis, the peeled chunk's output (or None) and the writes that go with the loop."""
    final_buf = u.in_iteration(u.n_iter - 1).get(buf.write)
    if final_buf is None:
        raise u.fail("the output buffer is not written in the last iteration")
    removable: set[torch.fx.Node] = set()
    for j in range(u.n_iter):
        m = u.in_iteration(j)
        removable.update(m[x] for x in buf.plumbing if x in m)
    tail_write = next((x for x in final_buf.users if x not in u.in_loop
                       and x.target is buf.write.target and x.args[0] is final_buf), None)
    if tail_write is None:
        return final_buf, buf.axis, None, removable
    y_tail, plumbing = _written_value(tail_write)
    return tail_write, buf.axis, y_tail, removable | plumbing


def _check_buffer_shape(u: Unrolled, buf: Buffer, collector: torch.fx.Node,
                        stream: ChunkStream) -> None:
    """The buffer holds exactly the outputs joined along its axis, one slot per token: a
    longer buffer, or outputs broadcast into their slots, would keep values the converted loop
    does not write."""
    shape = list(collector.meta["val"].shape)
    y = list(buf.written.meta["val"].shape)
    axis = buf.axis % len(shape)
    n = stream.source.meta["val"].shape[stream.axis]
    expected = y[:axis] + [n] + y[axis:] if buf.stacked else y[:axis] + [n] + y[axis + 1:]
    if shape != expected:
        raise UnsupportedTTTError(
            f"the output buffer {_where_assigned(buf.producer, u)} has shape {shape}, but the "
            f"loop writes outputs of shape {y} into it along axis {axis} ({_where(buf.write)}), "
            f"which join to {expected}; allocate the buffer with the outputs' shape (e.g. "
            "`torch.empty_like(v)`) and write every token once, or collect the outputs in a "
            f"list and `torch.cat`/`torch.stack` them after the loop (loop at {u.loop.src}).")


def _refuse_repeated_runs(u: Unrolled, per_iter: list, collectors: set) -> None:
    """Outputs gathered by several ``cat``/``stack`` ops, each joining a run of consecutive
    iterations: the loop ran more than once in one call (a helper called per direction, per
    image, per layer). Refused with what to do; anything else falls through."""
    runs = sorted(([per_iter.index(p) for p in c.args[0] if p in per_iter] for c in collectors
                   if c.target in (aten.cat.default, aten.stack.default)), key=min)
    flat = [i for run in runs for i in run]
    if len(runs) != len(collectors) or flat != list(range(len(per_iter))):
        return
    where = "; ".join(_where(c) for c in sorted(collectors, key=lambda c: min(
        per_iter.index(p) for p in c.args[0] if p in per_iter)))
    raise u.fail(
        f"the loop ran {len(runs)} times in one call of its module (each run's outputs joined "
        f"by its own cat/stack: {where}), as a helper called once per direction or per input "
        "does. ttt2la converts one run of a loop per call of the module that owns it: give each "
        "run its own submodule (one module per direction, each calling the helper once), and "
        "each is converted on its own.")


def _gathered_by_cat(u: Unrolled, out_node: torch.fx.Node):
    """The ``cat``/``stack`` after the loop that joins every iteration's output (one more
    piece after them is the peeled last chunk), its axis and that piece (or None)."""
    per_iter = [u.in_iteration(j).get(out_node) for j in range(u.n_iter)]
    per_iter = [p for p in per_iter if p is not None]
    collectors = {x for po in per_iter for x in po.users if x not in u.in_loop}
    if len(collectors) > 1:
        _refuse_repeated_runs(u, per_iter, collectors)
    if len(collectors) != 1:
        raise u.fail("chunk outputs are not gathered by a single cat/stack or buffer after the "
                     "loop")
    (collector,) = collectors
    if collector.target not in (aten.cat.default, aten.stack.default):
        raise u.fail(f"chunk outputs are gathered by {collector.target}, expected cat, stack or "
                     "writes into a buffer")
    pieces = list(collector.args[0])
    extra = [p for p in pieces if p not in per_iter]
    if pieces[: len(per_iter)] != per_iter or len(extra) > 1:
        first = pieces.index(per_iter[0]) if per_iter and per_iter[0] in pieces else 0
        if first and pieces[first:first + len(per_iter)] == per_iter:
            raise u.fail(
                f"the loop's outputs are joined after {first} other piece(s) "
                f"({describe_op(pieces[0])}), in one {describe_op(collector)}: join the "
                "loop's outputs alone (torch.cat(outs, 1)) and add the other piece to the joined "
                "output after it (torch.cat([first, joined], 1) or F.pad)")
        raise u.fail("the gathered outputs are not the iterations' outputs in order: join "
                     "each iteration's output, in the loop's order, in one cat or stack")
    axis = collector.args[1] if len(collector.args) > 1 else collector.kwargs.get("dim", 0)
    return collector, axis, (extra[0] if extra else None), set()


def _peeled_apply(u: Unrolled, inputs: Inputs, states: States, updated: set,
                  out_node: torch.fx.Node, y_tail: torch.fx.Node) -> list[torch.fx.Node]:
    """The code after the loop that computes the last chunk's output ``y_tail``; it must run
    the body's apply ops (those that do not read the update), slicing aside. Its ops on values
    from before the loop alone (an ``einsum``'s permute of a fixed weight) are the loop's
    hoisted ones computed again, matched against those."""
    stack, seen = [y_tail], set()
    while stack:
        n = stack.pop()
        if n in seen or n.op != "call_function" or u.order[n] < u.first_pos or n in u.in_loop:
            continue
        seen.add(n)
        stack.extend(_input_nodes(n))
    tail_nodes = sorted(seen, key=u.order.get)
    sliced = SLICE_TARGETS | SELECT_TARGETS
    moving: set[torch.fx.Node] = set()      # reads the last chunk's tokens or the loop's states
    for n in tail_nodes:
        if n.target in sliced or any(a in u.in_loop or a in moving for a in _input_nodes(n)):
            moving.add(n)
    apply_nodes = [n for n in states.body_nodes if n not in updated and
                   (n is out_node or _reaches(n, out_node))]

    ours = [n for n in tail_nodes if n in moving and n.target not in sliced]
    theirs = [n for n in apply_nodes if n.target not in sliced]
    same = _SameValues(u, inputs.hoisted, sliced)
    if [n.target for n in ours] != [n.target for n in theirs] or \
            not all(same.op(a, b) for a, b in zip(ours, theirs)):
        raise u.fail(
            f"code after the loop computes a last output ({_where(y_tail)}) that is not the "
            "loop's own apply step, joined with the loop's outputs as if it were their last "
            "chunk. Let the loop take the last, partial chunk itself (range(0, L, C)), or join "
            "the loop's outputs alone and the other piece after them "
            "(torch.cat([torch.cat(outs, 1), rest], 1)), which converts for lengths that are "
            "multiples of the chunk")
    return tail_nodes


#: Ops whose two operands may be given in either order.
_COMMUTATIVE = frozenset({aten.mul.Tensor, aten.add.Tensor})


class _SameValues:
    """Whether an op after the loop computes what an op of the loop body does: its arguments
    are the same values — past slicing (the last chunk's tokens, a partial one's shape aside),
    the same value from before the loop, the loop's ops matched so far (``op``), a state, or
    loop-invariant code computed again after the loop (the same ops on the same values)."""

    def __init__(self, u: Unrolled, hoisted: set, sliced: frozenset):
        self.u, self.hoisted, self.sliced = u, hoisted, sliced
        self.matched: dict[torch.fx.Node, torch.fx.Node] = {}

    def _origin(self, n):
        while isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in self.sliced:
            n = n.args[0]
        return n

    def op(self, ours: torch.fx.Node, theirs: torch.fx.Node) -> bool:
        ok = self._args(ours, theirs)
        self.matched[ours] = theirs
        return ok

    def _args(self, ours: torch.fx.Node, theirs: torch.fx.Node) -> bool:
        a = [*ours.args, *ours.kwargs.values()]
        b = [*theirs.args, *theirs.kwargs.values()]
        if len(a) != len(b) or list(ours.kwargs) != list(theirs.kwargs):
            return False
        if all(self._value(x, y) for x, y in zip(a, b)):
            return True
        # ``hh.mul_(gate)`` in the loop, ``gate * hh`` after it: the same product
        return ours.target in _COMMUTATIVE and len(ours.args) == 2 and not ours.kwargs and \
            self._value(a[0], b[1]) and self._value(a[1], b[0])

    def _value(self, x, y) -> bool:
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and all(self._value(p, q) for p, q in zip(x, y))
        if not isinstance(x, torch.fx.Node) or not isinstance(y, torch.fx.Node):
            # sizes follow the chunk's length; every other number must be the same
            return isinstance(x, int) and isinstance(y, int) or x == y
        x, y = self._origin(x), self._origin(y)
        if x is y:
            return True
        if x in self.matched:
            return self.matched[x] is y
        u = self.u
        if x in u.in_loop and y in u.in_loop:
            return True                     # a state: the last one, as the body reads its own
        return (x.op == "call_function" and u.order[x] >= u.first_pos and y in self.hoisted
                and x.target == y.target and self._args(x, y))


def _check_count(u: Unrolled, inputs: Inputs, peeled: bool) -> None:
    """The loop ran once per chunk of the sequence its first stream is sliced from (one fewer
    when the last chunk is applied after it)."""
    stream = inputs.first
    seq_len = stream.source.meta["val"].shape[stream.axis]
    n_chunks = seq_len if stream.per_token else -(-seq_len // stream.chunk)
    expected = n_chunks - 1 if peeled else n_chunks
    whole = seq_len // stream.chunk - (1 if peeled else 0)
    if u.n_iter != expected and not stream.per_token and u.n_iter == whole:
        raise u.fail(f"the loop ran {u.n_iter} iterations over {seq_len} tokens in chunks of "
                     f"{stream.chunk}, leaving the last {seq_len % stream.chunk} tokens out; such "
                     f"a layer converts from example inputs whose length is a multiple of "
                     f"{stream.chunk}", WholeChunksOnly)
    table = _longer_table(u, inputs, peeled) if u.n_iter != expected else None
    if table is not None:
        raise u.fail(table)
    if u.n_iter != expected:
        raise u.fail(f"the loop ran {u.n_iter} iterations over {seq_len} tokens in chunks of "
                     f"{stream.chunk}; expected {expected}")



def _longer_table(u: Unrolled, inputs: Inputs, peeled: bool) -> str | None:
    """Why the loop ran fewer iterations than its first stream has chunks, where another
    stream's tokens account for them: the first is a table longer than the sequence (rotary
    angles, a rate per position, sized for the longest sequence), read at the loop's index."""
    def chunks(s: ChunkStream) -> int:
        n = s.source.meta["val"].shape[s.axis]
        return (n if s.per_token else -(-n // s.chunk)) - (1 if peeled else 0)
    counted = [s for s in inputs.streams.values() if chunks(s) == u.n_iter]
    longer = [(n, s) for n, s in inputs.streams.items() if chunks(s) > u.n_iter]
    if not counted or not longer:
        return None
    node, s = longer[0]
    rows = s.source.meta["val"].shape[s.axis]
    tokens = counted[0].source.meta["val"].shape[counted[0].axis]
    name = stream_name(node.meta.get(SRC), 0, 1) or "the table"
    return (f"{describe_op(node)} reads {name}, which has {rows} rows, one "
            f"{'row' if s.per_token else 'chunk of rows'} per iteration, where the traced "
            f"sequence has {tokens} tokens: a table sized for the longest sequence (rotary angles, a rate per "
            f"position). Slice it to the sequence's length before the loop (`{name}[:T]`), so "
            "the loop reads it as a stream of the sequence")

# -- phase 5: the body ------------------------------------------------------------------------

def extract_body(u: Unrolled, inputs: Inputs, states: States, out_node: torch.fx.Node,
                 tail: Tail, module_path: str = "") -> TTTProgram:
    """Iteration 1 as the program's body: ``(*states, *streams, *invariants) -> (*states_out,
    chunk_output)`` (the convention of ``ttt2la.ir``), with names from the user's source."""
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    taken: set[str] = set()
    state_specs = _state_placeholders(u, states, body, env, taken)
    stream_specs = _stream_placeholders(inputs, states, body, env, taken)
    inv_specs = []
    state_names = {spec.name for spec in state_specs}
    for a in states.invariants:
        name = unique(_invariant_name(a, inputs.hoisted, state_names), taken)
        ph = placeholder(body, name)
        ph.meta.update(val=a.meta.get("val"), **{KIND: "invariant", NAME: name})
        value = _input_free_value(a)
        if value is not None:
            ph.meta[INPUT_FREE] = value
        env[a] = ph
        val = a.meta["val"]
        inv_specs.append(InvariantSpec(name, tuple(val.shape), val.dtype))
    for n in states.body_nodes:
        new = body.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        env[n] = new
    body.output(tuple(env[o] for o in states.carried.values()) + (env[out_node],))
    _materialize_shape_only(body)
    select_writes_as_slice_writes(body)     # run vmapped: see slice_assignments
    body_gm = graph_module(torch.nn.Module(), body)
    out_axis = tail.axis if tail.axis >= 0 else \
        tail.axis + out_node.meta["val"].dim() + int(tail.stacked)
    program = TTTProgram(
        body=body_gm, states=state_specs, streams=stream_specs, invariants=inv_specs,
        outputs=[OutputSpec("o", axis=out_axis, per_token=tail.stacked,
                            memory_order=memory_order(tail.collector.meta["val"]))],
        chunk_size=inputs.first.chunk, order=tail.order, last_chunk=tail.last_chunk,
        module_path=module_path, loop_src=u.loop.src, function=u.loop.function,
    )
    program.outputs[0].items = _joins_items(program, states, tail)
    return program


def _joins_items(program: TTTProgram, states: States, tail: Tail) -> bool:
    """Whether the loop's joined outputs are items of another count than the traced tokens
    (one per chunk, or a chunk's tokens with a summary beside them): told by the traced join's
    extent, which tokens make the traced length — also where a chunk's items happen to be as
    many as its tokens, and the partial last chunk's are not."""
    if tail.stacked:
        return False
    joined = tail.collector.meta["val"].shape[tail.axis]
    lengths = {int(states.invariants[s.source].meta["val"].shape[s.axis])
               for s in program.streams}
    if len(lengths) != 1 or joined in lengths:
        return False
    return not _cut_back_to(tail.collector, tail.axis, *lengths)


def _cut_back_to(joined: torch.fx.Node, axis: int, length: int) -> bool:
    """Whether the code after the loop cuts the joined outputs back to ``length`` along
    ``axis``, and reads nothing else of them: tokens of chunks the code padded itself (a last
    window padded to its full size, as Titans' memory pads it)."""
    rank = joined.meta["val"].dim()
    return bool(joined.users) and all(
        u.target is aten.slice.Tensor and len(u.args) >= 4 and u.args[1] % rank == axis % rank
        and u.args[2] in (0, None) and u.args[3] == length for u in joined.users)


#: Ops whose value depends on their arguments alone, evaluated for ``_input_free_value``.
_INPUT_FREE_OPS = frozenset({torch.ops.aten.eye.default, torch.ops.aten.eye.m})


def _input_free_value(a: torch.fx.Node) -> torch.Tensor | None:
    """The value (float64, on the CPU) of an invariant the code before the loop makes from
    Python numbers alone (``torch.eye(d)``), or None: any other invariant may differ between
    calls."""
    if a.op != "call_function" or a.target not in _INPUT_FREE_OPS or a.all_input_nodes:
        return None
    kwargs = {k: v for k, v in a.kwargs.items() if k not in ("device", "pin_memory", "layout")}
    kwargs["dtype"] = torch.float64
    with unset_fake_temporarily():
        try:
            return a.target(*a.args, **kwargs)
        except (RuntimeError, TypeError):
            return None


def _invariant_name(a: torch.fx.Node, hoisted: set, state_names: set[str]) -> str:
    """An invariant's name: what its line assigns; for hoisted code written inside a state's
    update (``W = W + k * scale[:, None]``), the name of the hoisted value it is computed from
    (``scale``) rather than the state's."""
    n = a
    while n in hoisted:
        name = assigned_name(n.meta.get(SRC))
        if name and name not in state_names:
            return name
        ins = [x for x in _input_nodes(n) if x in hoisted]
        if len(ins) != 1:
            break
        n = ins[0]
    return assigned_name(a.meta.get(SRC)) or _named_source(n) or a.name


def _named_source(n: torch.fx.Node) -> str | None:
    """For a value whose line binds no name (a helper's ``return g.unsqueeze(-1) * S``), the
    name of the one named tensor it is computed from (``g``), not the trace's ``unsqueeze_4``."""
    names = {name for x in _input_nodes(n) if isinstance(x.meta.get("val"), torch.Tensor)
             and (name := assigned_name(x.meta.get(SRC)) or
                  (x.target.rsplit(".", 1)[-1] if x.op == "get_attr" else None))}
    return names.pop() if len(names) == 1 else None


def _state_placeholders(u: Unrolled, states: States, body: torch.fx.Graph, env: dict,
                        taken: set) -> list[StateSpec]:
    """One placeholder per carried state, named after the line that updates it."""
    producers = list(states.carried)
    firsts = [assigned_name(states.initial[p].meta.get(SRC))
              if isinstance(states.initial.get(p), torch.fx.Node) else None for p in producers]
    initials = [states.initial.get(p) if isinstance(states.initial.get(p), torch.fx.Node) else None
                for p in producers]
    guessed = state_names([states.carried[p] for p in producers], u.depth, firsts,
                          keyed_initial_names(initials))
    return [state_input(body, p, states.carried[p], unique(guessed[i] or f"state{i}", taken),
                        env) for i, p in enumerate(producers)]


def _stream_placeholders(inputs: Inputs, states: States, body: torch.fx.Graph, env: dict,
                         taken: set) -> list[StreamSpec]:
    """One placeholder per stream, named after the tensor it slices; the same slice taken twice
    (``k[:, i, :, None]`` and ``k[:, i].unsqueeze(-1)``) is one stream, so the body reads one
    value where the code reads one."""
    specs = []
    per_line: dict = {}
    seen: dict = {}
    on_line = Counter(s.meta.get(SRC) for s in inputs.streams)
    for s, stream in inputs.streams.items():
        same = (stream.source, stream.axis, stream.per_token)
        if same in seen and _same_slice(seen[same].meta.get("val"), s.meta.get("val")):
            env[s] = seen[same]
            continue
        loc = s.meta.get(SRC)
        k = per_line.get(loc, 0)
        per_line[loc] = k + 1
        name = unique(s.meta.get(PIECE_NAME) or stream_name(loc, k, on_line[loc]) or "x", taken)
        ph = placeholder(body, name)
        ph.meta.update(val=s.meta.get("val"), **{KIND: "stream", NAME: name})
        env[s] = seen[same] = ph
        specs.append(StreamSpec(name, source=states.invariants.index(stream.source),
                                axis=stream.axis, per_token=stream.per_token))
    return specs


def _same_slice(a, b) -> bool:
    """Two slices of one source along one axis, as the trace saw them: same shape and layout."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


# -- phase 6: the outer graph -----------------------------------------------------------------

def rewrite_outer(u: Unrolled, inputs: Inputs, states: States, tail: Tail) -> None:
    """Rewrite ``u.gm`` in place into the outer graph: the loop and the peeled last chunk
    become one ``call_module`` to ``LOOP_MODULE`` (the convention of ``ttt2la.ir``), the
    code after the loop reads its assembled output and final states."""
    graph = u.gm.graph
    removable = ((u.in_loop - inputs.hoisted) | set(tail.tail_nodes) | tail.removable) \
        - states.init_nodes
    last = u.n_iter - 1 if not tail.truncated else u.n_iter - 2   # the last that updates
    finals = [u.in_iteration(last)[out1] for out1 in states.carried.values()]
    call, got_out, got_states = _insert_loop_call(u, states)
    tail.collector.replace_all_uses_with(_in_buffer_dtype(graph, got_out, states, tail))
    for i, (out1, final) in enumerate(zip(states.carried.values(), finals)):
        for j in range(u.n_iter):
            node = u.in_iteration(j).get(out1)
            if node is None:
                continue
            for x in list(node.users):
                if x not in removable:
                    if node is not final:
                        raise u.fail("code after the loop reads a state from before the last "
                                     "update")
                    x.replace_input_with(node, got_states[i])
    for n in reversed(list(graph.nodes)):
        if n in removable:
            if n.users and any(x not in removable for x in n.users):
                bad = next(x for x in n.users if x not in removable)
                raise u.fail(f"code after the loop ({describe_op(bad)}) reads a value from "
                             f"inside it ({describe_op(n)}): return what the code after the "
                             "loop needs as a carried state or an output of the loop")
            graph.erase_node(n)
    graph.eliminate_dead_code()
    _contiguous_inputs(graph)
    graph.lint()


def _in_buffer_dtype(graph: torch.fx.Graph, got_out: torch.fx.Node, states: States,
                     tail: Tail) -> torch.fx.Node:
    """The loop's output as the buffer holds it: a buffer of another dtype than the outputs
    written into it (``torch.zeros(B, L, D)`` for float64 outputs) casts them."""
    if states.buffer is None:
        return got_out
    want, got = tail.collector.meta["val"], states.buffer.written.meta["val"]
    if want.dtype == got.dtype:
        return got_out
    with graph.inserting_after(got_out):
        cast = graph.call_function(aten._to_copy.default, (got_out,), {"dtype": want.dtype})
    cast.meta["val"] = want
    return cast


def _insert_loop_call(u: Unrolled, states: States):
    """``call_module(LOOP_MODULE, (*initial_states, *invariants))`` after the last value it
    reads (a state that starts at zero gets a ``zeros``), and a ``getitem`` per result."""
    graph = u.gm.graph
    anchor = max([*states.invariants, *[v for v in states.initial.values()
                                         if isinstance(v, torch.fx.Node)]], key=u.order.get)
    if not hasattr(u.gm, LOOP_MODULE):
        u.gm.add_submodule(LOOP_MODULE, torch.nn.Module())   # replaced by the lowered plan
    init_args = []
    for p in states.carried:
        v0 = states.initial[p]
        if v0 is ZERO:
            val = p.meta["val"]
            with graph.inserting_after(anchor):
                v0 = graph.call_function(aten.zeros.default, (list(val.shape),),
                                         {"dtype": val.dtype, "device": val.device})
            v0.meta["val"] = val
            v0.meta[SKIPPED_FIRST] = True
        init_args.append(v0)
    nodes = [a for a in init_args if isinstance(a, torch.fx.Node)]
    anchor = max([anchor, *nodes], key=lambda n: u.order.get(n, len(u.order)))
    with graph.inserting_after(anchor):
        call = graph.call_module(LOOP_MODULE, tuple(init_args) + tuple(states.invariants))
    with graph.inserting_after(call):
        got_out = graph.call_function(operator.getitem, (call, 0))
    got_states = []
    for i in range(len(states.carried)):
        with graph.inserting_after(got_out if not got_states else got_states[-1]):
            got_states.append(graph.call_function(operator.getitem, (call, 1 + i)))
    return call, got_out, got_states


def _initialisation(v0: torch.fx.Node, first: set, in_loop: set, hoisted: set,
                    slices: set) -> set[torch.fx.Node] | None:
    """The first-iteration nodes that compute a state's initial value ``v0``, when they read
    nothing the loop produces or slices (``if W is None: W = self.w.expand(...)``), else None."""
    made, stack = set(), [v0]
    while stack:
        n = stack.pop()
        if n in made or n not in in_loop or n in hoisted:
            continue
        if n not in first or n in slices:
            return None
        made.add(n)
        stack.extend(_input_nodes(n))
    return made


def state_input(body: torch.fx.Graph, node: torch.fx.Node, updated: torch.fx.Node, name: str,
                env: dict) -> StateSpec:
    """A state placeholder of ``body`` standing for ``node`` (recorded in ``env``), and its spec;
    ``updated`` computes the state's next value (the line the report names)."""
    ph = placeholder(body, name)
    ph.meta.update(val=node.meta.get("val"), **{KIND: "state", NAME: name})
    env[node] = ph
    val = node.meta["val"]
    return StateSpec(name, tuple(val.shape), val.dtype, src=updated.meta.get(SRC))


def _contiguous_inputs(graph: torch.fx.Graph) -> None:
    """Let the outer graph take inputs of any memory layout without copying them.

    The layer is traced on contiguous copies of its inputs, so the trace may ``view`` them in
    ways that only a contiguous tensor allows. Every ``view`` becomes a ``reshape`` (a view
    where the layout allows one, a copy only where it does not), so a transposed or sliced input
    is read where it lies. A graph that reads raw strides (``as_strided``) gets every tensor
    input made contiguous first instead (``contiguous`` returns a contiguous input itself).
    """
    if not any(n.target is aten.as_strided.default for n in graph.nodes):
        reshape_views(graph)
        return
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not ph.users:
            continue
        users = list(ph.users)
        with graph.inserting_after(ph):
            c = graph.call_function(aten.contiguous.default, (ph,))
        c.meta = dict(ph.meta)
        for u in users:
            u.replace_input_with(ph, c)


def _materialize_shape_only(graph: torch.fx.Graph) -> None:
    """Replace fills shaped like a tensor (``zeros_like(x)``, ``ones_like(x)``, ``new_full``…) by
    ``full(shape, value)`` (an uninitialised ``empty_like`` by zeros).

    They read only ``x``'s shape, but as graph edges they make a value look like it depends on
    ``x`` — ``torch.func.grad`` seeds its backward with ``ones_like(loss)``, which would tie a
    gradient to the fast weights the loss was computed with.
    """
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if calls(node, TENSOR_SHAPED_FILLS):
            val = node.meta.get("val")
            fill = 0.0 if calls(node, EMPTY_FILLS) else fill_value(node)
            if val is None or fill is None:
                continue
            with graph.inserting_before(node):
                full = graph.call_function(aten.full.default, (list(val.shape), fill),
                                           {"dtype": val.dtype, "device": val.device})
            full.meta = dict(node.meta)
            node.replace_all_uses_with(full)
            graph.erase_node(node)


def _reaches(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    stack, seen = list(a.users), set()
    while stack:
        n = stack.pop()
        if n is b:
            return True
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.users)
    return False


__all__ = ["roll_up", "RolledLoop", "LOOP_MODULE"]
