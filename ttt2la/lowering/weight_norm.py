"""LaCT's weight normalisation, read from a traced update so the runtime op can run it.

After every update LaCT rescales each fast-weight row (or column) back to the norm it had before
the loop: ``W ← (W + Δ) / (‖W + Δ‖ + ε) · n``. The runtime's ``block_linear_attention`` runs
exactly this map chunk after chunk (its ``weight_norm`` option, *semi-parallel*), so a program
whose only sequential step is this normalisation is lifted onto the op instead of the generic
executor. ``match_weight_norm`` accepts only that form — an L2 norm over one axis, kept, plus a
constant ε, dividing the same sum it is taken of, times a target read from outside the loop —
and reports the axis and ε; the caller checks they are the runtime's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

aten = torch.ops.aten


@dataclass(frozen=True)
class WeightNorm:
    """``output = sum / (‖sum‖₂ over dim + eps) · target``."""

    sum: torch.fx.Node
    target: torch.fx.Node
    dim: int                # the axis the norm runs over, negative (counted from the end)
    eps: float


def _norm_of(den) -> tuple[torch.fx.Node, float] | None:
    """``(norm node, eps)`` when ``den`` is ``‖x‖ + eps`` with a constant ``eps``."""
    if not isinstance(den, torch.fx.Node) or den.target is not aten.add.Tensor:
        return None
    for nrm, eps in (den.args, den.args[::-1]):
        if isinstance(nrm, torch.fx.Node) and nrm.target is aten.linalg_vector_norm.default \
                and isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return nrm, float(eps)
    return None


def match_weight_norm(output: torch.fx.Node) -> WeightNorm | None:
    """The weight normalisation ending at ``output``, or None for any other form."""
    if not isinstance(output, torch.fx.Node) or output.target is not aten.mul.Tensor:
        return None
    for quotient, target in (output.args, output.args[::-1]):
        if not isinstance(quotient, torch.fx.Node) or quotient.target is not aten.div.Tensor \
                or not isinstance(target, torch.fx.Node):
            continue
        total, den = quotient.args
        found = _norm_of(den)
        if found is None or not isinstance(total, torch.fx.Node):
            continue
        nrm, eps = found
        args = list(nrm.args) + [None] * 4
        order = nrm.kwargs.get("ord", args[1] if len(nrm.args) > 1 else 2)
        dim = nrm.kwargs.get("dim", args[2])
        keepdim = nrm.kwargs.get("keepdim", args[3])
        if nrm.args[0] is not total or order != 2 or not keepdim \
                or not isinstance(dim, (list, tuple)) or len(dim) != 1:
            continue
        val = total.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        return WeightNorm(total, target, dim[0] % val.dim() - val.dim(), eps)
    return None


__all__ = ["WeightNorm", "match_weight_norm"]
