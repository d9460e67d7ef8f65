"""The associativity checker: can a body's chunks be scanned in parallel, and by which schedule?

Per carried state it takes the class of its update in itself and in every other state (from
``dependence``), builds the state graph (edge ``S → T`` when ``T``'s update reads ``S``) and
decides per strongly connected component:

* one state, at most scalar-affine in itself → a prefix sum / affine scan (``parallel``);
* one state, matrix-affine (delta rule) or state-local (weight norm after an additive step), or
  several states coupled at most state-locally → a sequential pass over chunks of only the small
  state-dependent graph, everything else batched (``semi-parallel``);
* anything nonlinear inside a component → ``recurrent``: the body runs in a loop.

A final layer whose update depends nonlinearly on itself (a layer norm or nonlinearity after it
inside the loss, a rate computed from it and the data) is outside the paper's theorem: its
blocker says so and that no pass removes it, ahead of any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx

from ..errors import NonReducibleError
from ..ir import TTTProgram, ancestors, describe_op, node_src, torch_name
from .dependence import Dep, Dependence, StateDep, analyze_dependence
from .op_vocabulary import NORMALISATION_OPS, calls, op_name
from .rules import match_newton_schulz, match_norm, update_rules

_SCHEDULE_RANK = {"parallel": 0, "semi-parallel": 1, "recurrent": 2}

_ROLE_PHRASE = {
    "theta": "kernel-weight Θ state",
    "final": "final-layer state",
    "momentum": "momentum state",
    "other": "state",
}


def role_phrase(program: TTTProgram, state: int) -> str:
    """``"the kernel-weight Θ state w0"`` — how errors and reports name a state."""
    spec = program.states[state]
    return f"the {_ROLE_PHRASE.get(spec.role, 'state')} {spec.name}"


@dataclass
class StateAnalysis:
    """One state's update: its class in itself, what it reads, and the recovered rule.

    ``mode`` says how an executor obtains its sequence over chunks: ``constant``,
    ``independent`` (recomputed each chunk), ``prefix`` (a sum), ``affine`` (a scan),
    ``sequential`` (a loop over the small state-dependent graph) or ``recurrent``.
    """

    index: int
    name: str
    role: str
    self_dependence: Dep
    depends_on: dict[str, Dep]
    rule: str
    mode: str
    culprit: torch.fx.Node | None = None


@dataclass
class Blocker:
    """Why a state cannot run in a more parallel schedule: the op, where, and what helps."""

    state: int
    op: torch.fx.Node | None
    message: str
    remedy: str
    schedule: str                   # the most parallel schedule this blocker allows
    kind: str = ""                  # "theta_update", "state_norm" ...: what a pass may remove
    outside_theory: bool = False    # no pass of the paper can remove it: reported first


@dataclass
class Analysis:
    """The checker's verdict on one program (see the module docstring)."""

    program: TTTProgram
    dependence: Dependence
    states: list[StateAnalysis]
    graph: nx.DiGraph               # state indices; edge u → t when t's update reads u
    groups: list[list[int]]         # strongly connected components in topological order
    group_modes: list[str]
    schedule: str
    blockers: list[Blocker] = field(default_factory=list)

    @property
    def reducible(self) -> bool:
        """True when the chunks can run (semi-)parallel: no nonlinear recurrence in a component."""
        return self.schedule != "recurrent"

    @property
    def topological_order(self) -> list[str]:
        """State names in an order where every state comes after the states its update reads."""
        return [self.program.states[i].name for g in self.groups for i in g]

    @property
    def rules(self) -> dict[str, str]:
        """``{state name: rendered update rule}`` for the report."""
        return {s.name: s.rule for s in self.states}

    def require_reducible(self, level: int | None = None) -> None:
        """Raise ``NonReducibleError`` naming the state, op, source line and remedy when the
        program can only run recurrently."""
        self.require_schedule("semi-parallel", level)

    def require_schedule(self, schedule: str, level: int | None = None) -> None:
        """Raise ``NonReducibleError`` when ``schedule`` is more parallel than the program
        allows."""
        if schedule not in _SCHEDULE_RANK:
            raise ValueError(f"unknown schedule {schedule!r}; "
                             f"expected one of {list(_SCHEDULE_RANK)}")
        wanted = _SCHEDULE_RANK[schedule]
        blocking = [b for b in self.blockers if _SCHEDULE_RANK[b.schedule] > wanted]
        if not blocking:
            return
        b = blocking[0]
        prog = self.program
        loop = f"the loop at {prog.loop_src}" if prog.loop_src is not None else "this loop"
        where = f"{prog.module_path}: " if prog.module_path else ""
        at = f" at level {level}" if level is not None else ""
        how = {"semi-parallel": "chunk-parallel", "parallel": "fully parallel"}[schedule]
        raise NonReducibleError(
            f"{where}{loop} cannot run {how}{at}: {b.message} {b.remedy}",
            state=prog.states[b.state].name,
            op=torch_name(b.op) if b.op is not None else None,
            where=_line(b.op),
            remedy=b.remedy)


