"""Single-step (bidirectional) TTT: one update over a set of tokens, then every token reads it.

ViTTT steps its fast weights once on all tokens of an image; LaCT's novel-view renderer steps
once on the input views' tokens and then reads all tokens. Neither loops over the sequence — a
Python loop there runs over constants (conv offsets, heads, a fixed list of schedule steps) — so
there is nothing to roll up. Instead, the layer is traced once and its test-time updates are
found in the graph: a value ``W' = W ± Δ`` whose ``W`` is computed from parameters alone and
whose increment ``Δ`` (same shape) from the layer's inputs. Each such ``W`` is a state, stepped
once; the state's new value is ``W'`` or, after a state-local map of it (weight
normalisation), the last value of that map the rest of the layer reads.

The program is one chunk: the body runs from the first op that reads a fast weight to the first
value every read of the stepped weights flows through (the *output*); the code before and after
it is the outer graph, with the body as one ``call_module``. Its ``order`` is ``"inclusive"``
(the output reads the stepped weights) and it has one stream, the whole sequence, so every
executor runs the body exactly once: exact, no scan. The layer's length is fixed (an image's
``h × w``, the views' tokens); batch sizes are fitted from two traces like any layer.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..analysis.op_vocabulary import UPDATE_STEPS, calls, is_view, op_name
from ..analysis.roles import peel_views
from ..errors import ConversionError, UnsupportedShapeError, UnsupportedTTTError
from ..ir import (KIND, LOOP_MODULE, NAME, SRC, describe_op, graph_module, node_src, placeholder,
                  InvariantSpec, OutputSpec, StreamSpec, TTTProgram, memory_order)
from .any_length import (FixedLength, changing_axis, length_slots, probe_lengths, rewrite,
                         shortest_length)
from .call_signature import CallSignature
from .capture import trace, user_frame
from .recognize import (InputLayout, RecognizedLayer, _first_line, _inputs_at, _layer_name,
                        _layout, layer_function, traced_weights)
from .rollup import RolledLoop, _contiguous_inputs, _materialize_shape_only, state_input
from .slice_assignments import select_writes_as_slice_writes
from .source_names import assigned_name, state_names, unique
from .shape_constants import BatchConstant, refuse_shape_constants
from .shapes import fit_template

aten = torch.ops.aten


class NotSingleStep(UnsupportedTTTError):
    """The traced layer is not one update followed by reads (the caller's own error stands)."""


class OtherBatch(NotSingleStep):
    """The step traces at the example's batch size but not at another: it is converted for
    the example's batch size only."""


@dataclass
class SingleStepLayout(InputLayout):
    """An ``InputLayout`` of a single-step layer: its fast weights are stepped once on all the
    tokens of a call, so there is no sequence to continue from one call to the next; with a
    ``length`` it runs at that length only (``length_why`` says why)."""

    length: int | None = None
    length_why: str = ""
    shortest: int = 1

    def sizes(self, flat_inputs: list) -> tuple[int, int]:
        B, L = super().sizes(flat_inputs)
        if self.length is None and L < self.shortest:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'layer'} was called with {L} tokens, but it was "
                f"converted for {self.shortest} tokens or more: {self.length_why}. Convert it "
                "again with example inputs of the length you call it with.")
        if self.length is not None and L != self.length:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'layer'} was called with {L} tokens, but it was "
                f"converted for {self.length} tokens only: it steps its fast weights once over "
                f"all the tokens of a call, and it cannot do so at other lengths ("
                f"{self.length_why}). Convert it again with example inputs of the length you "
                "call it with.")
        return B, L


@dataclass
class ImageLayout(SingleStepLayout):
    """A ``SingleStepLayout`` whose tokens are the positions of an image: axes ``image_axes``
    of the reference input (``[B, C, H, W]``), which the layer flattens into one token axis.
    It runs at the example's image size ``image_size`` only (``image_why`` says why)."""

    image_axes: tuple[int, ...] = ()
    image_size: tuple[int, ...] = ()
    image_why: str = ""

    def length_of(self, x: torch.Tensor) -> int:
        n = 1
        for a in self.image_axes:
            n *= x.shape[a]
        return n

    def describe_image(self, sizes) -> str:
        axes = ", ".join(str(a) for a in self.image_axes)
        name = self.signature.leaves[self.ref].name if self.signature is not None \
            else f"#{self.ref}"
        return (f"an image of {' × '.join(str(n) for n in sizes)} (axes {axes} of {name}: "
                f"{self.length_of_sizes(sizes)} tokens)")

    @staticmethod
    def length_of_sizes(sizes) -> int:
        n = 1
        for m in sizes:
            n *= m
        return n

    def other_image(self, flat_inputs: list) -> str:
        """The call's image, described, when its size is not the example's; else ``""``."""
        x = flat_inputs[self.ref]
        if not isinstance(x, torch.Tensor) or x.dim() <= max(self.image_axes):
            return ""
        sizes = tuple(x.shape[a] for a in self.image_axes)
        return "" if sizes == self.image_size else self.describe_image(sizes)

    def sizes(self, flat_inputs: list) -> tuple[int, int]:
        other = self.other_image(flat_inputs)
        if other:
            raise UnsupportedShapeError(
                f"the converted {self.path or 'layer'} was called with {other}, but it was "
                f"converted for {self.describe_image(self.image_size)} only: it steps its fast "
                f"weights once over all the positions of an image ({self.image_why}). A lossy "
                "conversion does not run the layer as written; convert it again with example "
                "inputs of the image size you call it with.")
        return super().sizes(flat_inputs)


