"""A state's update read as affine in the state: ``S' = a·S + Σ_i c_i·t_i``.

People write the same momentum or decay many ways: ``β·m + g``, ``m·β + (1 − β)·g``,
``torch.lerp(m, g, β)`` (traced as ``m + β·(g − m)``), ``γ·W + Δ``, ``W + η·NS(M)``. ``affine_in``
reads any of them off the traced graph as one coefficient ``a`` and the state-free terms ``t_i``,
each coefficient a sum of monomials ``c · Π f`` over constants ``c`` and *factors* ``f``:
state-independent values holding one number per matrix (``[..., 1, 1]``), so that ``a·S`` is a
scalar per matrix, which is what the runtime's per-chunk coefficients take — or, where the
caller asks (``factor=is_vector_factor``), one number per row or column, the token-causal op's
decay per key channel. Anything else that reads the state (a product of two state-dependent
values) is not affine in this sense and gives ``None``; so does a constant added to the state,
which no runtime op takes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

aten = torch.ops.aten

#: ``c · Π factors``: a constant and the factor nodes it multiplies (sorted by name).
Monomial = tuple[float, tuple[torch.fx.Node, ...]]
#: A sum of monomials, each distinct product once, none with a zero constant.
Polynomial = tuple[Monomial, ...]

ONE: Polynomial = ((1.0, ()),)


@dataclass(frozen=True)
class Affine:
    """``coefficient · S + Σ scale · term``: the terms are state-free nodes."""

    coefficient: Polynomial
    terms: tuple[tuple[Polynomial, torch.fx.Node], ...]

    def single_term(self, state_dep: set, strip) -> tuple[Polynomial, torch.fx.Node] | None:
        """``(scale, term)`` when the state-free part is one term, its own factors (constants,
        per-matrix values: ``η·NS(M)``) moved into the scale."""
        if len(self.terms) != 1:
            return None
        scale, term = self.terms[0]
        while True:
            n = strip(term)
            if n.target is aten.neg.default:
                scale, term = times(scale, as_polynomial(-1.0)), n.args[0]
                continue
            if n.target is aten.div.Tensor and _constant(n.args[1]) and n.args[1] != 0:
                scale, term = times(scale, as_polynomial(1.0 / n.args[1])), n.args[0]
                continue
            if n.target is aten.mul.Tensor:
                x, f = next(((x, f) for x, f in (n.args, n.args[::-1])
                             if isinstance(x, torch.fx.Node) and is_factor(f, state_dep)
                             and not is_factor(x, state_dep)), (None, None))
                if x is not None:
                    scale, term = times(scale, as_polynomial(f)), x
                    continue
            return scale, term


def _normal(monomials) -> Polynomial:
    """Like monomials merged, zero constants dropped."""
    merged: dict[tuple, float] = {}
    for c, factors in monomials:
        key = tuple(sorted(factors, key=lambda n: n.name))
        merged[key] = merged.get(key, 0.0) + c
    return tuple((c, f) for f, c in merged.items() if c != 0.0)


def times(p: Polynomial, q: Polynomial) -> Polynomial:
    """The product of two polynomials."""
    return _normal((a * b, fa + fb) for a, fa in p for b, fb in q)


def plus(p: Polynomial, q: Polynomial) -> Polynomial:
    return _normal((*p, *q))


def _scaled(form: Affine, s: Polynomial) -> Affine:
    return Affine(times(form.coefficient, s), tuple((times(p, s), t) for p, t in form.terms))


def _sum(x: Affine, y: Affine) -> Affine:
    terms: dict[torch.fx.Node, Polynomial] = {}
    for p, t in (*x.terms, *y.terms):
        terms[t] = plus(terms.get(t, ()), p)
    return Affine(plus(x.coefficient, y.coefficient),
                  tuple((p, t) for t, p in terms.items() if p))


def _constant(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_factor(x, state_dep: set) -> bool:
    """A constant, or a state-free node holding one number per matrix (``[..., 1, 1]``, a
    scalar, a ``[1]``)."""
    return factor_shape(x, state_dep) == (1, 1)


def is_vector_factor(x, state_dep: set) -> bool:
    """``is_factor``, or a state-free node holding one number per row or per column of each
    matrix (``[..., d, 1]`` or ``[..., 1, d]``): a decay per key channel (GLA's gate)."""
    shape = factor_shape(x, state_dep)
    return shape is not None and 1 in shape


def factor_shape(x, state_dep: set) -> tuple | None:
    """The last two sizes of a state-free value (``(1, 1)`` for a constant), else ``None``."""
    if _constant(x):
        return (1, 1)
    if not isinstance(x, torch.fx.Node) or x in state_dep or "val" not in x.meta:
        return None
    shape = tuple(x.meta["val"].shape)
    return ((1, 1) + shape)[-2:]


def vector_axis(p: Polynomial) -> int | bool | None:
    """The matrix axis (-2: rows, -1: columns) along which ``p``'s factors vary (``is_vector_factor``),
    ``None`` when each holds one number per matrix, ``False`` when they vary along both."""
    axes = {-2 if shape[0] > 1 else -1 for _, fs in p for f in fs
            if (shape := factor_shape(f, set())) != (1, 1)}
    return None if not axes else (axes.pop() if len(axes) == 1 else False)


def as_polynomial(x) -> Polynomial:
    """A factor (``is_factor``) as a polynomial."""
    return ((float(x), ()),) if not isinstance(x, torch.fx.Node) else ((1.0, (x,)),)


def affine_in(node, state: torch.fx.Node, reads: set, state_dep: set, strip,
              factor=is_factor) -> Affine | None:
    """``node`` as ``a·state + Σ c_i·t_i``, or ``None``. ``reads`` holds the nodes computed from
    ``state`` (what must be taken apart), ``state_dep`` those computed from any live state (what
    no factor may be); ``strip`` peels relayouts that keep a value's elements where they are;
    ``factor`` says what may multiply (``is_factor``, or ``is_vector_factor``)."""
    if not isinstance(node, torch.fx.Node):
        return None
    if strip(node) is state:
        return Affine(ONE, ())
    if node not in reads:
        return Affine((), ((ONE, node),))
    n = strip(node)
    args = n.args
    recurse = lambda x: affine_in(x, state, reads, state_dep, strip, factor)  # noqa: E731
    if n.target in (aten.add.Tensor, aten.sub.Tensor) and len(args) == 2:
        x, y = recurse(args[0]), recurse(args[1])
        alpha = n.kwargs.get("alpha", 1)
        if x is None or y is None or not _constant(alpha):
            return None
        sign = 1.0 if n.target is aten.add.Tensor else -1.0
        return _sum(x, _scaled(y, as_polynomial(sign * float(alpha))))
    if n.target is aten.neg.default:
        x = recurse(args[0])
        return None if x is None else _scaled(x, as_polynomial(-1.0))
    if n.target is aten.mul.Tensor and len(args) == 2:
        for x, f in (args, args[::-1]):
            if isinstance(x, torch.fx.Node) and x in reads and factor(f, state_dep):
                form = recurse(x)
                return None if form is None else _scaled(form, as_polynomial(f))
        return None
    if n.target is aten.div.Tensor and len(args) == 2 and _constant(args[1]) and args[1] != 0:
        x = recurse(args[0])
        return None if x is None else _scaled(x, as_polynomial(1.0 / float(args[1])))
    return None


def factors_of(*polynomials: Polynomial) -> list[torch.fx.Node]:
    """Every factor node the polynomials multiply, each once, in a stable order."""
    return list(dict.fromkeys(f for p in polynomials for _, fs in p for f in fs))


def per_matrix(v: torch.Tensor, batch: tuple, matrix: tuple = (1, 1)) -> torch.Tensor:
    """Per-chunk values ``[N, ...]`` holding one number per matrix, as ``[N, *batch, 1, 1]``: the
    value's own axes right-aligned against the state's, as the code broadcast them (a rate per
    head ``[H, 1, 1]`` beside ``[B, H, d, d]`` states); ``matrix`` the trailing sizes of values
    per row (``(d, 1)``) or per column (``(1, d)``), or ``(1,)`` beside a state of vectors."""
    pad = len(batch) + 1 + len(matrix) - v.dim()
    return v.reshape(v.shape[0], *([1] * pad), *v.shape[1:]).expand(v.shape[0], *batch, *matrix)


def evaluate(p: Polynomial, values: dict, like: torch.Tensor, batch: tuple,
             matrix: tuple = (1, 1)) -> torch.Tensor:
    """``p`` per chunk, ``[N, *batch, *matrix]``, from the factor ``values`` (by key, each
    ``[N, ...]`` as computed chunk by chunk, broadcast by ``per_matrix``), in ``like``'s dtype
    and device; ``N`` is ``like``'s first axis."""
    total = like.new_zeros(())
    for c, fs in p:
        term = like.new_full((), c)
        for f in fs:
            term = term * per_matrix(values[f], batch, matrix)
        total = total + term
    return total.to(like.dtype).expand(like.shape[0], *batch, *matrix)


__all__ = ["Affine", "Monomial", "Polynomial", "ONE", "affine_in", "as_polynomial",
           "evaluate", "factor_shape", "factors_of", "is_factor", "is_vector_factor", "per_matrix",
           "plus", "times", "vector_axis"]
