"""Recover each state's update rule from the body graph and render it with sympy for the report.

``W1' = W1 + NS5(α·m1 + (η⊙v)ᵀ·φ(k))`` is read off the graph: normalisations become
``Norm``, Newton–Schulz iterations ``NS5``, single-stream feature maps ``φ(k)``, chunk-level
gates of a learning-rate or momentum stream ``η`` / ``α``; ops it does not know become
``f(...)`` of the symbols they read. The same pattern matchers serve the passes
(``drop_norm`` uses ``match_norm``).
"""
from __future__ import annotations

import operator

from dataclasses import dataclass

import sympy
import torch
import torch.fx

from ..ir import KIND, TTTProgram
from .dependence import node_shape
from .op_vocabulary import (CASTS, CONSTANT_FILLS, FILL_VALUE_ARGUMENTS, MATMULS, MATRIX_PRODUCTS,
                            NORM_REDUCTIONS, NORM_SCALE_CHAIN, PERMUTES, SHAPE_ONLY, SLICES,
                            SQUARE_REDUCTIONS, UNARY_FUNCTIONS, VALUE_PRESERVING, VIEWS, calls,
                            fill_value, is_view, op_name)
from .roles import peel_views

@dataclass(frozen=True)
class NormMatch:
    """``output`` computes ``Norm(input)``: ``input`` rescaled by (a function of) its own norm."""

    output: torch.fx.Node
    input: torch.fx.Node
    kind: str               # "l2" (x/‖x‖), "rms" (x·rsqrt(mean x²)), "layer" (layer norm)


@dataclass(frozen=True)
class NewtonSchulzMatch:
    """``output`` is ``steps`` Newton–Schulz iterations ``X ← aX + (bA + cA²)X`` (A = XXᵀ)
    started from ``input`` (normalised first when the body does so).

    What the graph says about the iteration, as data for the runtime: ``coefficients`` one
    ``(a, b, c)`` per step (``None`` when a step's polynomial is not ``bA + cA²``), ``eps`` the
    Frobenius normalisation's epsilon (``None`` when the start is not ``X / (‖X‖_F + eps)``) and
    ``dtype`` the dtype the input is cast to before the iteration (``None``: no cast).
    """

    output: torch.fx.Node
    input: torch.fx.Node
    steps: int
    coefficients: tuple | None = None
    eps: float | None = None
    dtype: torch.dtype | None = None


def _same_value(a, b) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node) \
        and peel_views(a) is peel_views(b)


def _squared(node) -> torch.fx.Node | None:
    """``y`` when ``node`` is ``y*y``, ``y**2`` or ``square(y)``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    name = op_name(node)
    if name == "mul" and _same_value(node.args[0], node.args[1]):
        return node.args[0]
    if name == "pow" and len(node.args) > 1 and node.args[1] == 2:
        return node.args[0]
    if name == "square":
        return node.args[0]
    return None


def _norm_sources(node, depth: int = 12) -> list[torch.fx.Node]:
    """The values whose norm ``node`` is computed from (through eps, clamps, sqrt, broadcast)."""
    found, stack, seen = [], [(node, 0)], set()
    while stack:
        n, d = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or d > depth or n.op != "call_function":
            continue
        seen.add(n)
        name = op_name(n)
        if n.target is operator.getitem:
            stack.append((n.args[0], d + 1))
        elif name in NORM_REDUCTIONS:
            found.append(n.args[0])
        elif name in SQUARE_REDUCTIONS and (y := _squared(n.args[0])) is not None:
            found.append(y)
        elif name in NORM_SCALE_CHAIN:
            stack.extend((a, d + 1) for a in n.all_input_nodes)
    return found


def _centered_base(node) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``x - mean(x)``."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and op_name(node) == "sub":
        x, m = node.args[0], node.args[1]
        if isinstance(m, torch.fx.Node) and op_name(m) == "mean" and _same_value(m.args[0], x):
            return x
    return None


def _depends_on(node, target: torch.fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        if n is target:
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def match_norm(node) -> NormMatch | None:
    """Recognise a normalisation ending at ``node``: ``x/‖x‖`` (optionally times a target norm),
    ``x·rsqrt(mean(x²)+ε)``, ``(x-μ)/σ`` or an aten layer norm."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    name = op_name(node)
    if node.target is operator.getitem and node.args[1] == 0:
        parent = node.args[0]
        if isinstance(parent, torch.fx.Node) and op_name(parent) == "native_layer_norm":
            return NormMatch(node, parent.args[0], "layer")
        return None
    if name == "div":
        x, d = node.args[0], node.args[1]
        if not isinstance(x, torch.fx.Node):
            return None
        inner = match_norm(peel_views(x))
        if inner is not None and not _depends_on(d, inner.input):
            return NormMatch(node, inner.input, inner.kind)
        base = _centered_base(peel_views(x))
        for src in _norm_sources(d):
            if _same_value(src, x):
                return NormMatch(node, x, "l2")
            if base is not None and (_same_value(src, base) or _centered_base(peel_views(src))):
                return NormMatch(node, base, "layer")
        return None
    if name == "mul":
        a, b = node.args[0], node.args[1]
        for m, t in ((a, b), (b, a)):
            if not isinstance(m, torch.fx.Node):
                continue
            inner = match_norm(peel_views(m))
            if inner is not None and not _depends_on(t, inner.input):
                return NormMatch(node, inner.input, inner.kind)
        for x, r in ((a, b), (b, a)):
            if not isinstance(x, torch.fx.Node) or not isinstance(r, torch.fx.Node):
                continue
            if not _has_reciprocal_root(r):
                continue
            for src in _norm_sources(r):
                if _same_value(src, x):
                    return NormMatch(node, x, "rms")
                base = _centered_base(peel_views(x))
                if base is not None and _same_value(src, base):
                    return NormMatch(node, base, "layer")
    return None


