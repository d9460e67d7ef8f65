"""The per-token (gated) delta rule read off a loop body and run on the chunked delta-rule op.

A per-token loop whose one live state is a linear memory trained on the MSE loss, optionally
decayed, updates it as ``S' = a S − c kᵀ(k S) + b kᵀ v`` (``S`` stored ``[Dk, Dv]``; stored
``[Dv, Dk]`` the same holds for ``Sᵀ``) with per-token scalars ``a, b, c`` and vectors ``k, v``
computed from the token alone. That is the gated delta rule
``S_t = α_t (I − β_t k_tᵀ k_t) S_{t-1} + β_t k_tᵀ v'_t`` with ``α = a``, ``β = c / a`` and
``v' = (a b / c) v`` — which the runtime's ``delta_rule`` runs chunk by chunk (UT form inside a
chunk, a log-depth scan of ``[Dk, Dk]`` maps across chunks) instead of carrying a ``[Dk, Dk]``
map per token through the generic matrix-affine scan. A loop that slices its tokens one wide
(``k[:, t:t + 1]``, heads folded into the batch for ``torch.bmm``) is such a loop too: a chunk of
one token is the token, its unit token axis kept (``TTTProgram.one_token``); its streams are cut
and its outputs joined as chunks of one.

What the loop computes is read from the graph and confirmed numerically, never assumed:

* the *frontier* — the state-free values the update reads — holds the key, the value and the
  scalars; which is which is found on a few random tokens in float64: the update's matrix
  ``A`` (its derivative along basis states) must be ``a I − c kkᵀ`` for one frontier vector
  ``k``, its constant part ``B`` must be ``kᵀ (b v)`` for one frontier vector ``v``, and each of
  ``a, b, c`` a constant times a product of frontier scalars (powers −1, 0 or 1), per token or
  constants of the body with one number per row (a rate per head a lossy pass wrote in);
  where the frontier's own vectors do not fit (a Householder transition reads ``I − β kkᵀ``,
  fla's identity-plus-low-rank form ``β v``), key, value and scalars are also looked for a few
  ops behind it, and an invariant made from no input (``I = torch.eye(d)`` before the loop)
  takes its traced value instead of a random one;
* the output must read the state through one matmul with a state-free query (``q S``, ``S qᵀ``
  and their transposed forms), the code after it taken as it is;
* then the whole body, evaluated in float64 on fresh random inputs and states, must equal the
  delta rule built from these pieces — states and outputs — or the loop keeps the generic plan.
"""
from __future__ import annotations

import dataclasses
import itertools

from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import is_fake
from torch.func import vmap
from torch.utils._python_dispatch import _disable_current_modes

from ..analysis.associativity import Analysis
from ..ir import INPUT_FREE, TTTProgram, ancestors, descendants, reshape_views
from ..runtime.delta_rule import DELTA_CHUNK_SIZE, delta_rule
from .chunking import assemble_outputs, chunk_layout, chunk_stream
from .executors import extract, shape_only
from .forward_ad import jvp
from .lift import replayed
from .lift_delta import DeltaScanPlan, scanned_groups
from .precision import promoted, relative_error, samples

aten = torch.ops.aten

#: Random tokens the pieces are read from, and fresh ones the result is confirmed on.
SAMPLES = 6
#: Relative error (float64) below which a fit or the confirmation holds; a wrong reading of the
#: graph misses by order one.
FIT_TOLERANCE = 1e-8
#: At most this many frontier scalars are combined into a coefficient (3**n products tried).
MAX_ATOMS = 6
#: How many ops behind the frontier a key, value or scalar is looked for when the frontier's
#: own do not fit (a Householder transition reads ``I − β kkᵀ``, four ops from ``β``).
FAR = 6

#: One-input ops that only move elements: what ``_relayout_of`` replays.
_MOVES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                    aten.clone.default, aten.alias.default, aten.permute.default,
                    aten.transpose.int, aten.t.default, aten.unsqueeze.default,
                    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.expand.default, aten.clone.default,
          aten.alias.default, aten.reshape.default}


