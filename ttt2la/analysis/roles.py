"""Lift a loop body into the paper's roles: the final layer W, the kernel parameters Θ, momentum.

The fast weights a chunk output reads form layers: a fast weight is Θ (a kernel parameter) only
when a later fast weight reads through it — its product with the data feeds the features ``φ``
another fast weight multiplies. The last fast weight before the output is the final layer ``W``
(``o = φ(q)·W``), also when a norm or a nonlinearity follows it: such a layer is outside the
paper's theorem and is refused by the checker, never frozen as if it were Θ. States that enter
the increment through a product with stream data the way ``W0`` does in ``silu(k·W0ᵀ)`` are Θ
too; a state that decays by a scalar-affine recursion and feeds another state's update is a
momentum buffer. Stream roles (``q``, ``k``, ``v``, ``lr``, ``momentum``) are a best-effort
guess for reports.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..ir import INPUT_FREE, TTTProgram, ancestors
from .dependence import Dep, Dependence, analyze_dependence, node_shape
from .op_vocabulary import (MATMULS, MATRIX_PRODUCTS, OUTPUT_PATH_LINEAR, VIEWS, calls, is_view,
                            op_name)

#: Ops that only move or copy data: a matmul operand is "the state" through any chain of them
#: (the vocabulary's ``VIEWS``, under the name the passes use).
VIEW_OPS = VIEWS


@dataclass
class FinalProduct:
    """A product ``φ · W`` on an output path: the matmul, the state ``W`` and operand ``φ``."""

    state: int
    matmul: torch.fx.Node
    phi: torch.fx.Node


def peel_views(node):
    """Follow view/copy ops back to the value they relay out."""
    while is_view(node):
        node = node.args[0]
    return node


def matmul_operands(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The two multiplied operands of a matmul-family node, or ``None`` for other nodes."""
    if not calls(node, MATMULS):
        return None
    positions = MATMULS[op_name(node)].operands
    ops = [node.args[i] for i in positions if i < len(node.args)]
    return ops if len(ops) == 2 and all(isinstance(o, torch.fx.Node) for o in ops) else None


def state_valued(program: TTTProgram, dep: Dependence, operand) -> int | None:
    """The state an operand *is* — a relayout of its state-in or state-out, or a stream-free
    state-local map of it such as ``Norm(W)`` — else ``None``."""
    base = peel_views(operand)
    if not isinstance(base, torch.fx.Node):
        return None
    ins = program.state_inputs()
    if base in ins:
        return ins.index(base)
    outs = program.state_outputs()
    for i, o in enumerate(outs):
        if peel_views(o) is base:
            return i
    states = dep.states_of(operand)
    if len(states) == 1 and not dep.reads_streams(operand):
        (i,) = states
        if dep.of(operand, i).kind <= Dep.LOCAL:
            return i
    return None


def plus_term(program: TTTProgram, dep: Dependence, operand) -> int | None:
    """The state of an operand that is a state plus a term no state feeds (``S + u ⊙ kᵀv``,
    RWKV's bonus for the current token): a product with it is the state's product plus the
    term's, so the state is read linearly, as a final layer is; else ``None``."""
    base = peel_views(operand)
    if not isinstance(base, torch.fx.Node) or op_name(base) != "add" or len(base.args) != 2 \
            or base.kwargs:
        return None
    for x, term in (base.args, base.args[::-1]):
        if isinstance(term, torch.fx.Node) and not dep.states_of(term):
            s = state_valued(program, dep, x)
            if s is not None:
                return s
    return None


def _reads_state(program: TTTProgram, node, s: int) -> bool:
    """Whether ``node`` reads state ``s`` other than through another state's new value: data
    read through a kernel Θ stepped before it is read (update, then apply) depend on ``W`` only
    by way of Θ's own update, which does not make them a product of ``W`` with itself."""
    target = program.state_inputs()[s]
    stops = {peel_views(o) for t, o in enumerate(program.state_outputs()) if t != s}
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen or not isinstance(n, torch.fx.Node):
            continue
        seen.add(n)
        if n is target:
            return True
        if n not in stops:
            stack.extend(n.all_input_nodes)
    return False


def final_products(program: TTTProgram, dep: Dependence | None = None) -> list[FinalProduct]:
    """Products ``φ · W`` reached from the chunk outputs through linear ops only.

    The walk goes back from every chunk output through views, sums, elementwise products and both
    sides of a division (linear attention's normaliser is a memory read in the denominator) and
    stops at nonlinear ops; a matmul with a state operand and a stream-dependent other operand
    is a final product, and its other operand is the kernel feature ``φ`` (not walked into).
    """
    dep = dep or analyze_dependence(program)
    found: dict[tuple[int, torch.fx.Node], FinalProduct] = {}
    stack = [o for o in program.chunk_outputs() if isinstance(o, torch.fx.Node)]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        ops = matmul_operands(node)
        if ops is not None:
            hit = False
            for mine, other in (ops, ops[::-1]):
                s = state_valued(program, dep, mine)
                s = plus_term(program, dep, mine) if s is None else s
                if s is not None and dep.reads_streams(other) and not _reads_state(program, other, s):
                    found.setdefault((s, node), FinalProduct(s, node, other))
                    hit = True
            if not hit:
                stack.extend(ops)
            continue
        name = op_name(node)
        if name == "div":               # a normaliser's memory is read in the denominator
            stack.extend(node.all_input_nodes)
        elif name in OUTPUT_PATH_LINEAR:
            stack.extend(node.all_input_nodes)
    return list(found.values())




