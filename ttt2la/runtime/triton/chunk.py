"""Token-causal chunked linear attention with a per-head scalar decay, as Triton kernels.

``o_t = scale · q_t S_t`` with ``S_t = exp(log_decay_t) S_{t-1} + k_tᵀ v_t``. The forward pass walks the chunks
once to produce the state at every chunk boundary, then every chunk computes its output in parallel from that
state plus a masked intra-chunk attention. The backward pass recomputes the boundary states (cheaper than storing
them), walks the chunks in reverse for the state gradients, and assembles the decay gradient chunk by chunk.
Every exponent of the decay is a sum of log decays over its own span (``Spans``; the in-chunk mask a masked
cumulative sum per pair), never a difference of two cumulative sums, which would cost the open span after a gate
that shut earlier in the chunk its digits.

Addressing: each program forms scalar int64 base pointers (token ``t0`` of its batch and head, its chunk's state)
and int32 offsets within the tile; int64 offsets per element cost about 1.5× the registers.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ttt2la.runtime.higher_order import refuse_graph
from ttt2la.runtime.naive import check_chunk_inputs, final_state_dtype

from ._common import HALF_DTYPES, cdiv, contiguous, cumulative, default_warps, mm, tile, tl_dtype, total, upcast
from .tile_tuning import Config, candidates, config, launch, shape_key, sides_up_to


@triton.jit
def token_base(ptr, i_b, i_h, t0, T, H, D):
    """Pointer to feature 0 of token ``t0`` (batch ``i_b``, head ``i_h``) of a ``[B, T, H, D]`` tensor."""
    return ptr + ((i_b * T + t0).to(tl.int64) * H + i_h) * D


@triton.jit
def load_tile(base, o_t, m_t, o_d, H, D):
    """The ``[BT, BD]`` tile of tokens ``o_t`` (relative to ``base``) and features ``o_d``, zero outside."""
    return tl.load(base + o_t[:, None] * (H * D) + o_d[None, :], mask=m_t[:, None] & (o_d[None, :] < D), other=0.)


@triton.jit
def store_tile(base, value, o_t, m_t, o_d, H, D):
    """Store a ``[BT, BD]`` tile where ``load_tile`` reads it."""
    tl.store(base + o_t[:, None] * (H * D) + o_d[None, :], value.to(base.dtype.element_ty),
             mask=m_t[:, None] & (o_d[None, :] < D))


@triton.jit
def _chunk_decay(g, i_b, i_h, i_t, T, H, BT: tl.constexpr):
    """The chunk's cumulative log decays (padding rows repeat the last one) and the last one."""
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    base = token_base(g, i_b, i_h, i_t * BT, T, H, 1)
    g_last = tl.load(base + (tl.minimum(BT, T - i_t * BT) - 1) * H).to(tl.float32)
    b_g = tl.load(base + o_t * H, mask=m_t, other=0.).to(tl.float32)
    return tl.where(m_t, b_g, g_last), g_last


@triton.jit
def _chunk_suffix(gs, i_b, i_h, i_t, T, H, BT: tl.constexpr):
    """The chunk's exclusive suffix sums of the log decays per head, ``Σ_{t<l≤last} g_l`` (0 past ``T``)."""
    o_t = tl.arange(0, BT)
    base = token_base(gs, i_b, i_h, i_t * BT, T, H, 1)
    return tl.load(base + o_t * H, mask=i_t * BT + o_t < T, other=0.).to(tl.float32)


@triton.jit
def _chunk_segments(gr, i_b, i_h, i_t, T, H, BT: tl.constexpr):
    """``[BT, BT]``: ``Σ_{i<l≤t} g_l`` at ``[t, i]`` for ``t > i``, else 0: per-head log decays summed over
    each pair's own span (a masked cumulative sum), never a difference of two cumulative sums."""
    o_t = tl.arange(0, BT)
    base = token_base(gr, i_b, i_h, i_t * BT, T, H, 1)
    b_g = tl.load(base + o_t * H, mask=i_t * BT + o_t < T, other=0.).to(tl.float32)
    return cumulative(tl.where(o_t[:, None] > o_t[None, :], b_g[:, None], 0.), 0, False)