#: the name other modules know it by
FixedLengthLayout = SingleStepLayout


# -- finding the update ---------------------------------------------------------------------

def _data_dependent(graph: torch.fx.Graph, data: set[torch.fx.Node]) -> set[torch.fx.Node]:
    out = set(data)
    for n in graph.nodes:
        if n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _shape(n) -> tuple | None:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _broadcasts(small, shape) -> bool:
    """Whether a tensor of shape ``small`` broadcasts to ``shape``, a matrix or more after its
    last broadcast axis: a weight shared by the batch (``[H, D, D]`` or ``[1, H, D, D]``) or by
    chunks (``[B, 1, D, D]``); a bias broadcast over the tokens inside a memory's own forward
    (``x @ W + b``, ``b`` of ``[B, 1, D]``) is not stepped."""
    if small is None or shape is None or len(small) > len(shape):
        return False
    small = (1,) * (len(shape) - len(small)) + tuple(small)
    if not all(a in (1, b) for a, b in zip(small, shape)):
        return False
    spread = [i for i, (a, b) in enumerate(zip(small, shape)) if a != b]
    return not spread or len(small) - spread[-1] - 1 >= 2


def _updates(graph: torch.fx.Graph, dep: set[torch.fx.Node],
             from_weights: set[torch.fx.Node]) -> list[tuple]:
    """``(W', W, Δ)`` for every ``W ± Δ``: ``W`` from parameters only (``from_weights``: the
    values computed from them; a parameter itself when it broadcasts over the batch, ``[1, H, D,
    D] − [B, H, D, D]``; a constant such as ``torch.eye(C)`` is no weight), ``Δ`` from the inputs
    and of the result's shape, a matrix or more."""
    found = []
    for n in graph.nodes:
        if not calls(n, UPDATE_STEPS) or len(n.args) < 2:
            continue
        a, b = n.args[0], n.args[1]
        pairs = [(a, b)] if op_name(n) == "sub" else [(a, b), (b, a)]
        for w, d in pairs:
            if isinstance(w, torch.fx.Node) and isinstance(d, torch.fx.Node) \
                    and w not in dep and d in dep and w.op in ("call_function", "placeholder") \
                    and _shape(d) == _shape(n) and _broadcasts(_shape(w), _shape(n)) \
                    and len(_shape(n) or ()) >= 2 and w in from_weights:
                found.append((n, w, d))
                break
    return found


def _full_size(graph: torch.fx.Graph, updates: list[tuple]) -> list[tuple]:
    """Every update's weight at the result's shape: a broadcast weight is expanded first
    (``expand(W, shape)``), so that the state the step carries is the weight it steps."""
    out = []
    for n, w, d in updates:
        if _shape(w) != _shape(n):
            with graph.inserting_before(n):
                full = graph.call_function(aten.expand.default, (w, list(_shape(n))))
            full.meta = {k: v for k, v in n.meta.items() if k != "val"}
            full.meta["val"] = n.meta["val"]
            n.replace_input_with(w, full)
            w = full
        out.append((n, w, d))
    return out


def _state_local(start: torch.fx.Node, dep: set[torch.fx.Node], order: dict) -> list:
    """``start`` and the values computed from it and parameters alone (a weight norm)."""
    local, stack = {start}, [start]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in local or u.op != "call_function":
                continue
            if all(a in local or a not in dep for a in u.all_input_nodes):
                local.add(u)
                stack.append(u)
    return sorted(local, key=order.get)


