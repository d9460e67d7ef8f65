"""Generic executors of a ``TTTProgram``: the recurrent reference and the chunk-parallel schedules.

``recurrent`` runs the body in a Python loop over chunks, exactly as ``ttt2la.ir`` defines the
iteration. ``parallel`` and ``semi-parallel`` split the body along the checker's state order:

* each state, in topological order, gets its whole sequence ``S_0 … S_N`` at once — a constant,
  a batched recomputation, a prefix sum of batched increments (``S + f``), an affine scan of
  batched coefficient/increment pairs (``a⊙S + f``; the increment is the update at ``S = 0``, the
  coefficient its derivative there), or, for matrix-affine and state-local updates, a sequential
  pass over chunks of only the small state-dependent subgraph with everything it reads
  precomputed in one batch;
* then every chunk output at once, given the state sequences.

Batches are ``torch.func.vmap`` over the chunk axis (invariants unbatched); everything stays on
autograd, so the converted model trains and its gradients match the recurrent executor's.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import is_fake
from torch.func import vmap

from ..analysis.associativity import Analysis, analyze
from ..analysis.op_vocabulary import (AVERAGES, CONSTANT_FILLS, FILL_VALUE_ARGUMENTS,
                                      TENSOR_SHAPED_FILLS, calls, op_name)
from ..errors import PartialChunkError, UnsupportedTTTError
from ..ir import TTTProgram, graph_module, reshape_views
from ..preparation import autocast_state, out_of_sight
from ..runtime import affine_scan, prefix_sum
from ..testing import tolerance
from .chunking import ChunkLayout, assemble_outputs, chunk_streams
from .forward_ad import jvp
from .lean_calls import at_shapes, lean_calls
from .loop_expansions import expansions, expansions_pay
from .scan_choice import affine_scan_pays
from .written_products import written

SCHEDULES = ("parallel", "semi-parallel", "recurrent")
_Value = tuple[torch.Tensor, bool]          # a tensor and whether it has a leading chunk axis


# --------------------------------------------------------------------------------------------
# graph surgery


def shape_only(node: torch.fx.Node) -> bool:
    """``ones_like(x)`` and friends: the value depends on ``x``'s shape only, which is static."""
    return calls(node, TENSOR_SHAPED_FILLS) and isinstance(node.meta.get("val"), torch.Tensor)


