"""Lift a parallel program onto the runtime's linear-attention ops.

The generic executors run any reducible body by batching its subgraphs over chunks. When the
body has the shape the paper proves every reduced TTT layer has — a final state read by one
matmul with kernel features and updated by a sum over tokens of key-feature ⊗ effective-value,
optionally through momentum and Newton–Schulz — it is lifted onto the runtime ops instead:

* ``block_linear_attention`` (LaCT's chunk form, with ``momentum`` and ``muon_steps``, and a
  state decayed once per chunk, ``W' = γ W + Δ``, as gated memories decay it) for chunked loops;
* ``chunk_linear_attention`` (token-causal) for per-token loops, with a state decayed once per
  token (``S' = γ S + kᵀv``, as retention and gated linear attention decay it) as its log decay.

Lifting extracts from the body the per-chunk subgraphs that compute φ(Q), φ(K), the effective
value, the momentum coefficient and the output post-processing, batches them over chunks, and
normalises their layout to the runtime's ``[B, T, H, D]`` with heads folded into the batch. It
never guesses: any mismatch returns ``None`` and the generic executor runs the program.

Newton–Schulz is read as data: the ``(a, b, c)`` of every step, the normalisation's epsilon and
the dtype the iteration runs in come from the graph (``match_newton_schulz``), and one float64
evaluation of the traced transform against the runtime's ``newton_schulz`` with that schedule
confirms them, so a look-alike (another normalisation, another polynomial, a missing transpose
rule) is never lifted.

``lift`` reads node metadata (shapes), which is true only for the program as traced. A converted
layer at another batch size runs a re-sized copy of that body (``GraphTemplate.instantiate``):
``LiftedProgram.resized`` carries the lifted structure over to it node by node and reads no
metadata, so the same runtime op runs at every batch size and length.
"""
from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch
import torch.fx

from ..analysis.op_vocabulary import RELAYOUT_TARGETS
from ..analysis.rules import match_newton_schulz
from ..errors import UnsupportedTTTError
from ..ir import TTTProgram, ancestors, descendants, reshape_views
from ..runtime import block_linear_attention, chunk_linear_attention, newton_schulz
from ..runtime.dispatch import CHUNK_SIZE, select_backend
from ..runtime.naive import NS_EPS, WEIGHT_NORM_EPS
from .affine_update import (ONE, Polynomial, affine_in, evaluate, factors_of, is_factor,
                            is_vector_factor, per_matrix, vector_axis)
from .bonus import Bonus, bonus_of, bonus_read, state_plus_term
from .chunking import assemble_outputs, chunk_layout, chunk_stream, chunk_streams
from .executors import extract, require_inert_padding
from .flat_vmap import flat_vmap
from .specialize import SpecializedGraph
from .precision import promoted
from .scan_choice import decayed_op_pays, forced, scanning
from .shared_keys import Companion, companions
from .weight_norm import WeightNorm, match_weight_norm
from .whole_sequence import (drop_identity_views, free_chunk_sizes, per_token_rate, stream_axes,
                             token_local)

aten = torch.ops.aten


#: Moves of axes that ``strip`` peels off where the chain they are part of only reshapes.
AXIS_MOVES = frozenset({aten.permute.default, aten.transpose.int, aten.unsqueeze.default,
                        aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                        aten.t.default})


def strip(n):
    """``n`` with the relayouts around it (views, copies) peeled off, and the moves of axes
    between them where the whole chain only reshapes its source (as ``torch.einsum`` traces:
    a unit axis put in and moved, a transpose undone) — a transpose that stays is kept."""
    while isinstance(n, torch.fx.Node) and n.target in RELAYOUT_TARGETS:
        n = n.args[0]
    source = n
    while isinstance(source, torch.fx.Node) and (source.target in RELAYOUT_TARGETS
                                                  or source.target in AXIS_MOVES):
        source = source.args[0]
    if source is not n and _only_reshapes(source, n):
        return source
    return n


def _only_reshapes(source, n: torch.fx.Node) -> bool:
    """Whether the chain of one-input relayouts from ``source`` to ``n`` gives every element
    of ``source`` the place ``reshape`` would: the chain replayed on ``arange``."""
    return _lands_as(n, source, lambda x: x, exact_shape=True)


def _lands_as(n, source, arranged, exact_shape: bool = False) -> bool:
    """Whether the chain of one-input relayouts from ``source`` to ``n``, replayed on
    ``arange``, puts every element where ``arranged`` of the source does (in the same order;
    ``n`` of the traced shape with ``exact_shape``, else the same last two sizes)."""
    found = replayed(n, source)
    if found is None:
        return False
    x, y = found
    want = arranged(x)
    shape = tuple(y.shape) == tuple(n.meta["val"].shape) if exact_shape else \
        y.numel() == want.numel() and tuple(y.shape[-2:]) == tuple(want.shape[-2:])
    return shape and torch.equal(y.reshape(-1), want.reshape(-1))