def _new_value(stepped: torch.fx.Node, shape, dep, order) -> tuple[torch.fx.Node, set]:
    """The state's value after the step: the value of its state-local map read elsewhere."""
    local = _state_local(stepped, dep, order)
    local_set = set(local)
    read = {peel_views(n) for n in local if any(u not in local_set for u in n.users)}
    if len(read) != 1 or _shape(next(iter(read))) != shape:
        return stepped, {stepped}
    (new,) = read
    return new, {n for n in local_set if order[n] <= order[new]}


# -- the output -----------------------------------------------------------------------------

def _output_node(nodes: list, states_out: list, order: dict, length: int
                 ) -> torch.fx.Node | None:
    """The first value with a token axis that every read of the stepped weights flows
    through (the reads' own views of the weights come before it)."""
    shapes = {_shape(s) for s in states_out}
    after: set[torch.fx.Node] = set()
    stack = [u for s in states_out for u in s.users]
    while stack:
        n = stack.pop()
        if n not in after and n.op == "call_function":
            after.add(n)
            stack.extend(n.users)
    inside: set[torch.fx.Node] = set(states_out)
    for n in sorted(after, key=order.get):
        inside.add(n)
        if _shape(n) not in shapes and _token_axis(_shape(n) or (), length) is not None \
                and all(u in inside for m in inside if m is not n for u in m.users):
            return n
    return None


def _returned(states_out: list) -> torch.fx.Node | None:
    """A stepped weight the graph returns as it is, or through views of it."""
    for s in states_out:
        stack, seen = [s], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if any(u.op == "output" for u in n.users):
                return s
            stack.extend(u for u in n.users if is_view(u) and u.args[0] is n)
    return None


# -- the program ----------------------------------------------------------------------------

def _ancestors_within(roots, allowed: set) -> set:
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n in seen or n not in allowed:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _descendants(roots) -> set:
    seen, stack = set(), [u for r in roots for u in r.users]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.users)
    return seen


def _body_nodes(nodes, order, dep, states_in, states_out, out_node, layer) -> list:
    """The ops of the step: from the first read of a fast weight to the output, that the new
    states or the output need; state-independent ones read after the output stay outside."""
    reads = _descendants(states_in)
    first = min(order[n] for n in reads)
    candidates = {n for n in nodes if n.op == "call_function"
                  and (n in reads or (n in dep and order[n] > first))}
    body = _ancestors_within([*states_out, out_node], candidates)
    changed = True
    while changed:
        changed = False
        for n in list(body):
            if n not in reads and any(u not in body for u in n.users if u is not out_node):
                body.discard(n)
                changed = True
    for n in body:
        if n is out_node:
            continue
        stray = [u for u in n.users if u not in body]
        if stray:
            raise UnsupportedTTTError(
                f"{layer}: code after the test-time step ({describe_op(stray[0])}) reads a "
                f"value from inside it ({describe_op(n)}); ttt2la converts a single step whose "
                "only result is what the stepped weights produce: compute what the code after "
                "it needs from the step's output, or outside the step.")
    return sorted(body, key=order.get)


def _externals(body_nodes, states_in) -> list:
    inside, out = set(body_nodes), []
    for n in body_nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in states_in and a not in out:
                out.append(a)
    return out


def _with_token_inputs(body_nodes, states_in, dep, order, length) -> tuple[list, list]:
    """The body grown backwards until every input it reads from the layer's data has a token
    axis: a slice of the input views' tokens or an image-shaped copy of the keys is computed
    inside, from the whole sequence, so that the body's data are streams."""
    body = set(body_nodes)
    while True:
        grown = False
        for a in _externals(body_nodes, states_in):
            if a in dep and a.op == "call_function" and \
                    _token_axis(_shape(a) or (), length) is None and \
                    all(u in body for u in a.users):
                body.add(a)
                grown = True
        if not grown:
            return body_nodes, _externals(body_nodes, states_in)
        body_nodes = sorted(body, key=order.get)


def _token_axis(shape: tuple, length: int) -> int | None:
    return next((a for a in range(1, len(shape)) if shape[a] == length), None)


