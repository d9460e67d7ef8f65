"""Token-causal chunked linear attention whose state decays per key channel (GLA's gate), as Triton kernels.

``S_t = diag(exp(g_t)) S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t`` with ``g_t [K]``. Across chunks the
states are the per-head kernels' (``chunk.states`` / ``chunk.state_gradients``, one factor per state row).
Inside a chunk the weight of key ``i`` in query ``t``'s read, ``Σ_c q_tc k_ic exp(Σ_{i<l≤t} g_lc)``, is no
longer one product of ``q`` and ``k``, so the chunk's attention ``A [T, BT]`` is built in sub-chunks of
``BC`` tokens, as in flash-linear-attention's GLA kernels:

* keys in an earlier sub-chunk than the queries: the decay splits at the queries' sub-chunk, into the
  queries' prefix inside it and the keys' suffix inside theirs plus the sub-chunks between; both factors are
  at most 1, so nothing overflows, and the block is one matmul;
* keys in the queries' own sub-chunk: the decays summed pair by pair, one key at a time.

Every exponent is a sum of log decays over the span it stands for, summed in the kernels from the log decays
themselves (``chunk.window_spans``), never a difference of two cumulative sums: a gate that closed earlier in
the chunk (a large cumulative sum) would otherwise cost the weights of the open span after it their digits.
Nothing but the log decays is read or kept for the backward besides the chunks' attention.

The backward builds ``dA = scale · do vᵀ`` the same way, gets ``dq``/``dk`` inside the chunk from it by the
same two splits, and assembles the decay gradient chunk-locally: for token ``s`` and channel ``c``,
``Σ_{t≥s} q_tc dq_tc − Σ_{i≥s} k_ic dk^intra_ic + Σ_{i<s} k_ic dk^inter_ic + exp(G_c) ⟨h_c, dh_c⟩``
(``G`` the chunk's total; every pair of tokens ``i < s ≤ t`` once), never a difference of sums over the
whole sequence.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ttt2la.runtime.higher_order import refuse_graph
from ttt2la.runtime.naive import check_chunk_inputs, final_state_dtype

from ._common import HALF_DTYPES, cdiv, contiguous, cumulative, default_warps, mm, tile, tl_dtype, total, upcast
from .chunk import (chunk_tile, decay_rows, feature_configs, load_tile, state_gradients, states, store_tile,
                    token_base, window_spans)
from .tile_tuning import candidates, config, launch, shape_key, sides_up_to

#: Tokens per sub-chunk: the blocks of the in-chunk attention, the smallest side ``tl.dot`` takes.
BC = 16


@triton.jit
def _sub_chunk(x, i_b, i_h, t0, T, H, D, o_d, BC: tl.constexpr):
    """The ``[BC, BD]`` tile of tokens ``t0 …`` and features ``o_d`` of a ``[B, T, H, D]`` tensor (zero past
    ``T``), in fp32, and its row mask."""
    o_c = tl.arange(0, BC)
    m_c = t0 + o_c < T
    return load_tile(token_base(x, i_b, i_h, t0, T, H, D), o_c, m_c, o_d, H, D).to(tl.float32), m_c


@triton.jit
def _token_row(x, i_b, i_h, t, T, H, D, o_d):
    """Features ``o_d`` of token ``t`` (zero past ``T``), in fp32."""
    return tl.load(token_base(x, i_b, i_h, t, T, H, D) + o_d, mask=(o_d < D) & (t + 0 * o_d < T),
                   other=0.).to(tl.float32)


@triton.jit
def _between(g, i_b, i_h, i_t, first, last, T, H, K, o_k, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """``[BK]``: the log decays summed over sub-chunks ``first … last − 1`` of chunk ``i_t``."""
    b_between = tl.full([BK], 0., tl.float32)
    for i_q in range(first, last):
        b_between += total(decay_rows(g, i_b, i_h, i_t * BT + i_q * BC, BC, T, H, K, o_k, BC, 0), 0)
    return b_between


@triton.jit
def _diagonal_scores(b_q, k, g, i_b, i_h, t0, T, H, K, o_k, BC: tl.constexpr, BK: tl.constexpr):
    """``[BC, BC]``: the sub-chunk's own causal scores ``Σ_c q_tc k_jc exp(Σ_{j<l≤t} g_lc)``, keys from the
    last back, each query row's decay summed as the keys pass."""
    o_c = tl.arange(0, BC)
    b_a = tl.full([BC, BC], 0., tl.float32)
    b_acc = tl.full([BC, BK], 0., tl.float32)          # Σ_{j<l≤t} g_l for rows t ≥ j
    for jj in range(0, BC):
        j = BC - 1 - jj
        b_kj = _token_row(k, i_b, i_h, t0 + j, T, H, K, o_k)
        later = o_c[:, None] >= j
        column = total(tl.where(later, b_q * b_kj[None, :] * tl.exp(b_acc), 0.), 1)
        b_a += tl.where(o_c[None, :] == j, column[:, None], 0.)
        b_acc += tl.where(later, _token_row(g, i_b, i_h, t0 + j, T, H, K, o_k)[None, :], 0.)
    return b_a