def _mode(dep: StateDep, out_is_in: bool) -> str:
    if out_is_in:
        return "constant"
    return {Dep.INDEPENDENT: "independent", Dep.IDENTITY: "prefix", Dep.SCALAR_AFFINE: "affine",
            Dep.MATRIX_AFFINE: "sequential", Dep.LOCAL: "sequential"}.get(dep.cls, "recurrent")


def _is_norm(node: torch.fx.Node | None) -> bool:
    return node is not None and (match_norm(node) is not None or op_name(node) in (
        "linalg_vector_norm", "norm", "native_layer_norm", "rsqrt"))


def _line(node: torch.fx.Node | None) -> str | None:
    """The user's ``file:line`` that made ``node``, or ``None``."""
    src = node_src(node) if node is not None else None
    return f"{src.short_file}:{src.line}" if src is not None else None


def _where(node: torch.fx.Node | None) -> str:
    return describe_op(node) if node is not None else ""


def _recurrent_blocker(program: TTTProgram, dep: Dependence, t: int,
                       members: set[int]) -> Blocker | None:
    bad = [(u, dep.update(t, u)) for u in sorted(members) if dep.update(t, u).cls == Dep.NONLINEAR]
    if not bad:
        return None
    u, d = bad[0]
    through = "itself" if u == t else role_phrase(program, u)
    out = program.state_outputs()[t]
    updated = node_src(out) if isinstance(out, torch.fx.Node) else None
    message = (f"{role_phrase(program, t)}{f' (updated at {updated})' if updated else ''} "
               f"depends nonlinearly on {through} through {_where(d.culprit)}, so its chunk "
               f"updates do not compose associatively.")
    roles = {program.states[i].role for i in members}
    kind = ("theta_update" if "theta" in roles else
            "increment_transform" if _in_newton_schulz(d.culprit, out) else
            "state_norm" if _is_norm(d.culprit) else "")
    return Blocker(t, d.culprit, message, _remedy(kind, "recurrent"), "recurrent", kind)


_WHAT_IT_DOES = {"theta_update": "so the kernel weights Θ stop being updated",
                 "state_norm": "to remove the state normalisation",
                 "increment_transform": "to replace the Newton–Schulz orthogonalisation of an "
                                        "increment that reads the state by a scale"}


def _remedy(kind: str, schedule: str) -> str:
    """What helps, from the pass registry: the pass that removes ``kind``, or the fallback."""
    from ..passes.base import remedy_for

    fix = remedy_for(kind) if kind else None
    if fix is None:
        if schedule == "semi-parallel":
            return "Use the semi-parallel schedule; no pass removes this dependence."
        return ("Keep the recurrent schedule (strict=False); ttt2la cannot parallelise this "
                "update.")
    fix = fix[0].upper() + fix[1:]
    if schedule != "recurrent":
        return f"{fix} to make it fully parallel."
    text = f"{fix} {_WHAT_IT_DOES.get(kind, 'to remove it')}"
    if kind == "theta_update":
        text += ", or keep the recurrent schedule (strict=False)"
    return text + "."


def _in_newton_schulz(culprit: torch.fx.Node, out: torch.fx.Node) -> bool:
    """Whether ``culprit`` is part of a Newton–Schulz orthogonalisation feeding ``out``."""
    for node in ancestors(out):
        if node.op != "call_function" or op_name(node) not in ("add", "_to_copy", "view"):
            continue
        m = match_newton_schulz(node)
        if m is not None and culprit in ancestors(m.output) - ancestors(m.input) | {m.input}:
            return True
    return False


def _normalises(node: torch.fx.Node, depth: int = 4) -> bool:
    """Whether ``node`` is, or feeds within a few ops, a normalisation op."""
    frontier = [node]
    for _ in range(depth + 1):
        if any(calls(n, NORMALISATION_OPS) for n in frontier):
            return True
        frontier = [u for n in frontier for u in n.users]
    return False


