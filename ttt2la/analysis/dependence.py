"""How every node of a loop body depends on every carried state, by abstract interpretation.

For each state-in ``S`` the body's aten nodes are visited in topological order and given a class
in the lattice ``Dep`` (independent < identity < scalar-affine < matrix-affine < local <
nonlinear), together with the layout of ``S`` inside the value (so that ``transpose∘transpose``
is the identity again), whether ``S`` was mixed with per-token stream data (``k @ S``), and the
first node where the value stopped being affine or state-local — the op an error must name.
"""
from __future__ import annotations

import operator

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Iterable

import torch
import torch.fx

from ..ir import KIND, TTTProgram
from .op_vocabulary import (ADDITIVE, COPIES, EXPANDS, INDEX_ARGUMENTS, KNOWN_NONLINEAR,
                            LINEAR_GATHERS, LINEAR_JOINS, LINEAR_MAPS, MATMULS, PERMUTES,
                            RESHAPES, SHAPE_ONLY, SLICES, op_name)


class Dep(IntEnum):
    """How a value depends on one carried state ``S`` (ordered: a join is the ``max``)."""

    INDEPENDENT = 0      # does not read S
    IDENTITY = 1         # S itself, relaid out or copied, plus an S-independent term: S + f
    SCALAR_AFFINE = 2    # a ⊙ S + f, a elementwise/broadcast and independent of S
    MATRIX_AFFINE = 3    # linear in S but not elementwise: S·A + f, A·S + f, Sᵀ, sums of S
    LOCAL = 4            # a nonlinear function of state-local affine values (weight norm of S)
    NONLINEAR = 5        # anything else, e.g. silu(k·S): S through per-token nonlinear compute

    def describe(self) -> str:
        """A short phrase for reports: ``"scalar affine (a⊙S + f)"``."""
        return _DESCRIPTIONS[self]


_DESCRIPTIONS = {
    Dep.INDEPENDENT: "independent",
    Dep.IDENTITY: "additive (S + f)",
    Dep.SCALAR_AFFINE: "scalar affine (a⊙S + f)",
    Dep.MATRIX_AFFINE: "matrix affine (S·A + f)",
    Dep.LOCAL: "state-local nonlinear",
    Dep.NONLINEAR: "nonlinear",
}


