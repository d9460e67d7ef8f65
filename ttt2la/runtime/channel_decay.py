"""Token-causal linear attention whose state decays per key channel (GLA's gate), chunked.

``S_t = diag(exp(g_t)) S_{t-1} + k_tᵀ v_t`` with ``g_t [Dk]``: each row of the state has its own
decay. Inside a chunk the weight of token ``i`` in token ``t``'s read is then
``Σ_c q_tc k_ic exp(Σ_{i<l≤t} g_lc)`` — a sum over channels that is no longer one product of
``q`` and ``k``. Three ways to compute it, the cheapest the decays allow:

* **mild** chunks (no channel decays by more than ``exp(-MILD)`` over a chunk): the decay factors
  into the queries' ``exp`` of their prefix and the keys' ``exp`` of minus theirs (at most
  ``exp(MILD)``), and the attention is one product, as with a decay per head;
* otherwise in **sub-chunks**, as flash-linear-attention's GLA kernels do: 16 tokens, or 8 or 4
  where the decay over 16 or 8 is stronger than ``exp(-MILD)`` (``tiles``). Between sub-chunks
  (keys of ``r`` before queries of ``p``) the decay splits at the boundary before ``p``: the
  queries times ``exp`` of their prefix inside ``p``, the keys times ``exp`` of their suffix
  inside ``r`` and of the sub-chunks between — sums of the log decays themselves, never
  differences of cumulative sums, so nothing cancels or overflows; pairs ``r ≥ p`` are −∞ before
  ``exp``. Inside a sub-chunk the decay factors again, unless even 4 tokens decay more, then
* **exact**: the ``[Dk, 4, 4]`` segment sums per channel, elementwise.

Across chunks the states scan with one factor per row of the state (``blocked_scan`` over
``B·H·Dk`` rows, in blocks of ``ROW_SCAN_BLOCK`` chunks). The choices read the decays' minimum:
a few syncs per call.
"""
from __future__ import annotations

import math

import torch

from ttt2la.runtime.scan import blocked_scan, segment_sums

#: Tokens per sub-chunk: the exact per-channel decay is ``[SUB, SUB, Dk]`` per sub-chunk.
SUB = 16
#: The largest total log decay per channel of a sub-chunk whose decay is factored (see
#: ``_inside_sub_chunks``).
MILD = 8.0
#: The chunk when sub-chunks are shorter than ``SUB`` (see ``tiles``): measured faster than 16
#: or 64 tokens for sub-chunks of 4 and 8 (B = 2, 4 heads of 64, T = 1024, 2 cores).
SHORT_CHUNK = 32
#: Chunks per block of the scan over state rows (see ``scan_rows``).
ROW_SCAN_BLOCK = 16


