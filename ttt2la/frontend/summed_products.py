"""Products summed over an axis, read as the matrix products they are.

``(q[..., :, None] * S).sum(-2)`` is ``q S`` and ``(S * k[..., None]).sum(-2)`` is ``k S``:
flash-linear-attention's reference loops and many hand-written recurrences read (and correct) a
state by broadcasting a vector against it and summing. Traced, that is a ``mul`` and a ``sum``,
which the analysis does not take for a product: the state's read is not found, its role is not
``final``, and the loop keeps the generic plan. Inside a loop body, every product of two
different tensors summed over axes both have, beside an axis only one of them has (the
broadcast that makes it a product of matrices, not a dot), is rewritten as the batched matmul
it computes, between relayouts. Values agree up to the rounding of the summation order.

The rewrite is for reading: a loop that lifts onto a runtime op never runs these products. A
loop that keeps the generic plan runs its body token by token, where a ``bmm`` of one row costs
more than the product and sum it replaced (twice the training step of a gated linear attention
on a CPU), so every rewritten product is tagged (``ir.SUMMED_PRODUCT``) and the generic plan
is built on the code's own ops (``lowering/written_products.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg

from ..ir import PRODUCT_CHAIN, PRODUCT_OPERAND, SRC, SUMMED_PRODUCT, lazy_graph_modules
from .capture import FRAMES
from .loops import caller_depth, loops_of

aten = torch.ops.aten


@dataclass(frozen=True)
class SummedProduct:
    """``sum(a * b, summed)`` as one batched matmul. Axes are those of the broadcast product
    (rank ``rank``): ``batch`` both operands have and are kept, ``a_own`` and ``b_own`` only one
    has (the other broadcasts along them), ``summed`` both have and are summed. ``a`` is laid
    out ``[batch, a_own, summed]``, ``b`` ``[batch, summed, b_own]``, one ``bmm`` multiplies
    them, and the result is laid back out in the product's order without the summed axes (kept
    as units with ``keepdim``). An axis is placed by its kind, whatever its size."""

    a: torch.fx.Node | None
    b: torch.fx.Node | None
    rank: int
    batch: tuple[int, ...]
    a_own: tuple[int, ...]
    b_own: tuple[int, ...]
    summed: tuple[int, ...]
    keepdim: bool

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a[(None,) * (self.rank - a.dim())] if a.dim() < self.rank else a
        b = b[(None,) * (self.rank - b.dim())] if b.dim() < self.rank else b
        sizes = [max(m, n) for m, n in zip(a.shape, b.shape)]
        rows = _laid_out(a, (self.batch, self.a_own, self.summed), self.b_own)
        cols = _laid_out(b, (self.batch, self.summed, self.b_own), self.a_own)
        order = [*self.batch, *self.a_own, *self.b_own]
        y = torch.bmm(rows, cols).reshape([sizes[i] for i in order])
        kept = sorted(order)
        if order != kept:
            y = y.permute([order.index(i) for i in kept])
        if self.keepdim:
            for d in self.summed:
                y = y.unsqueeze(d)
        return y


def _laid_out(x: torch.Tensor, groups: tuple, units: tuple[int, ...]) -> torch.Tensor:
    """``x`` permuted to its three groups of axes (then the unit axes it broadcasts along) and
    reshaped to one axis per group."""
    perm = [i for g in groups for i in g] + list(units)
    shape = [1, 1, 1]
    for j, g in enumerate(groups):
        for i in g:
            shape[j] *= x.shape[i]
    if perm != list(range(x.dim())):
        x = x.permute(perm)
    return x.reshape(shape)


def _shape(n) -> tuple[int, ...] | None:
    val = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def summed_product(node: torch.fx.Node) -> SummedProduct | None:
    """``node`` read as a summed product of two tensors of one dtype, or None when it is not
    one or is no product of matrices (a dot product, a sum of squares, a sum over an axis only
    one operand has)."""
    found = _summed(node)
    if found is None:
        return None
    prod, dims, keepdim = found
    if not isinstance(prod, torch.fx.Node) or prod.target is not aten.mul.Tensor \
            or len(prod.users) != 1 or prod.kwargs or not dims:
        return None
    a, b = prod.args
    sa, sb, sy = _shape(a), _shape(b), _shape(prod)
    if sa is None or sb is None or sy is None or a is b or not sa or not sb \
            or a.meta["val"].dtype != b.meta["val"].dtype:
        return None
    r = len(sy)
    pa, pb = (1,) * (r - len(sa)) + sa, (1,) * (r - len(sb)) + sb
    summed = tuple(sorted({d % r for d in dims}))
    a_own = tuple(i for i in range(r) if pa[i] > 1 and pb[i] == 1)
    b_own = tuple(i for i in range(r) if pb[i] > 1 and pa[i] == 1)
    # a unit axis summed is a product of matrices only between a column and a row
    unit = not any(pa[d] > 1 for d in summed)
    if set(summed) & set(a_own + b_own) or not (a_own or b_own) \
            or (unit and not (a_own and b_own)):
        return None
    batch = tuple(i for i in range(r) if i not in summed + a_own + b_own)
    if _reads_matrix_permuted(a_own, b_own, summed):
        a, b, a_own, b_own = b, a, b_own, a_own
    return SummedProduct(a, b, r, batch, a_own, b_own, summed, keepdim)


_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _summed(node: torch.fx.Node) -> tuple[torch.fx.Node, list[int], bool] | None:
    """``(product, summed axes, keepdim)`` of a sum over axes, or of a reshape that drops unit
    axes — ``torch.einsum`` contracting an axis of size one (the token of a one-token slice,
    ``einsum("bto,bti->boi", v[:, t:t + 1], k[:, t:t + 1])``) traces as a broadcast product
    reshaped without it. The dropped axes must be the product's only axes of size one, so that
    which they are is not a guess."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.sum.dim_IntList:
        return node.args[0], list(node.args[1]), len(node.args) > 2 and bool(node.args[2])
    prod = node.args[0] if node.target in _RESHAPES else None
    sy, sv = _shape(prod), _shape(node)
    if sy is None or sv is None:
        return None
    units = [i for i, n in enumerate(sy) if n == 1]
    kept = tuple(n for i, n in enumerate(sy) if i not in units)
    if not units or len(sv) != len(sy) - len(units) or sv != kept:
        return None
    return prod, units, False


