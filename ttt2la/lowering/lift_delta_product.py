"""Several delta-rule steps per token (gated DeltaProduct) run on the chunked delta-rule op.

A per-token loop whose state takes ``n`` delta-rule steps before its token is read,
``S ← a_j S − c_j k_jᵀ(k_j S) + b_j k_jᵀ v_j`` for ``j = 1..n`` (a gate once per token is a decay
on the first step only), is the delta rule over ``n`` tokens per token: token ``(t, j)`` has key
``k_{t,j}``, value ``v'_{t,j}``, rate ``β_{t,j}`` and decay ``α_{t,j}``, and the token's output is
the read after ``(t, n)`` (before ``(t, 1)`` when the loop reads before its update). The expanded
sequence is one interleave of the steps' features (``stack`` on a new axis after the token's),
the op is called once on it, and the reads are a strided slice of its outputs.

The steps are read off the graph, never assumed: the state's update is cut at the values every
path from the state to the new state goes through (``cuts``), consecutive cuts are grouped into
the longest runs that each fit one delta-rule step (``lift_delta_rule``'s fit, per run), and the
whole body is then confirmed in float64 on fresh tokens and states against the expanded rule,
or the loop keeps its generic plan. A look-alike that reads the state between the steps is not
read (its read is not of the token's last state); one whose gate decays every step lifts with a
decay at every expanded token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..analysis.associativity import Analysis
from ..ir import TTTProgram, reshape_views
from ..runtime.delta_rule import delta_rule
from .executors import extract, shape_only
from .lift_delta_rule import (Coefficient, DeltaRulePlan, _boundary, _confirmed, _fit_pieces,
                              _Probe, _reads, frontier_between, one_state_match,
                              require_positive)

#: At most this many steps per token are read (each cut tried as a step's end costs one fit).
MAX_STEPS = 16


@dataclass(frozen=True)
class Step:
    """One delta-rule step of a token: indices of its key, value and atoms among the features,
    and its coefficients ``α``, ``β``, ``v``-scale (``lift_delta_rule.Coefficient``)."""

    key: int
    value: int
    atoms: tuple[int, ...]
    decay: Coefficient
    beta: Coefficient
    value_scale: Coefficient


@dataclass
class DeltaProductMatch:
    """A per-token loop body read as ``len(steps)`` delta-rule steps of state ``state`` a token."""

    program: TTTProgram
    state: int
    side: str
    steps: list[Step]
    nodes: list[torch.fx.Node]         # the features: every step's key, value, atoms; the query
    read: torch.fx.Node
    query: torch.fx.Node
    features: torch.fx.GraphModule     # boundary -> (*nodes, query)
    feature_inputs: list[torch.fx.Node]
    post: torch.fx.GraphModule         # (read, boundary) -> the token's output
    post_inputs: list[torch.fx.Node]

    def resized(self, program: TTTProgram) -> "DeltaProductMatch | None":
        """The same reading of ``program``, a re-sized copy of this body (same nodes in the same
        order), its graphs cut again at the same nodes; None when it is not such a copy."""
        old, new = list(self.program.body.graph.nodes), list(program.body.graph.nodes)
        if len(old) != len(new) or any((a.op, a.target) != (b.op, b.target)
                                       for a, b in zip(old, new)):
            return None
        at = {n: new[i] for i, n in enumerate(old)}
        return _built(program, self.state, self.side, self.steps, [at[n] for n in self.nodes],
                      at[self.read], at[self.query])


def cuts(program: TTTProgram, t: int) -> list[torch.fx.Node]:
    """The values of the state's shape, in graph order, that every path from state ``t`` to its
    new state goes through (both ends included): where the update can be split into steps."""
    s_in, s_out = program.state_inputs()[t], program.state_outputs()[t]
    reads = {s_in}
    for n in program.body.graph.nodes:
        if not shape_only(n) and any(a in reads for a in n.all_input_nodes):
            reads.add(n)
    shape = s_in.meta["val"].shape
    found = []
    for n in program.body.graph.nodes:
        val = n.meta.get("val")
        if n in reads and isinstance(val, torch.Tensor) and val.shape == shape \
                and (n is s_in or n is s_out or not _bypassed(s_in, s_out, n, reads)):
            found.append(n)
    return found if found and found[-1] is s_out else []


def _bypassed(s_in, s_out, n, reads) -> bool:
    """Whether ``s_out`` reads ``s_in`` on a path that avoids ``n``."""
    seen, stack = {n}, [s_out]
    while stack:
        x = stack.pop()
        if x is s_in:
            return True
        if x in seen or x not in reads:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return False


def match_delta_product(program: TTTProgram, analysis: Analysis) -> DeltaProductMatch | None:
    """The per-token loop of ``program`` read as several delta-rule steps a token (see the
    module docstring), or None; the same preconditions as ``match_delta_rule``."""
    return one_state_match(program, analysis, _match)


def _match(program: TTTProgram, t: int) -> DeltaProductMatch | None:
    state_shape = tuple(program.state_inputs()[t].meta["val"].shape)
    points = cuts(program, t)
    if len(state_shape) < 2 or len(points) < 3:
        return None
    for read, query, side in _reads(program, t):
        rows, cols = state_shape[-2:]
        dk, dv = (rows, cols) if side == "left" else (cols, rows)
        batch = program.state_inputs()[t].meta["val"].numel() // (rows * cols)
        if query.meta["val"].numel() != batch * dk or read.meta["val"].numel() != batch * dv:
            continue
        fit = lambda a, b: _one_step(program, (a, b), state_shape, side, batch, dk, dv)  # noqa
        steps = _steps(points, fit)
        if steps is None or len(steps) < 2:
            continue
        match = _assembled(program, t, side, steps, read, query)
        if match is not None and _confirmed(match, _ProductProbe):
            return match
    return None


def _one_step(program, ends, state_shape, side, batch, dk, dv):
    """The first reading ``(key, value, atoms, (α, β, v-scale))`` of the state's way from
    ``ends[0]`` to ``ends[1]`` as one delta-rule step, or None."""
    frontier = frontier_between(program, *ends)
    if frontier is None:
        return None
    found = _fit_pieces(program, ends, frontier, _boundary(program), state_shape, side, batch,
                        dk, dv)
    try:
        return next(iter(found), None)
    except (RuntimeError, ValueError, IndexError, TypeError, NotImplementedError):
        return None                    # a run the probes cannot evaluate is not a step


def _steps(points: list[torch.fx.Node], fit) -> list[tuple] | None:
    """The update split at ``points`` into consecutive runs, each the longest from its start
    that ``fit`` reads as one step (a run past a fitting one that fails ends the search: it
    holds two steps); None when the runs do not reach the last point."""
    steps, start = [], 0
    while start < len(points) - 1 and len(steps) < MAX_STEPS:
        best = None
        for end in range(start + 1, len(points)):
            reading = fit(points[start], points[end])
            if reading is not None:
                best = (end, reading)
            elif best is not None:
                break
        if best is None:
            return None
        start = best[0]
        steps.append(best[1])
    return steps if start == len(points) - 1 else None


def _assembled(program, t, side, readings, read, query) -> DeltaProductMatch | None:
    """The match of these steps' readings, their features numbered in one list."""
    nodes: list[torch.fx.Node] = []

    def index(node):
        if node not in nodes:
            nodes.append(node)
        return nodes.index(node)

    steps = []
    for key, value, atoms, (decay, beta, scale) in readings:
        steps.append(Step(index(key), index(value), tuple(index(a) for a in atoms),
                          decay, beta, scale))
    return _built(program, t, side, steps, nodes, read, query)


