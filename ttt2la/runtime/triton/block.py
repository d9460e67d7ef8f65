"""LaCT's block (chunk-level) update as linear attention: Triton kernels for the token-level matmuls.

The op splits into token-level work, which dominates at LaCT's shapes and runs in two kernels, and chunk-level
work on ``[B, N, H, Dk, Dv]`` states, which stays in torch (batched over chunks):

* ``chunk_increments``: ``G_j = Xᵀ_j (s ⊙ Y_j)`` for every chunk ``j`` (the increment ``φ(K_j)ᵀ(lr ⊙ V_j)``,
  and in the backward the state gradient ``φ(Q_j)ᵀ dO_j``), the per-token scale fused into the load;
* ``chunk_read``: ``O_t = (s ⊙ X_t) S_{chunk(t)}`` (the output ``φ(Q) W``, and in the backward ``dO Wᵀ``,
  ``(lr ⊙ V) dGᵀ`` and ``φ(K) dG``), states given by strides so a transpose costs nothing;
* momentum (``scan.affine_scan``), Newton–Schulz (``newton_schulz``: three GEMMs a step with fused epilogues,
  its matrices kept for a hand-written backward) and the state prefix sum, in torch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ttt2la.errors import UnsupportedTTTError
from ttt2la.runtime.higher_order import refuse_graph
from ttt2la.runtime.naive import NS_EPS, check_block_inputs, compute_dtype, final_state_dtype, ns_schedule
from ttt2la.runtime.block import chunk_states
from ttt2la.runtime.newton_schulz import newton_schulz
from ttt2la.runtime.scan import affine_scan, prefix_sum

from ._common import (HALF_DTYPES, accumulator, cdiv, contiguous, default_warps, mm_split, tile, tl_dtype,
                      token_tile, upcast)
from .tile_tuning import Config, candidates, config, launch, shape_key, sides_up_to
from .chunk import load_tile, store_tile, token_base

#: ``SCALE`` modes of the kernels: no scale, one per token, one per token and feature.
NO_SCALE, TOKEN_SCALE, FEATURE_SCALE = 0, 1, 2


@triton.jit
def scaled(b_x, s_base, o_t, m_t, o_f, H, D, SCALE: tl.constexpr, ACC: tl.constexpr):
    """``b_x`` times its per-token (``[BT]``) or per-feature (``[BT, BD]``) scale, in ``ACC``.

    ``s_base`` points at the tile's first token in the scale tensor, ``[B, T, H]`` or ``[B, T, H, D]``.
    """
    if SCALE == 1:
        return b_x.to(ACC) * tl.load(s_base + o_t * H, mask=m_t, other=0.).to(ACC)[:, None]
    elif SCALE == 2:
        return b_x.to(ACC) * load_tile(s_base, o_t, m_t, o_f, H, D).to(ACC)
    else:
        return b_x


@triton.jit
def _increments_kernel(x, y, s, out, T, C,
                       H, DX, DY,
                       BT: tl.constexpr, BX: tl.constexpr, BY: tl.constexpr, SCALE: tl.constexpr,
                       SPLIT_X: tl.constexpr, SPLIT_Y: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
                       ACC: tl.constexpr):
    """One chunk × output tile: ``out[b, j, h] = Σ_{t ∈ chunk j} x_tᵀ (s_t ⊙ y_t)``, accumulated in ``ACC``."""
    i_j, i_xy, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    NY = cdiv(DY, BY)
    i_x, i_y = i_xy // NY, i_xy % NY
    o_t = tl.arange(0, BT)
    o_x = i_x * BX + tl.arange(0, BX)
    o_y = i_y * BY + tl.arange(0, BY)
    start = i_j * C
    length = tl.minimum(C, T - start)
    acc = tl.full([BX, BY], 0., ACC)
    for i in range(0, cdiv(length, BT)):
        m_t = i * BT + o_t < length
        t0 = start + i * BT
        b_x = load_tile(token_base(x, i_b, i_h, t0, T, H, DX), o_t, m_t, o_x, H, DX)
        b_y = load_tile(token_base(y, i_b, i_h, t0, T, H, DY), o_t, m_t, o_y, H, DY)
        if SCALE == 1:
            b_y = scaled(b_y, token_base(s, i_b, i_h, t0, T, H, 1), o_t, m_t, o_y, H, DY, SCALE, ACC)
        elif SCALE == 2:
            b_y = scaled(b_y, token_base(s, i_b, i_h, t0, T, H, DY), o_t, m_t, o_y, H, DY, SCALE, ACC)
        acc += mm_split(tl.trans(b_x), b_y, SPLIT_X, SPLIT_Y, DT, UPCAST)
    N = tl.num_programs(0)
    base = ((i_b * N + i_j) * H + i_h).to(tl.int64) * DX * DY
    tl.store(out + base + o_x[:, None] * DY + o_y[None, :], acc, mask=(o_x[:, None] < DX) & (o_y[None, :] < DY))


@triton.jit
def _read_kernel(x, s, S, out, T, C, s_b, s_n, s_h, s_k, s_v,
                 H, DX, DO,
                 BT: tl.constexpr, BX: tl.constexpr, BO: tl.constexpr, SCALE: tl.constexpr,
                 SPLIT_X: tl.constexpr, SPLIT_S: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
                 ACC: tl.constexpr):
    """One token tile × output tile: ``out_t = (s_t ⊙ x_t) S[b, chunk(t), h]`` (``S`` given by strides)."""
    i_tile, i_o, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    per_chunk = cdiv(C, BT)
    i_j, i_i = i_tile // per_chunk, i_tile % per_chunk
    t0 = i_j * C + i_i * BT
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t < T) & (i_i * BT + o_t < C)
    o_o = i_o * BO + tl.arange(0, BO)
    x_base = token_base(x, i_b, i_h, t0, T, H, DX)
    state = S + i_b.to(tl.int64) * s_b + i_j.to(tl.int64) * s_n + i_h.to(tl.int64) * s_h
    acc = tl.full([BT, BO], 0., ACC)
    for i_x in range(0, cdiv(DX, BX)):
        o_x = i_x * BX + tl.arange(0, BX)
        b_x = load_tile(x_base, o_t, m_t, o_x, H, DX)
        if SCALE == 1:
            b_x = scaled(b_x, token_base(s, i_b, i_h, t0, T, H, 1), o_t, m_t, o_x, H, DX, SCALE, ACC)
        elif SCALE == 2:
            b_x = scaled(b_x, token_base(s, i_b, i_h, t0, T, H, DX), o_t, m_t, o_x, H, DX, SCALE, ACC)
        b_s = tl.load(state + o_x[:, None] * s_k + o_o[None, :] * s_v,
                      mask=(o_x[:, None] < DX) & (o_o[None, :] < DO), other=0.)
        acc += mm_split(b_x, b_s, SPLIT_X, SPLIT_S, DT, UPCAST)
    store_tile(token_base(out, i_b, i_h, t0, T, H, DO), acc, o_t, m_t, o_o, H, DO)


def _scale_mode(scale: torch.Tensor | None) -> int:
    if scale is None:
        return NO_SCALE
    return TOKEN_SCALE if scale.dim() == 3 else FEATURE_SCALE


def chunk_increments(x, y, n, C, scale=None, *, dot_dtype=None, split_x=False, split_y=False):
    """``G[b, j, h] = X_jᵀ (scale ⊙ Y_j)`` for the first ``n`` chunks of ``C`` tokens, ``[B, n, H, DX, DY]``.

    ``x`` ``[B, T, H, DX]``, ``y`` ``[B, T, H, DY]``, ``scale`` ``[B, T, H]`` or ``[B, T, H, DY]``. The matmul
    operands are rounded to ``dot_dtype`` (default ``x.dtype``); ``split_x``/``split_y`` keep that operand at
    about 16 mantissa bits instead (one more matmul each), for half-precision ``dot_dtype``. The result is
    fp32.
    """
    x, y, scale = contiguous(x, y, scale)
    B, T, H, DX = x.shape
    DY = y.shape[-1]
    dot_dtype = dot_dtype or x.dtype
    out = x.new_empty(B, n, H, DX, DY, dtype=accumulator(dot_dtype))
    if n == 0:
        return out
    split_x, split_y = split_x and dot_dtype in HALF_DTYPES, split_y and dot_dtype in HALF_DTYPES

    def run(c):
        grid = (n, triton.cdiv(DX, c["BX"]) * triton.cdiv(DY, c["BY"]), B * H)
        _increments_kernel[grid](x, y, scale, out, T, C, H, DX, DY, c["BT"], c["BX"], c["BY"], _scale_mode(scale),
                                 split_x, split_y, tl_dtype(dot_dtype), upcast(dot_dtype),
                                 tl_dtype(accumulator(dot_dtype)), **c.options)

    key = shape_key(x, dot_dtype, y.dtype, C, DX, DY, _scale_mode(scale), split_x, split_y)
    launch("block.increments", key, _gemm_configs(dot_dtype, "BT", BT=C, BX=DX, BY=DY), run)
    return out


def chunk_read(x, states, C, *, scale=None, transpose=False, out_dtype=None, dot_dtype=None, split_x=False,
               split_s=False):
    """``O_t = (scale ⊙ X_t) S_j`` with ``j = t // C`` (``S_jᵀ`` with ``transpose``): ``[B, T, H, DO]``.

    ``states`` ``[B, n, H, Dk, Dv]`` in any strides; tokens of chunks ``≥ n`` get zeros. Operand rounding as
    in ``chunk_increments`` (``split_s`` for the states).
    """
    x, scale = contiguous(x, scale)
    B, T, H, DX = x.shape
    n = states.shape[1]
    s_b, s_n, s_h, s_k, s_v = states.stride()
    DO = states.shape[-1]
    if transpose:
        s_k, s_v, DO = s_v, s_k, states.shape[-2]
    alloc = torch.zeros if n * C < T else torch.empty
    out = alloc(B, T, H, DO, dtype=out_dtype or x.dtype, device=x.device)
    if n == 0:
        return out
    dot_dtype = dot_dtype or x.dtype
    split_x, split_s = split_x and dot_dtype in HALF_DTYPES, split_s and dot_dtype in HALF_DTYPES

    def run(c):
        grid = (n * triton.cdiv(C, c["BT"]), triton.cdiv(DO, c["BO"]), B * H)
        _read_kernel[grid](x, scale, states, out, T, C, s_b, s_n, s_h, s_k, s_v, H, DX, DO, c["BT"], c["BX"],
                           c["BO"], _scale_mode(scale), split_x, split_s, tl_dtype(dot_dtype), upcast(dot_dtype),
                           tl_dtype(accumulator(dot_dtype)), **c.options)

    key = shape_key(x, dot_dtype, states.dtype, C, DX, DO, _scale_mode(scale), split_x, split_s, s_k > s_v)
    launch("block.read", key, _gemm_configs(dot_dtype, "BX", BT=C, BX=DX, BO=DO), run)
    return out


@functools.lru_cache(maxsize=None)
def _gemm_configs(dot_dtype: torch.dtype, reduced: str, **dims: int) -> tuple[Config, ...]:
    """Launch options of a kernel with a token tile ``BT`` (within chunks of ``dims["BT"]`` tokens) and feature
    tiles (the other ``dims``), summing over the side ``reduced``: the default tiles first, then the classic GEMM
    sides for tensor cores (half precision: 64 or 128 wide outputs, 32 or 64 deep sums) or the narrower CUDA-core
    ones (fp32). Cached: every launch asks, tuning on or off."""
    defaults = {n: token_tile(d, dot_dtype) if n == "BT" else tile(d, 64, dot_dtype) for n, d in dims.items()}
    default = config(default_warps(*defaults.values()), 2, **defaults)
    half = dot_dtype in HALF_DTYPES

    def sides(name):
        return sides_up_to(dims[name], ((32, 64) if name == reduced else (64, 128)) if half else (16, 32))

    return tuple(candidates(default, {n: sides(n) for n in dims}))


def value_grads(du, v, lr, needs_v, needs_lr):
    """Gradients of ``u = lr ⊙ v`` from ``du``: ``(dv, dlr)``, each ``None`` when not needed."""
    if lr is None:
        return (du.to(v.dtype) if needs_v else None), None
    lr_b = lr.to(du.dtype).unsqueeze(-1) if lr.dim() == 3 else lr.to(du.dtype)
    dv = (du * lr_b).to(v.dtype) if needs_v else None
    dlr = None
    if needs_lr:
        dlr = du * v.to(du.dtype)
        dlr = (dlr.sum(-1) if lr.dim() == 3 else dlr).to(lr.dtype)
    return dv, dlr


def increments_backward(dG, phi_k, v, lr, C, needs, *, dot_dtype, precise):
    """``(dφK, dv, dlr)`` of ``G_j = φ(K_j)ᵀ (lr ⊙ V_j)`` from ``dG`` (``needs``: which of the three).

    With ``precise`` the matmul operands that are not exact in ``dot_dtype`` (``dG``, ``lr ⊙ V``, a computed
    ``φ(K)``) are split: Newton–Schulz's backward makes ``dG`` large along directions that cancel in these
    products, so its rounding error would not.
    """
    dG = dG.contiguous()
    dphi_k = dv = dlr = None
    if needs[0]:
        dphi_k = chunk_read(v, dG, C, scale=lr, transpose=True, out_dtype=phi_k.dtype, dot_dtype=dot_dtype,
                            split_x=precise and lr is not None, split_s=precise)
    if needs[1] or needs[2]:
        du = chunk_read(phi_k, dG, C, out_dtype=accumulator(dot_dtype), dot_dtype=dot_dtype,
                        split_x=precise and phi_k.dtype != dot_dtype, split_s=precise)
        dv, dlr = value_grads(du, v, lr, needs[1], needs[2])
    return dphi_k, dv, dlr


class ChunkIncrements(torch.autograd.Function):
    """``G_j = φ(K_j)ᵀ (lr ⊙ V_j)`` for the first ``n`` chunks, fp32; backward by the read kernel.

    ``precise`` (wanted when Newton–Schulz follows: it amplifies rounding in ``G`` and in ``dG`` by up to
    ``3.4445`` per step along small singular directions) keeps ``lr ⊙ V`` and ``dG`` unrounded.
    """

    @staticmethod
    def forward(ctx, phi_k, v, lr, n, C, precise):
        ctx.save_for_backward(phi_k, v, lr)
        ctx.C, ctx.precise = C, precise
        return chunk_increments(phi_k, v, n, C, scale=lr, split_y=precise and lr is not None)

    @staticmethod
    def backward(ctx, dG):
        refuse_graph("block_linear_attention[triton]")
        phi_k, v, lr = ctx.saved_tensors
        grads = increments_backward(dG, phi_k, v, lr, ctx.C, ctx.needs_input_grad[:3], dot_dtype=phi_k.dtype,
                                    precise=ctx.precise)
        return (*grads, None, None, None)


def read_backward(do, phi_q, states, C, needs, *, dot_dtype, precise):
    """``(dφQ, dstates)`` of ``o_t = φ(q_t) W_{chunk(t)}`` from ``do`` (``needs``: which of the two).

    ``dstates`` feeds Newton–Schulz's backward, so with ``precise`` a ``φ(Q)`` that is not exact in
    ``dot_dtype`` is split rather than rounded.
    """
    do = do.contiguous().to(dot_dtype)
    dphi_q = dstates = None
    if needs[0]:
        dphi_q = chunk_read(do, states, C, transpose=True, out_dtype=phi_q.dtype)
    if needs[1]:
        dstates = chunk_increments(phi_q, do, states.shape[1], C, dot_dtype=dot_dtype,
                                   split_x=precise and phi_q.dtype != dot_dtype)
    return dphi_q, dstates


class ChunkRead(torch.autograd.Function):
    """``o_t = φ(q_t) W_{chunk(t)}`` from fp32 states ``[B, n, H, Dk, Dv]``; backward by both kernels."""

    @staticmethod
    def forward(ctx, phi_q, states, C, out_dtype):
        ctx.save_for_backward(phi_q, states)
        ctx.C = C
        return chunk_read(phi_q, states, C, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, do):
        refuse_graph("block_linear_attention[triton]")
        phi_q, states = ctx.saved_tensors
        grads = read_backward(do, phi_q, states, ctx.C, ctx.needs_input_grad[:2], dot_dtype=phi_q.dtype,
                              precise=False)
        return (*grads, None, None)


def read_states(M, *, order, n, momentum, schedule, ns_eps, ns_dtype, initial_state, dtype, decay=None,
                step_scale=None):
    """From the increments ``M`` ``[B, n_update, H, Dk, Dv]``: the state every chunk reads and the final state.

    Runs momentum, Newton–Schulz (``schedule``, iterated in ``ns_dtype``, default ``dtype``) and the prefix
    sum in torch (chunk-level, differentiable); with a ``decay`` or ``step_scale``, the torch op's
    ``chunk_states`` on the same increments.
    """
    B, n_update, H, Dk, Dv = M.shape
    W0 = None if initial_state is None else initial_state.to(dtype)
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    if n_update > 0 and (decay is not None or step_scale is not None):
        states = chunk_states(M.transpose(1, 2), momentum=cast(momentum), schedule=schedule, ns_eps=ns_eps,
                              ns_dtype=ns_dtype, weight_norm=None, W0=W0, decay=cast(decay),
                              step_scale=cast(step_scale)).transpose(1, 2)
        final = states[:, -1]
    elif n_update > 0:
        if momentum is not None and n_update > 1:
            M = affine_scan(momentum[:, :n_update].to(dtype)[..., None, None], M, dim=1)
        delta = newton_schulz(M, 0, schedule, ns_eps, dtype=ns_dtype) if schedule else M
        states = prefix_sum(delta, dim=1, initial=W0)
        final = states[:, -1]
    else:
        states = M
        final = W0 if W0 is not None else M.new_zeros(B, H, Dk, Dv)
    if order == "exclusive":
        first = W0.unsqueeze(1) if W0 is not None else M.new_zeros(B, 1, H, Dk, Dv)
        states = torch.cat([first, states], dim=1)
    return states, final


def block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None, momentum=None,
                           muon_steps=0, ns_coefficients=None, ns_eps=NS_EPS, ns_dtype=None, weight_norm=None,
                           decay=None, step_scale=None, initial_state=None, output_final_state=False):
    """LaCT's block TTT update as linear attention, token-level matmuls in Triton; contract of the torch op.

    ``G_j = φ(K_j)ᵀ(lr ⊙ V_j)``, ``M_j = α_j M_{j-1} + G_j``, ``W_j = W_{j-1} + NS(M_j)``; ``order`` says which
    state chunk ``j`` reads; ``decay`` and ``step_scale`` as in the torch op (applied between chunks, in torch).
    ``weight_norm`` is not implemented here (``supports`` says so). Half-precision
    inputs use tensor-core matmuls, keeping the operands Newton–Schulz is sensitive to at about 16 bits.
    Precision follows the inputs: fp32 stays fp32, Newton–Schulz iterates in ``ns_dtype``.
    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    n = check_block_inputs(phi_q, phi_k, v, chunk_size=chunk_size, order=order, lr=lr, momentum=momentum,
                           muon_steps=muon_steps, weight_norm=weight_norm, initial_state=initial_state,
                           ns_coefficients=ns_coefficients, decay=decay, step_scale=step_scale)
    schedule = ns_schedule(muon_steps, ns_coefficients)
    if weight_norm is not None:
        raise UnsupportedTTTError(
            "block_linear_attention: the Triton kernels do not implement weight_norm (a sequential column-norm "
            "recursion); call the runtime op with backend='auto' or 'torch' for it")
    T = phi_k.shape[1]
    C = T if order == "full" else chunk_size
    n_update = n - 1 if order == "exclusive" else n
    dtype = compute_dtype(v.dtype)
    M = ChunkIncrements.apply(phi_k, v, lr, n_update, C, bool(schedule))
    states, final = read_states(M, order=order, n=n, momentum=momentum, schedule=schedule, ns_eps=ns_eps,
                                ns_dtype=ns_dtype, initial_state=initial_state, dtype=dtype, decay=decay,
                                step_scale=step_scale)
    o = ChunkRead.apply(phi_q, states, C, v.dtype)
    final = final.to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o, final


__all__ = ["block_linear_attention", "chunk_increments", "chunk_read", "read_states", "increments_backward",
           "read_backward", "ChunkIncrements", "ChunkRead"]
