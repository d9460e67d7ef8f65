"""The (gated) delta rule: a state that is matrix-affine in itself, chunk-parallel in plain torch.

A linear fast weight trained by a gradient step on the MSE loss ``½β‖k S − v‖²`` per token, with
an optional decay ``α_t`` of the state (weight decay, gating), is, in the ``[Dk, Dv]``
convention with row vectors ``k_t``::

    S_t = α_t (I − β_t k_tᵀ k_t) S_{t-1} + β_t k_tᵀ v_t
        = α_t S_{t-1} + β_t k_tᵀ (v_t − α_t k_t S_{t-1})

(the gated delta rule: decay, then correct the decayed state's prediction of ``v_t``).
``order="inclusive"`` reads ``o_t = q_t S_t``, ``"exclusive"`` reads ``o_t = q_t S_{t-1}``;
every token updates the state either way.

The chunked form (``torch_delta_rule``), chunk by chunk of ``C`` tokens entering with state
``S``, with ``γ_t = α_1 ⋯ α_t`` and ``D[t, i] = α_{i+1} ⋯ α_t`` inside the chunk:

* the corrections ``u_t = β_t (v_t − α_t k_t S_{t-1})`` solve one unit lower-triangular system
  of size ``C`` (the UT transform of the WY representation):
  ``(I + L) U = diag(β) V − diag(βγ) K S`` with ``L[t, i] = β_t D[t, i] k_t·k_i`` (``i < t``),
  so ``U = Ũ − W̃ S`` where ``[W̃ | Ũ] = (I + L)⁻¹ [diag(βγ) K | diag(β) V]`` does not depend on
  ``S``;
* the outputs are ``O = M Ũ + (diag(γ) Q − M W̃) S`` with ``M = (Q Kᵀ) ⊙ D`` (causal), and the
  state leaving the chunk is ``A S + B`` with ``A = γ_C I − K̂ᵀ W̃``, ``B = K̂ᵀ Ũ``,
  ``K̂ = diag(D[C, ·]) K``.

Every chunk's ``(A, B)``, ``M Ũ`` and ``diag(γ) Q − M W̃`` come from batched matmuls and one
batched triangular solve; only the ``[Dk, Dk]``/``[Dk, Dv]`` maps cross chunks, through the
matrix-affine scan (``matrix_affine_scan``: log-depth by default, or a sequential pass). Decay
ratios are exponentials of segment sums of ``log α`` (never quotients of cumulative products).
Gradients are plain autograd through this form.
"""
from __future__ import annotations

import math

import torch

from ttt2la.runtime.chunk import split_chunks
from ttt2la.runtime.scan import segment_sums
from ttt2la.runtime.matrix_affine_scan import METHODS, matrix_affine_scan
from ttt2la.runtime.naive import RuntimeInputError, compute_dtype, final_state_dtype

DELTA_ORDERS = ("inclusive", "exclusive")
#: The chunk size the runtime picks when a caller (a lowered loop) leaves it to it: the UT
#: solve costs ``O(C²)`` per token and the scan ``O(Dk²·Dv / C)``; 64 balances them for heads of
#: 64 features and is the size the delta-rule kernels of public libraries use.
DELTA_CHUNK_SIZE = 64
DELTA_BACKENDS = ("auto", "torch", "naive")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeInputError(f"delta_rule: {message}")