def replayed(n, source, targets=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, y)``: ``arange`` in ``source``'s traced shape, and ``y`` the same elements through
    the chain of one-input ops (reading only constants besides, of ``targets`` where given)
    from ``source`` to ``n``, replayed — where every element lands; None when ``n`` is no such
    chain of ``source`` or the replay fails."""
    chain, node = [], n
    while node is not source:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
                or (targets is not None and node.target not in targets) or any(
                    isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
            return None
        chain.append(node)
        node = node.args[0]
    if not isinstance(source, torch.fx.Node) or "val" not in source.meta:
        return None
    shape = tuple(source.meta["val"].shape)
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    y = x
    try:
        for op in reversed(chain):
            y = op.target(y, *op.args[1:], **op.kwargs)
    except Exception:
        return None
    return x, y


def _shape(n: torch.fx.Node) -> tuple:
    return tuple(n.meta["val"].shape)


@dataclass
class _Contraction:
    left: torch.fx.Node        # [b, r, T]
    right: torch.fx.Node       # [b, T, c]
    scales: list               # state-independent multipliers broadcast over (r, c)
    outer: bool                # an elementwise outer product (one token) rather than a bmm


def contraction(n, state_dep: set, factor=is_factor) -> _Contraction | None:
    """``n`` as a sum over tokens of outer products (a bmm, or a broadcast product of a column
    and a row), possibly times scalars per matrix (``factor``: or what else it admits)."""
    n = strip(n)
    if not isinstance(n, torch.fx.Node) or n in state_dep:
        return None
    if n.target is aten.bmm.default:
        return _Contraction(n.args[0], n.args[1], [], False)
    if n.target is aten.neg.default:
        inner = contraction(n.args[0], state_dep, factor)
        if inner is not None:
            inner.scales.append(-1.0)
        return inner
    if n.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(n.args[1], (int, float)):
        inner = contraction(n.args[0], state_dep, factor)
        if inner is not None:
            inner.scales.append(float(n.args[1]) if n.target is aten.mul.Tensor
                                else 1.0 / float(n.args[1]))
        return inner
    if n.target is aten.mul.Tensor and all(isinstance(a, torch.fx.Node) for a in n.args):
        a, b = n.args
        sa, sb = _shape(a), _shape(b)
        if len(sa) >= 2 and len(sb) >= 2:
            if sa[-1] == 1 and sb[-2] == 1 and sa[-2] > 1 and sb[-1] > 1:
                return _Contraction(a, b, [], True)
            if sb[-1] == 1 and sa[-2] == 1 and sb[-2] > 1 and sa[-1] > 1:
                return _Contraction(b, a, [], True)
        for x, s in ((a, b), (b, a)):
            if factor(s, state_dep):
                inner = contraction(x, state_dep, factor)
                if inner is not None:
                    inner.scales.append(s)
                    return inner
    return None


@dataclass(frozen=True)
class NewtonSchulz:
    """The orthogonalisation a lifted update applies, as the runtime takes it: one ``(a, b, c)``
    per step, the Frobenius normalisation's ``eps`` and the dtype the user's code casts to before
    iterating (``None``: no cast, so the iteration runs in the dtype of the values, bf16 in a bf16
    model — see ``iteration_dtype``)."""

    coefficients: tuple[tuple[float, float, float], ...]
    eps: float = NS_EPS
    dtype: torch.dtype | None = None

    @property
    def steps(self) -> int:
        return len(self.coefficients)

    def iteration_dtype(self, phi_k: torch.Tensor, value: torch.Tensor) -> torch.dtype:
        """The dtype the iteration runs in: the cast's, or without one the update's own dtype
        (keys and values promoted), as the user's code computes it — not the op's wider
        accumulation dtype, which would make a bf16 model iterate in fp32."""
        return self.dtype or torch.promote_types(phi_k.dtype, value.dtype)


@dataclass
class LiftedProgram:
    """A program recognised as block or token-causal linear attention.

    Holds no size read from the trace: every size comes from the tensors at run time.
    """

    program: TTTProgram
    kind: str                          # "block" | "chunk"
    w: int                             # index of the final state
    m: int | None                      # index of the momentum state
    transposed: bool                   # the runtime state is Wᵀ
    newton_schulz: NewtonSchulz | None
    features: torch.fx.GraphModule     # (streams, invariants) -> (q_side, left, right, *scales, alpha?, gamma?)
    feature_inputs: list
    post: torch.fx.GraphModule         # (read, streams, invariants) -> chunk output
    post_inputs: list
    read: torch.fx.Node
    scale: float = 1.0                 # constant factor of the increment (signs, fixed lrs)
    feature_boundary: list = field(default_factory=list)
    feature_outputs: list = field(default_factory=list)
    post_boundary: list = field(default_factory=list)
    weight_norm: torch.fx.Node | None = None              # the target norms, when normalised
    # per-chunk coefficients, polynomials over the ``factors`` that end the features (indices):
    # momentum's α, the decay γ of ``W' = γ·W + s·T(M)`` and the step's factor s after the
    # transform (None: no momentum, γ = 1, s = 1)
    alpha: tuple | None = None
    gamma: tuple | None = None
    step: tuple | None = None
    factors: int = 0
    # a decay per key or value channel: the traced state's axis it varies along (None: per
    # matrix); which channel that is depends on the layout (``decays_values``)
    decay_axis: int | None = None
    # memories written with the final state's keys, riding as value columns (``shared_keys``)
    companions: tuple[Companion, ...] = ()
    # a term the loop adds to the state where it reads it (``bonus``), its features last
    bonus: Bonus | None = None
    # the read multiplies the state's transpose (``Read.flipped``): the query and the read
    # are laid out as the other layout's
    flipped: bool = False
    # token-local features and post-processing run once over whole sequences (``whole_sequence``)
    whole_sequence: bool = False
    token_features: torch.fx.GraphModule | None = None    # -> (q_side, left, right)
    token_feature_inputs: list = field(default_factory=list)
    whole_post: torch.fx.GraphModule | None = None        # ``post`` for whole sequences
    chunk_features: torch.fx.GraphModule | None = None    # -> (*scales, alpha?, gamma?), per chunk
    chunk_feature_inputs: list = field(default_factory=list)

    @property
    def muon_steps(self) -> int:
        return 0 if self.newton_schulz is None else self.newton_schulz.steps

    @property
    def query_column(self) -> bool:
        """The query is the read's right operand (a column), the read ``Wᵀ``-shaped."""
        return self.transposed != self.flipped

    @property
    def decays_values(self) -> bool:
        """The decay varies along the state's value axis: one factor per column of the runtime
        state (the ops' ``value_decay`` / ``value_log_decay``), not per row."""
        return self.decay_axis is not None and self.decay_axis == (-2 if self.transposed else -1)

    @property
    def decayed(self) -> bool:
        """``W' = γ·W + Δ`` with a decay ``γ`` other than 1."""
        return self.gamma is not None

    def resized(self, program: TTTProgram) -> "LiftedProgram":
        """The same lifting of ``program``, a re-sized copy of this one's body (same nodes in the
        same order, other size arguments): the subgraphs are cut again at the same nodes."""
        old = list(self.program.body.graph.nodes)
        new = list(program.body.graph.nodes)
        if len(old) != len(new) or any((a.op, a.target) != (b.op, b.target)
                                       for a, b in zip(old, new)):
            raise UnsupportedTTTError(
                "the loop body at this batch size is not a re-sized copy of the traced one, so "
                "its lifting onto the runtime op cannot be reused")
        at = {n: new[i] for i, n in enumerate(old)}

        def mapped(nodes):
            return [at[n] if isinstance(n, torch.fx.Node) else n for n in nodes]

        features, feature_inputs = _batched(program.body, mapped(self.feature_boundary),
                                            mapped(self.feature_outputs))
        y = program.chunk_outputs()[0]
        post, post_inputs = _batched(program.body, mapped(self.post_boundary), [y])
        resized = dataclasses.replace(self, program=program, features=features,
                                      feature_inputs=feature_inputs, post=post,
                                      post_inputs=post_inputs, read=at[self.read],
                                      companions=tuple(dataclasses.replace(c, read=at[c.read])
                                                       for c in self.companions),
                                      feature_boundary=mapped(self.feature_boundary),
                                      feature_outputs=mapped(self.feature_outputs),
                                      post_boundary=mapped(self.post_boundary),
                                      weight_norm=None if self.weight_norm is None
                                      else at[self.weight_norm])
        return _split_features(resized) if self.whole_sequence else resized


@dataclass(frozen=True)
class Read:
    """The product that reads the state: ``node`` (a ``bmm``), ``transposed`` when the state
    is its left operand, ``term`` a term added to the state where it is read (``bonus``), and
    ``flipped`` when the operand is the state's transpose (``einsum("bkv,bk->bv", S, q)``,
    ``S.mT @ q``): the read of a state laid out the other way."""

    node: torch.fx.Node | None
    transposed: bool = False
    term: torch.fx.Node | None = None
    flipped: bool = False


