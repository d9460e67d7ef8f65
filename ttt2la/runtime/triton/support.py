"""Which calls the Triton kernels can take, decided without running them (the dispatcher's question).

Nothing here imports Triton until a call has passed the cheap checks, so the package imports and answers
``False`` where Triton is missing.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import torch

from ttt2la.runtime.naive import ORDERS, check_block_inputs, check_chunk_inputs

#: Op names ``supports`` answers for, with their short aliases (the dispatcher's ``"block"``/``"chunk"``).
OP_NAMES = {
    "chunk": "chunk_linear_attention", "chunk_linear_attention": "chunk_linear_attention",
    "block": "block_linear_attention", "block_linear_attention": "block_linear_attention",
    "fused_swiglu": "fused_swiglu_block_linear_attention",
    "fused_swiglu_block_linear_attention": "fused_swiglu_block_linear_attention",
}

_MODULES = {"chunk_linear_attention": "channel_decay", "block_linear_attention": "block",
            "fused_swiglu_block_linear_attention": "swiglu"}

_OPTIONS = {
    "chunk_linear_attention": {"chunk_size", "log_decay", "scale", "initial_state", "output_final_state"},
    "fused_swiglu_block_linear_attention": {"chunk_size", "order", "lr", "momentum", "muon_steps",
                                            "ns_coefficients", "ns_eps", "ns_dtype", "weight_norm", "initial_state",
                                            "output_final_state"},
}
_OPTIONS["block_linear_attention"] = _OPTIONS["fused_swiglu_block_linear_attention"] | {"decay", "step_scale"}

#: Dtypes of the sequence tensors (and SwiGLU weights) the kernels are tested for.
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def interpreting() -> bool:
    """Whether the kernels run (or, not yet imported, will run) in Triton's CPU interpreter in this process.

    Triton decides when the kernels are first imported, from ``TRITON_INTERPRET``; later changes to the
    variable do not affect kernels already imported.
    """
    common = sys.modules.get(f"{__package__}._common")
    if common is not None:
        return common.INTERPRET
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def triton_available() -> bool:
    """Whether the ``triton`` package can be found (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a stub in sys.modules without a spec
        return False


def kernel_module(op: str):
    """The module holding ``op``'s kernels, imported on first use (raises ``ImportError`` without Triton)."""
    return importlib.import_module(f"{__package__}.{_MODULES[OP_NAMES[op]]}")


def _devices_ok(tensors) -> bool:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = devices.pop()
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


def _check_arguments(op, main, options) -> bool:
    if op == "chunk_linear_attention":
        q, k, v = main
        check_chunk_inputs(q, k, v, chunk_size=options.get("chunk_size", 64), log_decay=options.get("log_decay"),
                           initial_state=options.get("initial_state"))
        return True
    if options.get("weight_norm") is not None or options.get("order", "exclusive") not in ORDERS:
        return False
    block_options = {key: options.get(key) for key in ("lr", "momentum", "weight_norm", "initial_state", "decay",
                                                       "step_scale")}
    if op == "fused_swiglu_block_linear_attention":
        q, k, v, w0, w2 = main
        if q.dim() != 4 or q.shape != k.shape or w0.dim() != 3 or w0.shape != w2.shape \
                or tuple(w0.shape[:2]) != tuple(q.shape[2:]):
            return False
        phi = k.new_empty(()).expand(*k.shape[:3], w0.shape[-1])
        main = (phi, phi, v)
    check_block_inputs(*main, chunk_size=options.get("chunk_size"), order=options.get("order", "exclusive"),
                       muon_steps=options.get("muon_steps", 0),
                       ns_coefficients=options.get("ns_coefficients"), **block_options)
    return True


def supports(op: str, *tensors, **options) -> bool:
    """Whether the Triton kernels can run ``op`` on these tensors and options; ``False`` means use torch.

    ``op``: ``"chunk"``, ``"block"``, ``"fused_swiglu"`` or the full op names; ``tensors`` the op's positional
    tensors; ``options`` its keyword options. False for CPU tensors unless ``TRITON_INTERPRET=1`` was set before
    the kernels were imported, for dtypes other than fp32/bf16, for ``weight_norm``, for unknown options and for
    arguments the op would reject.
    """
    name = OP_NAMES.get(op)
    if name is None or not set(options) <= _OPTIONS[name] or not triton_available():
        return False
    expected = 5 if name == "fused_swiglu_block_linear_attention" else 3
    if len(tensors) != expected or not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if any(t.dtype not in KERNEL_DTYPES for t in tensors) or len({t.dtype for t in tensors[:3]}) != 1:
        return False
    extra = [x for x in options.values() if isinstance(x, torch.Tensor)]
    if any(not x.is_floating_point() for x in extra) or not _devices_ok([*tensors, *extra]):
        return False
    try:
        if not _check_arguments(name, tensors, options):
            return False
        kernel_module(name)
    except Exception:  # malformed arguments (torch raises the error) or a Triton that cannot build the kernels
        return False
    return True


__all__ = ["supports", "interpreting", "triton_available", "kernel_module", "OP_NAMES", "KERNEL_DTYPES"]
