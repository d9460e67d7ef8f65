"""A batched matmul of one row by one column, read as the dot product it computes.

``torch.einsum("bhk,bhk->bh", q, z)`` traces to ``bmm(q [N, 1, K], z [N, K, 1])``: a dot product
of two vectors, which the analysis takes for a matrix product — a state multiplied by stream data
as a kernel weight Θ is. Spelt ``(q * z).sum(-1)``, the same dot product is a product summed: a
normaliser's read, lifted as one more value column. Inside loop bodies every ``bmm`` of one row
by one column is rewritten as that product and sum, so the two spellings are one program (and
the generic plan, which runs the body token by token, runs the cheaper one). Values agree up to
the rounding of the summation order.
"""
from __future__ import annotations

import torch
import torch.fx

from ..ir import PRODUCT_CHAIN, SRC
from .capture import FRAMES
from .loops import caller_depth, loops_of
from .summed_products import give_values

aten = torch.ops.aten


def _dot(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(N, K)`` when ``node`` is ``bmm(a [N, 1, K], b [N, K, 1])``."""
    if node.op != "call_function" or node.target is not aten.bmm.default or PRODUCT_CHAIN in node.meta:
        return None             # (a product ``summed_products`` made is read as it made it)
    shapes = [getattr(a.meta.get("val"), "shape", None) if isinstance(a, torch.fx.Node) else None
              for a in node.args[:2]]
    if any(s is None or len(s) != 3 for s in shapes):
        return None
    (n, rows, k), (_, _, cols) = shapes
    return (n, k) if rows == 1 and cols == 1 and isinstance(n, int) and isinstance(k, int) else None


def dot_products_as_sums(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite, in place, every ``bmm`` of one row by one column inside a loop body as the
    product and sum it computes (``gm`` annotated with frames)."""
    outer = caller_depth(gm)
    changed = False
    for node in list(gm.graph.nodes):
        dims = _dot(node)
        if dims is None or not loops_of(node, outer=outer):
            continue
        n, k = dims
        a, b = node.args[:2]
        before = set(gm.graph.nodes)
        with gm.graph.inserting_before(node):
            rows = gm.graph.call_function(aten.view.default, (a, [n, k]))
            cols = gm.graph.call_function(aten.view.default, (b, [n, k]))
            summed = gm.graph.call_function(aten.sum.dim_IntList,
                                            (gm.graph.call_function(aten.mul.Tensor, (rows, cols)), [1], True))
            dot = gm.graph.call_function(aten.view.default, (summed, [n, 1, 1]))
        meta = {key: node.meta[key] for key in (FRAMES, SRC, "stack_trace") if key in node.meta}
        give_values([x for x in gm.graph.nodes if x not in before], meta, (a, b))
        node.replace_all_uses_with(dot)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


__all__ = ["dot_products_as_sums"]