def _has_reciprocal_root(node, depth: int = 6) -> bool:
    stack = [(node, 0)]
    while stack:
        n, d = stack.pop()
        if not isinstance(n, torch.fx.Node) or d > depth or n.op != "call_function":
            continue
        name = op_name(n)
        if name in ("rsqrt", "reciprocal"):
            return True
        if name == "pow" and isinstance(n.args[1], (int, float)) and n.args[1] < 0:
            return True
        if name in ("expand", "view", "_unsafe_view", "unsqueeze", "_to_copy", "clone", "mul"):
            stack.extend((a, d + 1) for a in n.all_input_nodes)
    return False


def _only_through(node, source: torch.fx.Node) -> bool:
    """Every path from ``node`` back to a graph input passes through ``source``."""
    stack, seen, reached = [node], set(), False
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n is source:
            reached = True
            continue
        if n.op == "placeholder":
            return False
        stack.extend(n.all_input_nodes)
    return reached


def _constant_factor(node) -> tuple[torch.fx.Node, float] | None:
    """``(x, k)`` when ``node`` is ``k·x`` or ``x·k`` for a Python number ``k``."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and op_name(node) == "mul":
        a, b = node.args[0], node.args[1]
        if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, torch.fx.Node):
            return a, float(b)
        if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, torch.fx.Node):
            return b, float(a)
    return None


def _matmul_operands(node) -> tuple | None:
    node = peel_views(node)
    if calls(node, MATRIX_PRODUCTS):
        return node.args[0], node.args[1]
    return None


def _is_gram(node, x: torch.fx.Node) -> bool:
    """``node`` is ``X Xᵀ`` (or ``Xᵀ X``) of ``x``: a product of two views of ``x``."""
    ops = _matmul_operands(node)
    return ops is not None and all(peel_views(o) is x for o in ops)


def _scaled_gram(node, x: torch.fx.Node) -> float | None:
    """``k`` when ``node`` is ``k·(X Xᵀ)`` written as a product of two views of ``x``, either
    scaled by a constant (``0.5 * X @ X.mT`` is ``(0.5 X) Xᵀ``)."""
    ops = _matmul_operands(node)
    if ops is None:
        return None
    k = 1.0
    for o in ops:
        scaled = _constant_factor(peel_views(o))
        if scaled is not None:
            o, k = scaled[0], k * scaled[1]
        if peel_views(o) is not x:
            return None
    return k


def _poly_coefficients(poly, x: torch.fx.Node) -> tuple[float, float] | None:
    """``(b, c)`` when ``poly`` is ``b·A + c·A²`` with ``A`` the Gram matrix of ``x`` (a bare
    ``A`` or ``b·A``: ``c = 0``)."""
    poly = peel_views(poly)
    scaled = _constant_factor(poly)
    b = _scaled_gram(poly, x) if scaled is None else _scaled_gram(scaled[0], x)
    if b is not None:
        return b * (1.0 if scaled is None else scaled[1]), 0.0
    if not isinstance(poly, torch.fx.Node) or op_name(poly) != "add" \
            or poly.kwargs.get("alpha", 1) != 1:
        return None
    b = c = None
    for term in poly.args[:2]:
        term = peel_views(term)
        scaled = _constant_factor(term)
        if scaled is not None and _is_gram(scaled[0], x):          # b·A
            b = scaled[1] if b is None else None
            continue
        if scaled is not None:                                      # c·(A A)
            ops = _matmul_operands(scaled[0])
            if ops is not None and all(_is_gram(o, x) for o in ops):
                c = scaled[1] if c is None else None
                continue
        ops = _matmul_operands(term)                                # (c·A) A or A (c·A)
        if ops is not None:
            found = None
            for s_op, g_op in (ops, ops[::-1]):
                f = _constant_factor(peel_views(s_op))
                if f is not None and _is_gram(f[0], x) and _is_gram(g_op, x):
                    found = f[1]
            if found is not None:
                c = found if c is None else None
                continue
        return None
    return (b, c) if b is not None and c is not None else None


def _newton_schulz_step(node) -> tuple[torch.fx.Node, tuple | None] | None:
    """``(X, (a, b, c))`` when ``node`` is ``a·X ± k·(B·X)`` (or ``X·B``), ``B`` a polynomial of
    ``X`` alone (the classic cubic step ``1.5 X − 0.5 X Xᵀ X`` too); the triple is ``None`` when
    ``B`` is not ``bA + cA²``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" \
            or op_name(node) not in ("add", "sub") or len(node.args) < 2:
        return None
    u, w = node.args[0], node.args[1]
    sign = (-1.0 if op_name(node) == "sub" else 1.0) * node.kwargs.get("alpha", 1)
    for lin, poly, lin_sign, poly_sign in ((u, w, 1.0, sign), (w, u, sign, 1.0)):
        scaled = _constant_factor(lin)
        if scaled is None or not isinstance(poly, torch.fx.Node):
            continue
        x, a = peel_views(scaled[0]), lin_sign * scaled[1]
        outer = _constant_factor(peel_views(poly))
        k = poly_sign * (1.0 if outer is None else outer[1])
        mm = peel_views(poly if outer is None else outer[0])
        if not calls(mm, MATMULS):
            continue
        positions = MATMULS[op_name(mm)].operands
        ops = [mm.args[i] for i in positions]
        for mine, other in (ops, ops[::-1]):
            if peel_views(mine) is x and _only_through(other, x):
                bc = _poly_coefficients(other, x)
                return x, None if bc is None else (a, k * bc[0], k * bc[1])
    return None