def find_read(program: TTTProgram, w_ref: set, state_dep_other: set, state_dep=None,
              flips: bool = False) -> Read:
    """The product that reads the state (one of ``w_ref``) against an operand no other live
    state feeds (``Read(None)`` when there is none). With ``state_dep`` (what live states feed)
    the state may be read plus a term none of them feeds; with ``flips`` through its
    transpose."""
    for n in program.body.graph.nodes:
        if n.target is not aten.bmm.default:
            continue
        for transposed, mine, other in ((False, n.args[1], n.args[0]),
                                        (True, n.args[0], n.args[1])):
            if other in state_dep_other:
                continue
            if strip(mine) in w_ref:
                return Read(n, transposed)
            if flips and _transpose_of(mine, w_ref):
                return Read(n, transposed, flipped=True)
            plus = None if state_dep is None else state_plus_term(mine, w_ref, state_dep, strip)
            if plus is not None:
                return Read(n, transposed, plus[1])
    return Read(None)


def _transpose_of(n, w_ref: set) -> bool:
    """Whether ``n`` is a state of ``w_ref`` with its last two axes swapped, through relayouts
    (replayed: every element lands where the transpose puts it)."""
    source = n
    while isinstance(source, torch.fx.Node) and source not in w_ref and (
            source.target in RELAYOUT_TARGETS or source.target in AXIS_MOVES):
        source = source.args[0]
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if source not in w_ref or source is n or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return False
    return _lands_as(n, source, lambda x: x.transpose(-1, -2))


@dataclass
class _Update:
    """What ``lift`` reads off the final state's update ``W' = γ·W + s·T(M')`` (see ``_update``)."""

    w: int                              # index of the final state
    m: int | None                       # index of the momentum state
    frozen: list                        # states the loop no longer changes (read as invariants)
    others: list                        # other live states: companions, if anything
    state_dep: set                      # nodes that depend on a live state
    norm: WeightNorm | None             # ``W' = norm(W + Δ)·n`` when normalised
    delta: torch.fx.Node                # T(M'): Δ before its factor
    step: Polynomial = ONE              # s: the factor Δ is added with
    gamma: Polynomial = ONE             # the state's decay, one factor per matrix and chunk
    alpha: Polynomial | None = None     # the momentum coefficient of ``M' = α·M + g_scale·G``
    g: torch.fx.Node | None = None      # G
    g_scale: Polynomial = ONE


def _states(program: TTTProgram):
    """``(w, m, frozen, others)``: one final state, at most one live momentum state beside it
    or other live states (companions, if they are: ``shared_keys``), in an order and tail the
    runtime ops have; else ``None``."""
    roles = [s.role for s in program.states]
    ins, outs = program.state_inputs(), program.state_outputs()
    w = _matrix_final(program)
    if w is None or len(program.outputs) != 1:
        return None
    frozen = [i for i in range(len(roles)) if outs[i] is ins[i]]
    others = [i for i in range(len(roles)) if i != w and i not in frozen]
    per_token = any(s.per_token for s in program.streams)
    m = others[0] if len(others) == 1 and roles[others[0]] == "momentum" else None
    others = [i for i in others if i != m]
    # the token-causal op reads after each update; a read before it is the same op on the
    # keys and values shifted by one token (``LiftedPlan._read_first``), either tail
    tails = PER_TOKEN_TAILS if per_token else BLOCK_TAILS
    if (program.order, program.last_chunk) not in tails or (per_token and m is not None):
        return None
    return w, m, frozen, others


def _matrix_final(program: TTTProgram) -> int | None:
    """The final state the op runs: the only one, or of several (a normaliser read by a matrix
    product, ``Q z``, is final too) the one larger than every other."""
    finals = [i for i, s in enumerate(program.states) if s.role == "final"]
    sizes = {i: program.state_inputs()[i].meta["val"].numel() for i in finals}
    largest = [i for i in finals if sizes[i] == max(sizes.values(), default=0)]
    return largest[0] if len(largest) == 1 else None


#: The orders and last chunks a lifted loop may have: the block op's, and per token any.
BLOCK_TAILS = (("exclusive", "apply_only"), ("inclusive", "update"))
PER_TOKEN_TAILS = BLOCK_TAILS + (("exclusive", "update"),)


def _accumulated(program, state_in, out, state_dep, factor=is_factor):
    """``(a, s, t)`` of ``out = a·state_in + s·t`` (one state-free term ``t``, ``a`` not 0: the
    state is carried), or ``None``; ``factor`` says what ``a`` may hold (``affine_in``)."""
    form = affine_in(out, state_in, descendants(program.body.graph, [state_in]), state_dep, strip,
                     factor)
    found = None if form is None or not form.coefficient else form.single_term(state_dep, strip)
    return None if found is None else (form.coefficient, *found)


def _update(program: TTTProgram) -> _Update | None:
    """The final state's update read off the body as ``W' = γ·W + s·Δ`` however it is written
    (or ``norm(γ·W + s·Δ)·n``, which the op runs chunk after chunk; ``γ``, ``s`` factors per
    chunk or 1), through momentum ``M' = α·M + G`` when there is one (``affine_update``)."""
    found = _states(program)
    if found is None:
        return None
    w, m, frozen, others = found
    ins, outs = program.state_inputs(), program.state_outputs()
    state_dep = descendants(program.body.graph,
                            [ins[i] for i in range(len(ins)) if i not in frozen])
    norm = match_weight_norm(outs[w])
    # the state may decay per key channel: the token-causal op's log decay per key, the block
    # op's decay per state row
    read = _accumulated(program, ins[w], outs[w] if norm is None else norm.sum, state_dep,
                        is_vector_factor if norm is None else is_factor)
    if read is None:
        return None
    gamma, step, delta = read
    if vector_axis(step) is not None or vector_axis(gamma) is False:
        return None
    up = _Update(w, m, frozen, others, state_dep, norm, delta, step, gamma)
    if m is not None:
        if outs[m] not in ancestors(delta):
            return None
        momentum = _accumulated(program, ins[m], outs[m], state_dep)
        if momentum is None:
            return None
        up.alpha, up.g_scale, up.g = momentum
    return up


def _increment(program: TTTProgram, up: _Update):
    """``(contraction, transform_root)``: the key-feature ⊗ value contraction the increment is
    made of, and where the transform ``Δ = T(·)`` starts; else ``None``. A sign or constant
    factor around the contraction (``-η kᵀv`` written as a loss gradient) belongs to the
    increment's scale, not to the transform."""
    if up.g is not None:
        con = contraction(up.g, up.state_dep)
        if con is None or len(up.g_scale) != 1:
            return None
        _scale_by(con, up.g_scale)
        return con, program.state_outputs()[up.m]
    candidates = [n for n in ancestors(up.delta)
                  if n.target in (aten.bmm.default, aten.mul.Tensor, aten.neg.default,
                                  aten.div.Tensor)]
    for c in sorted(candidates, key=lambda n: -len(ancestors(n))):
        con = contraction(c, up.state_dep)
        if con is None:
            continue
        try:
            extract(program.body, [c], [up.delta])
        except RuntimeError:
            continue
        return con, c
    return None