def single_step(gm: torch.fx.GraphModule, n_params: int, length: int, *, module_path: str = "",
                layer: str = "", whole: bool = False) -> RolledLoop:
    """The single-step program of a traced layer (``gm`` takes its parameters, then its
    inputs); ``NotSingleStep`` when the graph holds no update or more than one per state.

    ``whole``: the program's one chunk is the whole sequence at any length (``_WholeSequence``),
    not a chunk of ``length`` tokens."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    dep = _data_dependent(graph, set(placeholders[n_params:]))
    updates = _updates(graph, dep, _data_dependent(graph, set(placeholders[:n_params])))
    if not updates:
        raise NotSingleStep(f"{layer}: no test-time update (W ± Δ of a weight) found")
    updates = _full_size(graph, updates)
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    states_in, states_out, locals_ = [], [], set()
    for stepped, w, _delta in updates:
        new, local = _new_value(stepped, _shape(w), dep, order)
        states_in.append(w)
        states_out.append(new)
        locals_ |= local
    if len(set(states_in)) != len(states_in):
        raise NotSingleStep(f"{layer}: a fast weight is updated more than once")
    for stepped, _w, _d in _updates_reading(graph, dep, locals_):
        raise NotSingleStep(f"{layer}: the stepped weights are stepped again "
                            f"({describe_op(stepped)}): a loop over chunks, not a single step")
    out_node = _output_node(nodes, states_out, order, length)
    if out_node is None:
        returned = _returned(states_out)
        if returned is not None:
            raise UnsupportedTTTError(
                f"{layer} returns its stepped fast weights ({describe_op(returned)}) beside its "
                "output: a converted single step reads them without forming them, so it cannot "
                "return them. Return only the output, or convert a module that keeps the fast "
                "weights inside it.")
        raise UnsupportedTTTError(
            f"{layer}: the reads of the stepped fast weights do not meet in one value before "
            "the layer's output; ttt2la converts a single step whose reads form one output.")
    body = _body_nodes(nodes, order, dep, states_in, states_out, out_node, layer)
    return _build(gm, order, dep, body, states_in, states_out, out_node, updates, length,
                  module_path, layer, whole)


def _updates_reading(graph, dep, stepped: set) -> list:
    """Updates whose weight is a stepped weight: a second step."""
    out = []
    for n in graph.nodes:
        if not calls(n, UPDATE_STEPS) or len(n.args) < 2:
            continue
        a, b = n.args[0], n.args[1]
        for w, d in ((a, b), (b, a)):
            if w in stepped and isinstance(d, torch.fx.Node) and d in dep and d not in stepped \
                    and _shape(w) == _shape(d) == _shape(n):
                out.append((n, w, d))
                break
    return out


class _WholeSequence:
    """How a single step runs at any length: every stream source gets a leading axis of size
    1, which is the chunk axis (chunk size 1, one chunk), so the runtime cuts nothing and the
    body reads the whole sequence, whatever its length; ``whole`` maps each source to the body
    placeholder holding all of it (sizes of the length are read from it at run time)."""

    def __init__(self, sources) -> None:
        self.sources = list(sources)
        self.whole: dict = {}

    @staticmethod
    def val(a: torch.fx.Node):
        return _lead(a.meta["val"])


def _lead(val):
    """``val`` with a leading axis of size 1 (a fake value: computed in its own fake mode)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val.unsqueeze(0)
    with mode:
        return val.unsqueeze(0)


def _emit(graph: torch.fx.Graph, target, args, val, meta: dict) -> torch.fx.Node:
    """A new node ``target(*args)`` with the frames of ``meta`` and the fake value ``val``."""
    node = graph.call_function(target, tuple(args))
    node.meta.update({k: v for k, v in meta.items() if k not in ("val", KIND, NAME)})
    node.meta["val"] = val
    return node


def _build(gm, order, dep, body_nodes, states_in, states_out, out_node, updates, length,
           module_path, layer, whole) -> RolledLoop:
    """The ``TTTProgram`` of the step and the outer graph calling it."""
    body_nodes, externals = _with_token_inputs(body_nodes, states_in, dep, order, length)
    out_axis = _token_axis(_shape(out_node), length)
    sources = [a for a in externals if a in dep and _token_axis(_shape(a) or (), length)
               is not None]
    if out_axis is None or not sources:
        raise UnsupportedTTTError(
            f"{layer}: the output of the test-time step ({describe_op(out_node)}) or its inputs "
            f"have no token axis of the layer's length {length}; ttt2la reads a single step as "
            "one chunk of the whole sequence.")

    cut = _WholeSequence(sources) if whole else None
    body_gm, state_specs, streams, inv_specs = _body_graph(
        body_nodes, states_in, states_out, out_node, updates, externals, sources, length, cut)
    if cut is not None:
        out_axis = 0

    first_update = updates[0][0].meta.get(SRC)
    program = TTTProgram(
        body=body_gm, states=state_specs,
        streams=streams,
        invariants=inv_specs,
        outputs=[OutputSpec("o", axis=out_axis, memory_order=memory_order(
            out_node.meta["val"] if cut is None else _lead(out_node.meta["val"])))],
        chunk_size=1 if cut else length, order="inclusive", last_chunk="update",
        module_path=module_path,
        loop_src=first_update, function=first_update.function if first_update else "",
        single_step=True)
    note = ("single-step TTT: the fast weights are stepped once over the whole sequence and "
            "then read by every token; it runs as one chunk")
    program.notes.append(note)
    _rewrite_outer(gm, order, body_nodes, states_in, externals, out_node, cut)
    return RolledLoop(program=program, outer=gm, n_iterations=1, tail=False, notes=[note])


