"""Higher-order gradients through the runtime's hand-written backwards.

The runtime's autograd Functions compute their gradients into preallocated memory (``out=``),
which autograd cannot differentiate. A backward asked to record a graph (``create_graph=True``:
a gradient penalty, meta-learning, a Hessian-vector product) instead recomputes the Function's
output from its saved inputs with plain differentiable ops and differentiates that: slower,
the same function, and never a gradient silently missing its second-order terms.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ttt2la.errors import UnsupportedTTTError


def recording_graph() -> bool:
    """Is the running backward recording a graph (``create_graph=True``)? Autograd runs a
    backward with gradients enabled exactly then."""
    return torch.is_grad_enabled()


def backward_as_graph(plain: Callable, inputs: Sequence, needs: Sequence[bool],
                      grad_output: torch.Tensor) -> tuple:
    """The gradients of ``plain(*inputs)`` against ``grad_output`` for the inputs ``needs``
    marks (``None`` for the others), as a differentiable graph."""
    wanted = [i for i, (x, need) in enumerate(zip(inputs, needs))
              if need and isinstance(x, torch.Tensor)]
    with torch.enable_grad():
        # each input through a fresh view: an input computed from another (states from the
        # initial state) must get only its own uses' gradient, as the Function's backward gives
        aliases = [x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x
                   for x in inputs]
        out = plain(*aliases)
        grads = torch.autograd.grad(out, [aliases[i] for i in wanted], grad_output,
                                    create_graph=True, allow_unused=True)
    result: list = [None] * len(inputs)
    for i, g in zip(wanted, grads):
        result[i] = torch.zeros_like(inputs[i]) if g is None else g
    return tuple(result)


def refuse_graph(op: str) -> None:
    """Raise ``UnsupportedTTTError`` when the running backward records a graph: ``op``'s
    kernels write gradients autograd cannot see, so a second-order term would go missing."""
    if recording_graph():
        raise UnsupportedTTTError(
            f"a backward that records a graph for higher-order gradients (create_graph=True) "
            f"through {op}: its Triton kernels' backward is not differentiable. Convert with "
            "backend='torch' where higher-order gradients are needed; the torch runtime "
            "differentiates its backward.")


__all__ = ["recording_graph", "backward_as_graph", "refuse_graph"]
