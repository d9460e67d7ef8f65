"""The block op with LaCT's kernel ``φ(x) = silu(x W0) ⊙ (x W2)`` fused into the kernels that consume it.

The forward pass never writes the ``[B, T, H, Dh]`` feature matrices: the increment kernel computes ``φ(K)``
tiles on the fly and multiplies them into ``G_j = φ(K_j)ᵀ(lr ⊙ V_j)``, the read kernel computes ``φ(Q)``
tiles and multiplies them by the chunk's state. Each feature tile is recomputed once per value tile
(``ceil(Dv / 64)`` times for the increments, ``ceil(Dv / 128)`` for the read; wider accumulators spill on
sm_90), so fusion pays where ``Dv`` is small or memory bandwidth is the limit; the benchmark measures it
against the materialised form. The backward pass recomputes ``φ`` in torch (materialised) and
reuses the plain block kernels, then backpropagates through the SwiGLU with autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ttt2la.errors import UnsupportedTTTError
from ttt2la.runtime.higher_order import refuse_graph
from ttt2la.runtime.naive import (NS_EPS, RuntimeInputError, check_block_inputs, compute_dtype,
                                  final_state_dtype, ns_schedule)

from ._common import (HALF_DTYPES, accumulator, cdiv, contiguous, launch_options, mm, mm_split, tile, tl_dtype,
                      token_tile, upcast)
from .block import _scale_mode, increments_backward, read_backward, read_states, scaled
from .chunk import load_tile, store_tile, token_base


@triton.jit
def _phi_tile(x_base, w0, w2, o_t, m_t, i_h, o_k, H, D, DH,
              BT: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
              ACC: tl.constexpr):
    """``φ`` of the tile's tokens for the features ``o_k``: ``silu(x W0) ⊙ (x W2)`` in ``ACC``, ``[BT, BK]``."""
    a = tl.full([BT, BK], 0., ACC)
    b = tl.full([BT, BK], 0., ACC)
    w_head = i_h.to(tl.int64) * D * DH
    for i_d in range(0, cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        b_x = load_tile(x_base, o_t, m_t, o_d, H, D)
        m_dk = (o_d[:, None] < D) & (o_k[None, :] < DH)
        b_w0 = tl.load(w0 + w_head + o_d[:, None] * DH + o_k[None, :], mask=m_dk, other=0.)
        b_w2 = tl.load(w2 + w_head + o_d[:, None] * DH + o_k[None, :], mask=m_dk, other=0.)
        a += mm(b_x, b_w0, DT, UPCAST)
        b += mm(b_x, b_w2, DT, UPCAST)
    return a / (1. + tl.exp(-a)) * b


@triton.jit
def _swiglu_increments_kernel(x, w0, w2, y, s, out, T, C,
                              H, D, DH, DY,
                              BT: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BY: tl.constexpr,
                              SCALE: tl.constexpr, SPLIT_X: tl.constexpr, SPLIT_Y: tl.constexpr,
                              DT: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """One chunk × output tile: ``out[b, j, h] = Σ_{t ∈ chunk j} φ(x_t)ᵀ (s_t ⊙ y_t)``, ``φ`` never stored."""
    i_j, i_ky, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NY = cdiv(DY, BY)
    i_k, i_y = i_ky // NY, i_ky % NY
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_y = i_y * BY + tl.arange(0, BY)
    start = i_j * C
    length = tl.minimum(C, T - start)
    acc = tl.full([BK, BY], 0., ACC)
    for i in range(0, cdiv(length, BT)):
        m_t = i * BT + o_t < length
        t0 = start + i * BT
        phi = _phi_tile(token_base(x, i_b, i_h, t0, T, H, D), w0, w2, o_t, m_t, i_h, o_k, H, D, DH, BT, BD, BK,
                        DT, UPCAST, ACC)
        b_y = load_tile(token_base(y, i_b, i_h, t0, T, H, DY), o_t, m_t, o_y, H, DY)
        if SCALE == 1:
            b_y = scaled(b_y, token_base(s, i_b, i_h, t0, T, H, 1), o_t, m_t, o_y, H, DY, SCALE, ACC)
        elif SCALE == 2:
            b_y = scaled(b_y, token_base(s, i_b, i_h, t0, T, H, DY), o_t, m_t, o_y, H, DY, SCALE, ACC)
        acc += mm_split(tl.trans(phi), b_y, SPLIT_X, SPLIT_Y, DT, UPCAST)
    N = tl.num_programs(0)
    base = ((i_b * N + i_j) * H + i_h).to(tl.int64) * DH * DY
    tl.store(out + base + o_k[:, None] * DY + o_y[None, :], acc, mask=(o_k[:, None] < DH) & (o_y[None, :] < DY))


@triton.jit
def _swiglu_read_kernel(x, w0, w2, S, out, T, C, s_b, s_n, s_h, s_k, s_v,
                        H, D, DH, DO,
                        BT: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BO: tl.constexpr,
                        DT: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """One token tile × output tile: ``out_t = φ(x_t) S[b, chunk(t), h]``, ``φ`` never stored."""
    i_tile, i_o, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    per_chunk = cdiv(C, BT)
    i_j, i_i = i_tile // per_chunk, i_tile % per_chunk
    t0 = i_j * C + i_i * BT
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t < T) & (i_i * BT + o_t < C)
    o_o = i_o * BO + tl.arange(0, BO)
    x_base = token_base(x, i_b, i_h, t0, T, H, D)
    state = S + i_b.to(tl.int64) * s_b + i_j.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h
    acc = tl.full([BT, BO], 0., ACC)
    for i_k in range(0, cdiv(DH, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        phi = _phi_tile(x_base, w0, w2, o_t, m_t, i_h, o_k, H, D, DH, BT, BD, BK, DT, UPCAST, ACC)
        b_s = tl.load(state + o_k[:, None] * s_k + o_o[None, :] * s_v,
                      mask=(o_k[:, None] < DH) & (o_o[None, :] < DO), other=0.)
        acc += mm(phi, b_s, DT, UPCAST)
    store_tile(token_base(out, i_b, i_h, t0, T, H, DO), acc, o_t, m_t, o_o, H, DO)


def swiglu_features(x, w0, w2, *, dtype=None):
    """``φ(x) = silu(x W0) ⊙ (x W2)`` in torch (``x`` ``[B, T, H, D]``, ``W`` ``[H, D, Dh]``), as ``dtype``.

    The products run in ``dtype`` (default ``x.dtype``), the gate in at least fp32.
    """
    dtype = dtype or x.dtype
    x, w0, w2 = x.to(dtype), w0.to(dtype), w2.to(dtype)
    a = torch.einsum("bthd,hde->bthe", x, w0)
    b = torch.einsum("bthd,hde->bthe", x, w2)
    gate_dtype = accumulator(dtype)
    return (F.silu(a.to(gate_dtype)) * b.to(gate_dtype)).to(dtype)


def swiglu_increments(x, w0, w2, y, n, C, scale=None, *, split_x=False, split_y=False):
    """``G[b, j, h] = φ(X_j)ᵀ (scale ⊙ Y_j)`` for the first ``n`` chunks, ``[B, n, H, Dh, DY]``, fp32."""
    x, w0, w2, y, scale = contiguous(x, w0, w2, y, scale)
    B, T, H, D = x.shape
    DH, DY = w0.shape[-1], y.shape[-1]
    out = x.new_empty(B, n, H, DH, DY, dtype=accumulator(x.dtype))
    if n == 0:
        return out
    half = x.dtype in HALF_DTYPES
    dt = x.dtype
    BT, BD, BK, BY = token_tile(C, dt), tile(D, 64, dt), tile(DH, 64, dt), tile(DY, 64, dt)
    grid = (n, triton.cdiv(DH, BK) * triton.cdiv(DY, BY), B * H)
    _swiglu_increments_kernel[grid](x, w0, w2, y, scale, out, T, C, H, D, DH, DY, BT, BD, BK, BY,
                                    _scale_mode(scale), split_x and half, split_y and half, tl_dtype(x.dtype),
                                    upcast(x.dtype), tl_dtype(accumulator(x.dtype)),
                                    **launch_options(BK, BY, BT))
    return out


def swiglu_read(x, w0, w2, states, C, *, out_dtype=None):
    """``O_t = φ(X_t) S_j`` with ``j = t // C``: ``[B, T, H, Dv]``; tokens of chunks ``≥ n`` get zeros."""
    x, w0, w2 = contiguous(x, w0, w2)
    B, T, H, D = x.shape
    n, DH, DO = states.shape[1], states.shape[-2], states.shape[-1]
    alloc = torch.zeros if n * C < T else torch.empty
    out = alloc(B, T, H, DO, dtype=out_dtype or x.dtype, device=x.device)
    if n == 0:
        return out
    dt = x.dtype
    BT, BD, BK, BO = token_tile(C, dt), tile(D, 64, dt), tile(DH, 64, dt), tile(DO, 128, dt)
    grid = (n * triton.cdiv(C, BT), triton.cdiv(DO, BO), B * H)
    _swiglu_read_kernel[grid](x, w0, w2, states, out, T, C, *states.stride(), H, D, DH, DO, BT, BD, BK, BO,
                              tl_dtype(x.dtype), upcast(x.dtype), tl_dtype(accumulator(x.dtype)),
                              **launch_options(BK, BO, BT))
    return out


def _recomputed_features(x, w0, w2, precise):
    """``φ(x)`` for the backward, with autograd: fp32 when ``precise`` and ``x`` is half precision."""
    dtype = accumulator(x.dtype) if precise else x.dtype
    x, w0, w2 = (t.detach().requires_grad_() for t in (x, w0, w2))
    return (x, w0, w2), swiglu_features(x, w0, w2, dtype=dtype)


def _swiglu_input_grads(leaves, phi, dphi, needs):
    if dphi is None or not any(needs):
        return (None, None, None)
    wanted = [leaf for leaf, need in zip(leaves, needs) if need]
    grads = iter(torch.autograd.grad(phi, wanted, dphi.to(phi.dtype)))
    return tuple(next(grads) if need else None for need in needs)


class SwigluIncrements(torch.autograd.Function):
    """``G_j = φ(K_j)ᵀ (lr ⊙ V_j)`` with ``φ`` fused into the kernel; the backward recomputes ``φ(K)``."""

    @staticmethod
    def forward(ctx, k, w0, w2, v, lr, n, C, precise):
        ctx.save_for_backward(k, w0, w2, v, lr)
        ctx.C, ctx.precise = C, precise
        return swiglu_increments(k, w0, w2, v, n, C, scale=lr, split_x=precise, split_y=precise and lr is not None)

    @staticmethod
    def backward(ctx, dG):
        refuse_graph("block_linear_attention[triton, fused SwiGLU]")
        k, w0, w2, v, lr = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            leaves, phi_k = _recomputed_features(k, w0, w2, ctx.precise)
            dphi_k, dv, dlr = increments_backward(dG, phi_k.detach(), v, lr, ctx.C, (any(needs[:3]), *needs[3:5]),
                                                  dot_dtype=k.dtype, precise=ctx.precise)
            dk, dw0, dw2 = _swiglu_input_grads(leaves, phi_k, dphi_k, needs[:3])
        return dk, dw0, dw2, dv, dlr, None, None, None


class SwigluRead(torch.autograd.Function):
    """``o_t = φ(q_t) W_{chunk(t)}`` with ``φ`` fused into the kernel; the backward recomputes ``φ(Q)``."""

    @staticmethod
    def forward(ctx, q, w0, w2, states, C, out_dtype, precise):
        ctx.save_for_backward(q, w0, w2, states)
        ctx.C, ctx.precise = C, precise
        return swiglu_read(q, w0, w2, states, C, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, do):
        refuse_graph("block_linear_attention[triton, fused SwiGLU]")
        q, w0, w2, states = ctx.saved_tensors
        needs = ctx.needs_input_grad
        with torch.enable_grad():
            leaves, phi_q = _recomputed_features(q, w0, w2, ctx.precise)
            dphi_q, dstates = read_backward(do, phi_q.detach(), states, ctx.C, (any(needs[:3]), needs[3]),
                                            dot_dtype=q.dtype, precise=ctx.precise)
            dq, dw0, dw2 = _swiglu_input_grads(leaves, phi_q, dphi_q, needs[:3])
        return dq, dw0, dw2, dstates, None, None, None


def _check_swiglu_inputs(q, k, w0, w2):
    op = "fused_swiglu_block_linear_attention"
    if q.dim() != 4 or q.shape != k.shape:
        raise RuntimeInputError(f"{op}: q and k must both be [B, T, H, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    H, D = q.shape[2], q.shape[3]
    if w0.dim() != 3 or w0.shape != w2.shape or tuple(w0.shape[:2]) != (H, D):
        raise RuntimeInputError(f"{op}: w0 and w2 must both be [H, D, Dh] = [{H}, {D}, Dh] (x @ W form); got "
                                f"{tuple(w0.shape)} and {tuple(w2.shape)}")


def fused_swiglu_block_linear_attention(q, k, v, w0, w2, *, chunk_size, order="exclusive", lr=None, momentum=None,
                                        muon_steps=0, ns_coefficients=None, ns_eps=NS_EPS, ns_dtype=None,
                                        weight_norm=None, initial_state=None, output_final_state=False):
    """``block_linear_attention(φ(q), φ(k), v, ...)`` with ``φ(x) = silu(x W0) ⊙ (x W2)`` fused into the kernels.

    ``q, k`` ``[B, T, H, D]``, ``v`` ``[B, T, H, Dv]``, ``w0, w2`` ``[H, D, Dh]``; states are ``[B, H, Dh, Dv]``.
    The other arguments and the result are those of ``block_linear_attention``.
    """
    _check_swiglu_inputs(q, k, w0, w2)
    B, T, H, _ = k.shape
    shape_of_phi = k.new_empty(()).expand(B, T, H, w0.shape[-1])
    n = check_block_inputs(shape_of_phi, shape_of_phi, v, chunk_size=chunk_size, order=order, lr=lr,
                           momentum=momentum, muon_steps=muon_steps, weight_norm=weight_norm,
                           initial_state=initial_state, ns_coefficients=ns_coefficients)
    schedule = ns_schedule(muon_steps, ns_coefficients)
    if weight_norm is not None:
        raise UnsupportedTTTError(
            "fused_swiglu_block_linear_attention: the Triton kernels do not implement weight_norm; compute "
            "φ in torch and call the runtime block op with backend='torch' for it")
    C = T if order == "full" else chunk_size
    n_update = n - 1 if order == "exclusive" else n
    dtype = compute_dtype(v.dtype)
    w0, w2 = (x.to(v.dtype) for x in (w0, w2))
    precise = bool(schedule)
    M = SwigluIncrements.apply(k, w0, w2, v, lr, n_update, C, precise)
    states, final = read_states(M, order=order, n=n, momentum=momentum, schedule=schedule, ns_eps=ns_eps,
                                ns_dtype=ns_dtype, initial_state=initial_state, dtype=dtype)
    o = SwigluRead.apply(q, w0, w2, states, C, v.dtype, precise)
    final = final.to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o, final


__all__ = ["fused_swiglu_block_linear_attention", "swiglu_features", "swiglu_increments", "swiglu_read",
           "SwigluIncrements", "SwigluRead"]