@dataclass(frozen=True)
class Layout:
    """A value that is ``S.permute(perm).reshape(shape)``: a pure relayout of the state."""

    perm: tuple[int, ...]
    shape: tuple[int, ...]

    @staticmethod
    def canonical(shape: Iterable[int]) -> "Layout":
        """The state itself: no permutation, its own shape."""
        shape = tuple(shape)
        return Layout(tuple(range(len(shape))), shape)

    def permuted_shape(self, base: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``base`` takes after this layout's permutation (before any reshape)."""
        return tuple(base[p] for p in self.perm)


@dataclass(frozen=True)
class StateDep:
    """The abstract value of one node with respect to one state.

    ``kind`` is how the coefficient of ``S`` acts, ignoring layout; ``layout`` is set while the
    value is a plain relayout of ``S`` (``None`` once it was sliced, reduced or broadcast);
    ``token_mixed`` says ``S`` was contracted or broadcast against stream data; ``culprit`` is the
    first node where the value became state-local or nonlinear.
    """

    kind: Dep
    layout: Layout | None = None
    token_mixed: bool = False
    culprit: torch.fx.Node | None = None
    state_shape: tuple[int, ...] = ()

    @property
    def cls(self) -> Dep:
        """The lattice class: an identity or scalar-affine value in a foreign layout is linear."""
        if self.kind in (Dep.IDENTITY, Dep.SCALAR_AFFINE):
            if self.layout is None or self.layout != Layout.canonical(self.state_shape):
                return Dep.MATRIX_AFFINE
        return self.kind


INDEPENDENT = StateDep(Dep.INDEPENDENT)


@dataclass
class NodeInfo:
    """What one body node depends on: per state its ``StateDep``, and whether it reads streams."""

    deps: dict[int, StateDep] = field(default_factory=dict)
    streams: bool = False

    @property
    def states(self) -> frozenset[int]:
        """Indices of the states this node reads."""
        return frozenset(self.deps)


@dataclass
class Dependence:
    """The result of ``analyze_dependence``: per node, per state, how the node depends on it."""

    program: TTTProgram
    nodes: dict[torch.fx.Node, NodeInfo]
    position: dict[torch.fx.Node, int]

    def of(self, node: torch.fx.Node, state: int) -> StateDep:
        """How ``node`` depends on state-in ``state`` (``INDEPENDENT`` when it does not)."""
        return self.nodes[node].deps.get(state, INDEPENDENT)

    def cls(self, node: torch.fx.Node, state: int) -> Dep:
        """The lattice class of ``node`` in state ``state``."""
        return self.of(node, state).cls

    def states_of(self, node: torch.fx.Node) -> frozenset[int]:
        """Indices of the states ``node`` depends on."""
        return self.nodes[node].states

    def reads_streams(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` is computed from chunk streams."""
        return self.nodes[node].streams

    def update(self, target: int, source: int) -> StateDep:
        """How the state-out of ``target`` depends on the state-in of ``source``."""
        return self.of(self.program.state_outputs()[target], source)


def node_shape(node) -> tuple[int, ...] | None:
    """The static shape recorded on a node by ``make_fx`` (``None`` when unknown)."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = tuple(val.shape)
        if all(type(s) is int for s in shape):
            return shape
        try:
            return tuple(int(s) for s in shape)
        except TypeError:
            return None
    return None


def _flatten_nodes(arg) -> list[torch.fx.Node]:
    if isinstance(arg, torch.fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [n for a in arg for n in _flatten_nodes(a)]
    return []


# --------------------------------------------------------------------------------------------
class _Interpreter:
    """Transfer functions per op family over ``StateDep`` values for one state."""

    def __init__(self, state: int, state_shape: tuple[int, ...], info: dict, position: dict):
        self.state = state
        self.state_shape = state_shape
        self.info = info
        self.position = position

    # -- helpers -----------------------------------------------------------------------------
    def dep(self, arg) -> StateDep:
        if isinstance(arg, torch.fx.Node):
            return self.info[arg].deps.get(self.state, INDEPENDENT)
        return INDEPENDENT

    def streams(self, arg) -> bool:
        return any(self.info[n].streams for n in _flatten_nodes(arg))

    def make(self, kind: Dep, layout=None, token_mixed=False, culprit=None) -> StateDep:
        if kind == Dep.INDEPENDENT:
            return INDEPENDENT
        if kind not in (Dep.IDENTITY, Dep.SCALAR_AFFINE):
            layout = None
        return StateDep(kind, layout, token_mixed, culprit, self.state_shape)

    def first_culprit(self, deps: Iterable[StateDep], at_least: Dep) -> torch.fx.Node | None:
        found = [d.culprit for d in deps if d.culprit is not None and d.kind >= at_least]
        return min(found, key=self.position.__getitem__) if found else None

    def nonlinear(self, node: torch.fx.Node, known: bool = True) -> StateDep:
        """A nonlinear op over its inputs: state-local when the inputs allow it, else nonlinear."""
        inputs = node.all_input_nodes
        deps = [self.dep(n) for n in inputs]
        dependent = [d for d in deps if d.kind > Dep.INDEPENDENT]
        if not dependent:
            return INDEPENDENT
        mixed = any(d.token_mixed for d in dependent)
        others_stream = any(self.info[n].streams for n, d in zip(inputs, deps)
                            if d.kind == Dep.INDEPENDENT)
        if not known or mixed or others_stream or any(d.kind == Dep.NONLINEAR for d in dependent):
            culprit = self.first_culprit(dependent, Dep.NONLINEAR) or node
            return self.make(Dep.NONLINEAR, token_mixed=mixed, culprit=culprit)
        culprit = self.first_culprit(dependent, Dep.LOCAL) or node
        return self.make(Dep.LOCAL, culprit=culprit)

    def broadcast_mixes(self, node, x: torch.fx.Node, other) -> tuple[bool, bool]:
        """(``x`` keeps its shape in ``node``, ``x`` was broadcast against stream data)."""
        same = node_shape(node) is not None and node_shape(node) == node_shape(x)
        return same, (not same) and self.streams(other)

    # -- transfer ----------------------------------------------------------------------------
    def visit(self, node: torch.fx.Node) -> StateDep:
        if node.op in ("get_attr", "output"):
            return INDEPENDENT
        if node.target is operator.getitem:
            return self.getitem(node)
        name = op_name(node)
        if name in SHAPE_ONLY:
            return INDEPENDENT
        if name in RESHAPES or name in COPIES or name in PERMUTES or name in EXPANDS \
                or name in SLICES:
            return self.relayout(node, name)
        if name == "pow" and len(node.args) > 1 and isinstance(node.args[1], (int, float)) \
                and node.args[1] in (0, 1):
            # x**1 (a gradient of x**2 writes it) is x; x**0 is a constant
            return self.relayout(node, "clone") if node.args[1] == 1 else INDEPENDENT
        if name in ADDITIVE:
            return self.additive(node, name)
        if name == "mul":
            return self.product(node)
        if name == "div":
            return self.quotient(node)
        if name == "where":
            return self.where(node)
        if name in MATMULS:
            return self.matmul(node, *MATMULS[name])
        if name in ("addcmul", "addcdiv"):
            return self.addc(node)
        if name in INDEX_ARGUMENTS and self.index_depends(node, name):
            return self.nonlinear(node)
        if name in LINEAR_MAPS or name in LINEAR_JOINS or name in LINEAR_GATHERS:
            return self.linear(node, name)
        return self.nonlinear(node, known=name in KNOWN_NONLINEAR)

    def getitem(self, node) -> StateDep:
        parent = node.args[0]
        d = self.dep(parent)
        if d.kind in (Dep.IDENTITY, Dep.SCALAR_AFFINE) \
                and isinstance(parent.meta.get("val"), (tuple, list)):
            # an element of a multi-output op (split, unbind ...) is no plain relayout
            return self.make(d.kind, None, d.token_mixed, d.culprit)
        return d

    def relayout(self, node, name) -> StateDep:
        x = node.args[0]
        d = self.dep(x)
        if d.kind == Dep.INDEPENDENT:
            return INDEPENDENT
        layout = d.layout
        out_shape, in_shape = node_shape(node), node_shape(x)
        if layout is not None:
            if name in COPIES:
                pass
            elif name in RESHAPES:
                layout = Layout(layout.perm, out_shape) if out_shape is not None else None
            elif name in EXPANDS or name in SLICES:
                layout = layout if (out_shape is not None and out_shape == in_shape) else None
            elif name in PERMUTES:
                layout = self.permute(node, name, layout)
        return self.make(d.kind, layout, d.token_mixed, d.culprit)

    def permute(self, node, name, layout: Layout) -> Layout | None:
        if layout.shape != layout.permuted_shape(self.state_shape):
            return None             # a transpose after a reshape: not tracked
        n = len(layout.perm)
        if name in ("transpose", "transpose_copy", "swapaxes"):
            d0, d1 = (int(a) % n for a in node.args[1:3])
            order = list(range(n))
            order[d0], order[d1] = order[d1], order[d0]
        elif name in ("t", "t_copy", "mT"):
            order = list(range(n))
            if n >= 2:
                order[-1], order[-2] = order[-2], order[-1]
        elif name == "movedim":
            src, dst = node.args[1], node.args[2]
            src = [int(s) % n for s in (src if isinstance(src, (list, tuple)) else [src])]
            dst = [int(s) % n for s in (dst if isinstance(dst, (list, tuple)) else [dst])]
            order = [None] * n
            for s, t in zip(src, dst):
                order[t] = s
            rest = iter(i for i in range(n) if i not in src)
            order = [o if o is not None else next(rest) for o in order]
        else:
            order = [int(p) % n for p in node.args[1]]
        perm = tuple(layout.perm[o] for o in order)
        return Layout(perm, tuple(self.state_shape[p] for p in perm))

    def additive(self, node, name) -> StateDep:
        args = list(node.args)
        alpha = node.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        x = args[0]
        y = args[1] if len(args) > 1 else None
        dx, dy = self.dep(x), self.dep(y)
        negate_y = name == "sub" or (name == "add" and alpha != 1)
        negate_x = name in ("neg", "rsub")
        if name == "rsub" and alpha != 1:
            negate_x = True
        terms = [(x, dx, negate_x), (y, dy, negate_y)]
        dependent = [(n, d, neg) for n, d, neg in terms if d.kind > Dep.INDEPENDENT]
        if not dependent:
            return INDEPENDENT
        if len(dependent) == 1:
            n, d, neg = dependent[0]
            other = y if n is x else x
            same, mixes = self.broadcast_mixes(node, n, other)
            kind = Dep.SCALAR_AFFINE if (neg and d.kind == Dep.IDENTITY) else d.kind
            return self.make(kind, d.layout if same else None, d.token_mixed or mixes, d.culprit)
        return self.join_linear(node, [d for _, d, _ in dependent], elementwise=True)

    def join_linear(self, node, deps: list[StateDep], elementwise: bool) -> StateDep:
        """Several S-dependent operands combined linearly (sum, cat, scatter ...)."""
        top = max(d.kind for d in deps)
        mixed = any(d.token_mixed for d in deps)
        if top >= Dep.LOCAL:
            culprit = self.first_culprit(deps, top)
            return self.make(top, token_mixed=mixed, culprit=culprit)
        layouts = {d.layout for d in deps}
        if elementwise and top <= Dep.SCALAR_AFFINE and len(layouts) == 1 and None not in layouts \
                and all(node_shape(node) == d.layout.shape for d in deps):
            return self.make(Dep.SCALAR_AFFINE, deps[0].layout, mixed)
        return self.make(Dep.MATRIX_AFFINE, token_mixed=mixed)

    def product(self, node) -> StateDep:
        x, y = node.args[0], node.args[1]
        dx, dy = self.dep(x), self.dep(y)
        if dx.kind > Dep.INDEPENDENT and dy.kind > Dep.INDEPENDENT:
            return self.nonlinear(node)
        if dx.kind == Dep.INDEPENDENT and dy.kind == Dep.INDEPENDENT:
            return INDEPENDENT
        n, d, other = (x, dx, y) if dx.kind > Dep.INDEPENDENT else (y, dy, x)
        return self.scaled(node, n, d, other)

    def scaled(self, node, n, d: StateDep, other) -> StateDep:
        same, mixes = self.broadcast_mixes(node, n, other)
        kind = Dep.SCALAR_AFFINE if d.kind == Dep.IDENTITY else d.kind
        return self.make(kind, d.layout if same else None, d.token_mixed or mixes, d.culprit)

    def quotient(self, node) -> StateDep:
        x, y = node.args[0], node.args[1]
        dx, dy = self.dep(x), self.dep(y)
        if dy.kind > Dep.INDEPENDENT:
            return self.nonlinear(node)
        if dx.kind == Dep.INDEPENDENT:
            return INDEPENDENT
        return self.scaled(node, x, dx, y)

    def where(self, node) -> StateDep:
        cond, a, b = node.args[0], node.args[1], node.args[2]
        if self.dep(cond).kind > Dep.INDEPENDENT:
            return self.nonlinear(node)
        deps = [self.dep(v) for v in (a, b) if self.dep(v).kind > Dep.INDEPENDENT]
        if not deps:
            return INDEPENDENT
        if len(deps) == 1:
            n = a if self.dep(a).kind > Dep.INDEPENDENT else b
            return self.scaled(node, n, deps[0], cond)
        return self.join_linear(node, deps, elementwise=True)

    def addc(self, node) -> StateDep:
        base, t1, t2 = node.args[0], node.args[1], node.args[2]
        d1, d2 = self.dep(t1), self.dep(t2)
        if d1.kind > Dep.INDEPENDENT and d2.kind > Dep.INDEPENDENT:
            term = self.nonlinear(node)
        elif op_name(node) == "addcdiv" and d2.kind > Dep.INDEPENDENT:
            term = self.nonlinear(node)
        elif d1.kind > Dep.INDEPENDENT or d2.kind > Dep.INDEPENDENT:
            n, d, other = (t1, d1, t2) if d1.kind > Dep.INDEPENDENT else (t2, d2, t1)
            term = self.scaled(node, n, d, other)
        else:
            term = INDEPENDENT
        db = self.dep(base)
        deps = [d for d in (db, term) if d.kind > Dep.INDEPENDENT]
        if not deps:
            return INDEPENDENT
        if len(deps) == 1:
            d = deps[0]
            if d is db:
                same, mixes = self.broadcast_mixes(node, base, [t1, t2])
                return self.make(d.kind, d.layout if same else None, d.token_mixed or mixes,
                                 d.culprit)
            return d
        return self.join_linear(node, deps, elementwise=True)

    def matmul(self, node, operands, additive) -> StateDep:
        args = list(node.args)
        ops = [args[i] for i in operands if i < len(args)]
        deps = [self.dep(o) for o in ops]
        dependent = [(o, d) for o, d in zip(ops, deps) if d.kind > Dep.INDEPENDENT]
        if len(dependent) > 1:
            product = self.nonlinear(node)
        elif dependent:
            o, d = dependent[0]
            other = [p for p in ops if p is not o]
            mixed = d.token_mixed or self.streams(other)
            kind = d.kind if d.kind >= Dep.LOCAL else Dep.MATRIX_AFFINE
            product = self.make(kind, token_mixed=mixed, culprit=d.culprit)
        else:
            product = INDEPENDENT
        added = [args[i] for i in additive if i < len(args) and isinstance(args[i], torch.fx.Node)]
        extra = [self.dep(a) for a in added]
        deps = [d for d in [product, *extra] if d.kind > Dep.INDEPENDENT]
        if not deps:
            return INDEPENDENT
        if len(deps) == 1 and deps[0] is product:
            return product
        if len(deps) == 1:                  # only the added term reads the state: S·β + A B
            d = deps[0]
            same, mixes = self.broadcast_mixes(node, added[extra.index(d)], ops)
            beta = node.kwargs.get("beta", 1)
            kind = Dep.SCALAR_AFFINE if (beta != 1 and d.kind == Dep.IDENTITY) else d.kind
            return self.make(kind, d.layout if same else None, d.token_mixed or mixes, d.culprit)
        return self.join_linear(node, deps, elementwise=False)

    def index_depends(self, node, name) -> bool:
        positions = INDEX_ARGUMENTS[name]
        args = list(node.args)
        return any(self.dep(n).kind > Dep.INDEPENDENT
                   for i in positions if i < len(args) for n in _flatten_nodes(args[i]))

    def linear(self, node, name) -> StateDep:
        data = node.all_input_nodes
        if name in INDEX_ARGUMENTS:
            index_nodes = {n for i in INDEX_ARGUMENTS[name] if i < len(node.args)
                           for n in _flatten_nodes(node.args[i])}
            data = [n for n in data if n not in index_nodes]
        deps = [self.dep(n) for n in data if self.dep(n).kind > Dep.INDEPENDENT]
        if not deps:
            return INDEPENDENT
        if len(deps) == 1:
            d = deps[0]
            others = [n for n in node.all_input_nodes if self.dep(n).kind == Dep.INDEPENDENT]
            mixes = name in LINEAR_JOINS and self.streams(others)
            return self.make(d.kind, None, d.token_mixed or mixes, d.culprit)
        return self.join_linear(node, deps, elementwise=False)


def analyze_dependence(program: TTTProgram) -> Dependence:
    """Run the abstract interpretation over ``program.body`` for every carried state."""
    graph = program.body.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    info: dict[torch.fx.Node, NodeInfo] = {}
    state_nodes = program.state_inputs()
    index = {n: i for i, n in enumerate(state_nodes)}
    interpreters = [_Interpreter(i, tuple(program.states[i].shape), info, position)
                    for i in range(len(state_nodes))]
    for node in graph.nodes:
        ni = NodeInfo()
        if node.op == "placeholder":
            kind = node.meta.get(KIND)
            ni.streams = kind == "stream"
            if node in index:
                i = index[node]
                ni.deps[i] = StateDep(Dep.IDENTITY, Layout.canonical(program.states[i].shape),
                                      False, None, tuple(program.states[i].shape))
            info[node] = ni
            continue
        inputs = node.all_input_nodes
        ni.streams = any(info[n].streams for n in inputs)
        involved = set().union(*(info[n].deps for n in inputs)) if inputs else set()
        info[node] = ni
        for i in sorted(involved):
            d = interpreters[i].visit(node)
            if d.kind > Dep.INDEPENDENT:
                ni.deps[i] = d
    return Dependence(program, info, position)


__all__ = ["Dep", "Layout", "StateDep", "NodeInfo", "Dependence", "analyze_dependence",
           "op_name", "node_shape"]
