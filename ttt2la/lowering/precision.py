"""A float64 evaluation of a traced graph: the reference a low-precision result is judged against.

Newton–Schulz amplifies rounding, so two correct fp32 (or bf16) evaluations of the same Muon
step differ by more than an fp32 tolerance. The honest question is then whether a lowered plan is
as close to the exact function as the user's own code is: both are compared with the same graph
evaluated in float64, where every floating dtype the graph names — casts such as ``G.bfloat16()``
before the iteration, the dtype of a created tensor — is replaced by float64.
"""
from __future__ import annotations

import torch
import torch.fx

from ..ir import copy_graph, graph_module

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _promote(value, dtype: torch.dtype):
    if isinstance(value, torch.dtype) and value in _FLOATING:
        return dtype
    if isinstance(value, (list, tuple)):
        return type(value)(_promote(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _promote(v, dtype) for k, v in value.items()}
    return value


def promoted(gm: torch.fx.GraphModule, dtype: torch.dtype = torch.float64) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose every floating dtype argument is ``dtype`` (its inputs are the
    caller's to cast): the same function, evaluated in one precision throughout."""
    graph = copy_graph(gm.graph)
    for node in graph.nodes:
        node.args = _promote(node.args, dtype)
        node.kwargs = _promote(node.kwargs, dtype)
    return graph_module(gm, graph)


def as_dtype(values, dtype: torch.dtype = torch.float64):
    """Floating tensors of ``values`` (a list, possibly holding ``None``) cast to ``dtype``."""
    return [v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v for v in values]


__all__ = ["promoted", "as_dtype", "relative_error", "samples"]


def relative_error(err: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖err‖ / ‖ref‖`` of a float64 fit or confirmation (huge when ``ref`` is zero and ``err``
    is not): how the lifts judge a piece read off a graph against the graph's own values."""
    return float(err.norm() / ref.norm().clamp_min(1e-300))


def samples(nodes: list[torch.fx.Node], n: int, seed: int) -> list[torch.Tensor] | None:
    """``n`` random float64 values of every node (its traced shape, a leading sample axis)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return None
        out.append(torch.randn((n, *val.shape), generator=gen, dtype=torch.float64))
    return out
