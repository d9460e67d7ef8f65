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

All chunks' intra-chunk attention, increments and outputs are batched matmuls, one call per
head (a head's chunks are strided views BLAS reads in place; batching heads as well forces
transposed copies of every input: measured up to 40% slower).
"""
from __future__ import annotations

import math

import torch

from ttt2la.runtime.block import split_chunks
from ttt2la.runtime.naive import check_chunk_inputs, compute_dtype, final_state_dtype
from ttt2la.runtime.scan import affine_scan, prefix_sum


def _intra_chunk(q, k, v, b, causal):
    """One head: in-chunk attention, chunk increments and decayed queries, all chunks at once.

    ``q, k, v``: ``[B, n, C, D]``; ``b``: cumulative log-decay inside each chunk ``[B, n, C]`` or
    None. Returns ``(o_intra [B, n, C, Dv], increment [B, n, Dk, Dv], q_read [B, n, C, Dk])``.
    """
    attn = q @ k.mT  # [B, n, C, C]
    if b is None:
        return attn.masked_fill(~causal, 0.0) @ v, k.mT @ v, q
    b_last = b[..., -1:]
    mask = (b.unsqueeze(-1) - b.unsqueeze(-2)).masked_fill(~causal, -math.inf).exp()
    increment = (k * (b_last - b).exp().unsqueeze(-1)).mT @ v
    return (attn * mask) @ v, increment, q * b.exp().unsqueeze(-1)


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
    qc, kc, vc = (split_chunks(x.to(dt), n, C).unbind(3) for x in (q, k, v))
    b = (None if log_decay is None
         else torch.cumsum(split_chunks(log_decay.to(dt), n, C), dim=2))  # [B, n, C, H]
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    heads = [_intra_chunk(qc[h], kc[h], vc[h], None if b is None else b[..., h], causal)
             for h in range(H)]
    increments = torch.stack([inc for _, inc, _ in heads], dim=2)  # [B, n, H, Dk, Dv]

    S0 = None if initial_state is None else initial_state.to(dt)
    if b is None:
        states = prefix_sum(increments, dim=1, initial=S0)
    else:
        states = affine_scan(b[:, :, -1].exp()[..., None, None], increments, initial=S0, dim=1)
    first = (torch.zeros(B, 1, H, Dk, Dv, dtype=dt, device=v.device) if S0 is None
             else S0.unsqueeze(1))
    before = torch.cat([first, states[:, :-1]], dim=1).unbind(2)
    o = torch.stack([o_intra + q_read @ S for (o_intra, _, q_read), S in zip(heads, before)],
                    dim=3)  # [B, n, C, H, Dv]
    if scale is not None:
        o = o * scale
    o = o.reshape(B, n * C, H, Dv)[:, :T]
    final = states[:, -1].to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o.to(v.dtype), final


__all__ = ["torch_chunk_linear_attention"]
