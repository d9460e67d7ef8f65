"""One-time preparation inside a call, out of sight of the call.

A converted layer prepares on its first call at a shape (specialised graphs, the probe of a
partial last chunk's padding) and on its first call with weights cast since conversion (the
conversion again). Whatever the caller runs around the call must see the call and not its
preparation: activation checkpointing counts the tensors the call saves and recomputes it on
prepared graphs (a saved tensor more on the first call fails the recomputation), a profiler or
an op counter sees the ops the call dispatches, autocast would change the precision a probe or
a trace sees.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def out_of_sight(grad: bool = False, devices=("cpu",)):
    """Inside: no dispatch modes, saved-tensor hooks or autocast of the caller (on ``devices``),
    and gradients recorded only with ``grad=True`` (a probe that differentiates); all restored
    on exit."""
    with _disable_current_modes(), _without_saved_tensor_hooks(), \
            torch.enable_grad() if grad else torch.no_grad(), contextlib.ExitStack() as off:
        for device in dict.fromkeys(("cpu", *devices)):
            off.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def _without_saved_tensor_hooks():
    """No saved-tensor hooks inside (activation checkpointing's, a user's), pushed back after."""
    hooks = torch._C._autograd
    stack = []
    while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


__all__ = ["out_of_sight"]
