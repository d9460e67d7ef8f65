"""A converted layer under TorchScript: ``torch.jit.trace`` records its code as written, and
``torch.jit.script`` is refused with a ``ConversionError``.

The plan cannot be recorded by the tracer: it builds graphs per (batch, length) from the call's
sizes, which the tracer hands out as tensors, and a plan op half recorded leaves the trace in a
state no fallback can run in. So a call under ``torch.jit.trace`` is decided before any plan op
runs: an exact conversion runs the user's ``forward`` (the same function), so the trace is the
one the original gives, and says so by a warning (once, though the trace's check traces the
layer again) and the report's runs; a lossy one, whose
function the code as written does not compute, refuses. ``torch.jit.script`` compiles Python
source, and a converted layer's ``forward`` is the package's Python (``*args``, graphs walked at
run time), never a TorchScript program: ``__prepare_scriptable__``, which ``torch.jit.script``
calls on a module and on each of its submodules before compiling, refuses it by name.
"""
from __future__ import annotations

import inspect
import sys
import warnings

import torch

from .errors import StreamingError, UnsupportedExportError, UnsupportedTTTError
from .original_class import written_call

#: What the trace of a converted layer holds, as its warning and refusals say it.
_RECORDS = ("the trace records the layer's code as written, not its plan (the tracer cannot "
            "record the plan: it builds its graphs from the call's sizes, which the tracer "
            "turns into tensors)")


def _sizes(state, flat: list) -> tuple[int, int]:
    """The call's (batch, length) as plain ints for the report; the tracer's warning about a
    size read as a Python number is moot here: the numbers name the call, the trace never
    holds them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        B, L = state.layout.sizes(flat)
        return state._batch(int(B)), int(L)


def _instead(export_reason: str) -> str:
    """What to use for a graph of the plan: ``torch.export`` where it traces the plan
    (``export_refusal``: ``export_reason`` empty), else ``torch.compile`` or eager calls."""
    if not export_reason:
        return ("For a graph of the plan, export the layer with torch.export.export (it traces "
                "the plan's tensor ops at the exported batch and length) or compile it with "
                "torch.compile")
    return (f"torch.export cannot trace this plan either ({export_reason}): run the layer "
            "eagerly or under torch.compile for the plan")


def _checking_a_trace() -> bool:
    """Whether the call is ``torch.jit.trace``'s check of the trace it just made
    (``check_trace``, on by default), which traces the layer again: the trace it checks gave
    the warning already."""
    check = getattr(torch.jit._trace, "_check_trace", None)
    code = getattr(inspect.unwrap(check), "__code__", None) if check is not None else None
    frame = sys._getframe(1)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def traced_call(module: torch.nn.Module, args: tuple, kwargs: dict, flat: list, stateful: bool,
                export_reason: str):
    """``module(*args, **kwargs)`` under ``torch.jit.trace`` (``flat``: its inputs flattened):
    the code as written for an exact conversion (a warning and the report's runs say so), an
    ``UnsupportedTTTError`` for a lossy one, a ``StreamingError`` for a call carrying state.
    ``export_reason`` is why ``torch.export`` cannot trace the plan ("" where it can)."""
    state = module._ttt2la
    where = state._where()
    if stateful:
        raise StreamingError(
            f"{where} cannot carry its fast-weight state through a call under torch.jit.trace: "
            f"{_RECORDS}, and the code as written carries no state between calls. Trace whole "
            "sequences, or decode eagerly.")
    if state.as_written is None:
        raise UnsupportedTTTError(
            f"{where} was called under torch.jit.trace: {_RECORDS}, and its lossy conversion "
            f"does not run the layer as written (that computes another function). "
            f"{_instead(export_reason)}; or convert it at an exact level to trace it.")
    B, L = _sizes(state, flat)
    why = "called under torch.jit.trace"
    state.runs[f"batch {B}, length {L}, torch.jit.trace"] = f"as written: {_RECORDS}"
    if not _checking_a_trace():
        warnings.warn(
            f"ttt2la: {where} was {why}: {_RECORDS}, the same trace the original layer gives. "
            f"Like the original's, it is specialised to this call's length ({L}). "
            f"{_instead(export_reason)}.", RuntimeWarning, stacklevel=3)
    return state._as_written(written_call(module, args, kwargs), f"when {why}")


def refuse_scripting(module: torch.nn.Module):
    """``torch.jit.script`` of a converted layer, or of a model holding one: an
    ``UnsupportedExportError`` naming the layer, why it cannot be scripted and what to use."""
    raise UnsupportedExportError(
        f"torch.jit.script cannot compile {module._ttt2la._where()}: a converted layer's forward "
        "is ttt2la's Python (it takes *args, builds its graphs for each batch and length, and "
        "runs them), not TorchScript source. Use torch.jit.trace (it records the layer's code "
        "as written, as for the original), torch.export.export (it traces the plan) or "
        "torch.compile; or script the original model (ttt2la.convert leaves it untouched).")


__all__ = ["traced_call", "refuse_scripting"]