def check_delta_inputs(q, k, v, beta, *, decay, chunk_size, initial_state, order) -> None:
    """Validate the delta rule's arguments (shared by every implementation)."""
    shape = lambda t: tuple(t.shape)  # noqa: E731
    _require(order in DELTA_ORDERS, f"order must be one of {DELTA_ORDERS}, got {order!r}")
    _require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
             f"q, k, v must be [B, T, H, D]; got {shape(q)}, {shape(k)}, {shape(v)}")
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    _require(T >= 1, "the sequence must hold at least one token (T >= 1)")
    _require(shape(q) == (B, T, H, Dk), f"q {shape(q)} must match k {shape(k)}")
    _require(shape(v)[:3] == (B, T, H), f"v {shape(v)} must share [B, T, H] = {(B, T, H)} with k")
    _require(shape(beta) == (B, T, H), f"beta must be [B, T, H] = {(B, T, H)}, got {shape(beta)}")
    _require(isinstance(chunk_size, int) and chunk_size >= 1,
             f"chunk_size must be a positive int, got {chunk_size!r}")
    if decay is not None:
        _require(shape(decay) == (B, T, H),
                 f"decay must be [B, T, H] = {(B, T, H)}, got {shape(decay)}")
    if initial_state is not None:
        _require(shape(initial_state) == (B, H, Dk, Dv),
                 f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, "
                 f"got {shape(initial_state)}")


