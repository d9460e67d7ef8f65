"""Roll an unrolled loop back up: from a traced layer to a ``TTTProgram`` plus its outer graph.

Given the aten graph of a layer's forward (``capture.trace``) and the loop site that holds the
TTT inner loop, ``roll_up`` finds, from the copies of the loop body:

* the **carried states** — values iteration j produces and iteration j+1 reads;
* the **chunk streams** — ``slice``/``select`` of a loop-invariant tensor whose offset moves by
  the chunk size (or by one token) from one iteration to the next;
* the **invariants** — values every iteration reads unchanged (loop-invariant code inside the
  loop is hoisted);
* the **chunk outputs** — what each iteration hands to code after the loop (``cat``/``stack``);
* a **peeled last chunk** — LaCT applies the last chunk without updating, either after the loop
  (a *tail* that repeats the body's apply ops) or in a last iteration whose update is skipped.

The body of the middle iteration becomes ``TTTProgram.body``; the rest of the layer becomes the
*outer graph*, in which the whole loop is one ``call_module`` to ``ttt_loop`` taking
``(*initial_states, *invariants)`` and returning ``(*assembled_outputs, *final_states)``.
"""
from __future__ import annotations

import ast
import difflib
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import UnsupportedTTTError
from ..ir import (KIND, NAME, SRC, InvariantSpec, OutputSpec, SourceLoc, StateSpec, StreamSpec,
                  TTTProgram, memory_order, reshape_views)
from .capture import FRAMES
from .loops import LoopSite, count_iterations, iteration_key, loop_depth, split_iterations

aten = torch.ops.aten
LOOP_MODULE = "ttt_loop"
_SLICE = (aten.slice.Tensor,)
_SELECT = (aten.select.int,)
ZERO = object()   # initial value of a state the first iteration does not read: zeros


@dataclass
class RolledLoop:
    """The result of rolling a loop up: the program and the graph around it."""

    program: TTTProgram
    outer: torch.fx.GraphModule            # with a ``call_module`` node targeting LOOP_MODULE
    n_iterations: int
    tail: bool                             # last chunk applied after the loop
    notes: list[str] = field(default_factory=list)


def _fail(msg: str, loop: LoopSite) -> UnsupportedTTTError:
    return UnsupportedTTTError(f"{msg} (loop at {loop.src}). ttt2la recognizes loops over chunks "
                               "or tokens that carry fast weights from one iteration to the next.")


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


def _assigned_names(src: SourceLoc | None) -> list[str] | None:
    """The names a line assigns: ``[W]`` for ``W = ...``, ``[W, b]`` for ``W, b = ...``."""
    if src is None or not src.code:
        return None
    try:
        tree = ast.parse(src.code.strip().rstrip(":"))
    except SyntaxError:
        return None
    stmt = tree.body[0] if tree.body else None
    if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            return [e.id for e in target.elts]
    return None


def _assigned_name(src: SourceLoc | None) -> str | None:
    names = _assigned_names(src)
    return "_".join(names) if names else None


def _stream_name(loc: SourceLoc | None, k: int, n: int) -> str | None:
    """The name of the ``k``-th of ``n`` streams sliced on one line: the sliced tensor's name
    (``q[:, s:e]``) when the line names one per stream, else the name it is assigned to
    (``lr0, lr1, lr2 = (t[:, s:e] for t in lrs)``)."""
    sliced = _sliced_names(loc)
    if n <= len(sliced):
        return sliced[k]
    assigned = _assigned_names(loc) or []
    if n == len(assigned):
        return assigned[k]
    return sliced[k] if k < len(sliced) else _assigned_name(loc)


def _state_names(outs: list[torch.fx.Node], depth: int,
                 first: list[str | None]) -> list[str | None]:
    """A name per carried state, from the statement that assigns its new value.

    The innermost frame that assigns one name gives it. A state assigned by a tuple
    (``W, b = step(W, b, ...)``) takes the name its initial value was assigned to when that is
    one of the tuple's (``first``), else the element at its place when the states that line
    assigns are as many as its names (their values are computed in the tuple's order).
    """
    names: list[str | None] = [None] * len(outs)
    tuples: dict[tuple, list[int]] = {}
    for i, out in enumerate(outs):
        frames = out.meta.get(FRAMES, ())[depth:] or ((out.meta.get(SRC),) if SRC in out.meta
                                                      else ())
        for frame in reversed(frames):
            got = _assigned_names(frame)
            if got and len(got) == 1:
                names[i] = got[0]
                break
            if got:
                tuples.setdefault((frame.file, frame.line, tuple(got)), []).append(i)
                break
    order = {n: k for k, n in enumerate(outs[0].graph.nodes)} if outs else {}
    for (_f, _l, got), members in tuples.items():
        members.sort(key=lambda i: order.get(outs[i], 0))
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


