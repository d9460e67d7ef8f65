"""Triton kernels behind the runtime ops' contracts (``[B, T, H, D]`` sequences, ``[B, H, Dk, Dv]`` states).

``supports(op, *tensors, **options)`` tells the dispatcher whether a call can run here; the ops import their
kernels (and Triton) on first call, so this package imports fine where Triton is missing. On CPU the kernels
run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call).
"""
from __future__ import annotations

from .support import interpreting, supports, triton_available


def chunk_linear_attention(q, k, v, *, chunk_size=64, log_decay=None, scale=None, initial_state=None,
                           output_final_state=False):
    """Token-causal linear attention ``o_t = scale · q_t S_t``, ``S_t = exp(log_decay_t) S_{t-1} + k_tᵀ v_t``.

    Chunk-parallel Triton kernels: ``chunk.py`` for a decay per head ``[B, T, H]`` (or none),
    ``channel_decay.py`` for one per key channel ``[B, T, H, Dk]``; contract of
    ``ttt2la.runtime.chunk_linear_attention``.
    """
    if log_decay is not None and log_decay.dim() == 4:
        from .channel_decay import channel_decay_linear_attention
        return channel_decay_linear_attention(q, k, v, chunk_size=chunk_size, log_decay=log_decay, scale=scale,
                                              initial_state=initial_state, output_final_state=output_final_state)
    from .chunk import chunk_linear_attention as op
    return op(q, k, v, chunk_size=chunk_size, log_decay=log_decay, scale=scale, initial_state=initial_state,
              output_final_state=output_final_state)


def block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None, momentum=None,
                           muon_steps=0, ns_coefficients=None, ns_eps=1e-7, ns_dtype=None, weight_norm=None,
                           decay=None, step_scale=None, initial_state=None, output_final_state=False):
    """LaCT's block update as linear attention (increments, momentum, Muon, a decay, prefix sum, reads).

    Token-level matmuls in Triton (``block.py``); contract of ``ttt2la.runtime.block_linear_attention``
    without ``weight_norm``.
    """
    from .block import block_linear_attention as op
    return op(phi_q, phi_k, v, chunk_size=chunk_size, order=order, lr=lr, momentum=momentum,
              muon_steps=muon_steps, ns_coefficients=ns_coefficients, ns_eps=ns_eps, ns_dtype=ns_dtype,
              weight_norm=weight_norm, decay=decay, step_scale=step_scale, initial_state=initial_state,
              output_final_state=output_final_state)


def fused_swiglu_block_linear_attention(q, k, v, w0, w2, **block_kwargs):
    """``block_linear_attention(φ(q), φ(k), v, **block_kwargs)`` with ``φ(x) = silu(x W0) ⊙ (x W2)`` fused in.

    ``w0, w2``: ``[H, D, Dh]`` (x @ W form); see ``swiglu.py``.
    """
    from .swiglu import fused_swiglu_block_linear_attention as op
    return op(q, k, v, w0, w2, **block_kwargs)


__all__ = ["chunk_linear_attention", "block_linear_attention", "fused_swiglu_block_linear_attention", "supports",
           "interpreting", "triton_available"]
