"""Token-causal (gated) linear attention in plain torch, by the standard chunked algorithm.

``S_t = exp(log_decay_t) S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t``. Per-token TTT loops and
fully reduced linear attention lower to this. With ``g`` the log-decays of one chunk:

* inside a chunk: ``o_t += Σ_{i≤t} exp(Σ_{i<l≤t} g_l) (q_t·k_i) v_i`` — the decay mask holds the
  segment sums ``Σ_{i<l≤t} g_l`` themselves (a cumulative sum of ``g`` masked to ``l > i``), not
  differences of cumulative sums, so neither the mask nor its gradient loses digits to
  cancellation; the non-causal half is −inf *before* ``exp``;
* across chunks: ``o_t += exp(Σ_{l≤t} g_l) q_t S_{j-1}``, where the boundary states
  ``S_j = exp(Σ g) S_{j-1} + Σ_i exp(Σ_{l>i} g_l) k_iᵀ v_i`` come from one blocked affine scan
  over chunks (``scan.blocked_scan``: log-depth; a plain prefix sum without decay).

All chunks' intra-chunk attention, increments and outputs are batched matmuls, one call per
head (a head's chunks are strided views BLAS reads in place); the chunk states are kept
head-major, ``[B, H, N, Dk, Dv]``, so the scan works on contiguous views.
"""
from __future__ import annotations

import math

import torch

import torch.nn.functional as F

from ttt2la.runtime.naive import check_chunk_inputs, compute_dtype, final_state_dtype
from ttt2la.runtime.scan import blocked_scan


def split_chunks(x: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...] → [B, n, chunk_size, ...]``, zero-padding the tokens after ``T``."""
    pad = n * chunk_size - x.shape[1]
    if pad > 0:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.reshape(x.shape[0], n, chunk_size, *x.shape[2:])


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``Z[..., t, i] = Σ_{i<l≤t} g_l`` for ``t ≥ i`` (−inf above the diagonal), from ``g [..., C]``.

    Summed directly (a cumulative sum over ``t`` of ``g_t`` masked to ``t > i``), never as a
    difference of two cumulative sums.
    """
    C = g.shape[-1]
    later = torch.ones(C, C, dtype=torch.bool, device=g.device).triu(1)  # [i, t]: t > i
    sums = torch.cumsum(g.unsqueeze(-2).masked_fill(~later, 0.0), dim=-1)  # [..., i, t]
    return sums.mT.masked_fill(later, -math.inf)  # [..., t, i]; later[t, i]: i > t


def _intra_chunk(q, k, v, g, causal):
    """One head: in-chunk attention, chunk increments, decayed queries and chunk decay.

    ``q, k, v``: ``[B, n, C, D]``; ``g``: log-decays ``[B, n, C]`` or None. Returns
    ``(o_intra [B, n, C, Dv], increment [B, n, Dk, Dv], q_read [B, n, C, Dk], decay [B, n] or None)``.
    """
    attn = q @ k.mT  # [B, n, C, C]
    if g is None:
        return attn.masked_fill(~causal, 0.0) @ v, k.mT @ v, q, None
    segments = segment_sums(g)  # [B, n, C, C]
    mask = segments.exp()
    increment = (k * mask[..., -1, :].unsqueeze(-1)).mT @ v
    b = torch.cumsum(g, dim=-1)
    return (attn * mask) @ v, increment, q * b.exp().unsqueeze(-1), b[..., -1].exp()


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
    g = None if log_decay is None else split_chunks(log_decay.to(dt), n, C).unbind(3)
    causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    heads = [_intra_chunk(qc[h], kc[h], vc[h], None if g is None else g[h], causal)
             for h in range(H)]
    increments = torch.stack([inc for _, inc, _, _ in heads], dim=1)  # [B, H, n, Dk, Dv]
    decay = None if g is None else torch.stack([d for *_, d in heads], dim=1)  # [B, H, n]

    S0 = None if initial_state is None else initial_state.to(dt)
    states = blocked_scan(None if decay is None else decay.reshape(B * H, n),
                          increments.reshape(B * H, n, Dk * Dv),
                          None if S0 is None else S0.reshape(B * H, Dk * Dv))
    states = states.view(B, H, n, Dk, Dv)
    first = (torch.zeros(B, H, 1, Dk, Dv, dtype=dt, device=v.device) if S0 is None
             else S0.unsqueeze(2))
    before = torch.cat([first, states[:, :, :-1]], dim=2).unbind(1)
    o = torch.stack([o_intra + q_read @ S for (o_intra, _, q_read, _), S in zip(heads, before)],
                    dim=3)  # [B, n, C, H, Dv]
    if scale is not None:
        o = o * scale
    o = o.reshape(B, n * C, H, Dv)[:, :T]
    final = (states[:, :, -1].to(final_state_dtype(v, initial_state)) if output_final_state
             else None)
    return o.to(v.dtype), final


__all__ = ["torch_chunk_linear_attention", "segment_sums"]