def _reads_matrix_permuted(a_own: tuple, b_own: tuple, summed: tuple) -> bool:
    """Whether the product of a matrix and a vector (one operand has axes of its own, the other
    none) would lay the matrix out against its stored order: the left operand of a ``bmm`` is
    read ``[own, summed]``, the right ``[summed, own]``. The product commutes, so the matrix
    takes the side its layout reads as stored — ``S * q[..., None]`` and ``q[..., None] * S``
    both read ``S`` as it lies, and the analysis sees one form of a state's read."""
    if bool(a_own) == bool(b_own):
        return False
    own = a_own or b_own
    own_first = max(own) < min(summed)
    return own_first != bool(a_own)


_chains = itertools.count()


def _val(n: torch.fx.Node):
    return n.meta["val"]


def give_values(nodes: list[torch.fx.Node], meta: dict, operands) -> None:
    """Nodes inserted into a trace: each gets ``meta`` and its value, computed from its inputs'
    in the trace's own fake mode (the one ``operands``' values hold), as every other node holds
    them."""
    mode = detect_fake_mode([x.meta["val"] for x in operands])
    with mode if mode is not None else contextlib.nullcontext():
        for n in nodes:
            n.meta = {**meta, "val": n.target(*map_arg(n.args, _val), **map_arg(n.kwargs, _val))}


@functools.lru_cache(maxsize=256)
def _traced(how: SummedProduct, layouts: tuple) -> torch.fx.GraphModule:
    """The matmul ``how`` computes, traced on operands of ``layouts`` (shape, stride, dtype):
    the same for every iteration of a loop, so traced once (the graph is only copied from)."""
    example = [torch.empty_strided(shape, stride, dtype=dtype).zero_()
               for shape, stride, dtype in layouts]
    with lazy_graph_modules():
        return make_fx(how, tracing_mode="fake")(*example)


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node, found: SummedProduct) -> None:
    """Replace ``node`` by the traced matmul, its nodes attributed to ``node``'s source."""
    # the trace of a reshape depends on the layout (a view where strides allow it, else a copy)
    layouts = tuple((tuple(v.shape), v.stride(), v.dtype)
                    for v in (found.a.meta["val"], found.b.meta["val"]))
    how = dataclasses.replace(found, a=None, b=None)
    if all(isinstance(n, int) for shape, stride, _ in layouts for n in shape + stride):
        sub = _traced(how, layouts)
    else:
        sub = _traced.__wrapped__(how, layouts)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    before = set(gm.graph.nodes)
    with gm.graph.inserting_before(node):
        y = gm.graph.graph_copy(sub.graph, dict(zip(placeholders, (found.a, found.b))))
    meta = {k: node.meta[k] for k in (FRAMES, SRC, "stack_trace") if k in node.meta}
    added = [n for n in gm.graph.nodes if n not in before]
    give_values(added, {**meta, PRODUCT_CHAIN: next(_chains)}, (found.a, found.b))
    for n in added:
        for i, x in enumerate((found.a, found.b)):
            if x in n.all_input_nodes:
                n.meta[PRODUCT_OPERAND] = i
    y.meta[SUMMED_PRODUCT] = (tuple(d - found.rank for d in found.summed), found.keepdim)
    prod = node.args[0]
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)
    gm.graph.erase_node(prod)


def summed_products_as_matmuls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every summed product of matrices inside a loop body as the batched
    matmul it is (``gm`` annotated with frames)."""
    changed = False
    outer = caller_depth(gm)
    for node in list(gm.graph.nodes):
        found = summed_product(node)
        if found is not None and loops_of(node, outer=outer):
            _inline(gm, node, found)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


__all__ = ["SummedProduct", "summed_product", "summed_products_as_matmuls"]