def _copy_as_constant(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    name, val = op_name(node), node.meta["val"]
    if name in FILL_VALUE_ARGUMENTS:
        value = node.args[FILL_VALUE_ARGUMENTS[name]]
    else:
        value = CONSTANT_FILLS.get(name, 0)     # an uninitialised fill (empty_like): zeros
    new = graph.call_function(torch.ops.aten.full.default, (list(val.shape), value),
                              {"dtype": val.dtype, "device": val.device})
    new.meta = dict(node.meta)
    return new


def extract(body: torch.fx.GraphModule, inputs: Sequence[torch.fx.Node],
            outputs: Sequence[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """A graph computing ``outputs`` from the ``inputs`` it actually needs (in ``inputs`` order).

    Returns the module and the list of inputs it takes. Every path back from an output must end
    in one of ``inputs`` or a constant; a graph placeholder outside ``inputs`` is a bug. Shape-only
    ops become constants, so a value that merely has a state's shape does not need the state.
    """
    boundary = set(inputs)
    needed, used, stack = set(), set(), [o for o in outputs if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in boundary:
            used.add(n)
            continue
        if n in needed:
            continue
        if n.op == "placeholder":
            raise RuntimeError(f"extract: {n.name} is needed but not provided")
        needed.add(n)
        if not shape_only(n):
            stack.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    taken = [n for n in dict.fromkeys(inputs) if n in used]
    for n in taken:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in body.graph.nodes:
        if n in needed:
            env[n] = _copy_as_constant(graph, n) if shape_only(n) else \
                graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outputs))
    return graph_module(body, graph), taken


def _extract(body: torch.fx.GraphModule, inputs: Sequence[torch.fx.Node],
             outputs: Sequence[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """``extract`` for a graph the plan runs batched over chunks (or chunk by chunk), its views
    made reshapes: the same values, and under ``vmap`` a view of a chunk of a stream can be
    refused for its strides where the reshape copies (the loop fallback ran otherwise)."""
    gm, taken = extract(body, inputs, outputs)
    reshape_views(gm.graph)
    gm.recompile()
    return gm, taken


def _call_batched(fn, values: list[_Value], n_chunks: int) -> tuple[list[torch.Tensor], bool]:
    """``fn`` over the chunk axis of the batched values: one ``vmap``, or a loop if vmap fails.

    Returns the outputs (each with a leading chunk axis) and whether the loop fallback ran.
    """
    args = [v for v, _ in values]
    dims = tuple(0 if b else None for _, b in values)
    if all(d is None for d in dims):
        out = fn(*args)
        return [o.unsqueeze(0).expand(n_chunks, *o.shape) for o in out], False
    if n_chunks == 1:       # one chunk (a single step): the body as written, no vmap to batch it
        out = fn(*[a.squeeze(0) if d == 0 else a for a, d in zip(args, dims)])
        return [o.unsqueeze(0) for o in out], False
    try:
        return list(vmap(fn, in_dims=dims)(*args)), False
    except (RuntimeError, NotImplementedError, ValueError):
        per_chunk = [fn(*[a[j] if d == 0 else a for a, d in zip(args, dims)])
                     for j in range(n_chunks)]
        return [torch.stack(o) for o in zip(*per_chunk)], True


# --------------------------------------------------------------------------------------------
# padding of a partial last chunk


def padding_problem(program: TTTProgram, states0: Sequence[torch.Tensor],
                    invariants: Sequence[torch.Tensor], layout: ChunkLayout) -> str | None:
    """What the zero padding of a partial last chunk would change, or ``None`` when it is inert.

    Probes the body at random states and tokens: the padded tokens must not move, to first
    order, the real tokens' outputs nor (when the last chunk updates) any state-out. This finds
    chunk means (a momentum gate averaged over the chunk), attention across the chunk's tokens
    and value terms of an MSE loss with a biased kernel. A padded token that enters only as a
    term linear in it with fixed coefficients (a running sum of a stream) moves a target too,
    yet zeros add nothing: such a target, its padding's gradient the same on other random states
    and tokens (``_added_linearly``), is inert. Random tokens
    that make the body non-finite are retried as positive values; a probe that stays
    non-finite reports a problem rather than guess.
    """
    for positive in (False, True):
        try:
            verdict = _probe_padding(program, states0, invariants, layout, positive)
        except RuntimeError as e:       # a body whose shapes the padded chunk does not fit
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"a probe of the padded chunk, which the loop's body could not run ({first})"
        if verdict != "non-finite":
            return verdict
    return "a probe of the padded chunk, which was not finite"


def require_inert_padding(program: TTTProgram, states0, invariants, layout: ChunkLayout,
                          cache: dict) -> None:
    """Raise ``PartialChunkError`` when a partial last chunk's zero padding is not inert
    (``padding_problem``); the verdict is cached per tail length (and autocast state) in
    ``cache``."""
    tail = int(layout.tail)            # a plain key, also when a compiler traces sizes
    # the body runs under the caller's autocast, and is probed as it runs: a verdict per state
    autocast = autocast_state((*states0, *invariants))
    key = (tail, autocast) if autocast else tail
    if program.partial_chunk:
        cache[key] = program.partial_chunk
    if key not in cache:
        # it differentiates the body, out of sight of the call (``preparation``); under a
        # compiler's trace (torch.compile) the probe, which reads numbers, runs on real
        # stand-ins: its verdict is about the body's structure
        with out_of_sight(grad=True, devices=[t.device.type for t in (*states0, *invariants)],
                          autocast=autocast):
            if any(is_fake(t) for t in (*states0, *invariants) if isinstance(t, torch.Tensor)):
                states0, invariants = _stand_ins(states0), _stand_ins(invariants)
            cache[key] = padding_problem(program, states0, invariants, layout)
    what = cache[key]
    if what is not None:
        c = layout.chunk_size
        hint = " or an apply-only last chunk" if program.last_chunk == "update" else ""
        where = str(program.loop_src) if program.loop_src else None
        raise PartialChunkError(
            f"The last chunk is partial (L = {layout.length} with chunk size {c}: "
            f"{layout.tail} real token(s) padded with {c - layout.tail} zero(s)), and the "
            f"zero padding changes {what} in the loop"
            f"{f' at {where}' if where else ''} — the padded tokens are not inert (a mean over "
            f"the chunk, attention across its tokens, or a bias on an empty token). Use a length "
            f"that is a multiple of {c}{hint}.", what=what, where=where)


def _stand_ins(values) -> list:
    """Real random tensors shaped like ``values`` (fake tensors of a compiler's trace)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [[int(n) for n in v.shape] for v in values]     # sizes the trace has symbolic
    return [torch.randn(shape, generator=gen).to(v.dtype).to(v.device)
            if v.is_floating_point() else torch.zeros(shape, dtype=v.dtype, device=v.device)
            for v, shape in zip(values, shapes)]


def _probe_padding(program, states0, invariants, layout: ChunkLayout, positive: bool):
    tail, c = layout.tail, layout.chunk_size
    gen_device = states0[0].device if states0 else invariants[0].device
    gen = torch.Generator(device=gen_device).manual_seed(0)

    def randn(shape, like):
        x = torch.randn(shape, generator=gen, device=like.device, dtype=torch.float32)
        return (x.abs() + 0.1 if positive else x).to(like.dtype)

    def targets_at(random_pads: bool):
        """The body on random states and real tokens, its padded tokens zeros (or random):
        ``(targets, reals, pads)``, the targets ``(what, value)`` the padding must not move."""
        invs = [x.detach().clone() for x in invariants]
        states = [randn(s.shape, s) if s.is_floating_point() else s.detach().clone()
                  for s in states0]
        reals, pads, chunks = [], [], []
        for spec in program.streams:
            src = invs[spec.source]
            axis = spec.axis % src.dim()
            shape = list(src.shape)
            shape[axis] = tail
            real = randn(shape, src)
            shape[axis] = c - tail
            pad = randn(shape, src) if random_pads and src.is_floating_point() else \
                torch.zeros(shape, dtype=src.dtype, device=src.device)
            if src.is_floating_point():
                real.requires_grad_(True)
                pad.requires_grad_(True)
                reals.append(real)
                pads.append(pad)
            chunks.append(torch.cat([real, pad], dim=axis))
        if not pads:
            return [], reals, pads
        res = program.body(*states, *chunks, *invs)
        n_s = len(program.states)
        targets = []
        if program.last_chunk == "update":
            targets += [(f"the update of state {program.states[i].name}", res[i])
                        for i in range(n_s)]
        for spec, y in zip(program.outputs, res[n_s:]):
            if isinstance(y, torch.Tensor) and y.dim() > 0:     # items: each one a target
                targets.append((f"the chunk output {spec.name}", y if spec.items
                                else y.narrow(spec.axis % y.dim(), 0, tail)))
        return [(what, y) for what, y in targets
                if isinstance(y, torch.Tensor) and y.requires_grad], reals, pads

    def pad_gradients(y, u, reals, pads):
        grads = torch.autograd.grad((y * u).sum(), pads + reals, allow_unused=True,
                                    retain_graph=True)
        return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, pads + reals)]

    with torch.inference_mode(False), torch.enable_grad():
        targets, reals, pads = targets_at(random_pads=False)
        if not pads:
            return None
        for k, (what, y) in enumerate(targets):
            u = randn(y.shape, y)
            grads = pad_gradients(y, u, reals, pads)
            norms = [float(g.double().norm()) for g in grads]
            pad_norm = sum(v * v for v in norms[:len(pads)]) ** 0.5
            ref = sum(v * v for v in norms[len(pads):]) ** 0.5
            if not (math.isfinite(pad_norm) and math.isfinite(ref)):
                return "non-finite"
            if pad_norm > tolerance(y.dtype) * ref or (ref == 0 and pad_norm > 0):
                if not _added_linearly(program, y, grads[:len(pads)], u, targets_at,
                                       pad_gradients, k):
                    return what
    return None


def _added_linearly(program: TTTProgram, y: torch.Tensor, grads: list[torch.Tensor],
                    u: torch.Tensor, targets_at, pad_gradients, k: int) -> bool:
    """Whether the padded tokens enter target ``k`` (``y``, its padding's gradients ``grads``
    along ``u``) only as a term linear in them with fixed coefficients — ``b + η Σ_t v_t``, a sum
    of a stream over the chunk's tokens: the gradient along the padding is the same on other
    random states and real tokens, with random padded tokens, so zeros add nothing. Never for a
    body that averages (``mean``, ``var``) what it reads: an average over the chunk is linear in
    its tokens too, and its divisor counts the padding."""
    if any(calls(n, AVERAGES) for n in program.body.graph.nodes):
        return False
    targets, reals, pads = targets_at(random_pads=True)
    other = targets[k][1]
    if other.shape != y.shape:
        return False
    again = pad_gradients(other, u, reals, pads)[:len(pads)]
    diff = sum(float((a - b).double().norm()) ** 2 for a, b in zip(grads, again)) ** 0.5
    size = sum(float(a.double().norm()) ** 2 for a in grads) ** 0.5
    return math.isfinite(diff) and diff <= tolerance(y.dtype) * size


# --------------------------------------------------------------------------------------------
# plans


@dataclass
class _StateStep:
    """How one strongly connected group of states gets its sequence."""

    states: list[int]
    mode: str
    graph: torch.fx.GraphModule | None = None
    inputs: list[torch.fx.Node] = field(default_factory=list)
    frontier_graph: torch.fx.GraphModule | None = None
    frontier_inputs: list[torch.fx.Node] = field(default_factory=list)
    frontier: list[torch.fx.Node] = field(default_factory=list)
    computed: list[torch.fx.Node] = field(default_factory=list)
    loop_graph: torch.fx.GraphModule | None = None      # the update and the outputs, per chunk
    loop_inputs: list[torch.fx.Node] = field(default_factory=list)
    as_loop: "_StateStep | None" = None     # a scalar-affine group as a loop over the chunks
    moved: set[torch.fx.Node] = field(default_factory=set)  # expansions its loop computes
    batched: "_StateStep | None" = None     # the same loop reading them batched beforehand


class _Values(dict):
    """The values a call has computed, by node; the ``deferred`` ones (state-independent values
    that a loop computes itself) are computed, all at once, when something else first reads
    one (``compute(values)``). It holds no reference to itself: a cycle would keep the call's
    tensors alive until Python's cycle collector ran, and each call would fault in fresh memory
    for its own."""

    def __init__(self, deferred: list[torch.fx.Node], compute):
        super().__init__()
        self._deferred, self._compute = set(deferred), compute

    def __missing__(self, node: torch.fx.Node) -> _Value:
        if node not in self._deferred:
            raise KeyError(node)
        self._deferred = set()
        self.update(self._compute(self))
        return self[node]


class Plan:
    """A lowered program: ``plan(states0, invariants) -> (outputs, final_states)``.

    ``schedule`` is the schedule it runs, ``implementation`` a short description for reports.
    """

    def __init__(self, program: TTTProgram, analysis: Analysis, schedule: str):
        self.program = program
        self.analysis = analysis
        self.schedule = schedule
        self.fallbacks: set[str] = set()
        self._padding_checked: dict[int, str | None] = {}
        self._looped_affine: set[int] = set()       # scalar-affine states the last call looped
        self._steps: list[_StateStep] = []
        self._outputs_graph = None
        self._outputs_read_last_group = False            # do the outputs read the last group?
        self._recurrent_body: torch.fx.GraphModule | None = None   # the body, called per chunk
        self._outputs_inputs: list[torch.fx.Node] = []
        self._independent: list[torch.fx.Node] = []      # state-free values read by the rest
        self._constant: list[torch.fx.Node] = []         # ... of those, the stream-free ones
        self._movable: set[torch.fx.Node] = set()       # state-free values reading streams
        self._eager: list[torch.fx.Node] = []            # independent values every call reads
        self._deferred: list[torch.fx.Node] = []         # ... and those only loops compute
        self._independent_graph = self._constant_graph = self._deferred_graph = None
        self._independent_inputs: list[torch.fx.Node] = []
        self._constant_inputs: list[torch.fx.Node] = []
        self._deferred_inputs: list[torch.fx.Node] = []
        if schedule != "recurrent":
            self._build()

    # -- construction ------------------------------------------------------------------------
    def _sort_independent(self) -> None:
        """Sort out the state-independent values the state updates and outputs read (computed
        once per call, batched over chunks when they read streams and unbatched otherwise; their
        graphs are built by ``_build_independent_graphs``) and those a loop may compute itself."""
        prog = self.program
        nodes = list(prog.body.graph.nodes)
        reads_state: set[torch.fx.Node] = set(prog.state_inputs())
        reads_stream: set[torch.fx.Node] = set(prog.stream_inputs())
        for n in nodes:
            if n.op == "placeholder" or shape_only(n):
                continue
            if any(a in reads_state for a in n.all_input_nodes):
                reads_state.add(n)
            if any(a in reads_stream for a in n.all_input_nodes):
                reads_stream.add(n)
        results = set(prog.state_outputs()) | set(prog.chunk_outputs())
        for n in nodes:
            if n.op in ("placeholder", "get_attr", "output") or n in reads_state:
                continue
            if n in reads_stream and not shape_only(n):
                self._movable.add(n)
            if n in results or any(u in reads_state for u in n.users):
                (self._independent if n in reads_stream else self._constant).append(n)

    def _build_independent_graphs(self, leaves: list[torch.fx.Node]) -> None:
        """The graphs computing the state-independent values: the constant ones, the batched
        ones every call reads, and those only a loop computes itself (``loop_expansions``),
        deferred until a scan or the outputs read them."""
        prog = self.program
        moved = set().union(*(s.moved for s in self._steps),
                            *(s.as_loop.moved for s in self._steps if s.as_loop is not None))
        self._eager = [n for n in self._independent if n not in moved]
        self._deferred = [n for n in self._independent if n in moved]
        if self._eager:
            self._independent_graph, self._independent_inputs = _extract(prog.body, leaves,
                                                                        self._eager)
        if self._deferred:
            self._deferred_graph, self._deferred_inputs = _extract(prog.body, leaves,
                                                                  self._deferred)
        if self._constant:
            self._constant_graph, self._constant_inputs = _extract(prog.body, leaves,
                                                                  self._constant)

    def _build(self) -> None:
        prog = self.program
        ins, outs = prog.state_inputs(), prog.state_outputs()
        available = [*prog.stream_inputs(), *prog.invariant_inputs()]
        leaves = list(available)
        self._sort_independent()
        available += self._independent + self._constant
        for group, mode in zip(self.analysis.groups, self.analysis.group_modes):
            step = _StateStep(list(group), mode)
            if mode == "recurrent":
                raise AssertionError("a recurrent group in a chunk-parallel plan")
            if mode in ("prefix", "affine", "independent"):
                (t,) = group
                step.graph, step.inputs = _extract(prog.body, available + [ins[t]], [outs[t]])
            if mode == "affine":            # scanned or looped, by the cost rule at each call
                step.as_loop = _StateStep(list(group), "sequential")
                self._build_sequential(step.as_loop, available)
            elif mode == "sequential":
                self._build_sequential(step, available)
            self._steps.append(step)
            for t in group:
                available.append(ins[t])
                if outs[t].op != "placeholder" and outs[t] not in available:
                    available.append(outs[t])
        self._build_independent_graphs(leaves)
        self._outputs_graph, self._outputs_inputs = _extract(prog.body, available,
                                                            prog.chunk_outputs())
        last = self._steps[-1].states if self._steps else []
        own = {ins[t] for t in last} | {outs[t] for t in last if outs[t].op != "placeholder"}
        self._outputs_read_last_group = any(i in own for i in self._outputs_inputs)

    def _build_sequential(self, step: _StateStep, available: list[torch.fx.Node],
                          move: bool = True) -> None:
        """Split a group's update into the small graph the chunk loop runs (every node that
        reads the group's states, and with ``move`` the expansions it computes itself) and the
        frontier it reads, computed beforehand in a batch. A loop with expansions carries the
        same loop without them (``batched``), for calls where they are small."""
        prog = self.program
        ins, outs = prog.state_inputs(), prog.state_outputs()
        own_ins = [ins[t] for t in step.states]
        own_outs = [outs[t] for t in step.states]
        # structural, not value, dependence: ones_like(f(S)) has a constant value but its node
        # cannot be evaluated without S
        reads_group: set[torch.fx.Node] = set(own_ins)
        for n in prog.body.graph.nodes:
            if n not in available and not shape_only(n) \
                    and any(a in reads_group for a in n.all_input_nodes):
                reads_group.add(n)
        boundary = set(available) | set(own_ins)
        local, stack = set(), list(own_outs)
        while stack:
            n = stack.pop()
            if n in local or n in boundary or n not in reads_group:
                continue
            local.add(n)
            stack.extend(n.all_input_nodes)
        frontier = self._frontier(local, own_ins, own_outs)
        step.moved = expansions(frontier, self._movable) if move else set()
        if step.moved:
            step.batched = _StateStep(list(step.states), step.mode)
            self._build_sequential(step.batched, available, move=False)
            frontier = self._frontier(local | step.moved, own_ins, own_outs)
        step.frontier = frontier
        step.computed = [n for n in frontier if n not in available]
        if step.computed:
            step.frontier_graph, step.frontier_inputs = _extract(prog.body, available,
                                                                step.computed)
        step.graph, step.inputs = _extract(prog.body, own_ins + frontier, own_outs)
        step.graph = lean_calls(step.graph)

    def _frontier(self, local: set, own_ins: list, own_outs: list) -> list[torch.fx.Node]:
        """What the ``local`` nodes of a group's update read from outside it (its states
        aside), and the updates computed outside it, in graph order."""
        frontier: list[torch.fx.Node] = []
        for n in self.program.body.graph.nodes:
            if n in local:
                frontier += [a for a in n.all_input_nodes
                             if a not in local and a not in own_ins and a not in frontier]
        return frontier + [o for o in own_outs if o not in local and o not in own_ins
                           and o not in frontier]

    @property
    def forward_ad(self) -> bool:
        """Whether a call takes derivatives by forward-mode differentiation (``jvp``): a
        scalar-affine update's coefficients, which ``torch.compile`` cannot trace."""
        return any(s.mode == "affine" for s in self._steps)

    @property
    def implementation(self) -> str:
        """``"torch.vmap(semi-parallel; sequential: w1)"`` — what runs, for the report."""
        if self.schedule == "recurrent":
            return "torch(recurrent loop)"
        seq = self._sequential_names()
        detail = f"; sequential: {', '.join(seq)}" if seq else ""
        loop = "; loop fallback" if self.fallbacks else ""
        return f"torch.vmap({self.schedule}{detail}{loop})"

    @property
    def loops_over_chunks(self) -> bool:
        """Did the last call run a Python loop over the chunks (a state's update chunk after
        chunk)? Such a plan can lose to the user's own loop (``ttt2la.as_written``)."""
        return self.schedule == "recurrent" or bool(self._sequential_names())

    @property
    def raced(self) -> bool:
        """Can the last call's plan lose to the code as written, so that an exact layer races
        the two (``ttt2la.as_written``)? Always: a generic schedule runs the user's own ops in
        another order, and where it does not loop over the chunks it materialises every
        chunk's states (a prefix sum of per-token ``[H, K, V]`` memories, a normalised linear
        attention's, ran at 0.17-0.23x its token loop on a CPU)."""
        return True

    def _sequential_names(self) -> list[str]:
        """The states the last call updated chunk after chunk."""
        scanned = self._scanned_states()
        return [self.program.states[t].name for s in self._steps if s.mode == "sequential"
                for t in s.states if t not in scanned] + self._looped_affine_names()

    def _scanned_states(self) -> set[int]:
        """The states of sequential groups the last call scanned instead (none here)."""
        return set()

    def _looped_affine_names(self) -> list[str]:
        """The scalar-affine states the last call ran as a loop over the chunks."""
        return [self.program.states[t].name for s in self._steps if s.mode == "affine"
                for t in s.states if t in self._looped_affine]

    # -- running -----------------------------------------------------------------------------
    def __call__(self, states0: Sequence[torch.Tensor], invariants: Sequence[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        prog = self.program
        if len(states0) != len(prog.states):
            raise ValueError(f"expected {len(prog.states)} initial states "
                             f"({', '.join(s.name for s in prog.states)}), got {len(states0)}")
        if len(invariants) != len(prog.invariants):
            raise ValueError(f"expected {len(prog.invariants)} invariants, got {len(invariants)}")
        streams, layout = chunk_streams(prog, list(invariants))
        if layout.partial:
            self._check_padding(states0, invariants, layout)
        if self.schedule == "recurrent":
            chunk_outs, finals = self._run_recurrent(list(states0), streams, list(invariants),
                                                     layout)
        else:
            chunk_outs, finals = self._run_parallel(list(states0), streams, list(invariants),
                                                    layout)
        return assemble_outputs(prog, chunk_outs, layout), finals

    def _check_padding(self, states0, invariants, layout: ChunkLayout) -> None:
        require_inert_padding(self.program, states0, invariants, layout, self._padding_checked)

    def _run_recurrent(self, states, streams, invariants, layout):
        prog = self.program
        n_s = len(prog.states)
        if self._recurrent_body is None:
            self._recurrent_body = lean_calls(prog.body)
        forward = self._recurrent_body.forward
        per_output: list[list[torch.Tensor]] = [[] for _ in prog.outputs]
        columns = [x.unbind(0) for x in streams]
        for j in range(layout.n_chunks):
            res = forward(*states, *[c[j] for c in columns], *invariants)
            for k, y in enumerate(res[n_s:]):
                per_output[k].append(y)
            if j < layout.n_chunks - 1 or prog.last_chunk == "update":
                states = list(res[:n_s])
        return per_output, states

    def _run_parallel(self, states0, streams, invariants, layout):
        prog = self.program
        n = layout.n_chunks
        n_upd = n if prog.last_chunk == "update" else n - 1
        ins, outs = prog.state_inputs(), prog.state_outputs()
        env = _Values(self._deferred, lambda values: self._batched(
            self._deferred_graph, self._deferred_inputs, self._deferred, values, n))
        for ph, x in zip(prog.stream_inputs(), streams):
            env[ph] = (x, True)
        for ph, p in zip(prog.invariant_inputs(), invariants):
            env[ph] = (p, False)
        if self._constant_graph is not None:
            values = self._constant_graph(*[env[i][0] for i in self._constant_inputs])
            env.update((node, (v, False)) for node, v in zip(self._constant, values))
        if self._independent_graph is not None:
            env.update(self._batched(self._independent_graph, self._independent_inputs,
                                     self._eager, env, n))
        finals: list[torch.Tensor | None] = [None] * len(prog.states)
        for step in self._steps:
            run = self._how_to_run(step, states0)
            if step is self._steps[-1] and self._outputs_in_loop(run, states0, n):
                return self._loop_reading_outputs(run, env, states0, n, n_upd, finals), finals
            afters = self._sequence(run, env, states0, n)
            for t, after in zip(step.states, afters):
                s0 = states0[t]
                before = torch.cat([s0.unsqueeze(0), after[:-1]]) if n > 1 else s0.unsqueeze(0)
                finals[t] = after[n_upd - 1] if n_upd > 0 else s0
                env[ins[t]] = (before, True)
                if outs[t].op != "placeholder" and outs[t] not in env:
                    env[outs[t]] = (after, True)
        values = [env[i] for i in self._outputs_inputs]
        chunk_outs, fell_back = _call_batched(self._outputs_graph, values, n)
        if fell_back:
            self.fallbacks.add("outputs")
        return chunk_outs, finals

    def _batched(self, graph, inputs, computed, env, n: int) -> dict[torch.fx.Node, _Value]:
        """The state-independent values ``computed`` by ``graph``, batched over the chunks."""
        values, fell_back = _call_batched(graph, [env[i] for i in inputs], n)
        if fell_back:
            self.fallbacks.add("state-independent values")
        return {node: (v, True) for node, v in zip(computed, values)}

    def _how_to_run(self, step: _StateStep, states0) -> _StateStep:
        """``step``, or for a scalar-affine state its loop over the chunks when on this call
        the scan would not pay (``affine_scan_pays``); a loop with its expansions read batched
        where on this call they are small (``expansions_pay``)."""
        run = step
        if step.as_loop is not None:
            (t,) = step.states
            if affine_scan_pays(states0[t]):
                self._looped_affine.discard(t)
            else:
                self._looped_affine.add(t)
                run = step.as_loop
        if run.batched is not None and not self._expansions_pay(run, states0):
            return run.batched
        return run

    def _expansions_pay(self, step: _StateStep, states0) -> bool:
        """Are the loop's expansions, at this call's sizes, worth computing in the loop?"""
        t = step.states[0]
        traced = self.program.state_inputs()[t].meta["val"].numel()
        return expansions_pay(step.moved, states0[t], traced)

    def _sequence(self, step: _StateStep, env, states0, n: int) -> list[torch.Tensor]:
        """``[S_1 … S_N]`` (the state after each chunk) for every state of the group."""
        ins = self.program.state_inputs()
        if step.mode == "constant":
            (t,) = step.states
            return [states0[t].unsqueeze(0).expand(n, *states0[t].shape)]
        if step.mode in ("prefix", "independent", "affine"):
            (t,) = step.states
            s0 = states0[t]
            zero = torch.zeros_like(s0)
            values = [(zero, False) if i is ins[t] else env[i] for i in step.inputs]
            if step.mode == "affine":
                f, a = self._affine_terms(step, values, t, s0, n)
                return [affine_scan(a, f, s0, dim=0)]
            (f,), fell_back = _call_batched(step.graph, values, n)
            if fell_back:
                self.fallbacks.add(self.program.states[t].name)
            if step.mode == "independent":
                return [f]
            return [prefix_sum(f, dim=0, initial=s0)]
        return self._sequential(step, env, states0, n)

    def _affine_terms(self, step: _StateStep, values, t: int, s0: torch.Tensor, n: int):
        """Per chunk ``f = F(0)`` and ``a = ∂F/∂S·1`` of a scalar-affine update
        ``F(S) = a⊙S + f``."""
        ins = self.program.state_inputs()
        k = step.inputs.index(ins[t]) if ins[t] in step.inputs else None
        graph = step.graph
        zero, one = torch.zeros_like(s0), torch.ones_like(s0)

        def terms(*args):
            if k is None:
                (f,) = graph(*args)
                return f, torch.zeros_like(f)

            def update(state):
                full = list(args)
                full[k] = state
                return graph(*full)[0]

            return jvp(update, (zero,), (one,))

        (f, a), fell_back = _call_batched(terms, values, n)
        if fell_back:
            self.fallbacks.add(self.program.states[t].name)
        return f, a

    def _frontier_values(self, step: _StateStep, env, n: int) -> dict[torch.fx.Node, _Value]:
        """The step's frontier (what its state-dependent subgraph reads), batched over chunks."""
        if step.frontier_graph is None:
            return {}
        vals, fell_back = _call_batched(step.frontier_graph,
                                        [env[i] for i in step.frontier_inputs], n)
        if fell_back:
            self.fallbacks.add("frontier")
        return {node: (v, True) for node, v in zip(step.computed, vals)}

    def _loops(self, step: _StateStep, states0, n: int) -> bool:
        """Does ``step`` run as a Python loop over the chunks on this call?"""
        return step.mode == "sequential"

    def _outputs_in_loop(self, step: _StateStep, states0, n: int) -> bool:
        """Read the outputs inside the last ``step``'s chunk loop rather than batched after it?
        When the loop runs anyway and the outputs read its states: the batched read would need every
        chunk's state before and after it kept (two copies of ``n`` states), which for a large
        state costs more than the products they feed."""
        return self._outputs_read_last_group and self._loops(step, states0, n)

    def _chunk_loop(self, step: _StateStep, env, states0, n: int, graph, inputs):
        """Run ``graph`` once per chunk with the group's states carried (it takes them among
        ``inputs`` and returns their updates first, in the group's order): yields each chunk's
        results. Batched inputs are split once, and the graph's code is called directly, from
        the first chunk whose states keep their shapes on without the views that leave those
        shapes as they are (``at_shapes``)."""
        frontier_values = self._frontier_values(step, env, n)
        own = [self.program.state_inputs()[t] for t in step.states]
        state = {i: states0[t] for i, t in zip(own, step.states)}
        columns = [None if i in state else _chunks(frontier_values.get(i) or env[i], n)
                   for i in inputs]
        kept = self.__dict__.setdefault("_at_shapes", {})
        forward, settled = graph.forward, False
        for j in range(n):
            args = [state[i] if col is None else col[j] for i, col in zip(inputs, columns)]
            res = forward(*args)
            if not settled and all(r.shape == state[i].shape for i, r in zip(own, res)):
                # the states kept their shapes (an initial state may broadcast to the
                # batch's): every later chunk is called at this one's shapes
                forward, settled = at_shapes(graph, args, kept).forward, True
            state = dict(zip(own, res))
            yield res

    def _sequential(self, step: _StateStep, env, states0, n: int) -> list[torch.Tensor]:
        k = len(step.states)
        afters = zip(*(res[:k] for res in self._chunk_loop(step, env, states0, n, step.graph,
                                                            step.inputs)))
        return [torch.stack(a) for a in afters]

    def _loop_reading_outputs(self, step: _StateStep, env, states0, n: int, n_upd: int,
                              finals: list) -> list[list[torch.Tensor]]:
        """The last group's chunk loop with each chunk's outputs read as it goes, by one graph
        (see ``_outputs_in_loop``); fills the group's ``finals`` and returns each output's chunks
        (joined by ``assemble_outputs`` in one copy)."""
        if step.loop_graph is None:
            self._build_loop_reading_outputs(step)
        k = len(step.states)
        for t in step.states:
            finals[t] = states0[t]
        per_output: list[list[torch.Tensor]] = [[] for _ in self.program.outputs]
        loop = self._chunk_loop(step, env, states0, n, step.loop_graph, step.loop_inputs)
        for j, res in enumerate(loop):
            for ys, y in zip(per_output, res[k:]):
                ys.append(y)
            if j < n_upd:
                for t, after in zip(step.states, res[:k]):
                    finals[t] = after
        return per_output

    def _build_loop_reading_outputs(self, step: _StateStep) -> None:
        """One graph per chunk: the group's update and the chunk outputs."""
        prog = self.program
        ins, outs = prog.state_inputs(), prog.state_outputs()
        own_outs = [outs[t] for t in step.states]
        leaves = [ins[t] for t in step.states] + step.frontier + [
            i for i in self._outputs_inputs if i not in own_outs or i.op == "placeholder"]
        graph, step.loop_inputs = _extract(prog.body, leaves, own_outs + list(prog.chunk_outputs()))
        step.loop_graph = lean_calls(graph)


def _chunks(value: _Value, n: int) -> Sequence[torch.Tensor]:
    """The ``n`` chunks of a value batched over chunks (views, split once); an unbatched value
    ``n`` times."""
    v, batched = value
    return v.unbind(0) if batched else [v] * n


def lower(program: TTTProgram, analysis: Analysis | None = None, backend: str = "auto",
          schedule: str | None = None) -> Plan:
    """Plan ``program`` for execution: the analysis' schedule unless ``schedule`` asks for a less
    parallel one (asking for a more parallel one raises ``NonReducibleError``)."""
    if backend not in ("auto", "torch"):
        raise UnsupportedTTTError(
            f"Backend {backend!r} has no generic lowering: generic loop bodies run with torch "
            f"(vmap over chunks); use backend='torch' or 'auto'.")
    if analysis is not None and analysis.program.body.graph is not program.body.graph:
        raise ValueError("the analysis belongs to a different program; call analyze(program)")
    # the generic plan runs the code's own products
    program, analysis = written(program, analysis)
    if analysis is None:
        analysis = analyze(program)
    schedule = schedule or analysis.schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    analysis.require_schedule(schedule)
    return Plan(program, analysis, schedule)


def execute(program: TTTProgram, analysis: Analysis | None, states0: Sequence[torch.Tensor],
            invariants: Sequence[torch.Tensor], schedule: str | None = None
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run ``program`` over the whole sequence: ``(outputs, final_states)`` (see ``lower``)."""
    return lower(program, analysis, schedule=schedule)(states0, invariants)


__all__ = ["Plan", "lower", "execute", "extract", "padding_problem", "require_inert_padding",
           "SCHEDULES"]
