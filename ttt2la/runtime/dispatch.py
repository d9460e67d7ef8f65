"""The public runtime ops and the choice of the implementation that runs them.

``backend``: ``"naive"`` (the references in ``naive.py``), ``"torch"`` (``block.py``,
``chunk.py``), ``"triton"`` (``ttt2la.runtime.triton``) or ``"auto"``: Triton when every tensor
is on CUDA, triton imports and the Triton package says it supports the call, else torch.

The Triton package is imported lazily and may be absent or incomplete. It takes part when it
exposes ``block_linear_attention`` / ``chunk_linear_attention`` with the same contracts as the
torch ops, and ``supports(op, *tensors, **options) -> bool`` with ``op`` in
``("block", "chunk")``, the positional tensors of the op and its keyword options.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from ttt2la.errors import UnsupportedTTTError
from ttt2la.runtime.block import torch_block_linear_attention
from ttt2la.runtime.chunk import torch_chunk_linear_attention
from ttt2la.runtime.naive import (NS_EPS, RuntimeInputError, naive_block_linear_attention,
                                  naive_chunk_linear_attention)

BACKENDS = ("auto", "torch", "triton", "naive")
OPS = ("block", "chunk")
#: The token-causal op's chunk of tokens: a shorter sequence is padded to it.
CHUNK_SIZE = 64

_TORCH = {"block": torch_block_linear_attention, "chunk": torch_chunk_linear_attention}
_NAIVE = {"block": naive_block_linear_attention, "chunk": naive_chunk_linear_attention}


def _triton_module():
    try:
        if importlib.util.find_spec("triton") is None:
            return None
        return importlib.import_module("ttt2la.runtime.triton")
    except Exception:  # absent, or broken on this machine: fall back to torch
        return None


def _triton_op(op: str):
    module = _triton_module()
    if module is None:
        return None, None
    return getattr(module, f"{op}_linear_attention", None), getattr(module, "supports", None)


def _triton_supports(op: str, tensors, options) -> bool:
    fn, supports = _triton_op(op)
    if fn is None or supports is None:
        return False
    try:
        return bool(supports(op, *tensors, **options))
    except Exception:
        return False


def _all_cuda(tensors, options) -> bool:
    found = [t for t in (*tensors, *options.values()) if isinstance(t, torch.Tensor)]
    return bool(found) and all(t.is_cuda for t in found)


def select_backend(op: str, *tensors, backend: str = "auto", **options) -> str:
    """Resolve ``backend`` to the one that will run ``op`` on these tensors and options."""
    if op not in OPS:
        raise RuntimeInputError(f"unknown runtime op {op!r}; expected one of {OPS}")
    if backend not in BACKENDS:
        raise RuntimeInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if _all_cuda(tensors, options) and _triton_supports(op, tensors, options) \
            else "torch"
    if backend == "triton" and not _triton_supports(op, tensors, options):
        raise UnsupportedTTTError(
            f"backend='triton' was requested for the {op} op, but triton or "
            f"ttt2la.runtime.triton is unavailable or does not support these shapes/options; "
            f"use backend='auto' or 'torch'")
    return backend


def _run(op: str, tensors, options, backend: str):
    chosen = select_backend(op, *tensors, backend=backend, **options)
    if chosen == "triton":
        fn = _triton_op(op)[0]
    else:
        fn = (_TORCH if chosen == "torch" else _NAIVE)[op]
    # an op keeps its own precision (``compute_dtype``): under autocast its matmuls would be
    # cast one by one and meet the fp32 accumulators they feed (off already: nothing to turn off)
    device = tensors[0].device.type
    if torch.amp.is_autocast_available(device) and not torch.is_autocast_enabled(device):
        return fn(*tensors, **options)
    with torch.autocast(device, enabled=False):
        return fn(*tensors, **options)


def block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None,
                           momentum=None, muon_steps=0, ns_coefficients=None, ns_eps=NS_EPS,
                           ns_dtype=None, weight_norm=None, decay=None, step_scale=None,
                           value_decay=None, initial_state=None, output_final_state=False,
                           backend="auto"):
    """LaCT-style block TTT as linear attention (see ``naive_block_linear_attention``).

    Newton–Schulz is data: ``ns_coefficients`` (one ``(a, b, c)`` for all ``muon_steps`` steps,
    or one per step), ``ns_eps`` and the iteration dtype ``ns_dtype``. ``decay [B, N, H]``
    multiplies the state before each chunk's update (a gated memory's ``W ← γ W + Δ``),
    ``step_scale [B, N, H]`` each chunk's step after Newton–Schulz (Muon's ``W ← W + η NS(M)``).
    ``decay [B, N, H, Dk]`` decays each row of the state (a key channel), ``value_decay [B, N,
    H, Dv]`` each column (a value channel; with ``decay`` per matrix at most). A backend whose
    ``supports`` does not name an option is never asked to run it: ``"auto"`` runs torch.

    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``, computed by ``backend``.
    """
    options = dict(chunk_size=chunk_size, order=order, lr=lr, momentum=momentum,
                   muon_steps=muon_steps, ns_coefficients=ns_coefficients, ns_eps=ns_eps,
                   ns_dtype=ns_dtype, weight_norm=weight_norm, initial_state=initial_state,
                   output_final_state=output_final_state)
    for name, factor in (("decay", decay), ("step_scale", step_scale),
                         ("value_decay", value_decay)):
        if factor is not None:  # a backend without the option is never asked to run it
            options[name] = factor
    return _run("block", (phi_q, phi_k, v), options, backend)


def chunk_linear_attention(q, k, v, *, chunk_size=CHUNK_SIZE, log_decay=None, scale=None,
                           value_log_decay=None, initial_state=None, output_final_state=False,
                           backend="auto"):
    """Token-causal gated linear attention ``o_t = scale · q_t S_t`` (scale None means 1.0).

    ``log_decay`` decays the state per head ``[B, T, H]`` or per key channel ``[B, T, H, Dk]``
    (a row of ``S``); ``value_log_decay [B, T, H, Dv]`` per value channel (a column of ``S``),
    alone or with a decay per head: a separate argument, so that a square state never leaves
    the axis to be guessed from a shape. A backend whose ``supports`` does not name it is never
    asked to run it: ``"auto"`` runs torch.

    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``, computed by ``backend``.
    """
    options = dict(chunk_size=chunk_size, log_decay=log_decay, scale=scale,
                   initial_state=initial_state, output_final_state=output_final_state)
    if value_log_decay is not None:
        options["value_log_decay"] = value_log_decay
    return _run("chunk", (q, k, v), options, backend)


def implementation_name(op: str, *tensors, backend: str = "auto", **options) -> str:
    """What runs ``op`` on these inputs, for the conversion report: e.g.
    ``"torch.block(semi-parallel)"``, ``"torch.block(parallel)"``, ``"triton.chunk"``.
    """
    chosen = select_backend(op, *tensors, backend=backend, **options)
    if op == "chunk":
        return "naive.chunk(recurrent)" if chosen == "naive" else f"{chosen}.chunk"
    if chosen == "naive":
        schedule = "recurrent"
    else:
        schedule = "semi-parallel" if options.get("weight_norm") is not None else "parallel"
    return f"{chosen}.block({schedule})"


__all__ = ["block_linear_attention", "chunk_linear_attention", "implementation_name",
           "select_backend", "BACKENDS"]