@triton.jit
def decay_rows(g, i_b, i_h, t0, n, T, H, K, o_k, N: tl.constexpr, SHIFT: tl.constexpr):
    """``[N, BK]``: the log decays per key channel ``[B, T, H, K]`` of tokens ``t0 + i + SHIFT`` in channels
    ``o_k``, in fp32, zero where ``i + SHIFT`` leaves the window of ``n`` tokens from ``t0`` or passes ``T``."""
    rows = tl.arange(0, N) + SHIFT
    m = (rows < n) & (t0 + rows < T)
    return tl.load(token_base(g, i_b, i_h, t0, T, H, K) + rows[:, None] * (H * K) + o_k[None, :],
                   mask=m[:, None] & (o_k[None, :] < K), other=0.).to(tl.float32)


@triton.jit
def window_spans(g, i_b, i_h, t0, T, H, K, o_k, N: tl.constexpr):
    """Sums of the log decays per key channel over the window of ``N`` tokens from ``t0``, each over its own
    span, never a difference of two: ``(inclusive prefix [N, BK], exclusive suffix [N, BK], total [BK])``
    (rows past ``T`` count as zero)."""
    b_g = decay_rows(g, i_b, i_h, t0, N, T, H, K, o_k, N, 0)
    later = decay_rows(g, i_b, i_h, t0, N, T, H, K, o_k, N, 1)
    return cumulative(b_g, 0, False), cumulative(later, 0, True), total(b_g, 0)


