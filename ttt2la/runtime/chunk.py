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

The inputs are laid out head-major once (``[B·H, N, C, D]``; no copy for one head of contiguous
tokens), so every chunk of every head is a contiguous block and the intra-chunk attention, the
increments and the reads are each one batched matmul; the states, ``[B·H, N, Dk, Dv]``, scan as
contiguous rows, and each chunk's read of the state before it is added in place.
"""
from __future__ import annotations

import math

import torch

import torch.nn.functional as F

from ttt2la.runtime.channel_decay import intra_chunk_channel_decay, scan_rows, tiles
from ttt2la.runtime.naive import check_chunk_inputs, compute_dtype, final_state_dtype
from ttt2la.runtime.scan import blocked_scan, segment_sums
from ttt2la.runtime.value_decay import intra_chunk_value_decay, scan_columns


def split_chunks(x: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...] → [B, n, chunk_size, ...]``, zero-padding the tokens after ``T``."""
    pad = n * chunk_size - x.shape[1]
    if pad > 0:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    return x.reshape(x.shape[0], n, chunk_size, *x.shape[2:])


def _head_major(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...] → [B·H, n, C, ...]``: at most one copy into head-major order (none when
    that is how ``x`` lies), zero-padded after ``T``; every chunk of every head is then a
    contiguous block, so all heads and chunks run as one batched matmul with no hidden copies."""
    B, T, H = x.shape[:3]
    x = x.movedim(2, 1).reshape(B * H, T, *x.shape[3:]).contiguous()
    return split_chunks(x, n, C)


def _intra_chunk(q, k, v, g, causal):
    """In-chunk attention, chunk increments, decayed queries and chunk decay, all heads at once.

    ``q, k, v``: ``[N, n, C, D]``; ``g``: log-decays ``[N, n, C]`` or None. Returns
    ``(o_intra [N, n, C, Dv], increment [N, n, Dk, Dv], q_read [N, n, C, Dk], decay [N, n] or None)``.
    """
    attn = q @ k.mT  # [N, n, C, C]
    if g is None:
        return attn.masked_fill(~causal, 0.0) @ v, k.mT @ v, q, None
    segments = segment_sums(g)  # [N, n, C, C]
    mask = segments.exp()
    increment = (k * mask[..., -1, :].unsqueeze(-1)).mT @ v
    b = torch.cumsum(g, dim=-1)
    return (attn * mask) @ v, increment, q * b.exp().unsqueeze(-1), b[..., -1].exp()


def _reads_of_previous(q_read: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """``q_read[r, j] @ states[r, j-1]`` for every row ``r`` and chunk ``j ≥ 1``, flattened to
    ``[R·n − 1, C, Dv]`` beside the flattened outputs' chunks ``1 …``: one matmul over
    contiguous slices (no copy of ``states[:, :-1]``); the pairs that straddle two rows (a row's
    first chunk with the previous row's last state) are zeroed."""
    R, n, C, Dk = q_read.shape
    reads = q_read.reshape(R * n, C, Dk)[1:] @ states.reshape(R * n, Dk, -1)[:-1]
    if R > 1:
        straddling = torch.arange(1, R, device=reads.device) * n - 1
        reads.index_fill_(0, straddling, 0.0)
    return reads


def torch_chunk_linear_attention(q, k, v, *, chunk_size=64, log_decay=None, scale=None,
                                 value_log_decay=None, initial_state=None,
                                 output_final_state=False):
    """Chunked token-causal linear attention; same contract as ``naive_chunk_linear_attention``.

    ``scale=None`` means 1.0 (not ``D**-0.5``). A decay per key channel runs in
    ``channel_decay.py``, one per value channel (``value_log_decay``, a decay per head added to
    it) in ``value_decay.py``. Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    check_chunk_inputs(q, k, v, chunk_size=chunk_size, log_decay=log_decay,
                       initial_state=initial_state, value_log_decay=value_log_decay)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    per_value = value_log_decay is not None
    if per_value:
        log_decay = value_log_decay if log_decay is None else \
            value_log_decay + log_decay.unsqueeze(-1)
    per_channel = log_decay is not None and log_decay.dim() == 4
    C, sub = tiles(log_decay, chunk_size) if per_channel else (min(chunk_size, T), None)
    n = math.ceil(T / C)
    qc, kc, vc = (_head_major(x.to(dt), n, C) for x in (q, k, v))   # [B·H, n, C, D]
    g = None if log_decay is None else _head_major(log_decay.to(dt), n, C)
    S0 = None if initial_state is None else initial_state.to(dt).reshape(B * H, Dk, Dv)
    read_scale = None                   # per value channel: a chunk's read scaled per column
    if per_value:
        o, increments, read_scale, decay = intra_chunk_value_decay(qc, kc, vc, g, sub)
        states, q_read = scan_columns(decay, increments, S0), qc
    elif per_channel:
        o, increments, q_read, decay = intra_chunk_channel_decay(qc, kc, vc, g, sub)
        states = scan_rows(decay, increments, S0)
    else:
        causal = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        o, increments, q_read, decay = _intra_chunk(qc, kc, vc, g, causal)
        states = blocked_scan(decay, increments.reshape(B * H, n, Dk * Dv),
                              None if S0 is None else S0.reshape(B * H, Dk * Dv))
        states = states.view(B * H, n, Dk, Dv)
    # chunk j reads the state left by chunks < j, added in place (a matmul's backward does
    # not read its result): no concatenation of the initial state to the states
    if n > 1:
        reads = _reads_of_previous(q_read, states)
        o.view(-1, C, Dv)[1:] += reads if read_scale is None else \
            reads * read_scale.reshape(-1, C, Dv)[1:]
    if S0 is not None:
        first = q_read[:, 0] @ S0
        o[:, 0] += first if read_scale is None else first * read_scale[:, 0]
    if scale is not None:
        o = o * scale
    o = o.reshape(B, H, n * C, Dv)[:, :, :T].movedim(1, 2)
    final = (states[:, -1].reshape(B, H, Dk, Dv).to(final_state_dtype(v, initial_state))
             if output_final_state else None)
    return o.to(v.dtype), final


__all__ = ["torch_chunk_linear_attention", "segment_sums"]