def _body_graph(body_nodes, states_in, states_out, out_node, updates, externals, sources,
                length, cut=None):
    """The body ``(*states, *streams, *invariants) -> (*new states, output)`` and its specs:
    every input with a token axis is a stream of one chunk, the whole sequence (with ``cut``,
    a one-token chunk of a leading axis of size 1 put in front of it)."""
    body = torch.fx.Graph()
    env: dict = {}
    taken: set[str] = set()
    firsts = [assigned_name(w.meta.get(SRC)) for w in states_in]
    guessed = state_names(states_out, 0, firsts)
    guessed = [g or assigned_name(u[0].meta.get(SRC)) for g, u in zip(guessed, updates)]
    state_specs, inv_specs = [], []
    for i, (w, new) in enumerate(zip(states_in, states_out)):
        state_specs.append(state_input(body, w, new, unique(guessed[i] or f"state{i}", taken),
                                       env))
    streams, stream_phs = [], {}
    for a in sources:
        name = unique(assigned_name(a.meta.get(SRC)) or a.name, taken)
        ph = placeholder(body, name)
        ph.meta.update(val=cut.val(a) if cut else a.meta.get("val"),
                       **{KIND: "stream", NAME: name})
        stream_phs[a] = ph
        streams.append(StreamSpec(name, source=externals.index(a),
                                  axis=0 if cut else _token_axis(_shape(a), length)))
    for a in externals:
        base = assigned_name(a.meta.get(SRC)) or a.name
        name = unique(f"{base}_all" if a in stream_phs else base, taken)
        ph = placeholder(body, name)
        val = cut.val(a) if cut and a in stream_phs else a.meta["val"]
        ph.meta.update(val=val, **{KIND: "invariant", NAME: name})
        env[a] = stream_phs.get(a, ph)
        inv_specs.append(InvariantSpec(name, tuple(val.shape), val.dtype))
        if cut is not None and a in stream_phs:
            cut.whole[a] = ph
    if cut is not None:
        for a, ph in stream_phs.items():
            env[a] = _emit(body, aten.select.int, (ph, 0, 0), a.meta["val"], a.meta)
    for n in body_nodes:
        new = body.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        env[n] = new
    out = env[out_node]
    if cut is not None:
        out = _emit(body, aten.unsqueeze.default, (out, 0), _lead(out_node.meta["val"]),
                    out_node.meta)
    body.output(tuple(env[s] for s in states_out) + (out,))
    _materialize_shape_only(body)
    select_writes_as_slice_writes(body)     # run vmapped: see slice_assignments
    body.eliminate_dead_code()
    body_gm = graph_module(torch.nn.Module(), body)
    return body_gm, state_specs, streams, inv_specs


def _rewrite_outer(gm, order, body_nodes, states_in, externals, out_node, cut=None) -> None:
    """Replace the step by one ``call_module`` taking ``(*initial states, *invariants)``
    (with ``cut``, the streams' sources and the output with a leading axis of size 1)."""
    graph = gm.graph
    if not hasattr(gm, LOOP_MODULE):
        gm.add_submodule(LOOP_MODULE, torch.nn.Module())
    with graph.inserting_before(out_node):
        args = list(externals)
        if cut is not None:
            args = [_emit(graph, aten.unsqueeze.default, (a, 0), cut.val(a), a.meta)
                    if a in cut.sources else a for a in args]
        call = graph.call_module(LOOP_MODULE, tuple(states_in) + tuple(args))
        got = graph.call_function(operator.getitem, (call, 0))
        if cut is not None:
            got = _emit(graph, aten.select.int, (got, 0, 0), out_node.meta["val"],
                        out_node.meta)
    out_node.replace_all_uses_with(got)
    for n in reversed(body_nodes):
        graph.erase_node(n)
    graph.eliminate_dead_code()
    _contiguous_inputs(graph)
    graph.lint()
    gm.recompile()


# -- recognition ----------------------------------------------------------------------------