def _consistent_shapes(program: TTTProgram, up: _Update, contraction, read) -> tuple | None:
    """``(batch, rows, cols)`` of the state when the contraction, the read and the state agree
    on them; else ``None``."""
    sl, sr = _shape(contraction.left), _shape(contraction.right)
    if len(sl) < 2 or len(sr) < 2 or sl[:-2] != sr[:-2] or sl[-1] != sr[-2]:
        return None
    batch = 1
    for d in sl[:-2]:
        batch *= d
    if _shape(read)[0] != batch:
        return None
    rows, cols = sl[-2], sr[-1]
    w_in = program.state_inputs()[up.w]
    if _shape(strip(w_in))[-2:] != (rows, cols) and _shape(w_in)[-2:] != (rows, cols):
        return None
    return batch, rows, cols


def lift(program: TTTProgram) -> LiftedProgram | None:
    """Recognise ``program`` as block/token-causal linear attention, or return ``None``."""
    up = _update(program)
    found = None if up is None else _increment(program, up)
    if found is None:
        return None
    increment, transform_root = found
    try:
        transform, _ = extract(program.body, [transform_root], [up.delta])
    except RuntimeError:
        return None
    # the read: o = φ(Q) W (W right) or W φ(Q)ᵀ (W left)
    ins, outs = program.state_inputs(), program.state_outputs()
    # the state read after its update may be a relayout of the update (``baddbmm`` on flattened
    # heads, viewed back), which ``strip`` sees through
    w_ref = {ins[up.w]} if program.order == "exclusive" else {outs[up.w], strip(outs[up.w])}
    per_token = any(s.per_token for s in program.streams)
    found = find_read(program, w_ref, up.state_dep - w_ref, up.state_dep if per_token else None,
                      flips=True)
    read, term, flipped = found.node, found.term, found.flipped
    # the state's layout: transposed when it is the read's left operand, or its transpose the
    # right one
    transposed = found.transposed != flipped
    shapes = None if read is None else _consistent_shapes(program, up, increment, read)
    bonus = None if term is None else bonus_of(term, up.state_dep, contraction)
    if shapes is None or (term is not None and bonus is None):
        return None
    if up.norm is not None and not _runtime_weight_norm(up.norm, transposed, up.state_dep):
        return None
    # the orthogonalisation, read from the graph and confirmed by one evaluation
    ns = _read_transform(transform, _shape(transform_root), shapes, up.delta)
    if ns is False:
        return None
    # with nothing between the increment and the step, the step's factor scales the increment
    # (not a factor per chunk after momentum: s_j·M_j is no momentum recursion)
    if ns is None and len(up.step) == 1 and (up.m is None or not up.step[0][1]):
        _scale_by(increment, up.step)
        up.step = ONE
    # a per-token decay runs as the token-causal op's log decay (per key or value channel: a
    # row or a column of the op's state); a step factor left after the fold above (``lerp``'s
    # ``1 − a``) scales each token's values
    if per_token and ns is not None:
        return None
    decay_axis = vector_axis(up.gamma)
    # value columns and a bonus term share the decay per row or matrix only
    if decay_axis is not None and decay_axis == (-2 if transposed else -1) \
            and (up.others or term is not None):
        return None
    riders = ()
    if up.others and (flipped or not (per_token or _plain_block(up, increment, ns))):
        return None
    if up.others:
        key, query = ((increment.right, read.args[1]) if transposed
                      else (increment.left, read.args[0]))
        # a chunk's key feature holds its tokens along the contraction's axis
        tokens = None if per_token else (-2 if transposed else -1)
        riders = companions(program, up.others, up, key, query, not transposed, _accumulated,
                            tokens)
        if riders is None:
            return None
    # a loop over slices of one token (``q[:, t:t + 1]``) runs token by token: the token-causal
    # op, not the block op at chunks of one, where nothing but a decay comes with the update
    token_causal = per_token or (program.chunk_size == 1 and ns is None and up.m is None
                                 and up.norm is None)
    lifted = _assemble(program, up, increment, read, transposed, ns, token_causal, riders, bonus,
                       flipped)
    return None if lifted is None else dataclasses.replace(lifted, decay_axis=decay_axis)


def _plain_block(up: _Update, increment: _Contraction, ns) -> bool:
    """Whether a chunk loop's update leaves value columns beside its values untouched: no
    orthogonalisation, norm or momentum mixing the whole state, no factor on the increment but
    constants (the block op scales every column by a rate; a constant scales the values before
    the columns join them)."""
    return ns is None and up.norm is None and up.m is None and up.step == ONE \
        and all(isinstance(c, float) for c in increment.scales)


def _scale_by(con: _Contraction, p: Polynomial) -> None:
    """Multiply the contraction's scales by ``p``, one monomial (a constant times factors)."""
    (c, fs), = p
    con.scales.extend([*([c] if c != 1.0 else []), *fs])


def _assemble(program, up: _Update, contraction, read, transposed, ns, per_token, riders=(),
              bonus=None, flipped=False):
    """The ``LiftedProgram``: the feature and post-processing subgraphs cut from the body."""
    streams = program.stream_inputs()
    ins = program.state_inputs()
    invariants = [*program.invariant_inputs(), *(ins[i] for i in up.frozen)]
    constant_scale = 1.0
    for c in contraction.scales:
        if isinstance(c, float):
            constant_scale *= c
    node_scales = [c for c in contraction.scales if not isinstance(c, float)]
    coefficients = (up.alpha, None if up.gamma == ONE else up.gamma,
                    None if up.step == ONE else up.step)
    # the companions' column values end the factors: per token, like the decay
    factors = factors_of(*(p for p in coefficients if p is not None), *(c.column for c in riders))
    alpha, gamma, step = (None if p is None else _indexed(p, factors) for p in coefficients)
    riders = [dataclasses.replace(c, column=_indexed(c.column, factors)) for c in riders]
    feat_outputs = [read.args[1] if transposed != flipped else read.args[0], contraction.left,
                    contraction.right, *node_scales, *factors, *(bonus[1] if bonus else ())]
    feature_boundary = [*streams, *invariants]
    post_boundary = [read, *(c.read for c in riders), *streams, *invariants]
    try:
        features, feature_inputs = _batched(program.body, feature_boundary, feat_outputs)
        y = program.chunk_outputs()[0]
        post, post_inputs = _batched(program.body, post_boundary, [y])
    except RuntimeError:
        return None
    lifted = LiftedProgram(program, "chunk" if per_token else "block", up.w, up.m, transposed,
                           ns, features, feature_inputs, post, post_inputs, read,
                           constant_scale, feature_boundary, feat_outputs, post_boundary,
                           weight_norm=None if up.norm is None else up.norm.target,
                           alpha=alpha, gamma=gamma, step=step, factors=len(factors),
                           companions=tuple(riders), bonus=bonus[0] if bonus else None,
                           flipped=flipped)
    return _whole_sequence(lifted)