def _frobenius_eps(start) -> tuple[torch.fx.Node, float] | None:
    """``(x, eps)`` when ``start`` is ``x / (‖x‖_F + eps)`` (``eps`` 0 without the addition),
    the norm taken over the last two dimensions."""
    if not isinstance(start, torch.fx.Node) or op_name(start) != "div":
        return None
    x, den = start.args[0], start.args[1]
    if not isinstance(x, torch.fx.Node) or not isinstance(den, torch.fx.Node):
        return None
    eps = 0.0
    if op_name(den) == "add" and isinstance(den.args[1], (int, float)) \
            and den.kwargs.get("alpha", 1) == 1:
        den, eps = den.args[0], float(den.args[1])
    den = peel_views(den)
    if not isinstance(den, torch.fx.Node) or op_name(den) != "linalg_vector_norm" \
            or peel_views(den.args[0]) is not peel_views(x):
        return None
    ord_ = den.args[1] if len(den.args) > 1 else den.kwargs.get("ord", 2)
    dims = den.args[2] if len(den.args) > 2 else den.kwargs.get("dim")
    shape, normed = node_shape(x) or (), node_shape(den.args[0]) or ()
    rank = len(shape)
    # the norm over the last two dimensions, or over the last of ``x.flatten(-2)``
    flattened = len(normed) == rank - 1 and rank >= 2 and \
        tuple(normed) == (*shape[:-2], shape[-2] * shape[-1])
    want = [rank - 2] if flattened else [rank - 2, rank - 1]
    if ord_ != 2 or dims is None or rank < 2 \
            or sorted(d % len(normed or shape) for d in dims) != want:
        return None
    return x, eps