def naive_delta_rule(q, k, v, beta, *, decay=None, chunk_size=DELTA_CHUNK_SIZE,
                     initial_state=None, output_final_state=False, order="inclusive"):
    """The gated delta rule one token at a time (the reference; see the module docstring).

    ``chunk_size`` only exists to share the fast op's signature. Returns
    ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    check_delta_inputs(q, k, v, beta, decay=decay, chunk_size=chunk_size,
                       initial_state=initial_state, order=order)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = k.shape
    q, k, vv, beta = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    S = (torch.zeros(B, H, Dk, v.shape[-1], dtype=dt, device=v.device) if initial_state is None
         else initial_state.to(dt))
    outputs = []
    for t in range(T):
        if order == "exclusive":
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        if decay is not None:
            S = decay[:, t].to(dt)[..., None, None] * S
        error = vv[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * error[:, :, None, :]
        if order == "inclusive":
            outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1)
    final = S.to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o.to(v.dtype), final


def _head_major_chunks(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """``[B, T, H, ...] → [B, H, n, C, ...]``, zero-padding the tokens after ``T``."""
    return split_chunks(x, n, C).movedim(3, 1)


def _decay_masks(g: torch.Tensor, order: str):
    """``(D, γ, D_read, γ_read)`` of every chunk from its log-decays ``g [..., C]``.

    ``D[t, i] = exp(Σ_{i<l≤t} g_l)`` (0 above the diagonal), ``γ_t = exp(Σ_{l≤t} g_l)``; the
    read masks are these for the state a query reads: ``S_t`` (inclusive) or ``S_{t-1}``.
    """
    D = segment_sums(g).exp()
    gamma = torch.cumsum(g, dim=-1).exp()
    if order == "inclusive":
        return D, gamma, D, gamma
    D_read = torch.cat([torch.zeros_like(D[..., :1, :]), D[..., :-1, :]], dim=-2)
    gamma_read = torch.cat([torch.ones_like(gamma[..., :1]), gamma[..., :-1]], dim=-1)
    return D, gamma, D_read, gamma_read


def chunk_maps(q, k, v, beta, g, order: str):
    """Every chunk as an affine map of the state entering it.

    ``q, k``: ``[..., C, Dk]``; ``v``: ``[..., C, Dv]``; ``beta``, ``g`` (log-decays):
    ``[..., C]``. Returns ``(A [..., Dk, Dk], B [..., Dk, Dv], Y [..., C, Dv], P [..., C, Dk])``:
    the state leaving the chunk is ``A S + B`` and its outputs ``Y + P S``.
    """
    C, Dk = k.shape[-2:]
    D, gamma, D_read, gamma_read = _decay_masks(g, order)
    strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    L = (beta.unsqueeze(-1) * (k @ k.mT) * D).masked_fill(~strict, 0.0)
    rhs = torch.cat([(beta * gamma).unsqueeze(-1) * k, beta.unsqueeze(-1) * v], dim=-1)
    solved = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    W, U = solved.split([Dk, v.shape[-1]], dim=-1)
    M = (q @ k.mT) * D_read
    k_out = D[..., -1, :].unsqueeze(-1) * k  # K̂: each key decayed to the chunk's end
    eye = torch.eye(Dk, dtype=k.dtype, device=k.device)
    A = gamma[..., -1, None, None] * eye - k_out.mT @ W
    return A, k_out.mT @ U, M @ U, gamma_read.unsqueeze(-1) * q - M @ W


def torch_delta_rule(q, k, v, beta, *, decay=None, chunk_size=DELTA_CHUNK_SIZE,
                     initial_state=None, output_final_state=False, order="inclusive",
                     scan="pairwise"):
    """Chunked gated delta rule; same contract as ``naive_delta_rule``.

    ``scan`` chooses how the chunk maps are composed: ``"pairwise"`` (log-depth) or
    ``"sequential"``.
    """
    check_delta_inputs(q, k, v, beta, decay=decay, chunk_size=chunk_size,
                       initial_state=initial_state, order=order)
    _require(scan in METHODS, f"scan must be one of {METHODS}, got {scan!r}")
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = min(chunk_size, T)
    n = math.ceil(T / C)
    qc, kc, vc = (_head_major_chunks(x.to(dt), n, C) for x in (q, k, v))
    bc = _head_major_chunks(beta.to(dt), n, C)  # padded tokens: β = 0, an identity step
    g = (torch.zeros_like(bc) if decay is None
         else _head_major_chunks(torch.log(decay.to(dt)), n, C))  # padded: log α = 0
    A, Bm, Y, P = chunk_maps(qc, kc, vc, bc, g, order)
    S0 = (torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device) if initial_state is None
          else initial_state.to(dt))
    states = matrix_affine_scan(A, Bm, S0, method=scan)  # [B, H, n, Dk, Dv]
    entering = torch.cat([S0.unsqueeze(2), states[:, :, :-1]], dim=2)
    o = (Y + P @ entering).movedim(1, 3).reshape(B, n * C, H, Dv)[:, :T]
    final = (states[:, :, -1].to(final_state_dtype(v, initial_state)) if output_final_state
             else None)
    return o.to(v.dtype), final


def delta_rule(q, k, v, beta, *, decay=None, chunk_size=DELTA_CHUNK_SIZE, initial_state=None,
               output_final_state=False, order="inclusive", scan="pairwise", backend="auto"):
    """The gated delta rule ``S_t = α_t (I − β_t k_tᵀ k_t) S_{t-1} + β_t k_tᵀ v_t``.

    ``q, k``: ``[B, T, H, Dk]``; ``v``: ``[B, T, H, Dv]``; ``beta``: ``[B, T, H]`` (the step
    size; a gradient step of size ``η`` on ``‖k S − v‖²`` is ``β = 2η``); ``decay``: ``[B, T, H]``
    positive factors ``α_t`` (None: 1); ``initial_state``: ``[B, H, Dk, Dv]``. Outputs
    ``o_t = q_t S_t`` (``order="inclusive"``) or ``q_t S_{t-1}`` (``"exclusive"``).
    ``backend``: ``"torch"`` (chunked; ``"auto"`` is torch until a Triton kernel exists) or
    ``"naive"`` (the token loop). Returns ``(o [B, T, H, Dv], final_state or None)``.
    """
    _require(backend in DELTA_BACKENDS, f"backend must be one of {DELTA_BACKENDS}, "
             f"got {backend!r}")
    options = dict(decay=decay, chunk_size=chunk_size, initial_state=initial_state,
                   output_final_state=output_final_state, order=order)
    if backend == "naive":
        return naive_delta_rule(q, k, v, beta, **options)
    return torch_delta_rule(q, k, v, beta, scan=scan, **options)


__all__ = ["delta_rule", "naive_delta_rule", "torch_delta_rule", "check_delta_inputs",
           "chunk_maps", "DELTA_ORDERS", "DELTA_CHUNK_SIZE"]