def _theorem_blocker(program: TTTProgram, dep: Dependence, t: int) -> Blocker | None:
    """The final layer's update depends nonlinearly on the final layer itself — a norm or a
    nonlinearity after it inside the loss, or a learning rate computed from it. The paper's
    reduction needs ``f(x) = φ(x)·W`` with ``W`` linear and the step's effective value free of
    ``W``; no step of the paper changes that, so the layer is refused, whatever the level."""
    d = dep.update(t, t)
    if program.states[t].role != "final" or d.cls != Dep.NONLINEAR or d.culprit is None:
        return None
    out = program.state_outputs()[t]
    if _in_newton_schulz(d.culprit, out):
        return None
    if _normalises(d.culprit):
        what = (f"a normalisation ({_where(d.culprit)}) follows it inside the loss it is "
                "trained with (a layer norm, as in TTT-Linear or a layer-normed memory)")
    else:
        what = (f"its update depends nonlinearly on itself through {_where(d.culprit)} (a "
                "nonlinearity after it inside the loss, or a learning rate or gate computed "
                "from it)")
    updated = node_src(out) if isinstance(out, torch.fx.Node) else None
    message = (f"{role_phrase(program, t)}{f' (updated at {updated})' if updated else ''} is "
               f"the last fast weight before the output, and {what}, so the loop is not linear "
               "attention: the paper's reduction needs a linear, bias-free final layer whose "
               "gradient step adds φ(k)ᵀ times a value that does not depend on it.")
    remedy = ("No pass removes this: freezing the final layer would leave no test-time training "
              "and no step of the paper takes a norm or nonlinearity out of the loss. Keep the "
              "layer as written (strict=False), or train a variant without it.")
    return Blocker(t, d.culprit, message, remedy, "recurrent", outside_theory=True)


def _sequential_blocker(program: TTTProgram, dep: Dependence, t: int,
                        members: set[int]) -> Blocker:
    d = max((dep.update(t, u) for u in sorted(members)), key=lambda x: x.cls)
    local = d.cls == Dep.LOCAL
    kind = "is normalised" if local else "is matrix-affine in itself (a delta rule)"
    through = f" through {_where(d.culprit)}" if d.culprit is not None else ""
    message = (f"{role_phrase(program, t)} {kind}{through}; only a sequential pass over its "
               f"chunks is exact.")
    kind = "state_norm" if local else ""
    return Blocker(t, d.culprit, message, _remedy(kind, "semi-parallel"), "semi-parallel", kind)


def analyze(program: TTTProgram, dependence: Dependence | None = None) -> Analysis:
    """Classify every state update of ``program`` and choose the most parallel exact schedule."""
    dep = dependence or analyze_dependence(program)
    n = len(program.states)
    ins, outs = program.state_inputs(), program.state_outputs()
    rules = update_rules(program)
    graph = nx.DiGraph()
    graph.add_nodes_from((i, {"name": s.name, "role": s.role})
                         for i, s in enumerate(program.states))
    graph.add_edges_from((u, t) for t in range(n) for u in range(n)
                         if t != u and dep.update(t, u).kind > Dep.INDEPENDENT)
    condensed = nx.condensation(graph)
    groups = [sorted(condensed.nodes[c]["members"]) for c in nx.topological_sort(condensed)]

    states, blockers, group_modes = [], [], []
    for group in groups:
        members = set(group)
        if len(group) == 1:
            mode = _mode(dep.update(group[0], group[0]), outs[group[0]] is ins[group[0]])
        else:
            worst = max(dep.update(t, u).cls for t in group for u in group)
            mode = "recurrent" if worst == Dep.NONLINEAR else "sequential"
        group_modes.append(mode)
        for t in group:
            spec = program.states[t]
            inner = max((dep.update(t, u) for u in group), key=lambda d: d.cls)
            states.append(StateAnalysis(
                index=t, name=spec.name, role=spec.role, self_dependence=dep.update(t, t).cls,
                depends_on={program.states[u].name: dep.update(t, u).cls for u in range(n)
                            if u != t and dep.update(t, u).kind > Dep.INDEPENDENT},
                rule=rules[spec.name], mode=mode,
                culprit=inner.culprit if mode in ("sequential", "recurrent") else None))
            if mode == "recurrent":
                blocker = _theorem_blocker(program, dep, t) or \
                    _recurrent_blocker(program, dep, t, members)
            elif mode == "sequential":
                blocker = _sequential_blocker(program, dep, t, members)
            else:
                blocker = None
            if blocker is not None:
                blockers.append(blocker)
    states.sort(key=lambda s: s.index)
    schedule = "parallel"
    if "sequential" in group_modes:
        schedule = "semi-parallel"
    if "recurrent" in group_modes:
        schedule = "recurrent"
    blockers.sort(key=lambda b: (-_SCHEDULE_RANK[b.schedule], not b.outside_theory))
    return Analysis(program, dep, states, graph, groups, group_modes, schedule, blockers)


__all__ = ["Analysis", "StateAnalysis", "Blocker", "analyze", "role_phrase"]
