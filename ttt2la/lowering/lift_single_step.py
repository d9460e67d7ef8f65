"""A single-step program's fast weights lifted onto ``bidirectional_linear_attention``.

A single-step (bidirectional) TTT program steps each fast weight once over all its tokens and
reads the stepped weight with every token; the generic executor runs its body as one chunk.
When a fast weight's step and read are linear attention, they run on the runtime op instead:

* *linear attention with an output gate* — ``W' = W ± c·φ(K)ᵀV`` (one ``bmm`` and constant
  factors), read by one ``bmm`` with state-free queries, ``φ(Q) W'``, possibly multiplied
  elementwise by a state-free gate (ViTTT's gated unit with its gate's Θ frozen);
* *local linear attention* — a state of ``size²`` taps per channel, ``W'`` = ``W`` plus a
  state-free increment, whose reads all flow through one image-shaped value: a depthwise
  convolution whose taps are a fast weight. Which image is the query, the key and the value,
  the window's size and a constant factor of the value are found by evaluation (float64, on
  random inputs), not by the shape of the code that computes them.

Every part is then confirmed: the body with the parts replaced by the op, evaluated in float64
on fresh random inputs, must give the same new states and outputs as the body itself, or the
program keeps the generic executor (still exact). Parts that do not have either form (a
gradient normalised ``g/(‖g‖+1)``, which is not linear in the values) keep their own code inside
the same one-chunk body.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
import torch.fx
import torch.nn.functional as F

from ..analysis.op_vocabulary import (RELAYOUT_TARGETS, RESHAPE_TARGETS, SLICE_TARGETS,
                                      UPDATE_STEPS, calls, op_name)
from ..errors import UnsupportedTTTError
from ..ir import KIND, TTTProgram, ancestors, copy_graph, descendants, graph_module
from ..runtime.bidirectional import bidirectional_linear_attention, window_offsets
from .chunking import assemble_outputs, chunk_streams
from .lift import contraction, find_read, strip
from .precision import promoted, relative_error

aten = torch.ops.aten
#: same elements in the same order, another shape (not a broadcast)
_RESHAPES = RESHAPE_TARGETS - {aten.expand.default}

#: Relative error (float64) within which a fitted piece or the whole body counts as equal; a
#: wrong reading misses by order one.
FIT_TOLERANCE = 1e-8

# ---------------------------------------------------------------------------------------------
# the op as the rewritten body calls it


def gated_linear_attention(phi_q, left, right, state, gate, scale: float, transposed: bool,
                           backend: str):
    """``(read, state')`` of ``state' = state + scale·left·right`` read by ``phi_q`` — the body's
    own layouts: ``phi_q [b, Tq, Dk]``, ``left [b, Dk, T]``, ``right [b, T, Dv]``, the read
    ``[b, Tq, Dv]`` (gated: the gate's shape); transposed, the state is ``[Dv, Dk]``, ``phi_q``
    is ``[b, Dk, Tq]``, ``left [b, Dv, T]``, ``right [b, T, Dk]`` and the read ``[b, Dv, Tq]``."""
    b = left.shape[0]
    if transposed:
        q, k, v = phi_q.mT, right, left.mT
    else:
        q, k, v = phi_q, left.mT, right
    if scale != 1.0:
        v = v * scale
    T, Dk, Dv = q.shape[1], k.shape[-1], v.shape[-1]
    s0 = state.reshape(b, Dv, Dk).mT if transposed else state.reshape(b, Dk, Dv)
    g = None if gate is None else gate.reshape(b, T, 1, Dv)
    o, S = bidirectional_linear_attention(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), gate=g,
                                          initial_state=s0.unsqueeze(1), output_final_state=True,
                                          backend=backend)
    o, S = o.squeeze(2), S.squeeze(1)
    if transposed:
        o, S = o.mT, S.mT
    return (o if gate is None else o.reshape(gate.shape)), S.reshape(state.shape)


def local_linear_attention(q_image, k_image, v_image, state, scale: float, size: int,
                           backend: str):
    """``(read, state')`` of a depthwise convolution whose ``size²`` taps per channel are a fast
    weight: images ``[..., h, w]``, taps ``[..., size²]`` (the same leading axes, one head each)."""
    h, w = q_image.shape[-2:]
    heads = state.numel() // state.shape[-1]

    def tokens(x):                           # [..., h, w] -> [1, T, heads, 1]
        return x.reshape(1, heads, h * w).mT.unsqueeze(-1)

    v = v_image if scale == 1.0 else v_image * scale
    o, S = bidirectional_linear_attention(
        tokens(q_image), tokens(k_image), tokens(v), window=(h, w, size),
        initial_state=state.reshape(1, heads, -1, 1), output_final_state=True, backend=backend)
    return o.squeeze(-1).mT.reshape(q_image.shape), S.reshape(state.shape)


# ---------------------------------------------------------------------------------------------
# what a part is


@dataclass(frozen=True)
class Part:
    """One fast weight whose step and read run on the op: ``inputs`` are body nodes (``None``
    for an absent gate), ``read`` the value the op's output replaces."""

    state: int
    kind: str                 # "gated" | "linear" | "local"
    inputs: tuple
    read: torch.fx.Node
    state_out: torch.fx.Node
    options: tuple            # (scale, transposed) or (scale, size): the scale first
    #: factors of the scale computed in the body (sizes of a length read at run time), with
    #: their powers: ``scale · Π node ** power``
    scale_terms: tuple = ()

    def describe(self, program: TTTProgram) -> str:
        name = program.states[self.state].name
        if self.kind == "local":
            return f"{name}: local {self.options[1]}×{self.options[1]}"
        return f"{name}: {'gated' if self.kind == 'gated' else 'linear'}"

    def call(self, backend: str):
        fn = local_linear_attention if self.kind == "local" else gated_linear_attention
        return fn, (*self.options, backend)

    def mapped(self, at) -> "Part":
        """The same part in a copy of the body (``at``: old node -> new node)."""
        return replace(self, inputs=tuple(None if n is None else at[n] for n in self.inputs),
                       read=at[self.read], state_out=at[self.state_out],
                       scale_terms=tuple((at[n], p) for n, p in self.scale_terms))


def is_single_step(program: TTTProgram) -> bool:
    """Whether ``program`` was built by the single-step frontend (one chunk at every length)."""
    return program.single_step and program.order == "inclusive" and program.last_chunk == "update"


def _shape(n) -> tuple | None:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _step(program: TTTProgram, t: int, live_dep: set):
    """``(Δ, sign)`` of ``W' = W ± Δ`` with a state-free ``Δ``, else ``None``."""
    w_in, w_out = program.state_inputs()[t], program.state_outputs()[t]
    if not calls(w_out, UPDATE_STEPS) or len(w_out.args) < 2:
        return None
    a, b = w_out.args[:2]
    if strip(a) is w_in and isinstance(b, torch.fx.Node) and b not in live_dep:
        return b, (-1.0 if op_name(w_out) == "sub" else 1.0)
    if op_name(w_out) == "add" and strip(b) is w_in and isinstance(a, torch.fx.Node) \
            and a not in live_dep:
        return a, 1.0
    return None


def _live_dependents(program: TTTProgram) -> set:
    """Every node computed from a state the loop changes."""
    ins, outs = program.state_inputs(), program.state_outputs()
    return descendants(program.body.graph,
                       [ins[i] for i in range(len(ins)) if outs[i] is not ins[i]])


# ---------------------------------------------------------------------------------------------
# linear attention, with or without an output gate


def _gate(read: torch.fx.Node, live_dep: set):
    """``(gated, gate)``: the elementwise product of the read (through reshapes only) with a
    state-free value of the product's shape, else ``(read, None)``."""
    n = read
    while len(n.users) == 1:
        (user,) = n.users
        if user.target in _RESHAPES and user.args[0] is n:
            n = user
            continue
        if user.target is aten.mul.Tensor and len(user.args) == 2:
            other = user.args[1] if user.args[0] is n else user.args[0]
            if isinstance(other, torch.fx.Node) and other not in live_dep \
                    and _shape(other) == _shape(user) and other is not n:
                return user, other
        break
    return read, None


def _read_only_by(w_out: torch.fx.Node, read: torch.fx.Node) -> bool:
    """Whether the stepped weight reaches everything but the body's output through ``read``
    alone (views of it on the way): a second read (a gate computed from the stepped weight) is
    not linear attention."""
    stack = [w_out]
    while stack:
        for u in stack.pop().users:
            if u is read or u.op == "output":
                continue
            if u.target not in RELAYOUT_TARGETS:
                return False
            stack.append(u)
    return True


def _linear_part(program: TTTProgram, t: int, live_dep: set) -> Part | None:
    """State ``t`` as (gated) linear attention, read off the graph: ``W ± Δ`` with ``Δ`` a
    ``bmm`` contraction times constants and sizes, one ``bmm`` read, a gate if one multiplies
    it; else None."""
    found = _step(program, t, live_dep)
    if found is None:
        return None
    delta, sign = found
    delta, terms = _scalar_factors(delta, live_dep)
    con = contraction(delta, live_dep)
    if con is None or con.outer or not all(isinstance(c, float) for c in con.scales):
        return None
    scale = sign * math.prod(con.scales) * math.prod(c for c in terms if isinstance(c, float))
    terms = tuple(f for f in terms if not isinstance(f, float))
    w_out = program.state_outputs()[t]
    found = find_read(program, {w_out}, live_dep - {w_out})
    read, transposed = found.node, found.transposed
    if read is None:
        return None
    shapes = [_shape(n) for n in (con.left, con.right, read, *read.args)]
    if any(s is None or len(s) != 3 for s in shapes):
        return None
    if not _read_only_by(w_out, read):
        return None
    phi_q = read.args[1] if transposed else read.args[0]
    gated, gate = (read, None) if transposed else _gate(read, live_dep)
    return Part(t, "linear" if gate is None else "gated",
                (phi_q, con.left, con.right, program.state_inputs()[t], gate), gated, w_out,
                (scale, transposed), terms)


def _scalar_factors(n: torch.fx.Node, live_dep: set):
    """``(inner, factors)``: ``n`` is ``inner`` times and divided by scalars — numbers (as
    floats) and values the body computes from sizes (as ``(node, ±1)``)."""
    factors = []
    while isinstance(n, torch.fx.Node) and len(n.args) == 2 \
            and n.target in (aten.mul.Tensor, aten.div.Tensor):
        a, b = n.args
        power = 1 if n.target is aten.mul.Tensor else -1
        if _scalar(b, live_dep):
            factors.append(float(b) ** power if isinstance(b, (int, float)) else (b, power))
            n = a
        elif power == 1 and _scalar(a, live_dep):
            factors.append(float(a) if isinstance(a, (int, float)) else (a, 1))
            n = b
        else:
            break
    return n, factors


def _scalar(x, live_dep: set) -> bool:
    """A number, or a body value that is not a tensor (a size) and reads no state."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x != 0
    return isinstance(x, torch.fx.Node) and x not in live_dep \
        and not isinstance(x.meta.get("val"), torch.Tensor) and "val" in x.meta


# ---------------------------------------------------------------------------------------------
# local linear attention, read by evaluation


def _dominator(program: TTTProgram, start: torch.fx.Node, end: torch.fx.Node):
    """The first value after ``start`` that every path from ``start`` to ``end`` goes
    through and that has at least three axes (an image, not a view of the taps)."""
    order = {n: i for i, n in enumerate(program.body.graph.nodes)}
    reach = {start}
    for n in program.body.graph.nodes:
        if n.op != "output" and any(a in reach for a in n.all_input_nodes):
            reach.add(n)
    if end not in reach:
        return None
    for c in sorted(reach - {start}, key=order.get):
        seen, stack = {start}, [start]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u is not c and u not in seen and u.op != "output":
                    seen.add(u)
                    stack.append(u)
        if end not in seen and len(_shape(c) or ()) >= 3:
            return c
    return None


def _node_values(gm: torch.fx.GraphModule, args) -> dict:
    """Every node's value in one evaluation of ``gm``."""
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        interpreter.run(*args)
    return interpreter.env


def _random_inputs(program: TTTProgram, seed: int):
    """float64 random values of the body's inputs, at their traced shapes and strides (None if
    one is not a floating tensor)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for ph in program.placeholders():
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return None
        # laid out as the body is called (the views of its trace assume it): states
        # contiguous, the rest as traced, broadcast axes included
        stride = val.stride() if ph.meta.get(KIND) != "state" else \
            torch.empty(tuple(val.shape), device="meta").stride()
        base = [1 if st == 0 else n for n, st in zip(val.shape, stride)]
        x = torch.empty_strided(base, stride, dtype=torch.float64)
        x.copy_(torch.randn(base, generator=gen, dtype=torch.float64))
        out.append(x.expand(tuple(val.shape)))
    return out


def _local_part(program: TTTProgram, t: int, live_dep: set, values: dict) -> Part | None:
    """State ``t`` as local linear attention: ``size²`` taps per channel whose reads flow
    through one image-shaped value; the query, key and value images and the value's factor are
    the body's image-shaped values that reproduce its float64 ``values`` (``None`` if none do)."""
    found = _step(program, t, live_dep)
    w_in, w_out = program.state_inputs()[t], program.state_outputs()[t]
    shape = _shape(w_in)
    if found is None or not shape:
        return None
    size = math.isqrt(shape[-1])
    if size < 3 or size % 2 == 0 or size * size != shape[-1]:
        return None
    delta = found[0]
    read = _dominator(program, w_out, program.chunk_outputs()[0])
    image = _shape(read) if read is not None else None
    if image is None or image[:-2] != shape[:-1]:
        return None
    key_side, read_side = ancestors(delta), ancestors(read)
    images = [n for n in program.body.graph.nodes
              if n not in live_dep and _shape(n) == image and not calls(n, SLICE_TARGETS)
              and any(a.op == "placeholder" for a in ancestors(n))]
    kv = [n for n in images if n in key_side]
    increment = (values[w_out].double() - values[w_in].double()).reshape(-1, size * size)
    # products and sums, not ``bmm``: a float64 matrix-vector ``bmm`` was measured a thousand
    # times slower on CPU; wrong pairs are turned down on a few heads first
    few, windows = _Windows(values, size, 4), _Windows(values, size)
    for k in kv:
        for v in kv:
            if _scale((few(k) * few.row(v)).sum(-1), increment[:4]) is None:
                continue
            scale = _scale((windows(k) * windows.row(v)).sum(-1), increment)
            if scale is None:
                continue
            taps = values[w_out].reshape(-1, size * size, 1)
            for q in (n for n in images if n in read_side):
                got = (taps * windows(q)).sum(1).reshape(image)  # Σ_j q[x + off_j] taps[j]
                if relative_error(got - values[read], values[read]) <= FIT_TOLERANCE:
                    return Part(t, "local", (q, k, v, w_in), read, w_out, (scale, size))
    return None


class _Windows:
    """Each image value's ``size × size`` windows, ``[heads, size², h·w]`` (zero outside the
    image), and the value itself as ``[heads, 1, h·w]``, for the first ``heads`` heads (all when
    None), computed once per node: the fits read every pair of candidates."""

    def __init__(self, values: dict, size: int, heads: int | None = None) -> None:
        self.values, self.size, self.heads = values, size, heads
        self.windows, self.rows = {}, {}

    def _image(self, node: torch.fx.Node) -> torch.Tensor:
        x = self.values[node]
        return x.reshape(-1, *x.shape[-2:])[:self.heads]

    def __call__(self, node: torch.fx.Node) -> torch.Tensor:
        if node not in self.windows:
            x = self._image(node)
            h, w = x.shape[-2:]
            r = self.size // 2
            padded = F.pad(x, (r, r, r, r))
            shifts = [padded[:, r + di:r + di + h, r + dj:r + dj + w]
                      for di, dj in window_offsets(self.size)]
            self.windows[node] = torch.stack(shifts, dim=1).reshape(x.shape[0], -1, h * w)
        return self.windows[node]

    def row(self, node: torch.fx.Node) -> torch.Tensor:
        if node not in self.rows:
            x = self._image(node)
            self.rows[node] = x.reshape(x.shape[0], 1, -1).contiguous()
        return self.rows[node]


def _scale(S, increment) -> float | None:
    """``c`` with ``increment = c·S`` to the fit's tolerance, or None."""
    S = S.reshape(increment.shape)
    norm = float((S * S).sum())
    if norm == 0.0:
        return None
    c = float((S * increment).sum()) / norm
    fits = c != 0.0 and relative_error(c * S - increment, increment) <= FIT_TOLERANCE
    return c if fits else None


# ---------------------------------------------------------------------------------------------
# the rewritten body and its confirmation


def _topological(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` with its nodes in an order where each follows its inputs (the
    original order wherever it already is one)."""
    new, env = torch.fx.Graph(), {}
    for root in graph.nodes:
        stack = [root]
        while stack:
            n = stack[-1]
            if n in env:
                stack.pop()
                continue
            pending = [a for a in n.all_input_nodes if a not in env]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            env[n] = new.node_copy(n, lambda a: env[a])
    return new


def rewritten(body: torch.fx.GraphModule, parts: list[Part], backend: str
              ) -> torch.fx.GraphModule:
    """``body`` with every part's step and read replaced by one call of the op."""
    graph = copy_graph(body.graph)
    at = dict(zip(body.graph.nodes, graph.nodes))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for part in (p.mapped(at) for p in parts):
        args = [n for n in part.inputs if n is not None] + [n for n, _ in part.scale_terms]
        fn, options = part.call(backend)
        with graph.inserting_after(max(args, key=order.get)):
            scale = options[0]
            for n, power in part.scale_terms:
                scale = graph.call_function(operator.mul if power == 1 else operator.truediv,
                                            (scale, n))
            call = graph.call_function(fn, (*part.inputs, scale, *options[1:]))
        with graph.inserting_after(call):
            read = graph.call_function(operator.getitem, (call, 0))
        with graph.inserting_after(read):
            state = graph.call_function(operator.getitem, (call, 1))
        read.meta, state.meta = dict(part.read.meta), dict(part.state_out.meta)
        part.read.replace_all_uses_with(read)
        part.state_out.replace_all_uses_with(state)
        order = {n: i for i, n in enumerate(graph.nodes)}
    graph = _topological(graph)
    graph.eliminate_dead_code()
    return graph_module(body, graph)


def _confirmed(program: TTTProgram, parts: list[Part]) -> bool:
    """The body with the parts on the op equals the body: every new state and output, float64,
    fresh random inputs."""
    args = _random_inputs(program, seed=2)
    if args is None:
        return False
    try:
        with torch.no_grad():
            want = promoted(program.body)(*args)
            got = promoted(rewritten(program.body, parts, "torch"))(*args)
    except Exception:
        return False
    return all(relative_error(g - w, w) <= FIT_TOLERANCE for g, w in zip(got, want))


def single_step_parts(program: TTTProgram) -> list[Part]:
    """The confirmed parts of a single-step program (empty when none lifts). A reading that
    fails on a graph it was not written for lifts nothing: the generic executor runs it."""
    if not is_single_step(program) or len(program.outputs) != 1:
        return []
    live_dep = _live_dependents(program)
    ins, outs = program.state_inputs(), program.state_outputs()
    samples = _Samples(program)
    parts = []
    for t in range(len(ins)):
        if outs[t] is ins[t]:
            continue
        try:
            part = _linear_part(program, t, live_dep)
            if part is None and samples.values() is not None:
                part = _local_part(program, t, live_dep, samples.values())
        except Exception:       # a graph the reading does not know: not lifted
            part = None
        if part is not None and _confirmed(program, [*parts, part]):
            parts.append(part)
    return parts


class _Samples:
    """Every body value at one float64 random input, evaluated on first use (None when the
    body's inputs cannot be sampled or it fails on them)."""

    def __init__(self, program: TTTProgram) -> None:
        self.program, self._values, self._done = program, None, False

    def values(self) -> dict | None:
        if not self._done:
            self._done = True
            args = _random_inputs(self.program, seed=1)
            if args is not None:
                try:
                    gm = promoted(self.program.body)
                    by_copy = _node_values(gm, args)
                except Exception:
                    return None
                self._values = {n: by_copy[c] for n, c in
                                zip(self.program.body.graph.nodes, gm.graph.nodes)
                                if c in by_copy}
        return self._values


# ---------------------------------------------------------------------------------------------
# the plan


class SingleStepPlan:
    """Runs a single-step program as its body, once, with its lifted parts on
    ``bidirectional_linear_attention``: ``plan(states0, invariants)``."""

    schedule = "parallel"

    def __init__(self, program: TTTProgram, parts: list[Part], backend: str = "torch"):
        self.program, self.parts, self.backend = program, parts, backend
        self.body = rewritten(program.body, parts, backend)

    #: a single step: one chunk, no loop over chunks, nothing to race
    loops_over_chunks = raced = False

    @property
    def implementation(self) -> str:
        """``bidirectional_linear_attention[torch](W1: gated; taps: local 3×3)``, and the fast
        weights that keep their own code."""
        lifted = "; ".join(p.describe(self.program) for p in self.parts)
        own = [self.program.states[t].name for t, (i, o) in
               enumerate(zip(self.program.state_inputs(), self.program.state_outputs()))
               if i is not o and t not in {p.state for p in self.parts}]
        rest = f" + torch({', '.join(own)})" if own else ""
        return f"bidirectional_linear_attention[{self.backend}]({lifted}){rest}"

    def resized(self, program: TTTProgram) -> "SingleStepPlan":
        """This plan for ``program``, the body re-sized to another batch size (same nodes in
        the same order): the parts are carried over node by node."""
        old, new = list(self.program.body.graph.nodes), list(program.body.graph.nodes)
        if len(old) != len(new) or any((a.op, a.target) != (b.op, b.target)
                                       for a, b in zip(old, new)):
            raise UnsupportedTTTError(
                "the single-step body at this batch size is not a re-sized copy of the traced "
                "one, so its lifting onto bidirectional_linear_attention cannot be reused")
        at = dict(zip(old, new))
        return SingleStepPlan(program, [p.mapped(at) for p in self.parts], self.backend)

    def __call__(self, states0, invariants):
        prog = self.program
        streams, layout = chunk_streams(prog, list(invariants))
        if layout.n_chunks != 1:
            raise UnsupportedTTTError(
                f"the single step of {prog.module_path or 'the model'} runs as one chunk, but "
                f"this call cut its tokens into {layout.n_chunks}; report this as a bug")
        res = self.body(*states0, *(x[0] for x in streams), *invariants)
        n = len(prog.states)
        return assemble_outputs(prog, [y.unsqueeze(0) for y in res[n:]], layout), list(res[:n])


def lift_single_step(program: TTTProgram, backend: str = "torch") -> SingleStepPlan | None:
    """The plan of a single-step program with its linear-attention parts on the op, or None
    when the program is not single-step or no part confirms. ``backend="triton"`` raises: the
    op has no Triton kernel."""
    parts = single_step_parts(program)
    if not parts:
        return None
    if backend == "triton":
        raise UnsupportedTTTError(
            f"backend='triton' was asked for, but the single step of "
            f"{program.module_path or 'the model'} lowers onto bidirectional_linear_attention, "
            "which has no Triton kernel (its torch implementation runs on every device); use "
            "backend='auto' or 'torch'")
    return SingleStepPlan(program, parts, "torch")


__all__ = ["lift_single_step", "single_step_parts", "SingleStepPlan", "Part", "rewritten",
           "is_single_step", "gated_linear_attention", "local_linear_attention"]
