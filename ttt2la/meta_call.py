"""A converted layer called with meta tensors runs its code as written.

Meta tensors hold shapes and dtypes but no values: a model on the meta device is sized by a dry
run (its outputs' shapes), or built under ``torch.device("meta")`` before ``to_empty``. A
converted layer prepares for new weights by tracing and probing values, which meta tensors do
not have, and the shapes and dtypes of its outputs are those of the code as written at every
level (a lossy level changes values, not shapes). So a call with a meta weight or input runs the
code as written; the report's runs say so. A call carrying state (``ttt_state``) has no state on
meta to carry and is refused.
"""
from __future__ import annotations

import torch

from .errors import StreamingError
from .original_class import written_call


def on_meta(weights: dict, flat: list) -> bool:
    """Whether a call's weights (``params_and_buffers``) or tensor inputs are meta tensors."""
    return any(isinstance(t, torch.Tensor) and t.is_meta
               for t in (*weights.values(), *flat))


def meta_call(module: torch.nn.Module, args: tuple, kwargs: dict, stateful: bool):
    """``module(*args, **kwargs)`` by its code as written, for meta tensors (``on_meta``)."""
    state = module._ttt2la
    if stateful:
        raise StreamingError(
            f"{state._where()} was called on meta tensors and asked to carry its state: meta "
            "tensors hold no values to continue a sequence from. Call it without ttt_state and "
            "return_ttt_state on the meta device (for the outputs' shapes), or move it to a "
            "device with values (module.to_empty(device=...), then load its weights).")
    state.runs["meta tensors"] = ("as written: meta tensors hold shapes and dtypes, no values, "
                                  "and the code as written gives the shapes and dtypes")
    return state._as_written(
        written_call(module, args, kwargs),
        "on meta tensors")


__all__ = ["on_meta", "meta_call"]