def recognize_single_step(cand, seq_len: int | None, refusal: ConversionError):
    """A ``RecognizedLayer`` for ``cand`` when its forward is a single test-time step; else
    ``refusal`` (the loop recognizer's own error) is raised again.

    The step is converted for any length when its traces at three lengths differ only in
    numbers affine in the length (``any_length``); otherwise for the example's length only,
    and the converted layer says why when called at another."""
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.dim() > 0]
    if not tensors or seq_len is None:
        raise refusal
    batch = tensors[0].shape[0]
    try:
        layout = _layout(flat, seq_len, batch)
    except ConversionError:
        raise refusal from None
    layout.signature = CallSignature.of(cand.args, cand.kwargs, cand.module)
    step = _Step(cand, flat, in_spec, layout)
    try:
        b0, b1, unit, fixed = 2, 3, 1, False
        try:
            step.at(b0, seq_len)
        except NotSingleStep:
            if batch in (2, 3):
                raise
            b0, b1, unit, fixed = 1, 2, batch, True     # the example's batch only
            step.at(batch, seq_len)
    except NotSingleStep:
        raise refusal from None
    why = "the layer failed when traced at batch sizes 2 and 3"
    if fixed:
        step.layout = layout = dataclasses.replace(layout, batch_unit=unit, fixed_batch=True,
                                                   path=cand.path, why=why)
    try:
        result = _at_lengths(step, layout, b0, b1, unit, fixed, seq_len, batch)
    except OtherBatch as e:     # the example's batch runs, another fails: that batch only
        if fixed:
            raise refusal from None
        why, fixed = str(e), True
        step.layout = layout = dataclasses.replace(layout, batch_unit=batch, fixed_batch=True,
                                                   path=cand.path, why=why)
        result = _at_lengths(step, layout, 1, 2, batch, True, seq_len, batch)
    if fixed:
        result.notes.append(f"converted for batch size {batch} only: {why}")
    return result


def _at_lengths(step: "_Step", layout, b0, b1, unit, fixed, seq_len: int, batch: int):
    """The step converted for any length, or else for the example's (an image's size)."""
    flat = step.flat
    try:
        return _any_length(step, layout, b0, b1, unit, fixed, seq_len)
    except FixedLength as why:
        image = _flattened_image(step, unit * b0, seq_len)
        if image is not None:           # the channels were taken for tokens: an image's
            axes, where = image
            sizes = tuple(flat[layout.ref].shape[a] for a in axes)
            names = ", ".join(str(a) for a in axes)
            step.layout = layout = ImageLayout(
                **{f.name: getattr(layout, f.name) for f in dataclasses.fields(InputLayout)
                   if f.name != "token_axis"}, token_axis={}, image_axes=axes,
                image_size=sizes,
                image_why=f"its tokens are the positions of axes {names} of the input, "
                          f"flattened at {where}, and the step was traced at the example's "
                          "image size only")
            return _fixed_length(step, layout, b0, b1, unit, fixed,
                                 ImageLayout.length_of_sizes(sizes), layout.image_why, batch)
        return _fixed_length(step, layout, b0, b1, unit, fixed, seq_len, str(why), batch)


def _flattened_image(step: "_Step", B: int, L: int) -> tuple[tuple[int, ...], str] | None:
    """``(axes, where)`` when the layer flattens the trailing axes ``axes`` (two or more, after
    the batch and one more axis) of its reference input into one (``x.flatten(2)``,
    ``x.view(B, C, -1)``, ``x.reshape(B, H, D, h * w)``): an image ``[B, C, H, W]``, whose
    tokens are its positions; ``where`` is the line of the first such reshape."""
    x = step.flat[step.layout.ref]
    if not isinstance(x, torch.Tensor) or x.dim() < 4:
        return None
    try:
        gm = step.traced(B, L)
    except NotSingleStep:
        return None
    shape = tuple(x.shape)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _RESHAPES:
            continue
        before, after = _shape(n.args[0]), _shape(n)
        if before is None or after is None or len(before) != len(shape):
            continue
        for axes in _merged(before, after):
            if axes[0] >= 2 and axes[-1] == len(shape) - 1 and \
                    all(before[a] == shape[a] for a in axes):
                return axes, str(node_src(n) or "the layer's code")
    return None


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _merged(before: tuple, after: tuple) -> list[tuple[int, ...]]:
    """The runs of two or more axes of ``before`` that a reshape to ``after`` merges into one
    axis (read from where the two shapes' running products meet)."""
    out, i, j = [], 0, 0
    while i < len(before) and j < len(after):
        a0, b0, p, q = i, j, before[i], after[j]
        i, j = i + 1, j + 1
        while p != q:
            if p < q and i < len(before):
                p, i = p * before[i], i + 1
            elif q < p and j < len(after):
                q, j = q * after[j], j + 1
            else:
                return out
        if i - a0 >= 2 and j - b0 == 1:
            out.append(tuple(range(a0, i)))
    return out