@triton.jit
def _attention_fwd_kernel(q, k, g, A, T,
                          H, K,
                          BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                          DT: tl.constexpr, UPCAST: tl.constexpr):
    """One sub-chunk of queries: its rows of the chunk's attention ``A[t, i]`` (``[B, T, H, BT]``, zero for
    ``i > t``), every key sub-chunk of its chunk (see the module's docstring)."""
    i_tc, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    NC = BT // BC
    i_t, i_p = i_tc // NC, i_tc % NC
    t0 = i_t * BT + i_p * BC
    o_c = tl.arange(0, BC)
    a_base = token_base(A, i_b, i_h, t0, T, H, BT)
    for i_r in range(0, NC):
        b_a = tl.full([BC, BC], 0., tl.float32)
        for i_k in range(0, cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            b_q, _ = _sub_chunk(q, i_b, i_h, t0, T, H, K, o_k, BC)
            if i_r < i_p:
                b_spq, _, _ = window_spans(g, i_b, i_h, t0, T, H, K, o_k, BC)
                b_k, _ = _sub_chunk(k, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
                _, b_ssk, _ = window_spans(g, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
                b_between = _between(g, i_b, i_h, i_t, i_r + 1, i_p, T, H, K, o_k, BT, BC, BK)
                b_a += mm(b_q * tl.exp(b_spq), tl.trans(b_k * tl.exp(b_ssk + b_between[None, :])), DT, UPCAST)
            elif i_r == i_p:
                b_a += _diagonal_scores(b_q, k, g, i_b, i_h, t0, T, H, K, o_k, BC, BK)
        store_tile(a_base + i_r * BC, b_a, o_c, t0 + o_c < T, o_c, H, BT)


@triton.jit
def _chunk_read_kernel(x, y, g, s, A, out, scale, T,
                 H, K, V,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 BACKWARD: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk × value tile of a read through the state and the chunk's attention: the output,
    ``scale·((q ⊙ exp(prefix)) h_j + A v)`` (``x, y, s = q, v, h``), or with ``BACKWARD`` the
    values' gradient, ``(k ⊙ exp(suffix)) dh_j + scale · Aᵀ do`` (``x, y, s = k, do, dh``)."""
    i_t, i_v, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    o_v = i_v * BV + tl.arange(0, BV)
    x_base = token_base(x, i_b, i_h, i_t * BT, T, H, K)
    s_base = s + (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_o = tl.full([BT, BV], 0., tl.float32)
    for i_k in range(0, cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_x = load_tile(x_base, o_t, m_t, o_k, H, K)
        b_prefix, b_suffix, _ = window_spans(g, i_b, i_h, i_t * BT, T, H, K, o_k, BT)
        b_s = tl.load(s_base + o_k[:, None] * V + o_v[None, :], mask=(o_k[:, None] < K) & (o_v[None, :] < V),
                      other=0.)
        b_o += mm(b_x.to(tl.float32) * tl.exp(b_suffix if BACKWARD else b_prefix), b_s, DT, UPCAST)
    b_a = load_tile(token_base(A, i_b, i_h, i_t * BT, T, H, BT), o_t, m_t, o_t, H, BT)
    b_y = load_tile(token_base(y, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
    if BACKWARD:
        b_o += mm(tl.trans(b_a), b_y, DT, UPCAST) * scale
    else:
        b_o = (b_o + mm(b_a, b_y, DT, UPCAST)) * scale
    store_tile(token_base(out, i_b, i_h, i_t * BT, T, H, V), b_o, o_t, m_t, o_v, H, V)


@triton.jit
def _score_grad_kernel(v, do, dA, scale, T,
                       H, V,
                       BT: tl.constexpr, BV: tl.constexpr,
                       DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk: ``dA = scale · do vᵀ`` on and below the diagonal, zero above (``[B, T, H, BT]``)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    b_da = tl.full([BT, BT], 0., tl.float32)
    for i_v in range(0, cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_do = load_tile(token_base(do, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        b_v = load_tile(token_base(v, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        b_da += mm(b_do, tl.trans(b_v), DT, UPCAST)
    b_da = tl.where(o_t[:, None] >= o_t[None, :], b_da * scale, 0.)
    store_tile(token_base(dA, i_b, i_h, i_t * BT, T, H, BT), b_da, o_t, m_t, o_t, H, BT)


@triton.jit
def _query_grad_intra(k, g, dA, i_b, i_h, i_t, i_p, T, H, K, o_k,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """``[BC, BK]``: ``Σ_{i≤t} dA_ti k_ic exp(Σ_{i<l≤t} g_lc)`` for the queries of sub-chunk ``i_p``: earlier
    key sub-chunks split at ``i_p``'s start, the diagonal one key at a time from the last."""
    o_c = tl.arange(0, BC)
    t0 = i_t * BT + i_p * BC
    da_base = token_base(dA, i_b, i_h, t0, T, H, BT)
    m_q = t0 + o_c < T
    b_dq = tl.full([BC, BK], 0., tl.float32)
    for i_r in range(0, i_p):
        b_k, _ = _sub_chunk(k, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
        _, b_ssk, _ = window_spans(g, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
        b_between = _between(g, i_b, i_h, i_t, i_r + 1, i_p, T, H, K, o_k, BT, BC, BK)
        b_da = load_tile(da_base + i_r * BC, o_c, m_q, o_c, H, BT)
        b_dq += mm(b_da, b_k * tl.exp(b_ssk + b_between[None, :]), DT, UPCAST)
    b_spq, _, _ = window_spans(g, i_b, i_h, t0, T, H, K, o_k, BC)
    b_dq *= tl.exp(b_spq)
    b_acc = tl.full([BC, BK], 0., tl.float32)          # Σ_{j<l≤t} g_l for rows t ≥ j
    for jj in range(0, BC):
        j = BC - 1 - jj
        b_kj = _token_row(k, i_b, i_h, t0 + j, T, H, K, o_k)
        b_daj = tl.load(da_base + o_c * (H * BT) + i_p * BC + j, mask=m_q, other=0.)
        later = o_c[:, None] >= j
        b_dq += tl.where(later, b_daj[:, None] * b_kj[None, :] * tl.exp(b_acc), 0.)
        b_acc += tl.where(later, _token_row(g, i_b, i_h, t0 + j, T, H, K, o_k)[None, :], 0.)
    return b_dq


@triton.jit
def _key_grad_intra(q, g, dA, i_b, i_h, i_t, i_p, T, H, K, o_k,
                    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """``[BC, BK]``: ``Σ_{t≥i} dA_ti q_tc exp(Σ_{i<l≤t} g_lc)`` for the keys of sub-chunk ``i_p``: later query
    sub-chunks split at ``i_p``'s end, the diagonal one query at a time from the first."""
    NC = BT // BC
    o_c = tl.arange(0, BC)
    t0 = i_t * BT + i_p * BC
    b_dk = tl.full([BC, BK], 0., tl.float32)
    for i_r in range(i_p + 1, NC):
        b_q, m_r = _sub_chunk(q, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
        b_spq, _, _ = window_spans(g, i_b, i_h, i_t * BT + i_r * BC, T, H, K, o_k, BC)
        b_between = _between(g, i_b, i_h, i_t, i_p + 1, i_r, T, H, K, o_k, BT, BC, BK)
        b_da = load_tile(token_base(dA, i_b, i_h, i_t * BT + i_r * BC, T, H, BT) + i_p * BC, o_c, m_r, o_c,
                         H, BT)
        b_dk += mm(tl.trans(b_da), b_q * tl.exp(b_spq + b_between[None, :]), DT, UPCAST)
    _, b_ssk, _ = window_spans(g, i_b, i_h, t0, T, H, K, o_k, BC)
    b_dk *= tl.exp(b_ssk)
    da_base = token_base(dA, i_b, i_h, t0, T, H, BT) + i_p * BC
    b_acc = tl.full([BC, BK], 0., tl.float32)          # Σ_{i<l≤j} g_l for rows i ≤ j
    for j in range(0, BC):
        b_acc += tl.where(o_c[:, None] < j, _token_row(g, i_b, i_h, t0 + j, T, H, K, o_k)[None, :], 0.)
        b_qj = _token_row(q, i_b, i_h, t0 + j, T, H, K, o_k)
        b_daj = tl.load(da_base + j * (H * BT) + o_c, mask=t0 + j + 0 * o_c < T, other=0.)
        b_dk += tl.where(o_c[:, None] <= j, b_daj[:, None] * b_qj[None, :] * tl.exp(b_acc), 0.)
    return b_dk


@triton.jit
def _dqk_intra_kernel(q, k, g, dA, dq, dk, T,
                      H, K,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                      DT: tl.constexpr, UPCAST: tl.constexpr):
    """One sub-chunk × key tile: the in-chunk parts of ``dq`` (as queries) and ``dk`` (as keys), fp32."""
    i_tc, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NC = BT // BC
    i_t, i_p = i_tc // NC, i_tc % NC
    t0 = i_t * BT + i_p * BC
    o_c = tl.arange(0, BC)
    o_k = i_k * BK + tl.arange(0, BK)
    b_dq = _query_grad_intra(k, g, dA, i_b, i_h, i_t, i_p, T, H, K, o_k, BT, BC, BK, DT, UPCAST)
    b_dk = _key_grad_intra(q, g, dA, i_b, i_h, i_t, i_p, T, H, K, o_k, BT, BC, BK, DT, UPCAST)
    store_tile(token_base(dq, i_b, i_h, t0, T, H, K), b_dq, o_c, t0 + o_c < T, o_k, H, K)
    store_tile(token_base(dk, i_b, i_h, t0, T, H, K), b_dk, o_c, t0 + o_c < T, o_k, H, K)


@triton.jit
def _dqkg_bwd_kernel(q, k, v, g, h, do, dh, dq_intra, dk_intra, dq, dk, dg, scale, T,
                     H, K, V,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     STORE_DG: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr):
    """One chunk × key tile: ``dq``, ``dk`` (the state's parts plus the in-chunk ones) and, with ``STORE_DG``,
    the decay gradient of these channels (see the module's docstring)."""
    i_t, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NT = cdiv(T, BT)
    o_t = tl.arange(0, BT)
    m_t = i_t * BT + o_t < T
    o_k = i_k * BK + tl.arange(0, BK)
    state = (i_bh.to(tl.int64) * NT + i_t) * K * V
    b_dq = tl.full([BT, BK], 0., tl.float32)
    b_dk = tl.full([BT, BK], 0., tl.float32)
    b_hdh = tl.full([BK], 0., tl.float32)
    for i_v in range(0, cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
        b_v = load_tile(token_base(v, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        b_do = load_tile(token_base(do, i_b, i_h, i_t * BT, T, H, V), o_t, m_t, o_v, H, V)
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dq += mm(b_do, tl.trans(b_h), DT, UPCAST)
        b_dk += mm(b_v, tl.trans(b_dh), DT, UPCAST)
        if STORE_DG:
            b_hdh += total(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    b_g, b_suffix, g_last = window_spans(g, i_b, i_h, i_t * BT, T, H, K, o_k, BT)
    b_dq *= scale * tl.exp(b_g)
    b_dk *= tl.exp(b_suffix)
    b_dqi = load_tile(token_base(dq_intra, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
    b_dki = load_tile(token_base(dk_intra, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K)
    if STORE_DG:
        b_q = load_tile(token_base(q, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K).to(tl.float32)
        b_k = load_tile(token_base(k, i_b, i_h, i_t * BT, T, H, K), o_t, m_t, o_k, H, K).to(tl.float32)
        inter_k = b_k * b_dk
        b_dg = (cumulative(b_q * (b_dq + b_dqi) - b_k * b_dki, 0, True) + cumulative(inter_k, 0, False) - inter_k
                + (tl.exp(g_last) * b_hdh)[None, :])
        store_tile(token_base(dg, i_b, i_h, i_t * BT, T, H, K), b_dg, o_t, m_t, o_k, H, K)
    store_tile(token_base(dq, i_b, i_h, i_t * BT, T, H, K), b_dq + b_dqi, o_t, m_t, o_k, H, K)
    store_tile(token_base(dk, i_b, i_h, i_t * BT, T, H, K), b_dk + b_dki, o_t, m_t, o_k, H, K)


@functools.lru_cache(maxsize=None)
def key_configs(K: int, dtype: torch.dtype) -> tuple:
    """Launch options of a kernel tiled over key features only, its other side a sub-chunk: the default key
    tile first, then the tensor-core or CUDA-core sides ``feature_configs`` also tries."""
    BK = tile(K, 64, dtype)
    sides = (32, 64) if dtype in HALF_DTYPES else (16, 32)
    return tuple(candidates(config(default_warps(BK, BC), 2, BK=BK), {"BK": sides_up_to(K, sides)}))


def _attention(q, k, g, chunk):
    """The chunks' in-chunk attention ``A [B, T, H, chunk]`` (fp32, zero above the diagonal)."""
    B, T, H, K = q.shape
    A = q.new_empty(B, T, H, chunk, dtype=torch.float32)

    def run(c):
        grid = (triton.cdiv(T, chunk) * (chunk // BC), B * H)
        _attention_fwd_kernel[grid](q, k, g, A, T, H, K, chunk, BC, c["BK"],
                                    tl_dtype(q.dtype), upcast(q.dtype), **c.options)

    launch("channel.attention", shape_key(q, K, chunk), key_configs(K, q.dtype), run)
    return A


def _read(x, y, g, s, A, scale, chunk, backward: bool):
    """``_chunk_read_kernel``'s output ``[B, T, H, V]``: the op's output, or the values' gradient."""
    B, T, H, K = x.shape
    V = y.shape[-1]
    out = torch.empty_like(y)

    def run(c):
        grid = (triton.cdiv(T, chunk), triton.cdiv(V, c["BV"]), B * H)
        _chunk_read_kernel[grid](x, y, g, s, A, out, scale, T, H, K, V, chunk, c["BK"], c["BV"], backward,
                           tl_dtype(x.dtype), upcast(x.dtype), **c.options)

    site = "channel.dv" if backward else "channel.output"
    launch(site, shape_key(x, K, V, chunk), feature_configs(K, V, x.dtype, 64, chunk), run)
    return out


def channel_forward(q, k, v, g, h0, scale, chunk, want_final):
    """Forward pass on contiguous inputs (``g`` the log decays ``[B, T, H, K]``): ``o``, the fp32 final state
    (or ``None``) and the in-chunk attention (kept for the backward)."""
    h, ht = states(k, v, g, h0, chunk, want_final, k.dtype)
    A = _attention(q, k, g, chunk)
    return _read(q, v, g, h, A, scale, chunk, False), ht, A


def _score_gradients(v, do, scale, chunk):
    """``dA = scale · do vᵀ`` inside every chunk, ``[B, T, H, chunk]`` fp32."""
    B, T, H, V = v.shape
    dA = v.new_empty(B, T, H, chunk, dtype=torch.float32)

    def run(c):
        _score_grad_kernel[(triton.cdiv(T, chunk), B * H)](v, do, dA, scale, T, H, V, chunk, c["BV"],
                                                            tl_dtype(v.dtype), upcast(v.dtype), **c.options)

    launch("channel.scores_bwd", shape_key(v, V, chunk), feature_configs(V, V, v.dtype, 64, chunk), run)
    return dA


def _intra_gradients(q, k, g, dA, chunk):
    """The in-chunk parts of ``dq`` and ``dk`` (fp32)."""
    B, T, H, K = q.shape
    dq, dk = (torch.empty_like(q, dtype=torch.float32) for _ in range(2))

    def run(c):
        grid = (triton.cdiv(T, chunk) * (chunk // BC), triton.cdiv(K, c["BK"]), B * H)
        _dqk_intra_kernel[grid](q, k, g, dA, dq, dk, T, H, K, chunk, BC,
                                c["BK"], tl_dtype(q.dtype), upcast(q.dtype), **c.options)

    launch("channel.dqk_intra", shape_key(q, K, chunk), key_configs(K, q.dtype), run)
    return dq, dk


def channel_backward(q, k, v, g, h0, A, do, dht, scale, chunk, want_dh0, want_dg):
    """Backward pass: ``dq, dk, dv``, ``d log_decay`` ``[B, T, H, K]`` (fp32, or None) and ``dh0`` (fp32, or
    None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    # fp32 states: the decay gradient reads them outside the matmuls
    states_dtype = torch.float32 if want_dg else q.dtype
    h, _ = states(k, v, g, h0, chunk, False, states_dtype)
    dh, dh0 = state_gradients(q, do, g, dht, scale, chunk, want_dh0, states_dtype)
    dA = _score_gradients(v, do, scale, chunk)
    dv = _read(k, do, g, dh, A, scale, chunk, True)
    dq_intra, dk_intra = _intra_gradients(q, k, g, dA, chunk)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg = torch.empty_like(g, dtype=torch.float32) if want_dg else None

    def run(c):
        grid = (triton.cdiv(T, chunk), triton.cdiv(K, c["BK"]), B * H)
        _dqkg_bwd_kernel[grid](q, k, v, g, h, do, dh, dq_intra, dk_intra, dq, dk, dg, scale, T,
                               H, K, V, chunk, c["BK"], c["BV"], want_dg, tl_dtype(q.dtype), upcast(q.dtype),
                               **c.options)

    launch("channel.dqkg", shape_key(q, K, V, chunk, want_dg), feature_configs(K, V, q.dtype, 32, chunk), run)
    return dq, dk, dv, dg, dh0


class ChannelDecayLinearAttention(torch.autograd.Function):
    """Autograd wrapper: the kernels above; the boundary states are recomputed in the backward, the in-chunk
    attention kept from the forward (with the inputs, all it keeps)."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, initial_state, scale, chunk, output_final_state):
        q, k, v, g, initial_state = contiguous(q, k, v, log_decay, initial_state)
        o, ht, A = channel_forward(q, k, v, g, initial_state, scale, chunk, output_final_state)
        ctx.save_for_backward(q, k, v, g, initial_state, A)
        ctx.scale, ctx.chunk, ctx.decay_dtype = scale, chunk, log_decay.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        refuse_graph("chunk_linear_attention[triton]")
        q, k, v, g, h0, A = ctx.saved_tensors
        do = do.contiguous()
        dht = None if dht is None else dht.contiguous()
        need_h0 = h0 is not None and ctx.needs_input_grad[4]
        dq, dk, dv, dg, dh0 = channel_backward(q, k, v, g, h0, A, do, dht, ctx.scale, ctx.chunk, need_h0,
                                               ctx.needs_input_grad[3])
        return (dq, dk, dv, None if dg is None else dg.to(ctx.decay_dtype),
                None if dh0 is None else dh0.to(h0.dtype), None, None, None)


def channel_decay_linear_attention(q, k, v, *, log_decay, chunk_size=64, scale=None, initial_state=None,
                                   output_final_state=False):
    """Causal linear attention with log decays per key channel ``[B, T, H, K]``, chunk-parallel in Triton.

    Same contract as the torch runtime's ``chunk_linear_attention``; returns ``(o, final_state or None)``.
    """
    check_chunk_inputs(q, k, v, chunk_size=chunk_size, log_decay=log_decay, initial_state=initial_state)
    scale = 1.0 if scale is None else float(scale)
    o, ht = ChannelDecayLinearAttention.apply(q, k, v, log_decay, initial_state, scale,
                                              chunk_tile(chunk_size, q.dtype), bool(output_final_state))
    return o, (ht.to(final_state_dtype(v, initial_state)) if ht is not None else None)
