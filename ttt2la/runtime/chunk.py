"""Token-causal (gated) linear attention in plain torch, by the standard chunked algorithm.

``S_t = exp(log_decay_t) S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t``. Per-token TTT loops and
fully reduced linear attention lower to this. With ``b_t`` the cumulative log-decay inside a
chunk (``b`` restarts at every chunk, so it stays bounded by the chunk's own decay):

* inside a chunk: ``o_t += Σ_{i≤t} exp(b_t − b_i) (q_t·k_i) v_i`` — the decay mask is built from
  differences of ``b`` with the non-causal half set to −inf *before* ``exp``, so no large positive
  number is ever exponentiated;
* across chunks: ``o_t += exp(b_t) q_t S_{j-1}``, where the boundary states
  ``S_j = exp(b_C) S_{j-1} + Σ_i exp(b_C − b_i) k_iᵀ v_i`` come from one affine scan over chunks
  (a plain prefix sum without decay).

All chunks' intra-chunk attention, increments and outputs are single batched matmuls.
"""
from __future__ import annotations

import math

import torch

from ttt2la.runtime.block import split_chunks
from ttt2la.runtime.naive import check_chunk_inputs, compute_dtype, final_state_dtype
from ttt2la.runtime.scan import affine_scan, prefix_sum


def _heads_first(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """``[B, T, H, D] → [B, n, H, C, D]``."""
    return split_chunks(x, n, C).transpose(2, 3)


def torch_chunk_linear_attention(q, k, v, *, chunk_size=64, log_decay=None, scale=None,
                                 initial_state=None, output_final_state=False):
    """Chunked token-causal linear attention; same contract as ``naive_chunk_linear_attention``.

    ``scale=None`` means 1.0 (not ``D**-0.5``). Returns
    ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    check_chunk_inputs(q, k, v, chunk_size=chunk_size, log_decay=log_decay,
                       initial_state=initial_state)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk_size, T)
    n = math.ceil(T / C)
    qc, kc, vc = (_heads_first(x.to(dt), n, C) for x in (q, k, v))
    S0 = None if initial_state is None else initial_state.to(dt)
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()

    attn = qc @ kc.mT  # [B, n, H, C, C]
    if log_decay is None:
        attn = attn.masked_fill(~causal, 0.0)
        increments = kc.mT @ vc
        states = prefix_sum(increments, dim=1, initial=S0)
        q_read = qc
    else:
        b = torch.cumsum(split_chunks(log_decay.to(dt), n, C).transpose(2, 3), dim=-1)  # [B,n,H,C]
        b_last = b[..., -1:]
        mask = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, -math.inf).exp()
        attn = attn * mask
        increments = (kc * (b_last - b).exp().unsqueeze(-1)).mT @ vc
        states = affine_scan(b_last.exp().unsqueeze(-1), increments, initial=S0, dim=1)
        q_read = qc * b.exp().unsqueeze(-1)

    first = (torch.zeros(B, 1, H, Dk, Dv, dtype=dt, device=v.device) if S0 is None
             else S0.unsqueeze(1))
    before = torch.cat([first, states[:, :-1]], dim=1)
    o = attn @ vc + q_read @ before
    if scale is not None:
        o = o * scale
    o = o.transpose(2, 3).reshape(B, n * C, H, Dv)[:, :T]
    final = states[:, -1].to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o.to(v.dtype), final


__all__ = ["torch_chunk_linear_attention"]