def _cast_before(node) -> torch.dtype | None:
    """The dtype the value reaching ``node`` through views was last cast to, if any."""
    while is_view(node):
        dtype = node.kwargs.get("dtype")
        if op_name(node) in CASTS and isinstance(dtype, torch.dtype):
            return dtype
        node = node.args[0]
    return None


def match_newton_schulz(node) -> NewtonSchulzMatch | None:
    """Recognise Newton–Schulz iterations (Muon's orthogonalisation) ending at ``node``, with
    the schedule, epsilon and iteration dtype the graph uses."""
    x = peel_views(node)
    steps, triples = 0, []
    while (step := _newton_schulz_step(x)) is not None:
        steps += 1
        x, triple = step
        triples.append(triple)
    if steps == 0:
        return None
    start = peel_views(x)
    norm = match_norm(start)
    coefficients = None if None in triples else tuple(reversed(triples))
    frob = _frobenius_eps(start)
    eps = frob[1] if frob is not None else None
    dtype = _cast_before(frob[0]) if frob is not None else None
    return NewtonSchulzMatch(node, norm.input if norm is not None else start, steps,
                             coefficients, eps, dtype)


def _float_cast(node) -> bool:
    dtype = node.kwargs.get("dtype")
    return dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)


def constant_value(node) -> float | None:
    """The number every element of ``node`` equals whatever the data, or ``None``.

    Folds constant expressions exactly from the graph, never by evaluating data: fills
    (``full``, ``ones_like`` ...), views and float casts of constants, ``+ - * /`` of constants,
    and a product with an exact zero (``lr * 0.0 + 1.0`` is 1.0 for finite ``lr``).
    """
    if isinstance(node, bool):
        return None
    if isinstance(node, (int, float)):
        return float(node)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    name, args = op_name(node), node.args
    if name in CONSTANT_FILLS or name in FILL_VALUE_ARGUMENTS:
        return fill_value(node)
    if name in VALUE_PRESERVING or (name in CASTS and _float_cast(node)):
        return constant_value(args[0])
    if name == "neg":
        a = constant_value(args[0])
        return None if a is None else -a
    if name not in ("mul", "add", "sub", "rsub", "div") or len(args) < 2:
        return None
    a, b = constant_value(args[0]), constant_value(args[1])
    if name == "mul":
        if a == 0.0 or b == 0.0:
            return 0.0
        return None if a is None or b is None else a * b
    if a is None or b is None:
        return None
    alpha = node.kwargs.get("alpha", 1)
    if name == "add":
        return a + alpha * b
    if name == "sub":
        return a - alpha * b
    if name == "rsub":
        return b - alpha * a
    return a / b if b != 0.0 else None


@dataclass(frozen=True)
class MomentumMatch:
    """``output`` is the momentum update ``M' = α·M + sign·G`` of the state read at ``state``:
    ``coefficient`` is α (a node or a number), ``increment`` is G and ``sign`` a constant (±1
    for ``β·M - g`` written as a descent step, ``1 − w`` or ``w`` for a ``lerp`` with a constant
    weight); neither α nor G reads ``state``."""

    output: torch.fx.Node
    state: torch.fx.Node
    coefficient: torch.fx.Node | float
    increment: torch.fx.Node
    sign: float = 1.0


def _decay_coefficient(decayed, state: torch.fx.Node):
    """α when ``decayed`` is ``α·M`` (either order) of the state-in ``state``, else ``None``;
    constant factors in a row fold into one (``m = m * 1.0; m.mul_(0.9)``)."""
    if not isinstance(decayed, torch.fx.Node) or op_name(decayed) != "mul":
        return None
    p, q = decayed.args[0], decayed.args[1]
    for m, alpha in ((p, q), (q, p)):
        if _depends_on(alpha, state) or not (isinstance(alpha, torch.fx.Node) or (
                isinstance(alpha, (int, float)) and not isinstance(alpha, bool))):
            continue
        if peel_views(m) is state:
            return alpha
        inner = _decay_coefficient(peel_views(m), state)
        if isinstance(inner, (int, float)) and isinstance(alpha, (int, float)):
            return inner * alpha
    return None