@dataclass
class FastWeightLayers:
    """The fast weights on the output path, by layer: ``final`` maps each last fast weight
    before the output to its product with the data; ``theta`` holds those read through."""

    final: dict[int, torch.fx.Node]
    theta: set[int]


def fast_weight_layers(program: TTTProgram, dep: Dependence | None = None) -> FastWeightLayers:
    """Walk back from the chunk outputs through any ops (not into state updates).

    A product of a state with stream data met on the way is a fast-weight layer; the walk goes
    on into its data operand, where further products are layers it reads through (Θ).
    """
    dep = dep or analyze_dependence(program)
    top: dict[int, torch.fx.Node] = {}
    inner: set[int] = set()
    stack = [(o, False) for o in program.chunk_outputs() if isinstance(o, torch.fx.Node)]
    seen = set()
    while stack:
        node, under = stack.pop()
        if (node, under) in seen or node.op != "call_function":
            continue
        seen.add((node, under))
        ops = matmul_operands(node)
        hit = False
        for mine, other in (ops, ops[::-1]) if ops is not None else ():
            s = state_valued(program, dep, mine)
            if s is not None and dep.reads_streams(other) and not _reads_state(program, other, s):
                if under:
                    inner.add(s)
                else:
                    top.setdefault(s, node)
                stack.append((other, True))
                hit = True
        if hit or state_valued(program, dep, node) is not None:
            continue
        stack.extend((a, under) for a in node.all_input_nodes)
    return FastWeightLayers({s: n for s, n in top.items() if s not in inner}, inner)


def _state_of_node(program: TTTProgram, node) -> int | None:
    ins = program.state_inputs()
    return ins.index(node) if node in ins else None


def kernel_states(program: TTTProgram, dep: Dependence, finals: list[FinalProduct]) -> set[int]:
    """States that parameterise the kernel φ: read on a φ path of the output, or multiplied with
    stream data anywhere in the body (``k·W0ᵀ`` inside the increment), other than the final
    ones."""
    final = {f.state for f in finals}
    theta: set[int] = set()
    for f in finals:
        for n in ancestors(f.phi):
            s = _state_of_node(program, n)
            if s is not None and s not in final:
                theta.add(s)
    for node in program.body.graph.nodes:
        ops = matmul_operands(node)
        if ops is None:
            continue
        for mine, other in (ops, ops[::-1]):
            s = state_valued(program, dep, mine)
            if s is None or s in final:
                continue
            if dep.reads_streams(other) and not _reads_state(program, other, s):
                theta.add(s)
    return theta


def kernel_parameters(program: TTTProgram, dep: Dependence | None = None) -> list[torch.fx.Node]:
    """Placeholders other than streams (and their source sequences) that the kernel φ reads,
    constants the code makes from numbers alone (``torch.eye(c)``, ``INPUT_FREE``) aside: the
    same tensor on every call, no weights of a kernel."""
    dep = dep or analyze_dependence(program)
    finals = final_products(program, dep)
    sources = {s.source for s in program.streams}
    invariants = program.invariant_inputs()
    params = []
    for f in finals:
        for n in ancestors(f.phi):
            if n.op != "placeholder" or n in params:
                continue
            if n in invariants and invariants.index(n) in sources:
                continue
            if n in program.stream_inputs() or INPUT_FREE in n.meta:
                continue
            params.append(n)
    return params


def assign_roles(program: TTTProgram, dep: Dependence | None = None) -> dict[str, str]:
    """Set ``StateSpec.role`` for every state (and a best-effort ``StreamSpec.role``).

    Returns ``{state name: role}``. Precedence: ``final``, then ``theta``, then ``momentum``,
    else ``other``.
    """
    dep = dep or analyze_dependence(program)
    finals = final_products(program, dep)
    layers = fast_weight_layers(program, dep)
    linear = {f.state for f in finals}
    kernels = kernel_states(program, dep, finals)
    # a gate ``(q·W1) ⊙ silu(q·W2)``: W2 reaches the output only through a nonlinearity, beside
    # a linear final layer W1 whose increment it enters through ``silu(k·W2)`` — Θ, not final
    gates = {s for s in layers.final if s not in linear and s in kernels} if linear else set()
    final = linear | (set(layers.final) - gates)
    theta = (kernels | layers.theta) - final
    n = len(program.states)
    roles = {}
    for i in range(n):
        if i in final:
            role = "final"
        elif i in theta:
            role = "theta"
        elif _is_momentum(program, dep, i):
            role = "momentum"
        else:
            role = "other"
        program.states[i].role = role
        roles[program.states[i].name] = role
    _assign_stream_roles(program, dep, finals)
    return roles


