"""Token-causal linear attention whose state decays per value channel (a column of the state),
chunked: flash-linear-attention's ``gv``, the second pass of gated slot attention.

``S_t = S_{t-1} diag(exp(g_t)) + k_tᵀ v_t`` with ``g_t [Dv]``: each column of the state has its
own decay, so token ``s``'s value reaches token ``t``'s output as
``o_t[c] = Σ_{s≤t} (q_t·k_s) v_s[c] exp(Σ_{s<l≤t} g_l[c])`` — the attention ``A = q kᵀ`` is
shared by the channels, the decay acts on the values and the outputs. The same three ways as a
decay per key channel (``channel_decay.py``, whose tiles and sums this file shares), the cheapest
the decays allow:

* **mild** chunks: ``o = exp(G_t) ⊙ (tril(A) (v ⊙ exp(−G_s)))``, ``G`` the in-chunk prefix sums;
* otherwise in **sub-chunks**: between sub-chunks (keys of ``r`` before queries of ``p``) the
  values times ``exp`` of their suffix inside ``r`` and of the sub-chunks between, the outputs
  times ``exp`` of their prefix inside ``p`` — sums of the log decays themselves, never
  differences of cumulative sums; pairs ``r ≥ p`` are −∞ before ``exp``. Inside a sub-chunk the
  decay factors again, unless even 4 tokens decay more, then
* **exact**: the ``[Dv, 4, 4]`` segment sums per channel, elementwise.

Across chunks the states scan with one factor per column (``channel_decay.scan_rows`` on the
transposed states), and each chunk's read of the state before it is scaled per output channel
by the decay from the chunk's start (``read_scale``).
"""
from __future__ import annotations

import torch

from ttt2la.runtime.channel_decay import (causal, mild, scan_rows, sub_chunks_between,
                                          suffix_sums)
from ttt2la.runtime.scan import segment_sums


def _exact(attn, v, g):
    """``[..., t, Dv]``: ``Σ_i attn[t, i] v[i, c] exp(Σ_{i<l≤t} g_lc)`` from the exact
    ``[Dv, t, i]`` segment sums per channel (−∞ above the diagonal), elementwise."""
    decays = segment_sums(g.transpose(-1, -2)).exp()               # [..., Dv, t, i]
    weighted = decays * attn.unsqueeze(-3) * v.transpose(-1, -2).unsqueeze(-2)
    return weighted.sum(dim=-1).transpose(-1, -2)


def _inside_sub_chunks(qs, ks, vs, gs, inside):
    """``[R, n, m, s, Dv]``: each sub-chunk's own causal attention with its decay per value
    channel, factored where every sub-chunk is mild, else exact."""
    attn = causal(qs, ks)
    if mild(inside[..., -1, :]):
        return inside.exp() * (attn @ (vs * (-inside).exp()))
    return _exact(attn, vs, gs)


def _sub_chunked(q, k, v, g, s: int):
    """``[R, n, C, Dv]``: the in-chunk outputs of chunks whose decay is strong, in sub-chunks of
    ``s`` tokens (see the module's docstring)."""
    R, n, C, Dv = v.shape
    m = C // s
    qs, ks = (x.reshape(R, n, m, s, x.shape[-1]) for x in (q, k))
    vs, gs = (x.reshape(R, n, m, s, Dv) for x in (v, g))
    inside = gs.cumsum(dim=-2)                          # Σ_{start of p ≤ l ≤ t} g_l
    # values scaled per query sub-chunk p: by their suffix in r, by the sub-chunks between
    between = sub_chunks_between(inside[..., -1, :]).exp()   # [R, n, p, r, Dv], 0 for r ≥ p
    values = (vs * suffix_sums(gs, -2).exp()).unsqueeze(2) * between.unsqueeze(-2)
    attn = (qs @ k.unsqueeze(2).mT)                     # [R, n, p, s, C]
    o = inside.exp() * (attn @ values.reshape(R, n, m, m * s, Dv))
    o = o + _inside_sub_chunks(qs, ks, vs, gs, inside)
    return o.reshape(R, n, C, Dv)


def intra_chunk_value_decay(q, k, v, g, sub: int):
    """In-chunk outputs, chunk increments, read scales and chunk decay for log decays per value
    channel, all heads and chunks at once.

    ``q, k [R, n, C, Dk]``, ``v, g [R, n, C, Dv]``, ``C`` a multiple of the sub-chunk ``sub``
    (``channel_decay.tiles`` on ``g``). Returns ``(o_intra [R, n, C, Dv], increment [R, n, Dk,
    Dv], read_scale [R, n, C, Dv], decay [R, n, Dv])``: a chunk's read of the state before it
    is ``read_scale ⊙ (q S)``; the state's columns decay by ``decay`` over the chunk.
    """
    prefix = g.cumsum(dim=-2)                           # Σ_{l≤t} g_l within the chunk
    total = prefix[..., -1, :]
    read_scale, decay = prefix.exp(), total.exp()
    if mild(total):                    # the values' factors also give the increment's decays
        values = v * (-prefix).exp()
        o = read_scale * (causal(q, k) @ values)
        increment = k.mT @ (values * decay.unsqueeze(-2))
    else:
        o = _sub_chunked(q, k, v, g, sub)
        increment = k.mT @ (v * suffix_sums(g, -2).exp())
    return o, increment, read_scale, decay


def scan_columns(decay: torch.Tensor, increments: torch.Tensor,
                 initial: torch.Tensor | None) -> torch.Tensor:
    """Chunk-boundary states ``S_j = S_{j-1} diag(decay_j) + U_j``: ``decay [R, n, Dv]``,
    ``increments [R, n, Dk, Dv]``, ``initial [R, Dk, Dv]`` or None; returns ``[R, n, Dk, Dv]``.
    Each column is a row of the transposed states (``scan_rows``)."""
    states = scan_rows(decay, increments.mT, None if initial is None else initial.mT)
    return states.mT


__all__ = ["intra_chunk_value_decay", "scan_columns"]
