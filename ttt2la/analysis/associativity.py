"""The associativity checker: can a body's chunks be scanned in parallel, and by which schedule?

Per carried state it takes the class of its update in itself and in every other state (from
``dependence``), builds the state graph (edge ``S → T`` when ``T``'s update reads ``S``) and
decides per strongly connected component:

* one state, at most scalar-affine in itself → a prefix sum / affine scan (``parallel``);
* one state, matrix-affine (delta rule) or state-local (weight norm after an additive step), or
  several states coupled at most state-locally → a sequential pass over chunks of only the small
  state-dependent graph, everything else batched (``semi-parallel``);
* anything nonlinear inside a component → ``recurrent``: the body runs in a loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch.fx

from ..errors import NonReducibleError
from ..ir import TTTProgram, describe_node, node_src
from .dependence import Dep, Dependence, StateDep, analyze_dependence, op_name
from .rules import match_norm, update_rules

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
    """One state's update: its class in itself, what it reads, and the recovered rule."""

    index: int
    name: str
    role: str
    self_dependence: Dep
    depends_on: dict[str, Dep]
    rule: str
    mode: str                       # "constant" | "independent" | "prefix" | "affine" | "sequential" | "recurrent"
    culprit: torch.fx.Node | None = None


@dataclass
class Blocker:
    """Why a state cannot run in the requested schedule: the op, where, and the pass that helps."""

    state: int
    op: torch.fx.Node | None
    message: str
    remedy: str
    schedule: str                   # the best schedule this blocker allows


@dataclass
class Analysis:
    """The checker's verdict on one program (see the module docstring)."""

    program: TTTProgram
    dependence: Dependence
    states: list[StateAnalysis]
    graph: nx.DiGraph
    groups: list[list[int]]         # strongly connected components in topological order
    group_modes: list[str]
    schedule: str
    blockers: list[Blocker] = field(default_factory=list)

    @property
    def reducible(self) -> bool:
        """True when the chunks can run (semi-)parallel: no nonlinear recurrence in any component."""
        return self.schedule != "recurrent"

    @property
    def topological_order(self) -> list[str]:
        return [self.program.states[i].name for g in self.groups for i in g]

    @property
    def rules(self) -> dict[str, str]:
        return {s.name: s.rule for s in self.states}

    def require_reducible(self, level: int | None = None) -> None:
        """Raise ``NonReducibleError`` naming the state, op, source line and remedy when the
        program can only run recurrently."""
        self.require_schedule("semi-parallel", level)

    def require_schedule(self, schedule: str, level: int | None = None) -> None:
        """Raise ``NonReducibleError`` when ``schedule`` is more parallel than the program allows."""
        if schedule not in _SCHEDULE_RANK:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {list(_SCHEDULE_RANK)}")
        wanted = _SCHEDULE_RANK[schedule]
        blocking = [b for b in self.blockers if _SCHEDULE_RANK[b.schedule] > wanted]
        if not blocking:
            return
        b = blocking[0]
        at = f" at level {level}" if level is not None else ""
        prefix = (f"{self.program.module_path}: " if self.program.module_path else "")
        how = {"semi-parallel": "chunk-parallel", "parallel": "fully parallel"}.get(schedule, schedule)
        raise NonReducibleError(
            f"{prefix}this loop cannot run {how}{at}: {b.message} {b.remedy}",
            state=self.program.states[b.state].name,
            op=describe_node(b.op) if b.op is not None else None,
            where=str(node_src(b.op)) if b.op is not None and node_src(b.op) else None,
            remedy=b.remedy)


def _mode(dep: StateDep, out_is_in: bool) -> str:
    if out_is_in:
        return "constant"
    cls = dep.cls
    if cls == Dep.INDEPENDENT:
        return "independent"
    if cls == Dep.IDENTITY:
        return "prefix"
    if cls == Dep.SCALAR_AFFINE:
        return "affine"
    if cls in (Dep.MATRIX_AFFINE, Dep.LOCAL):
        return "sequential"
    return "recurrent"


def _remedy(program: TTTProgram, state: int, culprit: torch.fx.Node | None, reads: set[int]) -> str:
    roles = {program.states[i].role for i in reads | {state}}
    if "theta" in roles:
        return ("Apply freeze_theta (level >= 1) so the kernel weights Θ stop being updated, or "
                "keep the recurrent schedule (strict=False).")
    if culprit is not None and match_norm(culprit) is not None or \
            (culprit is not None and op_name(culprit) in ("linalg_vector_norm", "norm",
                                                          "native_layer_norm", "rsqrt")):
        return "Apply drop_norm (level >= 2) to remove the state normalisation."
    return "Keep the recurrent schedule (strict=False); ttt2la cannot parallelise this update."