def _is_momentum(program: TTTProgram, dep: Dependence, i: int) -> bool:
    if dep.update(i, i).cls not in (Dep.IDENTITY, Dep.SCALAR_AFFINE):
        return False
    return any(dep.update(t, i).kind > Dep.INDEPENDENT for t in range(len(program.states))
               if t != i)


def _streams_in(program: TTTProgram, node) -> set[int]:
    """The indices of the streams ``node`` is computed from."""
    index = {n: i for i, n in enumerate(program.stream_inputs())}
    return {index[n] for n in ancestors(node) if n in index}


def _contracted_state_dim(dep: Dependence, matmul: torch.fx.Node, operand, state: int):
    """Which dimension of ``state`` a matmul contracts, when the operand is a plain relayout."""
    ops = matmul_operands(matmul)
    if ops is None or op_name(matmul) not in MATRIX_PRODUCTS or operand not in ops:
        return None
    layout = dep.of(operand, state).layout
    if layout is None or layout.shape != layout.permuted_shape(dep.of(operand, state).state_shape):
        return None
    return layout.perm[-1] if operand is ops[0] else layout.perm[-2]


def _assign_stream_roles(program: TTTProgram, dep: Dependence, finals) -> None:
    """Best effort, for reports: ``q`` feeds φ on the output path only; ``momentum`` feeds the
    decay of a momentum state; ``lr`` is a per-token scalar in an update; ``k`` contracts the
    same dimension of W as ``q`` (or meets Θ in a product); ``v`` the other one."""
    if not program.streams:
        return
    outs = program.state_outputs()
    update_streams = set().union(*(_streams_in(program, o) for o in outs)) if outs else set()
    roles: dict[int, str] = {}
    q_dim: dict[int, int] = {}
    for f in finals:
        for i in _streams_in(program, f.phi) - update_streams:
            roles[i] = "q"
        ops = matmul_operands(f.matmul)
        mine = ops[1] if ops[0] is f.phi else ops[0]
        d = _contracted_state_dim(dep, f.matmul, mine, f.state)
        if d is not None:
            q_dim[f.state] = d
    ins = program.state_inputs()
    momentum_states = [i for i, s in enumerate(program.states) if s.role == "momentum"]
    nodes = list(program.body.graph.nodes)
    for node in nodes:
        if node.op != "call_function" or op_name(node) != "mul":
            continue
        args = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        for m in momentum_states:
            if len(args) == 2 and any(peel_views(a) is ins[m] for a in args):
                other = next(a for a in args if peel_views(a) is not ins[m])
                for i in _streams_in(program, other):
                    roles.setdefault(i, "momentum")
    for i in update_streams:
        shape = node_shape(program.stream_inputs()[i])
        if shape and shape[-1] == 1:
            roles.setdefault(i, "lr")
    for node in nodes:
        ops = matmul_operands(node)
        if ops is None:
            continue
        for mine, other in (ops, ops[::-1]):
            s = state_valued(program, dep, mine)
            if s is None or s in dep.states_of(other):
                continue
            streams = _streams_in(program, other) & update_streams
            if program.states[s].role == "theta":
                role = "k"
            elif s in q_dim:
                d = _contracted_state_dim(dep, node, mine, s)
                role = None if d is None else ("k" if d == q_dim[s] else "v")
            else:
                role = None
            for i in streams if role else ():
                roles.setdefault(i, role)
    for f in finals:
        if f.state not in q_dim:
            continue
        ndim = len(program.states[f.state].shape)
        for node in sorted(ancestors(outs[f.state]), key=dep.position.__getitem__):
            ops = matmul_operands(node)
            if ops is None or node_shape(node) != tuple(program.states[f.state].shape) \
                    or any(f.state in dep.states_of(o) for o in ops):
                continue
            left, right = (_streams_in(program, o) - set(roles) for o in ops)
            if left and right and not (left & right):
                row_side = "k" if q_dim[f.state] == ndim - 2 else "v"
                col_side = "v" if row_side == "k" else "k"
                for i in left:
                    roles.setdefault(i, row_side)
                for i in right:
                    roles.setdefault(i, col_side)
                break
    if "k" in roles.values():
        for i in update_streams - set(roles):
            roles[i] = "v"
    for i, role in roles.items():
        program.streams[i].role = role


__all__ = ["FastWeightLayers", "FinalProduct", "VIEW_OPS", "fast_weight_layers", "assign_roles",
           "final_products", "kernel_states", "kernel_parameters", "matmul_operands", "peel_views",
           "state_valued"]