def tiles(log_decay: torch.Tensor, chunk_size: int) -> tuple[int, int]:
    """``(chunk, sub_chunk)`` for log decays ``[B, T, H, Dk]``: the largest sub-chunk of at most
    ``SUB``, ``SUB/2`` or ``SUB/4`` tokens over which no channel decays by more than
    ``exp(-MILD)`` (its decay then factors: one product), in chunks of ``chunk_size`` rounded up
    to whole sub-chunks, or of at most ``SHORT_CHUNK`` tokens when they are shorter than ``SUB``.
    Where even ``SUB/4`` tokens decay more, the sub-chunks of ``SUB/4`` are computed exactly.
    The chunk size is a tile, not part of the result."""
    C = min(chunk_size, log_decay.shape[1])
    first = min(C, SUB)
    sizes = [first, *(s for s in (SUB // 2, SUB // 4) if s < first)]
    for s in sizes:
        if mild(_window_totals(log_decay, s)):
            break
    if s == first:
        return (C if C <= SUB else math.ceil(C / s) * s), s
    return min(math.ceil(C / s) * s, SHORT_CHUNK), s


def _window_totals(g: torch.Tensor, s: int) -> torch.Tensor:
    """The log decays ``[B, T, ...]`` summed over windows of ``s`` tokens from the first."""
    pad = -g.shape[1] % s
    if pad:
        g = torch.nn.functional.pad(g, [0, 0] * (g.dim() - 2) + [0, pad])
    return g.reshape(g.shape[0], -1, s, *g.shape[2:]).sum(dim=2)


def suffix_sums(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``Σ_{l>i} g_l`` along ``dim`` (exclusive), summed from the end, not as a difference."""
    later = torch.cat([g.narrow(dim, 1, g.shape[dim] - 1),
                       torch.zeros_like(g.narrow(dim, 0, 1))], dim=dim)
    return later.flip(dim).cumsum(dim).flip(dim)


def _segments(g: torch.Tensor) -> torch.Tensor:
    """``Z[..., t, i, c] = Σ_{i<l≤t} g_lc`` for ``t ≥ i``, −inf above the diagonal, from
    ``g [..., s, Dk]`` (a masked cumulative sum, ``scan.segment_sums``, per channel)."""
    return segment_sums(g.transpose(-1, -2)).permute(*range(g.dim() - 2), -2, -1, -3)


def sub_chunks_between(G: torch.Tensor) -> torch.Tensor:
    """``[..., p, r, Dk]``: ``Σ_{r<q<p} G_q`` (the sub-chunks strictly between) for ``r < p``,
    −inf for ``r ≥ p``, from the sub-chunks' totals ``G [..., m, Dk]``."""
    Z = _segments(G)                                    # Z[p', r] = Σ_{r<q≤p'} G_q, p' ≥ r
    closed = torch.full_like(Z[..., :1, :, :], -math.inf)
    return torch.cat([closed, Z[..., :-1, :, :]], dim=-3)


def _factored(q_scaled, k, prefix):
    """``[..., t, i]``: causal attention with the decay factored into the queries' ``exp`` of
    their prefix (``q_scaled``, already applied) and the keys' ``exp`` of minus theirs — exact up
    to rounding where the decay over the block is at most ``exp(MILD)``, else the keys' factors
    would overflow."""
    return causal(q_scaled, k * (-prefix).exp())


def causal(q, k):
    """``q kᵀ`` with the pairs ``i > t`` zeroed."""
    C = q.shape[-2]
    mask = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    return (q @ k.mT).masked_fill(~mask, 0.0)


def _inside_sub_chunks(q_scaled, qs, ks, gs, inside):
    """``[R, n, m, t, i]``: each sub-chunk's own causal attention with its decay per channel:
    factored where every sub-chunk is mild (``q_scaled``: the queries times ``exp`` of
    ``inside``), else exact."""
    if mild(inside[..., -1, :]):
        return _factored(q_scaled, ks, inside)
    return _exact(qs, ks, gs)


def _exact(q, k, g):
    """``[..., t, i]``: causal attention from the exact ``[Dk, t, i]`` segment sums per channel,
    elementwise; the channels come first, so the sum over them adds whole ``[t, i]`` slabs."""
    decays = segment_sums(g.transpose(-1, -2)).exp()
    weighted = decays * k.transpose(-1, -2).unsqueeze(-2) * q.transpose(-1, -2).unsqueeze(-1)
    return weighted.sum(dim=-3)


def mild(totals: torch.Tensor) -> bool:
    """Whether every block decays by at most ``exp(MILD)`` in every channel (one sync)."""
    return float(totals.detach().min()) >= -MILD


def _sub_chunked(q, k, g, s: int):
    """``[R, n, C, C]``: causal attention inside chunks whose decay is strong, in sub-chunks of
    ``s`` tokens (see the module's docstring)."""
    R, n, C, Dk = k.shape
    m = C // s
    qs, ks, gs = (x.reshape(R, n, m, s, Dk) for x in (q, k, g))
    inside = gs.cumsum(dim=-2)                          # Σ_{start of p ≤ l ≤ t} g_l
    # keys scaled per query sub-chunk p: by their suffix in r, by the sub-chunks between
    between = sub_chunks_between(inside[..., -1, :]).exp()   # [R, n, p, r, Dk], 0 for r ≥ p
    keys = (ks * suffix_sums(gs, -2).exp()).unsqueeze(2) * between.unsqueeze(-2)
    q_scaled = qs * inside.exp()
    attn = q_scaled @ keys.reshape(R, n, m, m * s, Dk).mT               # [R, n, p, s, C]
    attn = attn.reshape(R, n, m, s, m, s)
    attn.diagonal(dim1=2, dim2=4).add_(_inside_sub_chunks(q_scaled, qs, ks, gs, inside)
                                       .permute(0, 1, 3, 4, 2))
    return attn.reshape(R, n, C, C)


def intra_chunk_channel_decay(q, k, v, g, sub: int):
    """In-chunk attention, chunk increments, decayed queries and chunk decay for log decays
    per key channel, all heads and chunks at once.

    ``q, k [R, n, C, Dk]``, ``v [R, n, C, Dv]``, ``g [R, n, C, Dk]``, ``C`` a multiple of the
    sub-chunk ``sub`` (``tiles``). Returns ``(o_intra [R, n, C, Dv], increment [R, n,
    Dk, Dv], q_read [R, n, C, Dk], decay [R, n, Dk])``: the same parts as the per-head path of
    ``chunk.py``. Chunks that all decay mildly (``MILD``) factor their decay over the whole
    chunk; otherwise the attention is built in sub-chunks.
    """
    prefix = g.cumsum(dim=-2)                           # Σ_{l≤t} g_l within the chunk
    total = prefix[..., -1, :]
    q_read = q * prefix.exp()
    if mild(total):                    # the keys' factors also give the increment's decays
        keys = k * (-prefix).exp()
        attn, decay = causal(q_read, keys), total.exp()
        increment = (keys * decay.unsqueeze(-2)).mT @ v
    else:
        attn, decay = _sub_chunked(q, k, g, sub), total.exp()
        increment = (k * suffix_sums(g, -2).exp()).mT @ v
    return attn @ v, increment, q_read, decay


def scan_rows(decay: torch.Tensor, increments: torch.Tensor,
              initial: torch.Tensor | None) -> torch.Tensor:
    """Chunk-boundary states ``S_j = diag(decay_j) S_{j-1} + U_j``: ``decay [R, n, Dk]``,
    ``increments [R, n, Dk, Dv]``, ``initial [R, Dk, Dv]`` or None; returns ``[R, n, Dk, Dv]``.
    Each row of the state is one row of ``blocked_scan``."""
    R, n, Dk, Dv = increments.shape
    rows = increments.permute(0, 2, 1, 3).reshape(R * Dk, n, Dv)
    init = None if initial is None else initial.reshape(R * Dk, Dv)
    states = blocked_scan(decay.transpose(1, 2).reshape(R * Dk, n), rows, init, ROW_SCAN_BLOCK)
    return states.reshape(R, Dk, n, Dv).permute(0, 2, 1, 3).contiguous()


__all__ = ["SUB", "tiles", "intra_chunk_channel_decay", "scan_rows", "causal", "mild",
           "sub_chunks_between", "suffix_sums"]