class _Step:
    """Traces of one layer's single step at chosen batch sizes and lengths."""

    def __init__(self, cand, flat, in_spec, layout) -> None:
        self.cand, self.flat, self.in_spec, self.layout = cand, flat, in_spec, layout
        self.fn = layer_function(cand.module, in_spec)
        self.pb = traced_weights(cand.module)
        self.n_params = len(pytree.tree_leaves(self.pb))
        self.layer = _layer_name(cand)

    def traced(self, B: int, L: int) -> torch.fx.GraphModule:
        """The layer traced at batch ``B`` (in samples) and length ``L``."""
        try:
            return trace(self.fn, self.pb, *_inputs_at(self.flat, self.layout, B, L))
        except Exception as e:
            at = f" at {user_frame(e)}" if user_frame(e) else ""
            raise NotSingleStep(f"{self.layer}: tracing at batch {B}, length {L} failed{at}: "
                                f"{_first_line(e).rstrip('.')}. Its code runs at the example's "
                                "shape only; where it holds the batch size or the length (an "
                                "attribute, a constant), compute it from the input's shape "
                                "instead.") from e

    def at(self, B: int, L: int, whole: bool = True) -> RolledLoop:
        """The step traced at batch ``B`` (in samples) and length ``L`` (an image layout's
        inputs keep their image size: ``L`` is its number of positions)."""
        gm = self.traced(B, L)
        try:
            return single_step(gm, self.n_params, L, module_path=self.cand.path,
                               layer=self.layer, whole=whole)
        except ConversionError:
            raise
        except Exception as e:
            raise UnsupportedTTTError(
                f"{self.layer}: its fast weights are stepped once (a single-step TTT layer, "
                f"in {self.cand.loop.function} at {self.cand.loop.file}:{self.cand.loop.line}), "
                f"but ttt2la could not cut that step out of the layer ({_first_line(e)}); "
                "report the layer's code.") from e


def _any_length(step: _Step, layout, b0, b1, unit, fixed, L0) -> RecognizedLayer:
    """The step converted for any length (see ``any_length``), or ``FixedLength``."""
    sizes = {n for t in [*pytree.tree_leaves(step.pb), *step.flat]
             if isinstance(t, torch.Tensor) for n in t.shape}
    lengths = probe_lengths(L0, sizes | {unit * b0, unit * b1})
    at_b0 = [_traced_at(step, unit * b0, L) for L in lengths]
    at_b1 = None if fixed else [_at_other_batch(step, unit * b1, L) for L in lengths[:2]]
    name = step.cand.path or "the layer"
    bodies = length_slots([r.program.body for r in at_b0],
                          None if fixed else [r.program.body for r in at_b1], lengths,
                          f"test-time step of {name}")
    outers = length_slots([r.outer for r in at_b0],
                          None if fixed else [r.outer for r in at_b1], lengths,
                          f"code around the step of {name}")
    shortest, short_why = shortest_length(
        [(at_b0[0].program.body, at_b0[1].program.body), (at_b0[0].outer, at_b0[1].outer)],
        L0)
    carrier, axis = _body_carrier(at_b0)
    runs = [(at_b0[0], 0), (at_b0[1], 0)] + ([] if fixed else [(at_b1[0], 1)])
    floats = {k: v for k, v in outers.items() if v[2]}        # ints: the outer template's
    ref = step.n_params + layout.ref
    for rolled, which in runs:
        body = rolled.program.body
        rewrite(body, bodies, which, _placeholder(body.graph, carrier), axis)
        outer = rolled.outer
        rewrite(outer, floats, which, _placeholder(outer.graph, ref),
                layout.token_axis[layout.ref])
    rolled, rolled_L = at_b0[0], at_b0[1]
    rolled_B = rolled if fixed else at_b1[0]

    def corner() -> torch.fx.GraphModule:
        """The code around the step at (b1, L1), traced already, its lengths' floats read as
        the others' are: a size both move that no ``e·B·L`` gives (``B*(L + 2)``) is fitted
        from it."""
        outer = at_b1[1].outer
        rewrite(outer, floats, 1, _placeholder(outer.graph, ref), layout.token_axis[layout.ref])
        return outer

    outer = fit_template(rolled.outer, rolled_L.outer, rolled_B.outer, B0=b0, L0=lengths[0],
                         L1=lengths[1], B1=b1, what=f"code around the step of {name}",
                         corner=None if fixed else corner)
    single = SingleStepLayout(**{f.name: getattr(layout, f.name)
                                 for f in dataclasses.fields(InputLayout)}, length=None,
                              shortest=shortest, length_why=short_why)
    single.path = step.cand.path
    lengths_ok = "any length" if shortest == 1 else f"lengths from {shortest} on ({short_why})"
    notes = ["single-step TTT: the fast weights are stepped once over all tokens; converted "
             f"for {lengths_ok}: sizes and constants of the length are read when it runs"]
    return RecognizedLayer(step.cand.path, step.cand, rolled, rolled_L, rolled_B, single,
                           step.in_spec, outer, lengths[0], lengths[1], b0, b1, notes)


