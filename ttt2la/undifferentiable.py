"""A layer whose own backward fails converts; its converted form refuses the backward too.

A layer can run forward and fail when differentiated: an in-place state update (``S += k v``)
overwrites a tensor autograd saved, and torch raises "modified by an inplace operation". Its
forward is a function ttt2la converts like any other, but the conversion's gradient check
(``gradient_stops``) has no gradients of the layer to compare with, so it is skipped, and the
report says so. The converted layer then computes the same forward and refuses the same
backward, with a ``ConversionError`` in place of torch's: the plans would differentiate a
function whose gradients were never checked against the code (a stop the trace cannot see, a
``torch.no_grad()`` block, would go unnoticed), and refusing the forward of a call that records
gradients would refuse calls the original takes (inference without ``torch.no_grad()``).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedTTTError, first_line


class OwnBackwardFails(Exception):
    """The layer as written failed when differentiated: the message says how."""


def own_backward_failure(error: BaseException) -> OwnBackwardFails:
    """``error``, raised by the layer's own backward, as the reason gradients were not checked."""
    first = first_line(error)
    if len(first) > 160:
        first = first[:157] + "..."
    return OwnBackwardFails(f"{type(error).__name__}: {first}")


def refusal(where: str, why: str) -> str:
    """What a converted layer's backward raises when the layer as written fails there."""
    return (f"{where} cannot be differentiated as written: its own backward fails ({why}). Its "
            "converted form computes the same forward and refuses the backward as well: there "
            "are no gradients of the code as written to check its gradients against. Call it "
            "under torch.no_grad() for inference, or make the layer differentiable (update its "
            "state out of place, `S = S + ...` rather than `S += ...`) and convert it again.")


def refuse_backward(output, message: str):
    """``output`` with a hook on each of its tensors that records gradients, raising an
    ``UnsupportedTTTError`` with ``message`` when a backward reaches it."""
    def refuse(_grad):
        raise UnsupportedTTTError(message)

    for t in pytree.tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(refuse)
    return output


__all__ = ["OwnBackwardFails", "own_backward_failure", "refusal", "refuse_backward"]