def _batched(body: torch.fx.GraphModule, inputs, outputs):
    """``extract`` for a graph the plan runs under ``vmap`` over every chunk (or token) at once,
    its views made reshapes (``reshape_views``): the op's read reaches the post-processing laid
    out batch first, tokens second (``[b, N·T, ...]`` permuted), where a view the trace recorded
    on one token's contiguous read (``o.reshape(B, H·D)`` merging heads and features) is refused
    for its strides; the reshape copies only there."""
    gm, taken = extract(body, inputs, outputs)
    reshape_views(gm.graph)
    gm.recompile()
    return gm, taken


def _indexed(p: Polynomial, factors: list) -> tuple:
    """``p`` over the positions of its factors in ``factors`` (which survive a re-sizing)."""
    return tuple((c, tuple(factors.index(f) for f in fs)) for c, fs in p)


def _runtime_weight_norm(norm: WeightNorm, transposed: bool, state_dep: set) -> bool:
    """Whether the op's ``weight_norm`` computes ``norm``: the norm runs over the state's key
    axis (rows of ``[Dk, Dv]``; columns of the transposed ``[Dv, Dk]``) with the runtime's ε,
    towards a target the loop reads from outside (a placeholder no state flows into)."""
    return (norm.dim == (-1 if transposed else -2) and norm.eps == WEIGHT_NORM_EPS
            and norm.target.op == "placeholder" and norm.target not in state_dep)


def _split_features(lp: LiftedProgram) -> LiftedProgram:
    """``lp`` with its features cut in two: the token-level ones (φ(Q) side, left, right) and
    the chunk-level ones (scales, momentum coefficient)."""
    prog = lp.program
    token, token_inputs = extract(prog.body, lp.feature_boundary, lp.feature_outputs[:3])
    post, post_inputs = extract(prog.body, lp.post_boundary, [prog.chunk_outputs()[0]])
    read_axis = (-1 if lp.query_column else -2) % lp.read.meta["val"].dim()
    for gm, inputs, axes in ((token, token_inputs, stream_axes(prog, token_inputs)),
                             (post, post_inputs, {lp.read: read_axis, **_column_reads(lp),
                                                  **stream_axes(prog, post_inputs)})):
        # whole sequences arrive in the layout the user's code made them, not as traced, and
        # at any length: the no-op views a trace bakes the chunk's sizes into go, and the
        # reshapes that carry a token axis infer its length
        reshape_views(gm.graph)
        drop_identity_views(gm)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        free_chunk_sizes(gm, {ph: axes[n] for ph, n in zip(placeholders, inputs) if n in axes})
    chunk, chunk_inputs = None, []
    if lp.feature_outputs[3:]:
        chunk, chunk_inputs = extract(lp.program.body, lp.feature_boundary,
                                      lp.feature_outputs[3:])
    return dataclasses.replace(lp, whole_sequence=True, token_features=token,
                               token_feature_inputs=token_inputs, whole_post=post,
                               chunk_features=chunk,
                               chunk_feature_inputs=chunk_inputs)


def _whole_sequence(lp: LiftedProgram) -> LiftedProgram:
    """``lp`` marked to run its features and post-processing over whole sequences when both are
    token-local (``whole_sequence.token_local``), else ``lp`` unchanged."""
    prog = lp.program
    if lp.kind != "block" or any(s.per_token for s in prog.streams):
        return lp
    try:
        split = _split_features(lp)
    except RuntimeError:
        return lp
    q_axis = -1 if lp.query_column else -2
    if not token_local(split.token_features, split.token_feature_inputs,
                       stream_axes(prog, split.token_feature_inputs), (q_axis, -1, -2),
                       prog.chunk_size):
        return lp
    post_axes = {lp.read: q_axis, **_column_reads(lp), **stream_axes(prog, lp.post_inputs)}
    out_axis = prog.outputs[0].axis % prog.chunk_outputs()[0].meta["val"].dim()
    if not token_local(split.whole_post, lp.post_inputs, post_axes, (out_axis,),
                       prog.chunk_size):
        return lp
    return split


def _column_reads(lp: LiftedProgram) -> dict:
    """Each companion's read by its token axis: after its state's batch axes."""
    states = lp.program.state_inputs()
    return {c.read: states[c.index].meta["val"].dim() - 1 for c in lp.companions}