def _lerp_momentum(output, state: torch.fx.Node) -> MomentumMatch | None:
    """``torch.lerp`` with a constant weight ``w`` between the state and an increment, as the
    trace decomposes it (``start + w·(end − start)``): ``lerp(G, M, w) = w·M + (1 − w)·G`` and
    ``lerp(M, G, w) = (1 − w)·M + w·G``."""
    if not isinstance(output, torch.fx.Node) or op_name(output) != "add" \
            or output.kwargs.get("alpha", 1) != 1:
        return None
    for start, scaled in (output.args[:2], output.args[1::-1]):
        found = _constant_factor(scaled)
        if found is None or op_name(found[0]) != "sub" or found[0].args[1] is not start:
            continue
        end, w = found[0].args[0], found[1]
        for m, g, alpha, scale in ((end, start, w, 1.0 - w), (start, end, 1.0 - w, w)):
            if peel_views(m) is state and isinstance(g, torch.fx.Node) \
                    and not _depends_on(g, state):
                return MomentumMatch(output, state, float(alpha), g, float(scale))
    return None


def match_momentum(output, state: torch.fx.Node) -> MomentumMatch | None:
    """Recognise ``M' = α·M ± G`` (either operand order of a sum) ending at ``output`` for the
    state-in node ``state``, or a ``lerp`` between them with a constant weight; α and G must not
    depend on ``state``."""
    lerp = _lerp_momentum(output, state)
    if lerp is not None:
        return lerp
    if not isinstance(output, torch.fx.Node) or output.op != "call_function" \
            or op_name(output) not in ("add", "sub") or output.kwargs.get("alpha", 1) != 1:
        return None
    u, w = output.args[0], output.args[1]
    pairs = ((u, w, 1.0), (w, u, 1.0)) if op_name(output) == "add" else ((u, w, -1.0),)
    for decayed, increment, sign in pairs:
        if not isinstance(increment, torch.fx.Node) or _depends_on(increment, state):
            continue
        alpha = _decay_coefficient(decayed, state)
        if alpha is not None:
            return MomentumMatch(output, state, alpha, increment, sign)
    return None


# --------------------------------------------------------------------------------------------
# sympy rendering


class Transpose(sympy.Function):
    """``xᵀ`` for a noncommutative (matrix) symbol expression."""

    nargs = 1
    is_commutative = False

    @classmethod
    def eval(cls, x):
        """``(xᵀ)ᵀ = x``; a commutative (scalar) expression is its own transpose."""
        if isinstance(x, Transpose):
            return x.args[0]
        if x.is_commutative:
            return x
        return None

    def _sympystr(self, printer):
        arg = self.args[0]
        inner = printer._print(arg)
        bare = arg.is_Atom or (isinstance(arg, sympy.Function) and not isinstance(arg, Hadamard))
        return (inner if bare else f"({inner})") + "ᵀ"


class Hadamard(sympy.Function):
    """The elementwise product ``a⊙b`` of two matrix expressions."""

    is_commutative = False

    def _sympystr(self, printer):
        parts = []
        for a in self.args:
            s = printer._print(a)
            parts.append(f"({s})" if isinstance(a, (sympy.Add, sympy.Mul)) else s)
        return "⊙".join(parts)


class _Printer(sympy.printing.str.StrPrinter):
    def _print_Mul(self, expr):
        c, nc = expr.args_cnc()
        sign = ""
        if c and c[0].is_Number and c[0] < 0:
            c[0] = -c[0]
            sign = "-"
        factors = [f for f in c if f != 1] + nc
        parts = []
        for f in factors:
            s = self._print(f)
            parts.append(f"({s})" if isinstance(f, (sympy.Add, sympy.Mul, Hadamard)) else s)
        return sign + ("·".join(parts) if parts else "1")

    def _print_Pow(self, expr):
        return super()._print_Pow(expr).replace("**", "^")

    def _print_Float(self, expr):
        return f"{float(expr):.4g}"


def render(expr) -> str:
    """A sympy expression as a report string (``·`` for products, ``ᵀ``, ``⊙``)."""
    return _Printer().doprint(expr)


