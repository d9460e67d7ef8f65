"""One-time preparation inside a call, out of sight of the call.

A converted layer prepares on its first call at a shape (specialised graphs, the probe of a
partial last chunk's padding) and on its first call with weights cast since conversion (the
conversion again). Whatever the caller runs around the call must see the call and not its
preparation: activation checkpointing counts the tensors the call saves and recomputes it on
prepared graphs (a saved tensor more on the first call fails the recomputation), a profiler or
an op counter sees the ops the call dispatches, autocast would change the precision a probe or
a trace sees. A preparation that plans or probes what the call computes (a feature graph's
specialisation, the padding probe) takes the caller's autocast back inside
(``autocast_state``): the graphs run under it, and an fp32 weight times a bf16 activation is a
bf16 product there, a dtype clash without it; what it prepares is kept per autocast state.

A preparation that fails raises, and the call runs the code as written naming the error; torch's
fake tensors also log such a failure with its traceback, which is not logged inside.
"""
from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch.utils._python_dispatch import _disable_current_modes


def autocast_state(values) -> tuple:
    """The caller's autocast on the devices of the tensors in ``values``: ``(device type,
    dtype)`` for each device where it is on."""
    devices = dict.fromkeys(v.device.type for v in values if isinstance(v, torch.Tensor))
    return tuple((d, torch.get_autocast_dtype(d)) for d in devices
                 if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def out_of_sight(grad: bool = False, devices=("cpu",), autocast: tuple = ()):
    """Inside: no dispatch modes, saved-tensor hooks or autocast of the caller (on ``devices``),
    but the autocast states ``autocast`` (``autocast_state``) taken back (a device with no
    autocast, such as ``meta``, has none to turn off); gradients recorded
    only with ``grad=True`` (a probe that differentiates); fake tensors' failures not logged
    from this thread. All restored on exit."""
    with _disable_current_modes(), _without_saved_tensor_hooks(), _fake_failures_unlogged(), \
            torch.enable_grad() if grad else torch.no_grad(), contextlib.ExitStack() as off:
        for device in dict.fromkeys(("cpu", *devices, *(d for d, _ in autocast))):
            if torch.amp.is_autocast_available(device):     # none on "meta"
                off.enter_context(torch.autocast(device, enabled=False))
        for device, dtype in autocast:
            off.enter_context(torch.autocast(device, dtype=dtype))
        yield


class _ThreadsFakeFailures(logging.Filter):
    """Drops fake tensors' log of a failing op's traceback, raised to the caller anyway, from
    one thread."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread == self.thread and record.levelno >= logging.ERROR
                    and str(record.msg).startswith("failed while attempting to run meta"))


@contextlib.contextmanager
def _fake_failures_unlogged():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _ThreadsFakeFailures()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


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


__all__ = ["out_of_sight", "autocast_state"]
