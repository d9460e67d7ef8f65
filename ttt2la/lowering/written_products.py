"""A loop body with the products the frontend read as matmuls put back as the code wrote them.

``frontend/summed_products.py`` rewrites ``sum(a * b)`` as a ``bmm`` between relayouts so that
the matchers see the product a state is read by. A body that lifts onto a runtime op never runs
those products; one that keeps the generic plan runs them token by token, where a one-row
``bmm``, its relayouts and its backward cost more than the product and sum they replaced (a
gated linear attention's training step took twice as long on a CPU). The generic plan runs the
code's own ops instead, read back from the chains' metadata (``ir.SUMMED_PRODUCT``).
"""
from __future__ import annotations

import torch
import torch.fx

from ..analysis.associativity import Analysis, analyze
from ..ir import PRODUCT_CHAIN, PRODUCT_OPERAND, SRC, SUMMED_PRODUCT, TTTProgram

aten = torch.ops.aten


def _operands(graph: torch.fx.Graph, chain) -> list | None:
    """``[a, b]``: what the chain's nodes read from outside it, by the operand each reads."""
    operands = [None, None]
    for n in graph.nodes:
        if n.meta.get(PRODUCT_CHAIN) == chain and PRODUCT_OPERAND in n.meta:
            outside = [x for x in n.all_input_nodes if x.meta.get(PRODUCT_CHAIN) != chain]
            if len(outside) != 1:
                return None
            operands[n.meta[PRODUCT_OPERAND]] = outside[0]
    return None if None in operands else operands


def products_as_written(graph: torch.fx.Graph) -> bool:
    """Replace, in place, every rewritten product's result in ``graph`` by ``sum(a * b)`` (dead
    relayouts removed); whether any was. A chain a pass has cut apart stays as it is."""
    changed = False
    for y in [n for n in graph.nodes if SUMMED_PRODUCT in n.meta]:
        operands = _operands(graph, y.meta[PRODUCT_CHAIN])
        if operands is None:
            continue
        dims, keepdim = y.meta[SUMMED_PRODUCT]
        with graph.inserting_before(y):
            prod = graph.call_function(aten.mul.Tensor, tuple(operands))
            total = graph.call_function(aten.sum.dim_IntList, (prod, list(dims), keepdim))
        where = {k: y.meta[k] for k in (SRC, "stack_trace") if k in y.meta}
        prod.meta, total.meta = dict(where), {**where, "val": y.meta.get("val")}
        y.replace_all_uses_with(total)
        changed = True
    if changed:
        graph.eliminate_dead_code()
    return changed


def written(program: TTTProgram, analysis: Analysis | None = None
            ) -> tuple[TTTProgram, Analysis | None]:
    """``(program, analysis)`` unchanged, or, where the program has rewritten products, a copy
    running the code's own and that copy's analysis: what a generic plan is built on."""
    if not any(SUMMED_PRODUCT in n.meta for n in program.body.graph.nodes):
        return program, analysis
    copy = program.clone()
    products_as_written(copy.body.graph)
    copy.body.recompile()
    return copy, analyze(copy)


__all__ = ["products_as_written", "written"]