@dataclass(frozen=True)
class Coefficient:
    """A per-token scalar of the update: ``scale · Π atoms[i] ** powers[i]``."""

    scale: float
    powers: tuple[int, ...]

    def __call__(self, atoms: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(like, self.scale)
        for atom, p in zip(atoms, self.powers):
            if p:
                out = out * (atom if p == 1 else 1.0 / atom)
        return out

    @property
    def constant(self) -> bool:
        return not any(self.powers)

    @property
    def one(self) -> bool:
        """The constant 1 (to the fit's precision): no decay."""
        return self.constant and abs(self.scale - 1.0) <= FIT_TOLERANCE


@dataclass
class DeltaRuleMatch:
    """What a per-token loop body was read as: the gated delta rule of state ``state``."""

    program: TTTProgram
    state: int
    side: str                      # "left": S is [Dk, Dv] (k S); "right": S is [Dv, Dk] (S kᵀ)
    key: torch.fx.Node
    value: torch.fx.Node
    atoms: list[torch.fx.Node]
    decay: Coefficient             # α = a
    beta: Coefficient              # β = c / a
    value_scale: Coefficient       # v' = (a b / c) v
    read: torch.fx.Node            # the matmul of the query with the state
    query: torch.fx.Node
    features: torch.fx.GraphModule     # boundary -> (key, value, *atoms, query)
    feature_inputs: list[torch.fx.Node]
    post: torch.fx.GraphModule         # (read, boundary) -> the token's output
    post_inputs: list[torch.fx.Node]

    def resized(self, program: TTTProgram) -> "DeltaRuleMatch | None":
        """The same reading of ``program``, a re-sized copy of this body (same nodes in the
        same order, other size arguments; its metadata still holds the traced sizes, so
        nothing is read again): the graphs are cut again at the same nodes. None when the body
        is not such a copy."""
        old, new = list(self.program.body.graph.nodes), list(program.body.graph.nodes)
        if len(old) != len(new) or any((a.op, a.target) != (b.op, b.target)
                                       for a, b in zip(old, new)):
            return None
        at = {n: new[i] for i, n in enumerate(old)}
        key, value, read, query = (at[n] for n in (self.key, self.value, self.read, self.query))
        atoms = [at[n] for n in self.atoms]
        post, post_inputs = extract(program.body, [read, *_boundary(program)],
                                    [program.chunk_outputs()[0]])
        reshape_views(post.graph)
        post.recompile()
        return _built(program, self.state, self.side, key, value, atoms,
                      (self.decay, self.beta, self.value_scale), read, query, post, post_inputs)


# ---------------------------------------------------------------------------------------------
# reading the graph


def _relayout(n) -> tuple[torch.fx.Node, bool]:
    """``(x, swapped)``: ``n`` is ``x`` through views, batch reshapes and permutations that keep
    the leading axes in place, its last two axes swapped when ``swapped``."""
    swapped = False
    while isinstance(n, torch.fx.Node) and n.op == "call_function":
        if n.target in _VIEWS:
            n = n.args[0]
            continue
        if n.target is aten.t.default:
            swapped, n = not swapped, n.args[0]
            continue
        if n.target not in (aten.transpose.int, aten.permute.default):
            break
        rank = len(n.meta["val"].shape)
        if n.target is aten.transpose.int:
            dims = {d % rank for d in n.args[1:3]}
            if dims != {rank - 2, rank - 1}:
                break
            swapped, n = not swapped, n.args[0]
            continue
        perm = [d % rank for d in n.args[1]]
        if perm[:-2] != list(range(rank - 2)):
            break
        swapped, n = swapped ^ (perm[-2:] == [rank - 1, rank - 2]), n.args[0]
    return n, swapped


def _relayout_of(n, state: torch.fx.Node) -> bool | None:
    """Whether ``n`` is ``state`` with its batch axes folded (``False``) or also its last two
    axes swapped (``True``); None when it is neither. Read from the ops (``_relayout``), else
    from the chain of one-input relayouts replayed on ``arange`` (``torch.einsum`` moves unit
    axes about: a permutation that reorders a head axis of size 1 still only folds)."""
    base, swapped = _relayout(n)
    if base is state:
        return swapped
    found = replayed(n, state, _MOVES)
    if found is None:
        return None
    x, y = found
    for swapped, folded in ((False, x), (True, x.transpose(-1, -2))):
        if y.shape[-2:] == folded.shape[-2:] and y.numel() == folded.numel() \
                and torch.equal(y.reshape(-1), folded.reshape(-1)):
            return swapped
    return None


def _boundary(program: TTTProgram) -> list[torch.fx.Node]:
    """What the loop reads besides its live state: streams, invariants, frozen states."""
    ins, outs = program.state_inputs(), program.state_outputs()
    frozen = [ins[i] for i in range(len(ins)) if outs[i] is ins[i]]
    return [*program.stream_inputs(), *program.invariant_inputs(), *frozen]


def _frontier(program: TTTProgram, t: int) -> list[torch.fx.Node] | None:
    """The state-free values the update of state ``t`` reads (None when it reads no state)."""
    return frontier_between(program, program.state_inputs()[t], program.state_outputs()[t])


def frontier_between(program: TTTProgram, s_in: torch.fx.Node,
                     s_out: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The state-free values the body reads on its way from ``s_in`` to ``s_out`` (None when
    ``s_out`` does not read ``s_in``): one update, or one step of several within a token."""
    reads = {s_in}
    for n in program.body.graph.nodes:
        if not shape_only(n) and any(a in reads for a in n.all_input_nodes):
            reads.add(n)
    if s_out not in reads:
        return None
    local = {n for n in ancestors(s_out) if n in reads and n is not s_in}
    frontier = []
    for n in program.body.graph.nodes:
        if n in local:
            frontier += [a for a in n.all_input_nodes
                         if a not in local and a is not s_in and a not in frontier]
    return frontier


def _reads(program: TTTProgram, t: int):
    """``(read, query, side)`` for every matmul of the state the outputs read with a state-free
    query: ``q S`` and ``Sᵀ qᵀ`` read a ``[Dk, Dv]`` state (left), ``S qᵀ`` and ``q Sᵀ`` a
    ``[Dv, Dk]`` one (right)."""
    ins, outs = program.state_inputs(), program.state_outputs()
    state = outs[t] if program.order == "inclusive" else ins[t]
    state_dep = descendants(program.body.graph, [ins[t]])
    for n in program.body.graph.nodes:
        if n.target is not aten.bmm.default:
            continue
        x, y = n.args
        sx, sy = _relayout_of(x, state), _relayout_of(y, state)
        if sy is not None and x not in state_dep:
            yield n, x, "right" if sy else "left"
        elif sx is not None and y not in state_dep:
            yield n, y, "left" if sx else "right"


# ---------------------------------------------------------------------------------------------
# random inputs and float64 evaluation


def _matrices(update, state: torch.Tensor, side: str) -> torch.Tensor:
    """``A`` of ``update(S) = A S + B`` (left) or ``S A + B`` (right), ``[..., r, r]``: the
    derivative at zero along the basis states ``E_{i0}`` (its columns) or ``E_{0i}`` (rows)."""
    rows, cols = state.shape[-2:]
    r = rows if side == "left" else cols
    basis = torch.zeros(r, rows, cols, dtype=state.dtype)
    idx = torch.arange(r)
    if side == "left":
        basis[idx, idx, 0] = 1.0
    else:
        basis[idx, 0, idx] = 1.0
    basis = basis.view(r, *([1] * (state.dim() - 2)), rows, cols).expand(r, *state.shape)
    zero = torch.zeros_like(state)
    moved = vmap(lambda e: jvp(update, (zero,), (e,))[1])(basis)
    return moved[..., 0].movedim(0, -1) if side == "left" else moved[..., 0, :].movedim(0, -2)


def _sampled(nodes: list[torch.fx.Node], n: int, seed: int) -> list[torch.Tensor] | None:
    """``samples`` of ``nodes``, but an invariant made from no input (``I = torch.eye(d)``
    before the loop, ``INPUT_FREE``) takes its own value in every sample: it is the same
    tensor on every call, and the update ``(I − β kkᵀ) S`` is a delta rule only with it."""
    sampled = samples(nodes, n, seed)
    if sampled is None:
        return None
    for i, node in enumerate(nodes):
        value = node.meta.get(INPUT_FREE)
        if value is not None and tuple(value.shape) == tuple(sampled[i].shape[1:]):
            sampled[i] = value.to(sampled[i].dtype).expand_as(sampled[i]).clone()
    return sampled


# ---------------------------------------------------------------------------------------------
# fitting the pieces


def _fit_keys(A: torch.Tensor, keys: list[torch.Tensor]):
    """Every ``(i, a, c)`` for which candidate key ``k = keys[i]`` gives ``A = a I − c kkᵀ``
    (``A [N, r, r]``, ``k [N, r]``)."""
    r = A.shape[-1]
    if r < 2:
        return
    eye = torch.eye(r, dtype=A.dtype)
    for i, k in enumerate(keys):
        kk = k.unsqueeze(-1) * k.unsqueeze(-2)
        n2 = (k * k).sum(-1)
        if bool((n2 == 0).any()):
            continue
        trace, kak = A.diagonal(dim1=-2, dim2=-1).sum(-1), (kk * A).sum((-2, -1))
        det = (r - 1) * n2 * n2                      # of the 2×2 normal equations
        a = (trace * n2 * n2 - kak * n2) / det
        neg_c = (r * kak - n2 * trace) / det
        fitted = a[:, None, None] * eye + neg_c[:, None, None] * kk
        if relative_error(A - fitted, A) <= FIT_TOLERANCE:
            yield i, a, -neg_c


def _fit_values(B: torch.Tensor, k: torch.Tensor, values: list[torch.Tensor]):
    """Every ``(i, b)`` for which candidate value ``v = values[i]`` gives ``B = b kᵀ v``
    (``B [N, r, d]``)."""
    w = (k.unsqueeze(-2) @ B).squeeze(-2) / (k * k).sum(-1, keepdim=True)
    if relative_error(B - k.unsqueeze(-1) * w.unsqueeze(-2), B) > FIT_TOLERANCE:
        return
    for i, v in enumerate(values):
        vv = (v * v).sum(-1)
        if bool((vv == 0).any()):
            continue
        b = (w * v).sum(-1) / vv
        if relative_error(w - b.unsqueeze(-1) * v, w) <= FIT_TOLERANCE:
            yield i, b


def _fit_coefficient(target: torch.Tensor, atoms: list[torch.Tensor]) -> Coefficient | None:
    """``target`` (``[N]``) as ``κ · Π atoms ** powers``, the fewest atoms first, or None."""
    combos = sorted(itertools.product((0, 1, -1), repeat=len(atoms)),
                    key=lambda p: sum(map(abs, p)))
    for powers in combos:
        prod = torch.ones_like(target)
        for atom, p in zip(atoms, powers):
            prod = prod * (atom if p >= 0 else 1.0 / atom) if p else prod
        if not bool(torch.isfinite(prod).all()) or float(prod.norm()) == 0.0:
            continue
        scale = float((target * prod).sum() / (prod * prod).sum())
        if relative_error(target - scale * prod, target) <= FIT_TOLERANCE:
            return Coefficient(scale, tuple(powers))
    return None


def _combined(a: Coefficient, b: Coefficient, c: Coefficient):
    """``(α, β, v-scale) = (a, c/a, ab/c)`` as coefficients, or None when they divide by an
    atom the decay does not hold (the decay is checked positive at run time, so its atoms are
    nonzero; any other divisor the user's code never divided by could be)."""
    beta = Coefficient(c.scale / a.scale, tuple(pc - pa for pc, pa in zip(c.powers, a.powers)))
    scale = Coefficient(a.scale * b.scale / c.scale,
                        tuple(pa + pb - pc for pa, pb, pc in zip(a.powers, b.powers, c.powers)))
    for coef in (a, beta, scale):
        if any(p < 0 and a.powers[i] == 0 for i, p in enumerate(coef.powers)):
            return None
    if a.constant and a.scale <= 0:
        return None
    return a, beta, scale


# ---------------------------------------------------------------------------------------------
# the match


def _candidates(values: list[torch.Tensor], n: int, batch: int, size: int):
    """Indices and ``[n·batch, size]`` views of the frontier values with ``batch·size``
    elements per sample."""
    return [(i, x.reshape(n * batch, size)) for i, x in enumerate(values)
            if x[0].numel() == batch * size]


def match_delta_rule(program: TTTProgram, analysis: Analysis) -> DeltaRuleMatch | None:
    """The per-token loop of ``program`` (tokens selected or sliced one wide) read as the gated
    delta rule, or None (see the module docstring: read from the graph, then confirmed in
    float64)."""
    return one_state_match(program, analysis, _match)


#: The orders and last chunks of the per-token loops the delta-rule op runs.
DELTA_TAILS = (("inclusive", "update"), ("exclusive", "apply_only"), ("exclusive", "update"))


def one_state_match(program: TTTProgram, analysis: Analysis, match):
    """``match(program, t)`` for a per-token loop with one output and one live state ``t``
    that the analysis scans alone, run on real tensors (the probes evaluate the body); None
    for any other loop, or a body the probes cannot run (the generic plan)."""
    if not program.one_token or len(program.outputs) != 1 \
            or (program.order, program.last_chunk) not in DELTA_TAILS:
        return None
    groups = [g for g in scanned_groups(analysis) if len(g) == 1]
    ins, outs = program.state_inputs(), program.state_outputs()
    live = [i for i in range(len(ins)) if outs[i] is not ins[i]]
    if len(live) != 1 or (live[0],) not in groups:
        return None
    with _disable_current_modes(), torch.no_grad():
        try:
            return match(program, live[0])
        except (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError):
            return None                # a body the probes cannot run: the generic plan


def _match(program: TTTProgram, t: int) -> DeltaRuleMatch | None:
    frontier = _frontier(program, t)
    if frontier is None:
        return None
    s_in = program.state_inputs()[t]
    state_shape = tuple(s_in.meta["val"].shape)
    if len(state_shape) < 2:
        return None
    boundary = _boundary(program)
    for read, query, side in _reads(program, t):
        found = _match_with_read(program, t, frontier, boundary, state_shape, read, query, side)
        if found is not None:
            return found
    return None


def _match_with_read(program, t, frontier, boundary, state_shape, read, query, side):
    rows, cols = state_shape[-2:]
    dk, dv = (rows, cols) if side == "left" else (cols, rows)
    batch = 1
    for d in state_shape[:-2]:
        batch *= d
    if query.meta["val"].numel() != batch * dk or read.meta["val"].numel() != batch * dv:
        return None
    try:
        post, post_inputs = extract(program.body, [read, *boundary], [program.chunk_outputs()[0]])
    except RuntimeError:
        return None
    reshape_views(post.graph)
    post.recompile()
    ends = program.state_inputs()[t], program.state_outputs()[t]
    for key, value, atoms, combined in _fit_pieces(program, ends, frontier, boundary,
                                                   state_shape, side, batch, dk, dv):
        match = _built(program, t, side, key, value, atoms, combined, read, query, post,
                       post_inputs)
        if _confirmed(match):
            return match
    return None


def _built(program, t, side, key, value, atoms, combined, read, query, post, post_inputs):
    """The match of these pieces, with the graph that computes them from the loop's inputs."""
    features, feature_inputs = extract(program.body, _boundary(program),
                                       [key, value, *atoms, query])
    reshape_views(features.graph)
    features.recompile()
    return DeltaRuleMatch(program, t, side, key, value, atoms, *combined, read, query,
                          features, feature_inputs, post, post_inputs)


def _made_from(frontier: list[torch.fx.Node], depth: int = 3) -> list[torch.fx.Node]:
    """The values ``depth`` ops or fewer behind the frontier, nearest first: where the scalars
    of a product the update reads (``β`` of ``β k``) are found."""
    found, layer = [], list(frontier)
    for _ in range(depth):
        layer = [a for n in layer for a in n.all_input_nodes if a not in frontier and a not in found]
        layer = list(dict.fromkeys(layer))
        found += layer
    return found


def _per_row_constant(node: torch.fx.Node, x: torch.Tensor, depends: set, batch: int) -> bool:
    """Whether ``node`` is a constant of the body (it reads nothing the loop is given) holding
    one number per row of the state that differs between rows: a per-head rate a lossy pass
    wrote in (absorb_lr's calibration mean per head). It is evaluated, not read off the graph;
    one number for every row is a plain scale of the fit instead."""
    if x[0].numel() != batch or batch < 2 or ancestors(node) & depends:
        return False
    rows = x.reshape(x.shape[0], batch)          # [samples, rows]
    same_in_every_sample = bool((rows == rows[:1]).all())
    differs_between_rows = bool((rows[0] != rows[0, 0]).any())
    return same_in_every_sample and differs_between_rows


def _fit_pieces(program, ends, frontier, boundary, state_shape, side, batch, dk, dv):
    """Every reading ``(key, value, atoms, (α, β, v-scale))`` of the way ``ends = (s_in,
    s_out)`` (the state's whole update, or one step of it) that fits it on random tokens. The
    coefficients are products of the frontier's per-token scalars, or, where those do not fit,
    also of the scalars the frontier is made from (``(β k)ᵀ(v − k S)`` reads ``β k``, not ``β``).
    Key and value are frontier vectors; where none fit, they and the scalars are also looked for
    up to ``FAR`` ops behind the frontier: a Householder transition ``(I − β kkᵀ) S + β kᵀv``
    reads the matrices, not ``k``, ``v`` or ``β``, and the identity-plus-low-rank form
    ``S + kᵀ(β v) + (β k)ᵀ(−k S)`` reads ``β v``, not ``v``."""
    s_in, s_out = ends
    nearby = _made_from(frontier)
    # nearest first, starting with ``nearby``; only values computed from the loop's inputs
    outside = {x for x in program.body.graph.nodes if x.op == "placeholder"} - set(boundary)
    far = nearby + [x for x in _made_from(frontier, FAR)[len(nearby):]
                    if x not in outside and not (ancestors(x) & outside)
                    and isinstance(x.meta.get("val"), torch.Tensor)]
    nodes = frontier + far
    front_fn, front_inputs = extract(program.body, boundary, nodes)
    front_fn = promoted(front_fn)
    update_fn, update_inputs = extract(program.body, [s_in, *frontier], [s_out])
    update_fn = promoted(update_fn)
    n = SAMPLES
    sampled = _sampled(front_inputs, n, seed=0)
    if sampled is None:
        return
    evaluated = [v.double() for v in vmap(front_fn)(*sampled)]
    values = evaluated[:len(frontier)]
    by_node = dict(zip(nodes, evaluated))
    state = torch.zeros((n, *state_shape), dtype=torch.float64)

    def update(S, *front):
        env = dict(zip(frontier, front))
        return update_fn(*[S if i is s_in else env[i] for i in update_inputs])[0]

    A = vmap(lambda S, *f: _matrices(lambda x: update(x, *f), S, side))(state, *values)
    B = vmap(update)(state, *values)
    A = A.reshape(n * batch, dk, dk)
    B = (B if side == "left" else B.mT).reshape(n * batch, dk, dv)
    depends = set(boundary)

    every = [node for node, x in by_node.items()
             if (x[0].numel() in (1, batch) and ancestors(node) & depends)
             or _per_row_constant(node, x, depends, batch)]
    near = set(frontier + nearby)
    scalars = [node for node in every if node in near]
    own = [node for node in scalars if node in frontier]
    distinct = []                # the scalars up to FAR behind, each value once (nearest kept)
    for node in every:
        x = by_node[node].reshape(n, -1).expand(n, batch)
        if not any(torch.equal(x, by_node[m].reshape(n, -1).expand(n, batch)) for m in distinct):
            distinct.append(node)
    keys = _candidates(evaluated, n, batch, dk)
    vals = _candidates(evaluated, n, batch, dv)
    # the key and value fits do not depend on the atoms: found once for every atom set
    fits = [(ki, a, c, vi, b) for ki, a, c in _fit_keys(A, [k for _, k in keys])
            if float(c.abs().max()) != 0.0                # no forgetting: not a delta rule
            for vi, b in _fit_values(B, keys[ki][1], [v for _, v in vals])]
    in_frontier = lambda fit: keys[fit[0]][0] < len(frontier) and vals[fit[3]][0] < len(frontier)  # noqa: E731
    near_sets = list(dict.fromkeys((tuple(own), tuple(scalars))))
    for first in (True, False):     # the frontier's key and value first, as they always were
        for atoms in near_sets if first else list(dict.fromkeys([*near_sets, tuple(distinct)])):
            if len(atoms) > MAX_ATOMS:
                continue
            atom_values = [by_node[node].reshape(n, -1).expand(n, batch).reshape(-1)
                           for node in atoms]
            for fit in fits:
                tried = in_frontier(fit) and atoms in near_sets
                if (first and not in_frontier(fit)) or (not first and tried):
                    continue
                ki, a, c, vi, b = fit
                coefficients = [_fit_coefficient(x, atom_values) for x in (a, b, c)]
                if any(x is None for x in coefficients):
                    continue
                combined = _combined(*coefficients)
                if combined is not None:
                    yield nodes[keys[ki][0]], nodes[vals[vi][0]], list(atoms), combined


# ---------------------------------------------------------------------------------------------
# running it


class NonPositiveDecay(Exception):
    """A call whose decay is zero or negative somewhere: the chunked form takes its logarithm,
    so the plan runs the generic plan of the same program instead."""


def require_positive(decay: torch.Tensor) -> None:
    """Raise ``NonPositiveDecay`` where ``decay`` (a real tensor) is not positive everywhere."""
    if not is_fake(decay) and not bool((decay > 0).all()):
        raise NonPositiveDecay


def _op_inputs(match: DeltaRuleMatch, feats: list[torch.Tensor], L: int, b: int,
               apply_only: bool, check: bool = True):
    """``(q, k, v, beta, decay)`` for ``delta_rule`` (``[b, L, 1, ·]``, heads folded into the
    batch) from the features of every token (``[L, ...]``)."""
    key, value, *atoms, query = feats
    k = key.reshape(L, b, -1)
    q = query.reshape(L, b, -1)
    atoms = [x.reshape(L, -1).expand(L, b) for x in atoms]
    like = k[..., 0]
    decay = None if match.decay.one else match.decay(atoms, like)
    beta = match.beta(atoms, like)
    v = value.reshape(L, b, -1) * match.value_scale(atoms, like).unsqueeze(-1)
    if check and decay is not None:
        require_positive(decay)
    if apply_only:      # the last token is read, never written: an identity step
        keep = torch.ones(L, 1, dtype=beta.dtype, device=beta.device)
        keep[-1] = 0.0
        beta = beta * keep
        if decay is not None:
            decay = decay * keep + (1.0 - keep)
    fold = lambda x: x.transpose(0, 1).unsqueeze(2)  # noqa: E731  [L, b, ...] -> [b, L, 1, ...]
    # beta and decay: [L, b] -> [b, L, 1]
    return fold(q), fold(k), fold(v), fold(beta), None if decay is None else fold(decay)


class DeltaRulePlan(DeltaScanPlan):
    """A per-token loop run as the gated delta rule on ``delta_rule`` (chunked UT form): every
    token's key, value, rates and query computed at once, one call of the op, then the code
    after the read run for every token at once."""

    def __init__(self, match: DeltaRuleMatch, analysis: Analysis, schedule: str,
                 chunk_size: int = DELTA_CHUNK_SIZE):
        super().__init__(match.program, analysis, schedule)
        self.match = match
        self.chunk_size = chunk_size
        self.sides[match.state] = match     # what ``plan_at`` carries to other batch sizes

    #: whether an ``apply_only`` last token's update is left out (the program's semantics)
    final_update_dead = True
    #: the op's backend, and whether the decay is checked positive (the chunked form takes
    #: its logarithm)
    op_backend = "torch"
    check_decay = True
    #: one call of the runtime op replacing a loop over every token: never a loop, raced only
    #: at lengths up to the op's chunk (``as_written.may_lose``), which it pads a shorter
    #: sequence to
    loops_over_chunks = raced = False

    @property
    def races_up_to(self) -> int:
        return self.chunk_size

    #: whether the last call ran the generic plan, its decay not positive somewhere
    decay_fallback = False

    @property
    def implementation(self) -> str:
        if self.decay_fallback:
            return (f"{super().implementation}, not delta_rule: a decay <= 0 has no log "
                    "decay")
        return self.op_implementation

    @property
    def op_implementation(self) -> str:
        """The op as the report names it."""
        m = self.match
        gated = "" if m.decay.one else "gated, "
        name = self.program.states[m.state].name
        return f"delta_rule[torch]({gated}{name}, chunk {self.chunk_size})"

    def __call__(self, states0, invariants):
        try:
            out = self._on_the_op(states0, invariants)
        except NonPositiveDecay:    # the generic plan of the same program takes any decay
            self.decay_fallback = True
            return super().__call__(states0, invariants)
        self.decay_fallback = False
        return out

    def _on_the_op(self, states0, invariants):
        """The call on ``delta_rule``."""
        m, prog = self.match, self.program
        layout = chunk_layout(prog, list(invariants))
        L = layout.n_chunks
        values, dims = {}, {}
        needed = {*m.feature_inputs, *m.post_inputs}
        for node, spec in zip(prog.stream_inputs(), prog.streams):
            if node in needed:      # token-major, each token laid out like the traced one
                values[node] = chunk_stream(invariants[spec.source], spec, layout).contiguous()
                dims[node] = 0
        for node, x in [*zip(prog.invariant_inputs(), invariants),
                        *zip(prog.state_inputs(), states0)]:
            values.setdefault(node, x)
            dims.setdefault(node, None)
        feats = vmap(m.features, in_dims=tuple(dims[n] for n in m.feature_inputs))(
            *(values[n] for n in m.feature_inputs))
        s0 = states0[m.state]
        b = s0[..., 0, 0].numel()
        s0 = s0.reshape(b, *s0.shape[-2:])
        if m.side == "right":
            s0 = s0.mT
        apply_only = prog.last_chunk == "apply_only" and self.final_update_dead
        read, final = self.run_op(feats, L, b, s0, apply_only)
        read = read.unsqueeze(-2) if m.side == "left" else read.unsqueeze(-1)
        values[m.read], dims[m.read] = read, 0
        (y,) = vmap(m.post, in_dims=tuple(dims[n] for n in m.post_inputs))(
            *(values[n] for n in m.post_inputs))
        if m.side == "right":
            final = final.mT
        finals = list(states0)
        finals[m.state] = final.reshape(states0[m.state].shape)
        return assemble_outputs(prog, [y], layout), finals

    def run_op(self, feats: list[torch.Tensor], L: int, b: int, s0: torch.Tensor,
               apply_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The op run on every token's features: the reads ``[L, b, Dv]`` and the final state
        ``[b, Dk, Dv]``."""
        q, k, v, beta, decay = _op_inputs(self.match, feats, L, b, apply_only, self.check_decay)
        o, final = delta_rule(q, k, v, beta, decay=decay, chunk_size=self.chunk_size,
                              initial_state=s0.unsqueeze(1), output_final_state=True,
                              order=self.program.order, backend=self.op_backend)
        return o.squeeze(2).transpose(0, 1), final.squeeze(1)


def _confirmed(match: DeltaRuleMatch, probe: type | None = None) -> bool:
    """The body, evaluated in float64 on fresh random states and tokens, equals the delta rule
    built from the match — the state after the token and the token's output. ``probe``: the
    plan class that runs the match on one token (``_Probe`` when None)."""
    prog = match.program
    body = promoted(prog.body)
    ins = prog.state_inputs()
    n = SAMPLES
    placeholders = prog.placeholders()
    sampled = _sampled(placeholders, n, seed=1)
    if sampled is None:
        return False
    got_state, got_out = [], []
    probe = (probe or _Probe)(match)
    want = vmap(lambda *a: body(*a))(*sampled)
    for j in range(n):
        args = [x[j] for x in sampled]
        states0 = [args[placeholders.index(i)] for i in ins]
        invariants = [args[placeholders.index(i)] for i in prog.invariant_inputs()]
        streams = [args[placeholders.index(i)] for i in prog.stream_inputs()]
        # one token: each stream source is the token itself, on its token axis (a one-wide
        # slice kept that axis; a selected token gets it back)
        invs = list(invariants)
        for spec, x in zip(prog.streams, streams):
            invs[spec.source] = x.unsqueeze(spec.axis) if spec.per_token else x
        outs, finals = probe(states0, invs)
        got_out.append(outs[0].squeeze(prog.outputs[0].axis))
        got_state.append(finals[match.state])
    n_states = len(prog.states)
    state_ok = relative_error(torch.stack(got_state) - want[match.state], want[match.state])
    got_out = torch.stack(got_out)
    if got_out.numel() != want[n_states].numel():
        return False
    # a unit axis beside the token's (one head) may be squeezed on one side only
    out_ok = relative_error(got_out.reshape(want[n_states].shape) - want[n_states],
                            want[n_states])
    return state_ok <= FIT_TOLERANCE and out_ok <= FIT_TOLERANCE


class _Probe(DeltaRulePlan):
    """The plan on one token in float64, for the confirmation: no generic plan built, the
    extracted graphs' dtypes promoted, the token's update always applied (compared with the
    body's state-out) and the op's token loop run (random decays may be negative)."""

    final_update_dead = False
    op_backend = "naive"         # the token loop: no logarithm of a random decay
    check_decay = False

    def __init__(self, match: DeltaRuleMatch):  # noqa: D107 - see class docstring
        self.match = dataclasses.replace(match, features=promoted(match.features),
                                         post=promoted(match.post))
        self.program, self.chunk_size = match.program, DELTA_CHUNK_SIZE


def lift_delta_rule(program: TTTProgram, analysis: Analysis, schedule: str,
                    carried: DeltaRuleMatch | None = None) -> DeltaRulePlan | None:
    """The delta-rule plan of a per-token loop on ``schedule``, or None when the loop is not the
    (gated) delta rule as ``match_delta_rule`` reads it. ``carried``: the match of a plan of the
    same body at another batch size, carried over instead of read again."""
    if schedule != "semi-parallel":
        return None
    if carried is not None:
        match = carried.resized(program)
    else:
        match = match_delta_rule(program, analysis)
    if match is None:
        return None
    analysis.require_schedule(schedule)
    return DeltaRulePlan(match, analysis, schedule)


__all__ = ["DeltaRuleMatch", "DeltaRulePlan", "Coefficient", "NonPositiveDecay", "lift_delta_rule",
           "require_positive",
           "match_delta_rule"]