def _built(program, t, side, steps, nodes, read, query) -> DeltaProductMatch:
    """The match, with the graphs that compute the features and what follows the read."""
    boundary = _boundary(program)
    features, feature_inputs = extract(program.body, boundary, [*nodes, query])
    reshape_views(features.graph)
    features.recompile()
    post, post_inputs = extract(program.body, [read, *boundary], [program.chunk_outputs()[0]])
    reshape_views(post.graph)
    post.recompile()
    return DeltaProductMatch(program, t, side, list(steps), list(nodes), read, query, features,
                             feature_inputs, post, post_inputs)


def expanded_inputs(match: DeltaProductMatch, feats: list[torch.Tensor], L: int, b: int,
                    apply_only: bool, check: bool = True):
    """``(q, k, v, beta, decay)`` for ``delta_rule`` over ``L·n`` tokens (``[b, L·n, 1, ·]``):
    token ``(t, j)`` is step ``j`` of token ``t``, interleaved by one ``stack``."""
    *found, query = feats
    ks, vs, betas, decays = [], [], [], []
    for step in match.steps:
        atoms = [found[i].reshape(L, -1).expand(L, b) for i in step.atoms]
        k = found[step.key].reshape(L, b, -1)
        like = k[..., 0]
        ks.append(k)
        betas.append(step.beta(atoms, like))
        vs.append(found[step.value].reshape(L, b, -1) * step.value_scale(atoms, like)[..., None])
        decays.append(None if step.decay.one else step.decay(atoms, like))
    gated = any(d is not None for d in decays)
    decays = [torch.ones_like(betas[0]) if d is None else d for d in decays]
    if gated and check:
        _check_decay(match, decays)
    n = len(match.steps)
    beta, decay = torch.stack(betas, 1), torch.stack(decays, 1)          # [L, n, b]
    if apply_only:      # the last token is read, never written: identity steps
        keep = torch.ones(L, 1, 1, dtype=beta.dtype, device=beta.device)
        keep[-1] = 0.0
        beta, decay = beta * keep, decay * keep + (1.0 - keep)
    q = query.reshape(L, 1, b, -1).expand(L, n, b, -1)
    fold = lambda x: x.reshape(L * n, *x.shape[2:]).transpose(0, 1).unsqueeze(2)  # noqa: E731
    return (fold(q), fold(torch.stack(ks, 1)), fold(torch.stack(vs, 1)), fold(beta),
            fold(decay) if gated else None)