@triton.jit
def _states_fwd_kernel(k, v, g, gs, h0, h, ht, T,
                       H, K, V,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_G: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                       DT: tl.constexpr, UPCAST: tl.constexpr, CHANNEL: tl.constexpr):
    """Sequential over chunks: writes ``h[b, h, j]``, the state before chunk ``j``, and the final state.

    Per head, ``g`` holds the chunk's inclusive prefix sums of the log decays and ``gs`` its exclusive suffix
    sums, each summed directly, never a difference. ``CHANNEL``: ``g`` holds log decays per key channel (a row
    of the state) themselves, summed here (``window_spans``).
    """
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.full([BK, BV], 0., tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    for i_t in range(0, NT):
        tl.store(h + (i_bh.to(tl.int64) * NT + i_t) * K * V + p_kv, b_h.to(h.dtype.element_ty), mask=m_kv)
        m_t = i_t * BT + o_t < T
        b_k = load_tile(token_base(k, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
        b_v = load_tile(token_base(v, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        if USE_G:
            if CHANNEL:
                _, b_suffix, g_lastc = window_spans(g, i_b, i_h, i_t * BT, T, H, K, o_k, BT)
                b_h *= tl.exp(g_lastc)[:, None]
                b_k = b_k.to(tl.float32) * tl.exp(b_suffix)
            else:
                _, g_last = _chunk_decay(g, i_b, i_h, i_t, T, H, BT)
                b_h *= tl.exp(g_last)
                b_k = b_k.to(tl.float32) * tl.exp(_chunk_suffix(gs, i_b, i_h, i_t, T, H, BT))[:, None]
        b_h += mm(tl.trans(b_k), b_v, DT, UPCAST)
    if STORE_FINAL:
        tl.store(ht + i_bh.to(tl.int64) * K * V + p_kv, b_h, mask=m_kv)


@triton.jit
def _output_fwd_kernel(q, k, v, g, gr, h, o, scale, T,
                       H, K, V,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_G: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk × value tile: ``o = scale·(q h_j ⊙ decay + (q kᵀ ⊙ causal decay) v)``."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    q_base = token_base(q, i_b, i_h, i_t * BT, T, H, K)
    k_base = token_base(k, i_b, i_h, i_t * BT, T, H, K)
    h_base = h + (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_o = tl.full([BT, BV], 0., tl.float32)
    b_a = tl.full([BT, BT], 0., tl.float32)
    for i_k in range(0, cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = load_tile(q_base, o_t, m_t, o_k, H, K)
        b_k = load_tile(k_base, o_t, m_t, o_k, H, K)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=(o_k[:, None] < K) & (o_v[None, :] < V),
                      other=0.)
        b_o += mm(b_q, b_h, DT, UPCAST)
        b_a += mm(b_q, tl.trans(b_k), DT, UPCAST)
    causal = o_t[:, None] >= o_t[None, :]
    if USE_G:
        b_g, g_last = _chunk_decay(g, i_b, i_h, i_t, T, H, BT)
        b_o *= tl.exp(b_g)[:, None]
        b_a *= tl.exp(_chunk_segments(gr, i_b, i_h, i_t, T, H, BT))
    b_a = tl.where(causal, b_a, 0.)
    b_v = load_tile(token_base(v, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
    b_o = (b_o + mm(b_a, b_v, DT, UPCAST)) * scale
    store_tile(token_base(o, i_b, i_h, i_t * BT, T, H, V), b_o, o_t, m_t, o_v, H, V)


@triton.jit
def _states_bwd_kernel(q, do, g, dht, dh, dh0, scale, T,
                       H, K, V,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       USE_G: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                       DT: tl.constexpr, UPCAST: tl.constexpr, CHANNEL: tl.constexpr):
    """Reverse over chunks: writes ``dh[b, h, j]``, the gradient of the state after chunk ``j``, and ``dh0``
    (``CHANNEL``: as in ``_states_fwd_kernel``)."""
    i_k, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.full([BK, BV], 0., tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_bh.to(tl.int64) * K * V + p_kv, mask=m_kv, other=0.).to(tl.float32)
    for i_r in range(0, NT):
        i_t = NT - 1 - i_r
        tl.store(dh + (i_bh.to(tl.int64) * NT + i_t) * K * V + p_kv, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        m_t = i_t * BT + o_t < T
        b_q = load_tile(token_base(q, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
        b_do = load_tile(token_base(do, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        if USE_G:
            if CHANNEL:
                b_gc, _, g_lastc = window_spans(g, i_b, i_h, i_t * BT, T, H, K, o_k, BT)
                b_dh *= tl.exp(g_lastc)[:, None]
                b_q = b_q.to(tl.float32) * tl.exp(b_gc)
            else:
                b_g, g_last = _chunk_decay(g, i_b, i_h, i_t, T, H, BT)
                b_dh *= tl.exp(g_last)
                b_q = b_q.to(tl.float32) * tl.exp(b_g)[:, None]
        b_dh += scale * mm(tl.trans(b_q), b_do, DT, UPCAST)
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + p_kv, b_dh, mask=m_kv)


@triton.jit
def _dqk_bwd_kernel(q, k, v, g, gs, gr, h, do, dh, dq, dk, dg, scale, T,
                    H, K, V,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    USE_G: tl.constexpr, STORE_DG: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk × key tile: ``dq``, ``dk`` and (``STORE_DG``) this key tile's share of ``d log_decay``.

    The decay gradient is assembled chunk-locally in a form without cancellation: for token ``s`` of chunk
    ``j`` it is ``Σ_{r≥s} q_r·dq_r^inter + Σ_{r≥s>c} P_rc + Σ_{c<s} k_c·dk_c^inter``
    ``+ e^{g_last}⟨h_j, dh_j⟩``, where ``P_rc`` is the intra-chunk score times its gradient, ``h_j`` the
    state before the chunk and ``dh_j`` the gradient of the state after it. Each term is linear in the key
    features, so the key tiles' shares add up.
    """
    i_t, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    v_base = token_base(v, i_b, i_h, i_t * BT, T, H, V)
    do_base = token_base(do, i_b, i_h, i_t * BT, T, H, V)
    state = (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_dq = tl.full([BT, BK], 0., tl.float32)
    b_dk = tl.full([BT, BK], 0., tl.float32)
    b_ds = tl.full([BT, BT], 0., tl.float32)
    b_hdh = tl.full([BK], 0., tl.float32)
    for i_v in range(0, cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        b_v = load_tile(v_base, o_t, m_t, o_v, H, V)
        b_do = load_tile(do_base, o_t, m_t, o_v, H, V)
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dq += mm(b_do, tl.trans(b_h), DT, UPCAST)
        b_dk += mm(b_v, tl.trans(b_dh), DT, UPCAST)
        b_ds += mm(b_do, tl.trans(b_v), DT, UPCAST)
        if STORE_DG:
            b_hdh += total(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    causal = o_t[:, None] >= o_t[None, :]
    b_q = load_tile(token_base(q, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
    b_k = load_tile(token_base(k, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
    b_dq *= scale
    if USE_G:
        b_g, g_last = _chunk_decay(g, i_b, i_h, i_t, T, H, BT)
        b_dq *= tl.exp(b_g)[:, None]
        b_dk *= tl.exp(_chunk_suffix(gs, i_b, i_h, i_t, T, H, BT))[:, None]
        b_ds *= tl.exp(_chunk_segments(gr, i_b, i_h, i_t, T, H, BT))
    b_ds = tl.where(causal, b_ds, 0.) * scale
    if STORE_DG:
        inter_q = total(b_q.to(tl.float32) * b_dq, 1)
        inter_k = total(b_k.to(tl.float32) * b_dk, 1)
        b_p = b_ds * mm(b_q, tl.trans(b_k), DT, UPCAST)
        crossing = total(tl.where(o_t[None, :] < o_t[:, None], cumulative(b_p, 0, True), 0.), 1)
        b_dg = (cumulative(inter_q, 0, True) + crossing + cumulative(inter_k, 0, False) - inter_k
                + tl.exp(g_last) * total(b_hdh, 0))
        dg_base = token_base(dg + i_k.to(tl.int64) * tl.num_programs(2) * T, i_b, i_h, i_t * BT, T, H, 1)
        tl.store(dg_base + o_t * H, b_dg, mask=m_t)
    b_dq += mm(b_ds, b_k, DT, UPCAST)
    b_dk += mm(tl.trans(b_ds), b_q, DT, UPCAST)
    store_tile(token_base(dq, i_b, i_h, i_t * BT, T, H, K), b_dq, o_t, m_t, o_k, H, K)
    store_tile(token_base(dk, i_b, i_h, i_t * BT, T, H, K), b_dk, o_t, m_t, o_k, H, K)


@triton.jit
def _dv_bwd_kernel(q, k, gs, gr, do, dh, dv, scale, T,
                   H, K, V,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   USE_G: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk × value tile: ``dv = k dh ⊙ decay + (k qᵀ ⊙ anti-causal decay) do``."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    q_base = token_base(q, i_b, i_h, i_t * BT, T, H, K)
    k_base = token_base(k, i_b, i_h, i_t * BT, T, H, K)
    dh_base = dh + (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_dv = tl.full([BT, BV], 0., tl.float32)
    b_a = tl.full([BT, BT], 0., tl.float32)
    for i_k in range(0, cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_q = load_tile(q_base, o_t, m_t, o_k, H, K)
        b_k = load_tile(k_base, o_t, m_t, o_k, H, K)
        b_dh = tl.load(dh_base + o_k[:, None] * V + o_v[None, :], mask=(o_k[:, None] < K) & (o_v[None, :] < V),
                       other=0.)
        b_dv += mm(b_k, b_dh, DT, UPCAST)
        b_a += mm(b_k, tl.trans(b_q), DT, UPCAST)
    anticausal = o_t[:, None] <= o_t[None, :]
    if USE_G:
        b_dv *= tl.exp(_chunk_suffix(gs, i_b, i_h, i_t, T, H, BT))[:, None]
        b_a *= tl.exp(tl.trans(_chunk_segments(gr, i_b, i_h, i_t, T, H, BT)))
    b_a = tl.where(anticausal, b_a, 0.) * scale
    b_do = load_tile(token_base(do, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
    b_dv += mm(b_a, b_do, DT, UPCAST)
    store_tile(token_base(dv, i_b, i_h, i_t * BT, T, H, V), b_dv, o_t, m_t, o_v, H, V)


def chunk_tile(chunk_size: int, dtype: torch.dtype) -> int:
    """The kernels' chunk length: ``chunk_size`` rounded down to a power of two in [16, 64] (32 for fp32).

    Chunking does not change the result of this op, only its cost; the cap keeps the ``[BT, BT]`` intra-chunk
    tile and the per-chunk states within what one program holds in registers.
    """
    cap = 64 if dtype in HALF_DTYPES else 32
    return max(16, min(cap, 1 << (max(int(chunk_size), 1).bit_length() - 1)))


class Spans(NamedTuple):
    """Sums of per-head log decays ``[B, T, H]`` (fp32) the kernels read, each summed over its own span: an
    exponent that is a difference of two cumulative sums loses the digits of the larger (a gate that shut
    earlier in the chunk costs the open span after it its precision)."""

    log_decay: torch.Tensor     # g_t itself
    prefix: torch.Tensor        # Σ g over the chunk up to t, inclusive
    suffix: torch.Tensor        # Σ g over the chunk after t


def decay_spans(log_decay: torch.Tensor, chunk: int) -> Spans:
    """The ``Spans`` of per-head log decays ``[B, T, H]`` for chunks of ``chunk`` tokens."""
    B, T, H = log_decay.shape
    g = torch.zeros(B, triton.cdiv(T, chunk) * chunk, H, dtype=torch.float32, device=log_decay.device)
    g[:, :T] = log_decay
    w = g.view(B, -1, chunk, H)
    later = torch.cat([w[:, :, 1:], torch.zeros_like(w[:, :, :1])], dim=2)
    prefix, suffix = w.cumsum(2), later.flip(2).cumsum(2).flip(2)
    return Spans(*(x.reshape(B, -1, H)[:, :T].contiguous() for x in (w, prefix, suffix)))


#: Half-precision defaults of backward kernels that timing settled (H200, bf16, K = V = 128, chunks of 64, a
#: decay with its gradient; ``docs/benchmarks.md``): launched together with ``chunk.dqk`` at BK=64 BV=32 (4 warps,
#: 3 stages) they made the op's forward + backward 1.28x faster than the defaults derived from register counts
#: (6.91 -> 5.39 ms), where the forward kernels' derived defaults timed fastest as they were. That ``chunk.dqk``
#: tiling spills 280 bytes in the compile check without the JIT's hints (``ahead_of_time``), so it keeps its
#: derived default until a device run times it alone. Launches without the decay's gradient were not timed
#: and keep the derived defaults.
SETTLED_HALF_BACKWARD = {"chunk.states_bwd": config(8, 3, BK=64, BV=64), "chunk.dv": config(8, 3, BK=32, BV=64)}


@functools.lru_cache(maxsize=None)
def feature_configs(K: int, V: int, dtype: torch.dtype, k_cap: int = 64, *others: int,
                    settled: Config | None = None) -> tuple[Config, ...]:
    """Launch options of a kernel tiled over key and value features (``others``: its other tile sides, which
    count for the default warps): the default tiles first (``settled`` where timing chose them for half
    precision, else derived from the caps), then the tensor-core sides for half precision or the narrower
    CUDA-core ones for fp32 (``tile``'s caps). Cached: every launch asks, tuning on or off."""
    if settled is not None and dtype in HALF_DTYPES:
        default = config(settled.num_warps, settled.num_stages,
                         BK=tile(K, settled["BK"], dtype), BV=tile(V, settled["BV"], dtype))
    else:
        BK, BV = tile(K, k_cap, dtype), tile(V, 64, dtype)
        default = config(default_warps(BK, BV, *others), 2, BK=BK, BV=BV)
    sides = (32, 64) if dtype in HALF_DTYPES else (16, 32)
    return tuple(candidates(default, {"BK": sides_up_to(K, sides), "BV": sides_up_to(V, sides)}))


def states(k, v, d: Spans | torch.Tensor | None, h0, chunk, want_final, states_dtype):
    """The state before every chunk ``[B, H, NT, K, V]`` (``states_dtype``) and the fp32 final state (or
    ``None``); ``d``: the log decays' ``Spans`` per head, the log decays per key channel ``[B, T, H, K]``
    themselves, or ``None``."""
    channel = isinstance(d, torch.Tensor)
    g, gs = (d, None) if channel else (None, None) if d is None else (d.prefix, d.suffix)
    B, T, H, K = k.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk)
    h = k.new_empty(B, H, NT, K, V, dtype=states_dtype)
    ht = k.new_empty(B, H, K, V, dtype=torch.float32) if want_final else None

    def run(c):
        grid = (triton.cdiv(K, c["BK"]), triton.cdiv(V, c["BV"]), B * H)
        _states_fwd_kernel[grid](k, v, g, gs, h0, h, ht, T, H, K, V, chunk, c["BK"], c["BV"],
                                 g is not None, h0 is not None, want_final,
                                 tl_dtype(k.dtype), upcast(k.dtype), channel, **c.options)

    key = shape_key(k, states_dtype, K, V, chunk, g is not None, h0 is not None, want_final, channel)
    launch("chunk.states", key, feature_configs(K, V, k.dtype), run)
    return h, ht


def state_gradients(q, do, d: Spans | torch.Tensor | None, dht, scale, chunk, want_dh0, states_dtype, settled=None):
    """The gradient of the state after every chunk ``[B, H, NT, K, V]`` (``states_dtype``) and of the initial
    state (fp32, or ``None``), walking the chunks in reverse; ``d`` as in ``states``."""
    channel = isinstance(d, torch.Tensor)
    g = d if channel else None if d is None else d.prefix
    B, T, H, K = q.shape
    V = do.shape[-1]
    dh = q.new_empty(B, H, triton.cdiv(T, chunk), K, V, dtype=states_dtype)
    dh0 = q.new_empty(B, H, K, V, dtype=torch.float32) if want_dh0 else None

    def run(c):
        grid = (triton.cdiv(K, c["BK"]), triton.cdiv(V, c["BV"]), B * H)
        _states_bwd_kernel[grid](q, do, g, dht, dh, dh0, scale, T, H, K, V, chunk, c["BK"], c["BV"],
                                 g is not None, dht is not None, want_dh0, tl_dtype(q.dtype), upcast(q.dtype),
                                 channel, **c.options)

    key = shape_key(q, states_dtype, K, V, chunk, g is not None, dht is not None, want_dh0, channel)
    launch("chunk.states_bwd", key, feature_configs(K, V, q.dtype, 64, chunk, settled=settled), run)
    return dh, dh0


def chunk_forward(q, k, v, d: Spans | None, h0, scale, chunk, want_final):
    """Forward pass on contiguous inputs: returns ``o`` and the fp32 final state (or ``None``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    h, ht = states(k, v, d, h0, chunk, want_final, k.dtype)
    o = torch.empty_like(v)
    g, gr = (None, None) if d is None else (d.prefix, d.log_decay)

    def run(c):
        grid = (triton.cdiv(T, chunk), triton.cdiv(V, c["BV"]), B * H)
        _output_fwd_kernel[grid](q, k, v, g, gr, h, o, scale, T, H, K, V, chunk, c["BK"], c["BV"],
                                 g is not None, tl_dtype(q.dtype), upcast(q.dtype), **c.options)

    launch("chunk.output", shape_key(q, K, V, chunk, g is not None), feature_configs(K, V, k.dtype, 64, chunk), run)
    return o, ht


def chunk_backward(q, k, v, d: Spans | None, h0, do, dht, scale, chunk, want_dh0, want_dg):
    """Backward pass: ``dq, dk, dv``, ``d log_decay`` (fp32, or None) and ``dh0`` (fp32, or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk)
    DT, UP = tl_dtype(q.dtype), upcast(q.dtype)
    want_dg = want_dg and d is not None
    # fp32 states here: the decay gradient reads them outside the matmuls.
    states_dtype = torch.float32 if want_dg else q.dtype
    h, _ = states(k, v, d, h0, chunk, False, states_dtype)
    settled = SETTLED_HALF_BACKWARD if want_dg else {}
    dh, dh0 = state_gradients(q, do, d, dht, scale, chunk, want_dh0, states_dtype,
                              settled.get("chunk.states_bwd"))
    g, gs, gr = (None, None, None) if d is None else (d.prefix, d.suffix, d.log_decay)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def run_dqk(c):
        NKq = triton.cdiv(K, c["BK"])
        dg = q.new_empty(NKq, B, T, H, dtype=torch.float32) if want_dg else None
        _dqk_bwd_kernel[(NT, NKq, B * H)](q, k, v, g, gs, gr, h, do, dh, dq, dk, dg, scale, T, H, K, V, chunk,
                                          c["BK"], c["BV"], g is not None, want_dg, DT, UP, **c.options)
        return dg

    # With a decay this kernel also holds the [BT, BT] score-gradient products: narrower key tiles keep it
    # from spilling (ahead_of_time, sm_90).
    dg = launch("chunk.dqk", shape_key(q, K, V, chunk, g is not None, want_dg),
                feature_configs(K, V, q.dtype, 32 if want_dg else 64, chunk, tile(K, 64, q.dtype)), run_dqk)

    def run_dv(c):
        grid = (NT, triton.cdiv(V, c["BV"]), B * H)
        _dv_bwd_kernel[grid](q, k, gs, gr, do, dh, dv, scale, T, H, K, V, chunk, c["BK"], c["BV"],
                             g is not None, DT, UP, **c.options)

    launch("chunk.dv", shape_key(q, K, V, chunk, g is not None),
           feature_configs(K, V, q.dtype, 64, chunk, settled=settled.get("chunk.dv")), run_dv)
    return dq, dk, dv, (dg.sum(0) if dg is not None else None), dh0


class ChunkLinearAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward kernels above, boundary states recomputed in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, initial_state, scale, chunk, output_final_state):
        q, k, v, initial_state = contiguous(q, k, v, initial_state)
        d = decay_spans(log_decay, chunk) if log_decay is not None else None
        o, ht = chunk_forward(q, k, v, d, initial_state, scale, chunk, output_final_state)
        ctx.save_for_backward(q, k, v, initial_state, *(d or ()))
        ctx.scale, ctx.chunk = scale, chunk
        ctx.decay_dtype = None if log_decay is None else log_decay.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        refuse_graph("chunk_linear_attention[triton]")
        q, k, v, h0, *d = ctx.saved_tensors
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        need_h0 = h0 is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dlog_decay, dh0 = chunk_backward(q, k, v, Spans(*d) if d else None, h0, do, dht, ctx.scale, ctx.chunk, need_h0,
                                                     ctx.needs_input_grad[3])
        if dlog_decay is not None:
            dlog_decay = dlog_decay.to(ctx.decay_dtype)
        if dh0 is not None:
            dh0 = dh0.to(h0.dtype)
        return dq, dk, dv, dlog_decay, dh0, None, None, None


def chunk_linear_attention(q, k, v, *, chunk_size=64, log_decay=None, scale=None, initial_state=None,
                           output_final_state=False):
    """Causal linear attention with optional per-head decay, computed chunk-parallel by Triton kernels.

    Same contract as the torch runtime: tensors ``[B, T, H, D]``, ``log_decay`` ``[B, T, H]``, states
    ``[B, H, Dk, Dv]``; ``scale`` defaults to 1; returns ``(o, final_state or None)``.
    """
    check_chunk_inputs(q, k, v, chunk_size=chunk_size, log_decay=log_decay, initial_state=initial_state)
    scale = 1.0 if scale is None else float(scale)
    o, ht = ChunkLinearAttention.apply(q, k, v, log_decay, initial_state, scale, chunk_tile(chunk_size, q.dtype),
                                       bool(output_final_state))
    return o, (ht.to(final_state_dtype(v, initial_state)) if ht is not None else None)