def _at_other_batch(step: _Step, B: int, L: int, whole: bool = True) -> RolledLoop:
    """The step at batch ``B``, a length it was traced at with the example's batch, or
    ``OtherBatch`` saying why it cannot be traced there (its code holds the batch size)."""
    try:
        return step.at(B, L, whole=whole)
    except NotSingleStep as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        where = user_frame(cause)
        raise OtherBatch(f"the layer's own code fails at batch size {B}, length {L}"
                         f"{f' at {where}' if where else ''}: {_first_line(cause)}") from e


def _traced_at(step: _Step, B: int, L: int) -> RolledLoop:
    """The step at another shape, or ``FixedLength`` saying why it cannot be traced there."""
    try:
        return step.at(B, L)
    except NotSingleStep as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        where = user_frame(cause)
        raise FixedLength(f"the layer's own code fails at {L} tokens"
                          f"{f' at {where}' if where else ''}: {_first_line(cause)}") from e
    except ConversionError as e:
        raise FixedLength(f"at {L} tokens: {_first_line(e)}") from e


def _body_carrier(at_b0) -> tuple[str, int]:
    """The body input the length is read from: the first stream's whole-sequence source (its
    invariant name) and its token axis."""
    program = at_b0[0].program
    name = program.invariants[program.streams[0].source].name
    vals = [_placeholder(r.program.body.graph, name).meta["val"] for r in at_b0]
    return name, changing_axis(vals)


def _placeholder(graph: torch.fx.Graph, key) -> torch.fx.Node:
    """The placeholder named ``key`` (a body input), or the ``key``-th one (an outer input)."""
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    if isinstance(key, int):
        return phs[key]
    return next(n for n in phs if n.meta.get(NAME, n.name) == key)


def _fixed_length(step: _Step, layout, b0, b1, unit, fixed, L0, why: str,
                  batch: int) -> RecognizedLayer:
    """The step converted for the example's length ``L0`` only: one chunk of ``L0`` tokens; for
    the example's ``batch`` only where a number of the step moves with the batch size."""
    rolled = step.at(unit * b0, L0, whole=False)
    rolled_B = rolled if fixed else _at_other_batch(step, unit * b1, L0, whole=False)
    try:
        refuse_shape_constants(rolled, {"batch size": rolled_B},
                               {"ref": f"batch {unit * b0}", "batch size": f"batch {unit * b1}"},
                               step.layer)
    except BatchConstant as e:          # only the example's batch size holds the number
        b0, b1, unit, fixed = 1, 2, batch, True
        rolled = rolled_B = step.at(batch, L0, whole=False)
        layout = dataclasses.replace(layout, batch_unit=unit, fixed_batch=True,
                                     path=step.cand.path, batch_constant=str(e))
    outer = fit_template(rolled.outer, rolled.outer, rolled_B.outer, B0=b0, L0=L0,
                         L1=L0 + 1, B1=b1, what=f"code around the step of {step.cand.path}")
    if isinstance(layout, ImageLayout):
        single = dataclasses.replace(layout, length=L0, length_why=why, path=step.cand.path)
        notes = [f"single-step TTT over {layout.describe_image(layout.image_size)}: converted "
                 f"for that image size only ({why}); other image sizes run the code as written "
                 "where the conversion is exact, and are refused where it is lossy"]
    else:
        single = SingleStepLayout(**{f.name: getattr(layout, f.name)
                                     for f in dataclasses.fields(InputLayout)}, length=L0,
                                  length_why=why)
        single.path = step.cand.path
        notes = [f"single-step TTT over {L0} tokens: converted for that length only ({why})"]
    return RecognizedLayer(step.cand.path, step.cand, rolled, rolled, rolled_B, single,
                           step.in_spec, outer, L0, L0 + 1, b0, b1, notes)


__all__ = ["single_step", "recognize_single_step", "SingleStepLayout", "FixedLengthLayout",
           "ImageLayout", "NotSingleStep"]