def _check_decay(match: DeltaProductMatch, decays: list[torch.Tensor]) -> None:
    """``NonPositiveDecay`` for a zero or negative decay (the chunked form takes its
    logarithm): the plan then runs the generic plan of the same program."""
    for d in decays:
        require_positive(d)


class DeltaProductPlan(DeltaRulePlan):
    """A per-token loop of several delta-rule steps a token run as the delta rule over the
    expanded sequence: one call of ``delta_rule``, its reads taken every ``n``-th token."""

    @property
    def op_implementation(self) -> str:
        m = self.match
        gated = "gated, " if any(not s.decay.one for s in m.steps) else ""
        name = self.program.states[m.state].name
        return (f"delta_rule[torch]({gated}{name}, {len(m.steps)} steps a token, "
                f"chunk {self.chunk_size})")

    @property
    def races_up_to(self) -> int:
        """The tokens that fill the op's chunk: each token is ``n`` steps of the op."""
        return self.chunk_size // len(self.match.steps)

    def run_op(self, feats, L, b, s0, apply_only):
        """The op over the ``L·n`` expanded tokens; the reads of every token's own position."""
        n = len(self.match.steps)
        q, k, v, beta, decay = expanded_inputs(self.match, feats, L, b, apply_only,
                                               self.check_decay)
        o, final = delta_rule(q, k, v, beta, decay=decay, chunk_size=self.chunk_size,
                              initial_state=s0.unsqueeze(1), output_final_state=True,
                              order=self.program.order, backend=self.op_backend)
        first = n - 1 if self.program.order == "inclusive" else 0
        return o[:, first::n].squeeze(2).transpose(0, 1), final.squeeze(1)


class _ProductProbe(_Probe, DeltaProductPlan):
    """``DeltaProductPlan`` on one token in float64, for the confirmation (see ``_Probe``)."""


def lift_delta_product(program: TTTProgram, analysis: Analysis, schedule: str,
                       carried: DeltaProductMatch | None = None) -> DeltaProductPlan | None:
    """The expanded delta-rule plan of a loop of several steps a token on ``schedule``, or None
    when ``match_delta_product`` does not read it so. ``carried``: the match of a plan of the
    same body at another batch size, carried over instead of read again."""
    if schedule != "semi-parallel":
        return None
    match = carried.resized(program) if carried is not None \
        else match_delta_product(program, analysis)
    if match is None:
        return None
    analysis.require_schedule(schedule)
    return DeltaProductPlan(match, analysis, schedule)


__all__ = ["DeltaProductMatch", "DeltaProductPlan", "Step", "cuts", "expanded_inputs",
           "lift_delta_product", "match_delta_product"]