def _sliced_names(src: SourceLoc | None) -> list[str]:
    """The variables a line indexes, in order: ``qi = q[:, i:i+C]; ki = k[...]`` -> [q, k]."""
    if src is None or not src.code:
        return []
    try:
        tree = ast.parse(src.code.strip().rstrip(":"))
    except SyntaxError:
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            value = node.value
            if isinstance(value, ast.Name):
                names.append(value.id)
            elif isinstance(value, ast.Attribute):
                names.append(value.attr)
    return names


def _unique(name: str, taken: set[str]) -> str:
    base, i = name, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def roll_up(gm: torch.fx.GraphModule, loop: LoopSite, depth: int, *,
            module_path: str = "") -> RolledLoop:
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    loop_nodes = [n for n in nodes if n.op == "call_function" and loop_depth(n, loop) is not None]
    iters = split_iterations(loop_nodes, depth, count_iterations(loop_nodes), loop)
    n_iter = len(iters)
    if n_iter < 3:
        raise _fail(f"the loop ran {n_iter} iteration(s) at the traced shape; at least 3 are "
                    "needed to tell carried state from streams", loop)
    in_loop = set(loop_nodes)
    first_loop_pos = order[loop_nodes[0]]
    I0, I1, I2 = iters[0], iters[1], iters[2]
    k1 = [iteration_key(n, depth) for n in I1]
    if k1 != [iteration_key(n, depth) for n in I2]:
        raise _fail("iterations 1 and 2 run different ops; data-dependent control flow inside "
                    "the loop is not supported", loop)
    to2 = dict(zip(I1, I2))
    to0 = {v: k for k, v in _align(I0, I1, depth).items()}   # I1 node -> I0 node
    set1 = set(I1)
    set0 = set(I0)

    # -- classify the inputs of iteration 1 -------------------------------------------------
    hoisted: set[torch.fx.Node] = set()
    streams: dict[torch.fx.Node, tuple] = {}                  # I1 node -> (source, axis, C, per_token)

    def outside(n):
        return n not in in_loop and order[n] < first_loop_pos

    def same_modulo(a1, a2):
        if isinstance(a1, torch.fx.Node):
            if a1 in hoisted or a1 in streams:
                return to2.get(a1) is a2
            return a1 is a2
        return a1 == a2

    chunk = None
    for n in I1:
        ins = _input_nodes(n)
        if not all(outside(a) or a in hoisted for a in ins):
            continue
        a1, a2 = _flat_args(n), _flat_args(to2[n])
        if len(a1) == len(a2) and all(same_modulo(x, y) for x, y in zip(a1, a2)):
            hoisted.add(n)
            continue
        src = n.args[0]
        if n.target in _SLICE and to2[n].args[0] is src:
            dim = n.args[1]
            start1, end1 = n.args[2], n.args[3]
            start2, end2 = to2[n].args[2], to2[n].args[3]
            c = start2 - start1
            if c > 0 and end1 - start1 == c and end2 - start2 == c and start1 == c:
                if chunk not in (None, c):
                    raise _fail(f"streams are sliced with chunk sizes {chunk} and {c}", loop)
                chunk = c
                streams[n] = (src, dim, c, False)
                continue
        if n.target in _SELECT and to2[n].args[0] is src:
            dim, i1, i2 = n.args[1], n.args[2], to2[n].args[2]
            if i1 == 1 and i2 == 2:
                if chunk not in (None, 1):
                    raise _fail("the loop mixes per-token and per-chunk slicing", loop)
                chunk = 1
                streams[n] = (src, dim, 1, True)
                continue
        raise _fail(f"iteration input {n.format_node()} changes between iterations in a way "
                    "that is neither a chunk slice nor carried state", loop)
    if not streams:
        raise _fail("no chunk streams: the loop does not slice the sequence", loop)

    body_nodes = [n for n in I1 if n not in hoisted and n not in streams]
    carried: dict[torch.fx.Node, torch.fx.Node] = {}         # I0 producer -> I1 state-out
    notes: list[str] = []
    initial: dict[torch.fx.Node, object] = {}                 # I0 producer -> initial value
    invariants: list[torch.fx.Node] = []

    def note_invariant(a):
        if a not in invariants:
            invariants.append(a)

    for n in body_nodes:
        for pos, a in enumerate(_flat_args(n)):
            if not isinstance(a, torch.fx.Node):
                continue
            if a in hoisted:
                note_invariant(a)
                continue
            if a in set1:
                continue
            if a in set0:
                # what iteration 2 reads in the same place is iteration 1's state-out
                got2 = _flat_args(to2[n])[pos]
                if not (isinstance(got2, torch.fx.Node) and got2 in set1):
                    raise _fail(f"{a.format_node()} is read from the previous iteration, but "
                                "the next iteration reads something else there", loop)
                if carried.get(a, got2) is not got2:
                    raise _fail(f"{a.format_node()} is carried into two different values", loop)
                carried[a] = got2
                c0 = to0.get(n)
                v0 = ZERO if c0 is None else _flat_args(c0)[pos]
                if v0 is ZERO and a in initial:
                    continue
                if a in initial and initial[a] is not ZERO and initial[a] is not v0:
                    raise _fail("a carried value starts from two different initial values", loop)
                initial[a] = v0
            elif outside(a) or a in hoisted:
                note_invariant(a)
            elif a in in_loop:
                raise _fail(f"{n.format_node()} reads a value from an iteration two steps back",
                            loop)
            else:
                raise _fail(f"{n.format_node()} reads {a.format_node()}, defined after the loop",
                            loop)
    first_slices = {to0[x] for x in streams if x in to0}
    init_nodes: set[torch.fx.Node] = set()       # first-iteration code that only initialises
    for p, v0 in initial.items():
        if v0 is ZERO:
            notes.append(f"the first iteration skips the use of {p.name}: it starts at zero")
        if isinstance(v0, torch.fx.Node) and (v0 in in_loop and v0 not in hoisted):
            made = _initialisation(v0, set0, in_loop, hoisted, first_slices)
            if made is None:
                raise _fail("the initial value of a carried state is computed inside the loop "
                            "from the first chunk", loop)
            init_nodes |= made
            notes.append(f"the first iteration initialises {p.name}; that code runs before "
                         "the loop")
    for s, (src, *_rest) in streams.items():
        note_invariant(src)

    # -- output buffers: ``out[..., i:i+C] = y`` (a carried tensor written chunk by chunk) ------
    src0, axis0, C, per_token = next(iter(streams.values()))
    buffers = {}
    for p, o1 in carried.items():
        if o1.target is aten.slice_scatter.default and o1.args[0] is p:
            written = o1.args[1]
            y = written.args[1] if written.target is aten.copy.default else written
            dim, s_, e_ = o1.args[2], o1.args[3], o1.args[4]
            step = 1 if per_token else C
            if s_ == step and e_ == 2 * step:
                plumbing = {o1, written}
                if written.target is aten.copy.default:
                    plumbing.add(written.args[0])
                buffers[p] = (y, dim, plumbing)
    if len(buffers) > 1:
        raise _fail("more than one output buffer is written inside the loop", loop)
    buffer_plumbing = set().union(*(b[2] for b in buffers.values())) if buffers else set()
    carried_all = dict(carried)
    for p in buffers:
        del carried[p]
        initial.pop(p, None)
    body_nodes = [n for n in body_nodes if n not in buffer_plumbing]

    # -- chunk outputs: iteration-1 values read after the loop ------------------------------
    if buffers:
        chunk_outputs = [next(iter(buffers.values()))[0]]
    else:
        chunk_outputs = [n for n in body_nodes
                         if any(u not in in_loop for u in n.users) and n not in carried.values()]
    if not chunk_outputs:
        raise _fail("no iteration output is used after the loop", loop)
    if len(chunk_outputs) != 1:
        raise _fail("more than one per-chunk output", loop)
    out_node = chunk_outputs[0]

    producers = list(carried)

    def iteration_map(j):
        return _align(I1, iters[j], depth)

    # -- order and the peeled last chunk ----------------------------------------------------
    state_outs = set(carried.values())
    depends_on_update = set()
    for n in body_nodes:
        if n in state_outs or any(a in depends_on_update for a in _input_nodes(n)):
            depends_on_update.add(n)
    order_kind = "inclusive" if out_node in depends_on_update else "exclusive"

    last = iters[-1]
    truncated = [iteration_key(n, depth) for n in last] != k1
    map_last = iteration_map(n_iter - 1)
    if truncated and all(o in map_last for o in state_outs):
        raise _fail("the last iteration differs from the others", loop)

    per_iter = [iteration_map(j).get(out_node) for j in range(n_iter)]
    per_iter = [p for p in per_iter if p is not None]
    removable_extra: set[torch.fx.Node] = set()
    y_tail = None
    if buffers:
        (bp,) = buffers
        buf_dim = buffers[bp][1]
        final_buf = iteration_map(n_iter - 1).get(carried_all[bp])
        if final_buf is None:
            raise _fail("the output buffer is not written in the last iteration", loop)
        for j in range(n_iter):
            m = iteration_map(j)
            removable_extra.update(m[x] for x in buffers[bp][2] if x in m)
        users = [u for u in final_buf.users if u not in in_loop]
        tail_write = next((u for u in users if u.target is aten.slice_scatter.default
                           and u.args[0] is final_buf), None)
        replaced = final_buf
        if tail_write is not None:
            written = tail_write.args[1]
            y_tail = written.args[1] if written.target is aten.copy.default else written
            removable_extra.update({tail_write, written})
            if written.target is aten.copy.default:
                removable_extra.add(written.args[0])
            replaced = tail_write
        collector, cat_dim, stacked = replaced, buf_dim, per_token
    else:
        collectors = set()
        for po in per_iter:
            collectors.update(u for u in po.users if u not in in_loop)
        if len(collectors) != 1:
            raise _fail("chunk outputs are not gathered by a single cat/stack or buffer after "
                        "the loop", loop)
        collector = collectors.pop()
        if collector.target not in (aten.cat.default, aten.stack.default):
            raise _fail(f"chunk outputs are gathered by {collector.target}, expected cat, stack "
                        "or writes into a buffer", loop)
        pieces = list(collector.args[0])
        extra = [p for p in pieces if p not in per_iter]
        if pieces[: len(per_iter)] != per_iter or len(extra) > 1:
            raise _fail("the gathered outputs are not the iterations' outputs in order", loop)
        y_tail = extra[0] if extra else None
        cat_dim = collector.args[1] if len(collector.args) > 1 else collector.kwargs.get("dim", 0)
        stacked = collector.target is aten.stack.default
    removable_extra.add(collector)

    tail_nodes: list[torch.fx.Node] = []
    if y_tail is not None:
        stack, seen = [y_tail], set()
        while stack:
            n = stack.pop()
            if n in seen or n.op != "call_function" or order[n] < first_loop_pos or n in in_loop:
                continue
            seen.add(n)
            stack.extend(_input_nodes(n))
        tail_nodes = sorted(seen, key=order.get)
        apply_nodes = [n for n in body_nodes if n not in depends_on_update and
                       (n is out_node or _reaches(n, out_node))]
        strip = lambda ns: [n.target for n in ns if n.target not in _SLICE + _SELECT]  # noqa: E731
        if strip(tail_nodes) != strip(apply_nodes):
            raise _fail("code after the loop computes a last output that is not the loop's own "
                        "apply step", loop)
    extra = y_tail is not None
    last_chunk = "apply_only" if (extra or truncated) else "update"

    # -- check the iteration count against the chunking rule --------------------------------
    seq_len = src0.meta["val"].shape[axis0]
    n_chunks = seq_len if per_token else -(-seq_len // C)
    expected = n_chunks - 1 if extra else n_chunks
    if n_iter != expected:
        raise _fail(f"the loop ran {n_iter} iterations over {seq_len} tokens in chunks of {C}; "
                    f"expected {expected}", loop)

    # -- build the body graph ---------------------------------------------------------------
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    taken: set[str] = set()
    state_specs, stream_specs, inv_specs = [], [], []
    firsts = [_assigned_name(initial[p].meta.get(SRC)) if isinstance(initial.get(p), torch.fx.Node)
              else None for p in producers]
    guessed = _state_names([carried[p] for p in producers], depth, firsts)
    for i, p in enumerate(producers):
        out = carried[p]
        state_specs.append(state_input(body, p, out, _unique(guessed[i] or f"state{i}", taken),
                                       env))
    stream_items = list(streams.items())
    per_line: dict = {}
    on_line = Counter(s.meta.get(SRC) for s, _ in stream_items)
    for s, (src, axis, _c, pt) in stream_items:
        loc = s.meta.get(SRC)
        k = per_line.get(loc, 0)
        per_line[loc] = k + 1
        name = _unique(_stream_name(loc, k, on_line[loc]) or "x", taken)
        ph = body.placeholder(name)
        ph.meta.update(val=s.meta.get("val"), **{KIND: "stream", NAME: name})
        env[s] = ph
        stream_specs.append(StreamSpec(name, source=invariants.index(src), axis=axis,
                                       per_token=pt))
    for i, a in enumerate(invariants):
        name = _unique(_assigned_name(a.meta.get(SRC)) or a.name, taken)
        ph = body.placeholder(name)
        ph.meta.update(val=a.meta.get("val"), **{KIND: "invariant", NAME: name})
        env[a] = ph
        val = a.meta["val"]
        inv_specs.append(InvariantSpec(name, tuple(val.shape), val.dtype))
    for n in body_nodes:
        new = body.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        env[n] = new
    body.output(tuple(env[carried[p]] for p in producers) + (env[out_node],))
    _materialize_shape_only(body)
    body_gm = torch.fx.GraphModule(torch.nn.Module(), body)

    out_axis = cat_dim if cat_dim >= 0 else cat_dim + out_node.meta["val"].dim() + int(stacked)
    program = TTTProgram(
        body=body_gm, states=state_specs, streams=stream_specs, invariants=inv_specs,
        outputs=[OutputSpec("o", axis=out_axis, per_token=stacked,
                            memory_order=memory_order(collector.meta["val"]))],
        chunk_size=C, order=order_kind, last_chunk=last_chunk, module_path=module_path,
        loop_src=loop.src, function=loop.function,
    )

    # -- the outer graph: everything but the loop, with the loop as one call ------------------
    outer_graph = graph   # rewritten in place on a copy made by the caller
    last_state = {}
    for p in producers:
        # the final value of each state: the last iteration that still updates
        j = n_iter - 1 if not truncated else n_iter - 2
        last_state[p] = iteration_map(j)[carried[p]]
    removable = ((in_loop - hoisted) | set(tail_nodes) | removable_extra) - init_nodes
    anchor = max((a for a in [*invariants, *[v for v in initial.values()
                                               if isinstance(v, torch.fx.Node)]]),
                 key=order.get)
    if not hasattr(gm, LOOP_MODULE):
        gm.add_submodule(LOOP_MODULE, torch.nn.Module())   # replaced by the lowered plan
    init_args = []
    for p in producers:
        v0 = initial[p]
        if v0 is ZERO:
            val = p.meta["val"]
            with outer_graph.inserting_after(anchor):
                v0 = outer_graph.call_function(
                    aten.zeros.default, (list(val.shape),),
                    {"dtype": val.dtype, "device": val.device})
            v0.meta["val"] = val
        init_args.append(v0)
    last_init = [a for a in init_args if isinstance(a, torch.fx.Node)]
    anchor = max([anchor, *last_init], key=lambda n: order.get(n, len(order)))
    with outer_graph.inserting_after(anchor):
        call = outer_graph.call_module(LOOP_MODULE, tuple(init_args) + tuple(invariants))
    with outer_graph.inserting_after(call):
        got_out = outer_graph.call_function(operator.getitem, (call, 0))
        got_states = []
        for i in range(len(producers)):
            with outer_graph.inserting_after(got_out if not got_states else got_states[-1]):
                got_states.append(outer_graph.call_function(operator.getitem, (call, 1 + i)))
    collector.replace_all_uses_with(got_out)
    for i, p in enumerate(producers):
        for j in range(n_iter):
            node = iteration_map(j).get(carried[p])
            if node is None:
                continue
            for u in list(node.users):
                if u not in removable:
                    if node is not last_state[p]:
                        raise _fail("code after the loop reads a state from before the last "
                                    "update", loop)
                    u.replace_input_with(node, got_states[i])
    for n in reversed(list(outer_graph.nodes)):
        if n in removable:
            if n.users and any(u not in removable for u in n.users):
                bad = next(u for u in n.users if u not in removable)
                raise _fail(f"code after the loop reads {n.format_node()} from inside it "
                            f"({bad.format_node()})", loop)
            outer_graph.erase_node(n)
    outer_graph.eliminate_dead_code()
    _contiguous_inputs(outer_graph)
    outer_graph.lint()
    program.notes.extend(notes)
    return RolledLoop(program=program, outer=gm, n_iterations=n_iter, tail=bool(extra),
                      notes=notes)


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
    ph = body.placeholder(name)
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


_FILL = {aten.zeros_like.default: 0.0, aten.ones_like.default: 1.0,
         aten.empty_like.default: 0.0}


def _materialize_shape_only(graph: torch.fx.Graph) -> None:
    """Replace ``zeros_like(x)``/``ones_like(x)`` by ``full(shape, value)``.

    They read only ``x``'s shape, but as graph edges they make a value look like it depends on
    ``x`` — ``torch.func.grad`` seeds its backward with ``ones_like(loss)``, which would tie a
    gradient to the fast weights the loss was computed with.
    """
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _FILL or node.target is aten.full_like.default:
            val = node.meta.get("val")
            if val is None:
                continue
            fill = node.args[1] if node.target is aten.full_like.default else _FILL[node.target]
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