def _where(node: torch.fx.Node | None) -> str:
    if node is None:
        return ""
    src = node_src(node)
    code = f" (`{src.code}`)" if src is not None and src.code else ""
    return f"{describe_node(node)}{code}"


def analyze(program: TTTProgram, dependence: Dependence | None = None) -> Analysis:
    """Classify every state update of ``program`` and choose the most parallel exact schedule."""
    dep = dependence or analyze_dependence(program)
    n = len(program.states)
    ins, outs = program.state_inputs(), program.state_outputs()
    rules = update_rules(program)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    for t in range(n):
        for u in range(n):
            if t != u and dep.update(t, u).kind > Dep.INDEPENDENT:
                graph.add_edge(u, t)
    condensed = nx.condensation(graph)
    groups = [sorted(condensed.nodes[c]["members"]) for c in nx.topological_sort(condensed)]

    states, blockers, group_modes = [], [], []
    for group in groups:
        members = set(group)
        if len(group) == 1:
            (t,) = group
            d = dep.update(t, t)
            mode = _mode(d, outs[t] is ins[t])
        else:
            coupled = [dep.update(t, u) for t in group for u in group]
            worst = max((d.cls for d in coupled), default=Dep.INDEPENDENT)
            mode = "recurrent" if worst == Dep.NONLINEAR else "sequential"
        group_modes.append(mode)
        for t in group:
            self_dep = dep.update(t, t)
            reads = {u for u in range(n) if dep.update(t, u).kind > Dep.INDEPENDENT}
            culprit = None
            if mode in ("sequential", "recurrent"):
                inner = [dep.update(t, u) for u in sorted(members)]
                worst = max(inner, key=lambda d: d.cls)
                culprit = worst.culprit
            spec = program.states[t]
            states.append(StateAnalysis(
                index=t, name=spec.name, role=spec.role, self_dependence=self_dep.cls,
                depends_on={program.states[u].name: dep.update(t, u).cls for u in sorted(reads)
                            if u != t},
                rule=rules[spec.name], mode=mode, culprit=culprit))
            if mode == "recurrent":
                bad = [(u, dep.update(t, u)) for u in sorted(members)
                       if dep.update(t, u).cls == Dep.NONLINEAR]
                if not bad:
                    continue
                u, d = bad[0]
                through = "itself" if u == t else role_phrase(program, u)
                update_at = node_src(outs[t]) if isinstance(outs[t], torch.fx.Node) else None
                msg = (f"{role_phrase(program, t)[0].upper()}{role_phrase(program, t)[1:]}"
                       f"{f' (updated at {update_at})' if update_at else ''} depends nonlinearly "
                       f"on {through} through {_where(d.culprit)}, so its chunk updates do not "
                       f"compose associatively.")
                blockers.append(Blocker(t, d.culprit, msg, _remedy(program, t, d.culprit,
                                                                    members - {t}), "recurrent"))
            elif mode == "sequential":
                d = max((dep.update(t, u) for u in sorted(members)), key=lambda x: x.cls)
                kind = ("is normalised" if d.cls == Dep.LOCAL else
                        "is matrix-affine in itself (a delta rule)")
                msg = (f"{role_phrase(program, t)[0].upper()}{role_phrase(program, t)[1:]} {kind}"
                       f"{' through ' + _where(d.culprit) if d.culprit is not None else ''}; "
                       f"only a sequential pass over its chunks is exact.")
                remedy = ("Apply drop_norm (level >= 2) to make it fully parallel."
                          if d.cls == Dep.LOCAL else
                          "Use the semi-parallel schedule; no pass removes this dependence.")
                blockers.append(Blocker(t, d.culprit, msg, remedy, "semi-parallel"))
    states.sort(key=lambda s: s.index)
    schedule = "parallel"
    if any(m == "sequential" for m in group_modes):
        schedule = "semi-parallel"
    if any(m == "recurrent" for m in group_modes):
        schedule = "recurrent"
    blockers.sort(key=lambda b: -_SCHEDULE_RANK[b.schedule])
    return Analysis(program, dep, states, graph, groups, group_modes, schedule, blockers)


__all__ = ["Analysis", "StateAnalysis", "Blocker", "analyze", "role_phrase"]