_MAX_OPS = 40


class _Renderer:
    """Turn body nodes into sympy expressions, memoised, with the pattern collapses above."""

    def __init__(self, program: TTTProgram):
        self.program = program
        self.memo: dict[torch.fx.Node, sympy.Expr] = {}
        self.streams_of: dict[torch.fx.Node, frozenset] = {}
        self.foreign_states: dict[torch.fx.Node, bool] = {}
        self.nonlinear_in: dict[torch.fx.Node, bool] = {}
        self.symbols: dict[torch.fx.Node, sympy.Expr] = {}
        streams = program.stream_inputs()
        for i, n in enumerate(program.state_inputs()):
            self.symbols[n] = sympy.Symbol(program.states[i].name, commutative=False)
        for i, n in enumerate(streams):
            role = program.streams[i].role if i < len(program.streams) else ""
            if role == "lr":
                self.symbols[n] = sympy.Symbol("η", commutative=False)
            elif role == "momentum":
                self.symbols[n] = sympy.Symbol("α")
            else:
                self.symbols[n] = sympy.Symbol(program.streams[i].name if i < len(program.streams)
                                               else n.name, commutative=False)
        for i, n in enumerate(program.invariant_inputs()):
            name = program.invariants[i].name if i < len(program.invariants) else n.name
            shape = node_shape(n)
            scalar = shape is not None and all(s == 1 for s in shape[1:])
            self.symbols[n] = sympy.Symbol(name, commutative=scalar)
        self.stream_role = {n: (program.streams[i].role if i < len(program.streams) else "")
                            for i, n in enumerate(streams)}
        self.non_kernel_states = {n for i, n in enumerate(program.state_inputs())
                                  if program.states[i].role != "theta"}
        self._index_graph()

    def _index_graph(self):
        for node in self.program.body.graph.nodes:
            if node.op == "placeholder":
                is_stream = node.meta.get(KIND) == "stream"
                self.streams_of[node] = frozenset([node]) if is_stream else frozenset()
                self.nonlinear_in[node] = False
                self.foreign_states[node] = node in self.non_kernel_states
                continue
            inputs = node.all_input_nodes
            self.foreign_states[node] = any(self.foreign_states[n] for n in inputs)
            self.streams_of[node] = frozenset().union(*(self.streams_of[n] for n in inputs)) \
                if inputs else frozenset()
            name = op_name(node) if node.op == "call_function" else ""
            own = name in MATMULS or name in UNARY_FUNCTIONS or name in (
                "linalg_vector_norm", "mean", "sum", "pow", "silu_backward", "sigmoid_backward")
            self.nonlinear_in[node] = own or any(self.nonlinear_in[n] for n in inputs)

    def arg(self, a):
        if isinstance(a, torch.fx.Node):
            return self.expr(a)
        if isinstance(a, bool):
            return sympy.Integer(int(a))
        if isinstance(a, (int, float)):
            return sympy.nsimplify(a) if float(a).is_integer() else sympy.Float(a)
        return sympy.Symbol(str(a))

    def expr(self, node: torch.fx.Node) -> sympy.Expr:
        if node not in self.memo:
            e = self._expr(node)
            if sympy.count_ops(e) > _MAX_OPS:
                e = self.generic("f", [e])
            self.memo[node] = e
        return self.memo[node]

    def generic(self, name: str, exprs) -> sympy.Expr:
        free = set().union(*(sympy.sympify(e).free_symbols for e in exprs)) if exprs else set()
        syms = sorted(free, key=lambda s: s.name)
        fn = sympy.Function(name, commutative=all(s.is_commutative for s in syms))
        return fn(*syms) if syms else sympy.Symbol(name)

    def _stream_feature(self, node) -> sympy.Expr | None:
        streams = self.streams_of.get(node, frozenset())
        if len(streams) != 1 or not self.nonlinear_in.get(node, False) \
                or self.foreign_states.get(node, True):
            return None
        (s,) = streams
        role = self.stream_role.get(s, "")
        if role == "lr":
            return sympy.Symbol("η", commutative=False)
        if role == "momentum":
            return sympy.Symbol("α")
        phi = sympy.Function("φ", commutative=False)
        return phi(self.symbols[s])

    def _constant(self, node: torch.fx.Node) -> sympy.Expr:
        """A shape-only value: the number it is filled with, else a constant ``c``."""
        value = fill_value(node)
        return sympy.Symbol("c") if value is None else self.arg(value)

    def _expr(self, node: torch.fx.Node) -> sympy.Expr:
        if node in self.symbols:
            return self.symbols[node]
        if node.op == "get_attr":
            return sympy.Symbol(str(node.target), commutative=False)
        if node.op != "call_function":
            return self.generic("f", [self.expr(n) for n in node.all_input_nodes])
        name = op_name(node)
        args = node.args
        if node.target is operator.getitem:
            return self.expr(args[0])
        if name in PERMUTES:
            return Transpose(self.expr(args[0]))
        if name in VIEWS or name in SLICES or name == "select":
            return self.expr(args[0])
        if name in SHAPE_ONLY:
            return self._constant(node)
        if name == "pow" and len(args) > 1 and isinstance(args[1], (int, float)) \
                and args[1] in (0, 1):
            return self.expr(args[0]) if args[1] == 1 else sympy.Integer(1)
        feature = self._stream_feature(node)
        if feature is not None:
            return feature
        ns = match_newton_schulz(node)
        if ns is not None and peel_views(node) is peel_views(ns.output):
            fn = sympy.Function(f"NS{ns.steps}", commutative=False)
            return fn(self.expr(ns.input))
        norm = match_norm(node)
        if norm is not None:
            return sympy.Function("Norm", commutative=False)(self.expr(norm.input))
        if name == "add":
            alpha = node.kwargs.get("alpha", 1)
            return self.arg(args[0]) + self.arg(alpha) * self.arg(args[1])
        if name == "sub":
            alpha = node.kwargs.get("alpha", 1)
            return self.arg(args[0]) - self.arg(alpha) * self.arg(args[1])
        if name == "rsub":
            return self.arg(args[1]) - self.arg(args[0])
        if name == "neg":
            return -self.arg(args[0])
        if name == "mul":
            a, b = self.arg(args[0]), self.arg(args[1])
            if a.is_commutative or b.is_commutative:
                return a * b
            return Hadamard(a, b)
        if name == "div":
            a, b = self.arg(args[0]), self.arg(args[1])
            if b.is_commutative:
                return a / b
            return self.generic("f", [a, b])
        if name in MATMULS:
            operands, additive = MATMULS[name]
            ops = [self.arg(args[i]) for i in operands if i < len(args)]
            if name == "linear":
                ops = [ops[0], Transpose(ops[1])]
            product = ops[0] * ops[1]
            for i in additive:
                if i < len(args) and args[i] is not None:
                    product = self.arg(args[i]) + product
            return product
        if name in UNARY_FUNCTIONS and args and isinstance(args[0], torch.fx.Node):
            fn = sympy.Function(name.lstrip("_"), commutative=False)
            return fn(self.expr(args[0]))
        if name in ("mean", "sum") and isinstance(args[0], torch.fx.Node):
            fn = sympy.Function(name, commutative=self.expr(args[0]).is_commutative)
            return fn(self.expr(args[0]))
        return self.generic("f", [self.expr(n) for n in node.all_input_nodes])


def update_rules(program: TTTProgram) -> dict[str, str]:
    """``{state name: "W' = W + φ(k)ᵀ·v"}`` for every carried state of ``program``."""
    renderer = _Renderer(program)
    rules = {}
    ins = program.state_inputs()
    for i, out in enumerate(program.state_outputs()):
        name = program.states[i].name
        try:
            rhs = renderer.expr(out) if isinstance(out, torch.fx.Node) else renderer.arg(out)
            text = render(rhs)
        except Exception as exc:  # a report must never fail on an exotic graph
            text = f"f(...)  [not rendered: {type(exc).__name__}]"
        if out is ins[i]:
            text = name
        rules[name] = f"{name}' = {text}"
    return rules


def update_rule(program: TTTProgram, state: int) -> str:
    """The rendered update rule of one state (see ``update_rules``)."""
    return update_rules(program)[program.states[state].name]


__all__ = ["NormMatch", "NewtonSchulzMatch", "MomentumMatch", "match_norm", "match_newton_schulz",
           "match_momentum", "constant_value",
           "update_rules", "update_rule", "render", "Transpose", "Hadamard"]