def _read_transform(transform: torch.fx.GraphModule, in_shape: tuple, mat_shape: tuple,
                    delta: torch.fx.Node) -> NewtonSchulz | None | bool:
    """``None`` when ``transform`` is the identity, the ``NewtonSchulz`` it applies, or
    ``False`` when it is neither.

    The schedule, epsilon and dtype come from the graph (``match_newton_schulz``); the
    transform, evaluated in float64 (its casts promoted) on a random update of the traced
    shape, must then equal the runtime's ``newton_schulz`` with them, also in float64 — the
    structure is confirmed exactly, the dtype is taken as read.
    """
    match = match_newton_schulz(delta)
    if match is None:
        ns = None
    elif match.coefficients is None or match.eps is None:
        return False
    else:
        ns = NewtonSchulz(tuple(match.coefficients), match.eps, match.dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(mat_shape, generator=gen, dtype=torch.float64)
    try:
        with torch.no_grad():
            got = promoted(transform)(x.reshape(in_shape))[0].double().reshape(mat_shape)
    except Exception:
        return False
    ref = x if ns is None else newton_schulz(x, 0, ns.coefficients, ns.eps,
                                             dtype=torch.float64)
    return ns if float((got - ref).norm() / ref.norm()) < 1e-9 else False


def _positive(decay: torch.Tensor) -> bool:
    """Whether every per-token decay has a log: the token-causal op takes ``log γ``."""
    with torch.no_grad():
        return bool((decay > 0).all())


class BodyInputs(NamedTuple):
    """The body's placeholders by kind, found once per plan: finding them walks the whole body
    graph, which a short call paid six times."""

    streams: list
    invariants: list
    states: list

    @classmethod
    def of(cls, program: TTTProgram) -> "BodyInputs":
        return cls(program.stream_inputs(), program.invariant_inputs(), program.state_inputs())


def _bind(inputs: BodyInputs, streams: dict, invariants, states0) -> tuple[dict, dict]:
    """Every body input by node, and its ``vmap`` dim: ``streams`` (chunk-major, dim 0), the
    invariants and the states the loop no longer changes (read as constants, unbatched)."""
    values, dims = dict(streams), {n: 0 for n in streams}
    for n, v in zip(inputs.invariants, invariants):
        values[n], dims[n] = v, None
    for n, v in zip(inputs.states, states0):
        values.setdefault(n, v)
        dims.setdefault(n, None)
    return values, dims


class LiftedPlan:
    """Runs a ``LiftedProgram`` with the runtime ops: ``plan(states0, invariants)``.

    ``implementation`` names the op and the backend that ran it (``block_linear_attention[torch]``);
    ``backend="auto"`` is resolved per call by the runtime's dispatcher and every backend that
    ran is named. A backend asked for explicitly that cannot run a call raises
    ``UnsupportedTTTError``. A decayed state (``W' = γ W + Δ``) may come with ``loop``, the
    generic plan of the same program: calls where the op's chunk-parallel form does not pay
    (``scan_choice.decayed_op_pays``) run it as a loop over the chunks instead, and
    ``implementation`` then names it.
    """

    def __init__(self, lifted: LiftedProgram, backend: str = "auto", loop=None):
        self.lifted = lifted
        self.backend = backend
        self.loop = loop
        self.looped = False                 # whether the last call ran ``loop``
        self.ran: list[str] = []            # backends that ran, in the order first used
        self._padding_checked: dict[int, str | None] = {}
        self._inputs = BodyInputs.of(lifted.program)
        if lifted.whole_sequence:           # specialised to each call's layout
            self._token_features = SpecializedGraph(lifted.token_features)
            self._whole_post = SpecializedGraph(lifted.whole_post)

    @property
    def schedule(self) -> str:
        """Semi-parallel when the op normalises the state chunk after chunk, else parallel."""
        return "parallel" if self.lifted.weight_norm is None else "semi-parallel"

    @property
    def op(self) -> str:
        return "block_linear_attention" if self.lifted.kind == "block" else \
            "chunk_linear_attention"

    @property
    def transform_limit(self) -> str:
        """Why the plan cannot run under a ``torch.func`` transform ("" where it can): the block
        op's autograd Functions and the feature graphs planned for a gradient (one autograd
        Function each, partitioned by AOTAutograd) have no functorch rules."""
        if self.lifted.kind == "block":
            return "the block op's autograd functions have no torch.func rules"
        if self.lifted.whole_sequence:
            return "its feature graphs, planned for a gradient, have no torch.func rules"
        return ""

    @property
    def loops_over_chunks(self) -> bool:
        """Did the last call run the generic loop over the chunks instead of the op?"""
        return self.looped

    @property
    def raced(self) -> bool:
        """Can the last call's plan lose to the code as written (``ttt2la.as_written``)? On the
        block op it can: a loop over chunks as long as the features are wide runs the same
        products as the op, and on a CPU the op's states of every chunk cost it 0.73–0.98× the
        source's eager loop (``docs/benchmarks.md``). Token-causal ops replace a loop over every
        token and do not race, except with a decay per key channel: where it is strong the op
        builds its attention per channel, elementwise, at about the source's speed (and at
        lengths up to the op's chunk: ``races_up_to``)."""
        return self.looped or self.lifted.kind == "block" or self.lifted.decay_axis is not None

    @property
    def races_up_to(self) -> int:
        """The length up to which a plan on the token-causal op races although it replaces a
        step per token (``as_written.may_lose``): the op's chunk, which it pads a shorter
        sequence to, so the plan costs one chunk's call there while the loop runs the tokens
        there are."""
        return CHUNK_SIZE if self.lifted.kind == "chunk" else 0

    @property
    def implementation(self) -> str:
        if self.looped:
            why = ("a loop over chunks pays here" if self.lifted.kind == "block"
                   else "a decay <= 0 has no log decay")
            return f"{self.loop.implementation}, not {self.op}: {why}"
        backends = self.ran or [self.backend]
        riders = [self.lifted.program.states[c.index].name for c in self.lifted.companions]
        columns = f", {', '.join(riders)} as value columns" if riders else ""
        bonus = ", plus each token's own term" if self.lifted.bonus is not None else ""
        return f"{self.op}[{'|'.join(backends)}]{columns}{bonus}"

    def resized(self, program: TTTProgram, loop=None) -> "LiftedPlan":
        """This plan for ``program``, the body re-sized to another batch size (``loop``: its
        generic plan, where this one has one)."""
        return LiftedPlan(self.lifted.resized(program), self.backend, loop)

    def _features(self, states0, invariants):
        lp = self.lifted
        prog = lp.program
        streams, layout = chunk_streams(prog, list(invariants))
        if layout.partial:
            require_inert_padding(prog, states0, invariants, layout, self._padding_checked)
        # vmap's view rule needs each chunk laid out like the traced one: contiguous
        values, dims = _bind(self._inputs, dict(zip(self._inputs.streams,
                                                    (x.contiguous() for x in streams))),
                             invariants, states0)
        args = [values[n] for n in lp.feature_inputs]
        in_dims = tuple(dims[n] for n in lp.feature_inputs)
        return flat_vmap(lp.features, in_dims, args), values, dims, layout

    def _per_chunk(self, factors: list, b: int, N: int, like: torch.Tensor, w_shape) -> dict:
        """The block op's per-chunk coefficients (``momentum``, ``decay``, ``step_scale``), each
        ``[b, N, 1]``, from the factors that end the features (``[N, ...]`` each); a decay per
        key channel ``[b, N, 1, Dk]``, one per value channel ``value_decay [b, N, 1, Dv]``."""
        lp = self.lifted
        values = dict(enumerate(factors))
        # a constant keeps the precision the code's own arithmetic gives it (fp32 opmath)
        like = like.new_empty(N, dtype=torch.promote_types(like.dtype, torch.float32))
        w_batch = tuple(w_shape[:-2])
        found = {}
        for name, p in (("momentum", lp.alpha), ("decay", lp.gamma), ("step_scale", lp.step)):
            if p is None:
                continue
            if name == "decay" and lp.decay_axis is not None:
                matrix = (w_shape[-2], 1) if lp.decay_axis == -2 else (1, w_shape[-1])
                c = evaluate(p, values, like, w_batch, matrix)
                name = "value_decay" if lp.decays_values else name
                found[name] = c.reshape(N, b, 1, -1).transpose(0, 1)
            else:
                c = evaluate(p, values, like, w_batch)
                found[name] = c.reshape(N, b).transpose(0, 1).unsqueeze(-1)
        return found

    def _run_op(self, phi_q, phi_k, value, s0, per_chunk: dict, lr=None, values=None):
        lp = self.lifted
        if lp.kind == "block":
            ns = lp.newton_schulz
            options = dict(chunk_size=lp.program.chunk_size, order=lp.program.order,
                           momentum=per_chunk.get("momentum"), initial_state=s0,
                           output_final_state=True)
            if lr is not None:
                options["lr"] = lr
            # options a backend may not take are passed only when set (dispatch.py)
            options.update((k, v) for k, v in per_chunk.items() if k != "momentum")
            if lp.weight_norm is not None:      # [.., Dv, 1] or [.., 1, Dv] -> [b, 1, Dv]
                options["weight_norm"] = values[lp.weight_norm].reshape(s0.shape[0], 1, -1)
            if ns is not None:
                options.update(muon_steps=ns.steps, ns_coefficients=ns.coefficients,
                               ns_eps=ns.eps, ns_dtype=ns.iteration_dtype(phi_k, value))
            op, fn = "block", block_linear_attention
        else:
            options = dict(initial_state=s0, output_final_state=True, **per_chunk)
            op, fn = "chunk", chunk_linear_attention
        try:
            chosen = select_backend(op, phi_q, phi_k, value, backend=self.backend, **options)
        except UnsupportedTTTError as e:
            raise UnsupportedTTTError(
                f"the loop of {lp.program.module_path or 'the model'} "
                f"({lp.program.loop_src}) lowers onto {self.op}, which backend="
                f"{self.backend!r} cannot run here ({phi_k.dtype}, {phi_k.device.type}): {e}"
            ) from None
        if chosen not in self.ran:
            self.ran.append(chosen)
        return fn(phi_q, phi_k, value, backend=chosen, **options)

    def __call__(self, states0: Sequence[torch.Tensor], invariants: Sequence[torch.Tensor]):
        self.looped = (self.lifted.kind == "block" and self.loop is not None
                       and not decayed_op_pays(states0[self.lifted.w]))
        if self.looped:
            return self._run_loop(states0, invariants)
        if self.lifted.whole_sequence:
            return self._whole(states0, invariants)
        lp = self.lifted
        prog = lp.program
        feats, values, dims, layout = self._features(states0, invariants)
        # sizes come from the tensors: the body's node metadata holds the traced batch size
        N = feats[0].shape[0]
        b = feats[1][0, ..., 0, 0].numel()
        # fold every batch-like dim (batch, heads) into one: [N, b, rows, cols]
        q_side, left, right = (f.reshape(N, b, *f.shape[-2:]) for f in feats[:3])
        feats, term = self._bonus_features(feats)
        n_scales = len(feats) - 3 - lp.factors
        scales = feats[3:3 + n_scales]
        phi_q, phi_k, value = self._operands(q_side, left, right)
        T = phi_k.shape[-2]
        w_batch = states0[lp.w].shape[:-2]
        for s in scales:                         # a scalar per matrix and chunk
            value = value * per_matrix(s, w_batch).reshape(N, b, 1, 1)
        value = self._scaled(value)
        Dv = value.shape[-1]
        per_chunk = self._per_chunk(list(feats[3 + n_scales:]), b, N, value, states0[lp.w].shape)
        if lp.kind == "chunk" and "step_scale" in per_chunk:    # per token: each token's values
            value = value * per_chunk.pop("step_scale").transpose(0, 1).unsqueeze(-1)
        value = self._with_columns(value, feats[3 + n_scales:], states0)

        def flat(x):                             # [N, b, T, d] -> [b, N*T, 1, d]
            return x.permute(1, 0, 2, 3).reshape(b, N * T, 1, x.shape[-1])

        s0 = self._initial(states0, b)
        decay = per_chunk.get("value_decay", per_chunk.get("decay"))
        if lp.kind == "chunk" and decay is not None:
            if not _positive(decay):
                return self._run_loop(states0, invariants)
            per_chunk = {("value_log_decay" if lp.decays_values else "log_decay"): decay.log()}
        if lp.kind == "chunk" and prog.order == "exclusive":
            o, s_final = self._read_first(flat(phi_q), flat(phi_k), flat(value), s0, per_chunk)
        else:
            o, s_final = self._run_op(flat(phi_q), flat(phi_k), flat(value), s0, per_chunk,
                                      values=values)
        o = o.reshape(b, N, T, o.shape[-1]).permute(1, 0, 2, 3)
        tokens = T if lp.kind == "block" else None
        reads = {c.read: o[..., Dv + j].reshape(N, *c.read_shape(states0[c.index], tokens))
                 for j, c in enumerate(lp.companions)}
        o = o[..., :Dv]
        if term:
            o = o + bonus_read(lp.bonus, phi_q, term, states0[lp.w].shape, lp.transposed)
        reads[lp.read] = o.transpose(-1, -2) if lp.query_column else o
        post_args, post_dims = [], []
        for n in lp.post_inputs:
            if n in reads:
                post_args.append(reads[n])
                post_dims.append(0)
            else:
                post_args.append(values[n])
                post_dims.append(dims[n])
        (y,) = flat_vmap(lp.post, post_dims, post_args)
        outputs = assemble_outputs(prog, [y], layout)
        return outputs, self._finals(states0, s_final, Dv)

    def _operands(self, q_side, left, right):
        """``(φ(Q), φ(K), value)`` in the op's layout (tokens before features) from the read's
        query operand and the increment's two: the query as the read takes it (a column where
        ``query_column``), keys and values as the state is laid out (``Wᵀ``: φ(K) = right,
        value = leftᵀ)."""
        lp = self.lifted
        phi_q = q_side.transpose(-1, -2) if lp.query_column else q_side
        if lp.transposed:
            return phi_q, right, left.transpose(-1, -2)
        return phi_q, left.transpose(-1, -2), right

    def _bonus_features(self, feats) -> tuple[list, list]:
        """The features without the bonus term's, and the term's (``bonus``; none: empty)."""
        bonus = self.lifted.bonus
        if bonus is None:
            return list(feats), []
        return list(feats[:-bonus.outputs]), list(feats[-bonus.outputs:])

    def _with_columns(self, value: torch.Tensor, factors: list, states0) -> torch.Tensor:
        """The values ``[N, b, T, Dv]`` widened by one column per companion memory
        (``shared_keys``): its constant, or its per-token product of ``factors`` (``[N, ...]``
        each, one number per memory)."""
        riders = self.lifted.companions
        if not riders:
            return value
        values = dict(enumerate(factors))
        columns = []
        for c in riders:
            if any(fs for _, fs in c.column):        # per token: [N, b, 1, 1]
                N, b = value.shape[:2]
                column = evaluate(c.column, values, value, tuple(states0[c.index].shape[:-1]),
                                  (1,)).reshape(N, b, 1, 1)
            else:                                   # a constant, in any layout of the values
                column = value.new_full((), sum(k for k, _ in c.column))
            columns.append(column.expand(*value.shape[:-1], 1))
        return torch.cat([value, *columns], dim=-1)

    def _read_first(self, phi_q, phi_k, value, s0, per_token: dict):
        """A per-token loop that reads the state before each token's update, ``o_t = q_t
        S_{t-1}``, on the token-causal op, which reads after it: the same op on keys, values
        and log decays shifted one token later (the first token's zero key and zero log decay
        leave ``S_0`` as it is), so the op's ``S_t`` is the loop's ``S_{t-1}``. Its final
        state is the loop's after the last update but one; the last (``last_chunk ==
        "update"``) is applied here."""
        def later(x):
            return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

        shifted = {name: later(g) for name, g in per_token.items()}
        o, s_final = self._run_op(phi_q, later(phi_k), later(value), s0, shifted)
        if self.lifted.program.last_chunk == "update":
            if "log_decay" in per_token:             # [b, H] or [b, H, Dk] -> [b, H, ·, 1]
                last = per_token["log_decay"][:, -1]
                s_final = last.reshape(*last.shape[:2], -1, 1).exp() * s_final
            if "value_log_decay" in per_token:       # [b, H, Dv] -> [b, H, 1, Dv]
                s_final = per_token["value_log_decay"][:, -1].unsqueeze(-2).exp() * s_final
            s_final = s_final + phi_k[:, -1, :, :, None] * value[:, -1, :, None, :]
        return o, s_final

    def _run_loop(self, states0, invariants):
        """The generic plan of the same program, looping over the chunks where it scans."""
        if self.loop is None:               # an explicit Triton backend has no generic plan
            raise UnsupportedTTTError(
                f"the loop of {self.lifted.program.module_path or 'the model'} "
                f"({self.lifted.program.loop_src}) decays its state by a factor <= 0 in this "
                "call, which chunk_linear_attention cannot take as a log decay, and "
                f"backend={self.backend!r} runs no other plan; use backend='auto' or 'torch'")
        self.looped = True
        # on the block op the loop is chosen because looping pays; a per-token program's
        # generic plan keeps its own cost rules
        with scanning(False if self.lifted.kind == "block" else forced()):
            return self.loop(states0, invariants)

    def _scaled(self, value: torch.Tensor) -> torch.Tensor:
        """The effective value times the increment's constant factor (signs, fixed rates)."""
        return value if self.lifted.scale == 1.0 else value * self.lifted.scale

    def _finals(self, states0, s_final: torch.Tensor, Dv: int | None = None) -> list:
        """The program's final states: the runtime's ``[b, 1, Dk, Dv]`` state in the layout of
        the traced one, each companion from its column (past ``Dv``); the other states are not
        returned (momentum starts and ends unread)."""
        lp = self.lifted
        s_final = s_final.squeeze(1)
        finals = [None] * len(lp.program.states)
        for j, c in enumerate(lp.companions):
            finals[c.index] = s_final[..., Dv + j].reshape(states0[c.index].shape)
        if lp.companions:
            s_final = s_final[..., :Dv]
        w_final = s_final.transpose(-1, -2) if lp.transposed else s_final
        finals[lp.w] = w_final.reshape(states0[lp.w].shape)
        return finals

    def _initial(self, states0, b: int) -> torch.Tensor:
        """The final state's initial value as the runtime takes it, ``[b, 1, Dk, Dv]``, each
        companion's beside it as one more column."""
        lp = self.lifted
        w0 = states0[lp.w].reshape(b, *states0[lp.w].shape[-2:])
        w0 = w0.transpose(-1, -2) if lp.transposed else w0
        columns = [states0[c.index].reshape(b, -1, 1).to(w0.dtype) for c in lp.companions]
        return torch.cat([w0, *columns], dim=-1).unsqueeze(1) if columns else w0.unsqueeze(1)

    def _whole(self, states0, invariants):
        """The plan with token-local features and post-processing run once over the whole
        sequences (``whole_sequence``): no chunk-major copies, no output assembly."""
        lp = self.lifted
        prog = lp.program
        layout = chunk_layout(prog, list(invariants))
        if layout.partial and prog.partial_chunk:
            # nothing is padded here, but a number the trace took from a whole chunk's length
            # (``/ k.size(1)``) is the scale the op runs with: a partial chunk needs another
            require_inert_padding(prog, states0, invariants, layout, self._padding_checked)
        values, _ = _bind(self._inputs, dict(zip(self._inputs.streams,
                                                 (invariants[s.source] for s in prog.streams))),
                          invariants, states0)
        q_side, left, right = self._token_features(*(values[n] for n in lp.token_feature_inputs))
        batch = q_side.shape[:-2]
        b = left[..., 0, 0].numel()
        q_side, left, right = (f.reshape(b, *f.shape[-2:]) for f in (q_side, left, right))
        phi_q, phi_k, value = self._operands(q_side, left, right)
        T = phi_k.shape[-2]
        w_batch = states0[lp.w].shape[:-2]
        chunk_level = self._chunk_level(states0, invariants, layout)
        cut = len(chunk_level) - lp.factors
        per_chunk = self._per_chunk(chunk_level[cut:], b, layout.n_chunks, value,
                                    states0[lp.w].shape)
        rate = per_token_rate([per_matrix(c, w_batch) for c in chunk_level[:cut]], b,
                              prog.chunk_size, T)
        value = self._scaled(value)
        Dv = value.shape[-1]
        value = self._with_columns(value, [], states0)
        o, s_final = self._run_op(phi_q.unsqueeze(2), phi_k.unsqueeze(2), value.unsqueeze(2),
                                  self._initial(states0, b), per_chunk, lr=rate, values=values)
        o = o.squeeze(2)
        for j, c in enumerate(lp.companions):
            values[c.read] = o[..., Dv + j].reshape(c.read_shape(states0[c.index], T))
        read = o[..., :Dv].reshape(*batch, T, Dv)
        if lp.query_column:
            read = read.transpose(-1, -2)
        values[lp.read] = read
        (y,) = self._whole_post(*(values[n] for n in lp.post_inputs))
        return [_stacked_chunks(y, prog, layout)], self._finals(states0, s_final, Dv)

    def _chunk_level(self, states0, invariants, layout) -> list[torch.Tensor]:
        """The chunk-level features (scales, momentum coefficient), ``[N, ...]``, computed chunk
        by chunk as traced (a partial last chunk padded, its padding checked inert)."""
        lp = self.lifted
        if lp.chunk_features is None:
            return []
        prog = lp.program
        if layout.partial:
            require_inert_padding(prog, states0, invariants, layout, self._padding_checked)
        inputs = lp.chunk_feature_inputs
        # only the streams these features read, each chunk laid out like the traced one
        streams = {n: chunk_stream(invariants[spec.source], spec, layout).contiguous()
                   for n, spec in zip(self._inputs.streams, prog.streams) if n in inputs}
        values, dims = _bind(self._inputs, streams, invariants, states0)
        in_dims = tuple(dims[n] for n in inputs)
        args = [values[n] for n in inputs]
        if all(d is None for d in in_dims):   # from parameters alone (a fixed decay per head)
            return [c.unsqueeze(0).expand(layout.n_chunks, *c.shape)
                    for c in lp.chunk_features(*args)]
        return list(flat_vmap(lp.chunk_features, in_dims, args))



def _stacked_chunks(y: torch.Tensor, program: TTTProgram, layout) -> torch.Tensor:
    """The whole-sequence output ``y`` as the loop assembles it: where the loop stacks whole
    chunks on a new axis (``torch.stack(outs, 1)`` of pre-chunked mini-batches), the token axis
    cut into ``[N, C]`` there; otherwise ``y`` itself."""
    spec = program.outputs[0]
    if not spec.per_token or any(s.per_token for s in program.streams):
        return y
    axis = spec.axis % (y.dim() + 1)
    return y.unflatten(axis, (layout.n_chunks, layout.chunk_size))

__all__ = ["lift", "LiftedProgram", "LiftedPlan", "NewtonSchulz", "Read", "contraction",
           "find_read", "replayed", "strip"]
