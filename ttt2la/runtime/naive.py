"""Reference definitions of the runtime ops: plain loops over chunks / tokens, no cleverness.

These functions *are* the specification every fast path (torch or Triton) is tested against.
They run in the dtype they are given (float64 for the references in tests); bf16/fp16 inputs
are accumulated in fp32 and the result is cast back. The argument checks shared by all
implementations live here too, so every backend rejects the same malformed inputs the same way.

Layout (flash-linear-attention's): sequences ``[B, T, H, D]``, states ``[B, H, Dk, Dv]``.
"""
from __future__ import annotations

import math

import torch

from ttt2la.errors import ConversionError

ORDERS = ("exclusive", "inclusive", "full")
#: Muon's classic quintic Newton–Schulz triple, the default when no schedule is given.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
WEIGHT_NORM_EPS = 1e-5


class RuntimeInputError(ConversionError, ValueError):
    """A runtime op was called with tensors or options that break its contract."""


# ----------------------------------------------------------------------------- argument checks

def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a runtime op accumulates in: float64 stays float64, everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _require(cond: bool, op: str, message: str) -> None:
    if not cond:
        raise RuntimeInputError(f"{op}: {message}")


def num_chunks(seq_len: int, chunk_size: int, order: str) -> int:
    """How many chunks a sequence of ``seq_len`` tokens is cut into (``order="full"``: one)."""
    return 1 if order == "full" else math.ceil(seq_len / chunk_size)


def ns_schedule(muon_steps: int = 0, ns_coefficients=None) -> tuple[tuple[float, float, float], ...]:
    """The Newton–Schulz ``(a, b, c)`` triple of every step: ``()`` means no Muon.

    ``ns_coefficients`` is ``None`` (Muon's classic triple), one triple used at each of the
    ``muon_steps`` steps, or one triple per step; with a per-step schedule ``muon_steps`` is 0
    (taken from the schedule) or its length.
    """
    op = "block_linear_attention"
    _require(isinstance(muon_steps, int) and not isinstance(muon_steps, bool) and muon_steps >= 0,
             op, f"muon_steps must be a non-negative int, got {muon_steps!r}")
    if ns_coefficients is None:
        return (NS_COEFFICIENTS,) * muon_steps
    coeffs = tuple(ns_coefficients)
    if len(coeffs) == 3 and all(isinstance(c, (int, float)) for c in coeffs):
        return (tuple(float(c) for c in coeffs),) * muon_steps
    _require(all(isinstance(t, (tuple, list)) and len(t) == 3
                 and all(isinstance(c, (int, float)) for c in t) for t in coeffs), op,
             f"ns_coefficients must be one (a, b, c) triple or a sequence of them, "
             f"got {ns_coefficients!r}")
    _require(muon_steps in (0, len(coeffs)), op,
             f"muon_steps={muon_steps} disagrees with the {len(coeffs)} per-step triples of "
             "ns_coefficients; pass muon_steps=0 or its length")
    return tuple(tuple(float(c) for c in t) for t in coeffs)


def check_block_inputs(phi_q, phi_k, v, *, chunk_size, order, lr, momentum, muon_steps,
                       weight_norm, initial_state, ns_coefficients=None, decay=None,
                       step_scale=None, value_decay=None) -> int:
    """Validate the block op's arguments and return the number of chunks ``N``."""
    op = "block_linear_attention"
    _require(order in ORDERS, op, f"order must be one of {ORDERS}, got {order!r}")
    _require(phi_q.dim() == 4 and phi_k.dim() == 4 and v.dim() == 4, op,
             f"phi_q, phi_k, v must be [B, T, H, D]; got {_shape(phi_q)}, {_shape(phi_k)}, "
             f"{_shape(v)}")
    B, T, H, Dk = phi_k.shape
    Dv = v.shape[-1]
    _require(T >= 1, op, "the sequence must hold at least one token (T >= 1)")
    _require(_shape(phi_q) == (B, T, H, Dk), op,
             f"phi_q {_shape(phi_q)} must match phi_k {_shape(phi_k)}")
    _require(_shape(v)[:3] == (B, T, H), op,
             f"v {_shape(v)} must share [B, T, H] = {(B, T, H)} with phi_k")
    if order != "full":
        _require(isinstance(chunk_size, int) and chunk_size >= 1, op,
                 f"chunk_size must be a positive int, got {chunk_size!r}")
    ns_schedule(muon_steps, ns_coefficients)
    n = num_chunks(T, chunk_size, order)
    if lr is not None:
        _require(_shape(lr) in ((B, T, H), (B, T, H, Dv)), op,
                 f"lr must be [B, T, H] = {(B, T, H)} or [B, T, H, Dv] = {(B, T, H, Dv)}, "
                 f"got {_shape(lr)}")
    if momentum is not None and order != "full":
        _require(_shape(momentum) == (B, n, H), op,
                 f"momentum must hold one coefficient per chunk, [B, N, H] = {(B, n, H)} "
                 f"(N = ceil({T} / {chunk_size})), got {_shape(momentum)}")
    count = "1 for the full order" if order == "full" else f"ceil({T} / {chunk_size})"
    if step_scale is not None:
        _require(_shape(step_scale) == (B, n, H), op,
                 f"step_scale must hold one factor per chunk, [B, N, H] = {(B, n, H)} "
                 f"(N = {count}), got {_shape(step_scale)}")
    if decay is not None:
        _require(_shape(decay) in ((B, n, H), (B, n, H, Dk)), op,
                 f"decay must hold one factor per chunk, [B, N, H] = {(B, n, H)}, or one per "
                 f"chunk and key channel, [B, N, H, Dk] = {(B, n, H, Dk)} (N = {count}), "
                 f"got {_shape(decay)}")
    if value_decay is not None:
        _require(_shape(value_decay) == (B, n, H, Dv), op,
                 f"value_decay must hold one factor per chunk and value channel, [B, N, H, Dv] "
                 f"= {(B, n, H, Dv)} (N = {count}), got {_shape(value_decay)}")
        _require(decay is None or decay.dim() == 3, op,
                 "value_decay (per column of the state) cannot be combined with a decay per "
                 "key channel (per row of the state); pass one of them")
    if weight_norm is not None:
        _require(_shape(weight_norm) == (B, H, Dv), op,
                 f"weight_norm must be [B, H, Dv] = {(B, H, Dv)}, got {_shape(weight_norm)}")
    if initial_state is not None:
        _require(_shape(initial_state) == (B, H, Dk, Dv), op,
                 f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, "
                 f"got {_shape(initial_state)}")
    return n


def check_chunk_inputs(q, k, v, *, chunk_size, log_decay, initial_state,
                       value_log_decay=None) -> None:
    """Validate the token-causal op's arguments."""
    op = "chunk_linear_attention"
    _require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, op,
             f"q, k, v must be [B, T, H, D]; got {_shape(q)}, {_shape(k)}, {_shape(v)}")
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    _require(T >= 1, op, "the sequence must hold at least one token (T >= 1)")
    _require(_shape(q) == (B, T, H, Dk), op, f"q {_shape(q)} must match k {_shape(k)}")
    _require(_shape(v)[:3] == (B, T, H), op,
             f"v {_shape(v)} must share [B, T, H] = {(B, T, H)} with k")
    _require(isinstance(chunk_size, int) and chunk_size >= 1, op,
             f"chunk_size must be a positive int, got {chunk_size!r}")
    if value_log_decay is not None:
        _require(_shape(value_log_decay) == (B, T, H, Dv), op,
                 f"value_log_decay must be [B, T, H, Dv] = {(B, T, H, Dv)} (per value channel),"
                 f" got {_shape(value_log_decay)}")
        _require(log_decay is None or log_decay.dim() == 3, op,
                 "value_log_decay (per column of the state) cannot be combined with a log decay "
                 "per key channel (per row of the state); pass one of them")
    if log_decay is not None:
        _require(_shape(log_decay) in ((B, T, H), (B, T, H, Dk)), op,
                 f"log_decay must be [B, T, H] = {(B, T, H)} (per head) or [B, T, H, Dk] = "
                 f"{(B, T, H, Dk)} (per key channel), got {_shape(log_decay)}")
    if initial_state is not None:
        _require(_shape(initial_state) == (B, H, Dk, Dv), op,
                 f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, "
                 f"got {_shape(initial_state)}")


def effective_value(v: torch.Tensor, lr: torch.Tensor | None) -> torch.Tensor:
    """``u = lr ⊙ v`` with ``lr`` per token ``[B, T, H]`` or per token and feature."""
    if lr is None:
        return v
    return v * (lr.unsqueeze(-1) if lr.dim() == 3 else lr)


def final_state_dtype(v: torch.Tensor, initial_state: torch.Tensor | None) -> torch.dtype:
    """The returned state keeps the initial state's dtype, or the value dtype without one."""
    return initial_state.dtype if initial_state is not None else v.dtype


# ----------------------------------------------------------------------------- references

def naive_newton_schulz(G: torch.Tensor, schedule, eps: float = NS_EPS,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """Quintic Newton–Schulz orthogonalisation of ``[..., Dk, Dv]`` matrices, one ``(a, b, c)``
    of ``schedule`` per step, iterated in ``dtype`` (default ``G``'s) and returned in ``G``'s."""
    X = G.to(dtype or G.dtype)
    X = X.mT if G.shape[-2] > G.shape[-1] else X
    X = X / (X.square().sum(dim=(-2, -1), keepdim=True).sqrt() + eps)
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return (X.mT if G.shape[-2] > G.shape[-1] else X).to(G.dtype)


def _normalise_columns(W: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    norms = torch.linalg.vector_norm(W, dim=-2, keepdim=True)
    return W / (norms + WEIGHT_NORM_EPS) * target.unsqueeze(-2)


def naive_block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None,
                                 momentum=None, muon_steps=0, ns_coefficients=None,
                                 ns_eps=NS_EPS, ns_dtype=None, weight_norm=None, decay=None,
                                 step_scale=None, value_decay=None, initial_state=None,
                                 output_final_state=False):
    """LaCT's chunked TTT-as-linear-attention, one chunk at a time (the reference).

    Chunk ``j`` of ``C`` tokens adds ``G_j = φ(K_j)ᵀ (lr ⊙ V_j)``, through momentum
    (``M_j = α_j M_{j-1} + G_j``) and Muon (``muon_steps`` Newton–Schulz steps), times the step's
    factor ``s_j`` (``step_scale [B, N, H]``, None: 1; Muon's rate after the orthogonalisation),
    to the state decayed by ``decay`` (``W_j = γ_j W_{j-1} + s_j Δ_j``; ``[B, N, H]``, or
    ``[B, N, H, Dk]`` for a decay per key channel, each row of the state its own; None: 1);
    ``value_decay [B, N, H, Dv]`` decays each column of the state by its own factor, after
    ``decay`` (which is then per matrix or None: the two per-channel decays are exclusive);
    ``weight_norm`` rescales every state column to its target norm after each update.
    Newton–Schulz follows ``ns_schedule(muon_steps, ns_coefficients)``, normalises by
    ``‖M‖_F + ns_eps`` and iterates in ``ns_dtype`` (default: the accumulation dtype; a
    user's code that casts to bf16 before Newton–Schulz lowers to ``ns_dtype=torch.bfloat16``).
    ``order="exclusive"`` reads chunk ``j`` through the state before its update and never updates
    with the last chunk, ``"inclusive"`` updates then reads, ``"full"`` updates once on all tokens
    then reads every token (``chunk_size`` and ``momentum`` then play no part).
    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    n = check_block_inputs(phi_q, phi_k, v, chunk_size=chunk_size, order=order, lr=lr,
                           momentum=momentum, muon_steps=muon_steps, weight_norm=weight_norm,
                           initial_state=initial_state, ns_coefficients=ns_coefficients,
                           decay=decay, step_scale=step_scale, value_decay=value_decay)
    schedule = ns_schedule(muon_steps, ns_coefficients)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = phi_k.shape
    Dv = v.shape[-1]
    C = T if order == "full" else chunk_size
    fq, fk = phi_q.to(dt), phi_k.to(dt)
    u = effective_value(v.to(dt), None if lr is None else lr.to(dt))
    W = (torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device) if initial_state is None
         else initial_state.to(dt))
    M = None
    outputs = []
    for j in range(n):
        sl = slice(j * C, min((j + 1) * C, T))
        updates = order != "exclusive" or j < n - 1
        if order == "exclusive":
            outputs.append(torch.einsum("bthk,bhkv->bthv", fq[:, sl], W))
        if updates:
            G = torch.einsum("bthk,bthv->bhkv", fk[:, sl], u[:, sl])
            if momentum is not None and M is not None:
                M = momentum[:, j].to(dt)[..., None, None] * M + G
            else:
                M = G
            delta = naive_newton_schulz(M, schedule, ns_eps, ns_dtype) if schedule else M
            if step_scale is not None:
                delta = step_scale[:, j].to(dt)[..., None, None] * delta
            if decay is not None:       # per matrix [B, H] or per state row [B, H, Dk]
                d = decay[:, j].to(dt)
                W = (d[..., None] if d.dim() == 3 else d[..., None, None]) * W
            if value_decay is not None:     # per state column [B, H, Dv]
                W = value_decay[:, j].to(dt)[..., None, :] * W
            W = W + delta
            if weight_norm is not None:
                W = _normalise_columns(W, weight_norm.to(dt))
        if order != "exclusive":
            outputs.append(torch.einsum("bthk,bhkv->bthv", fq[:, sl], W))
    o = torch.cat(outputs, dim=1).to(v.dtype)
    final = W.to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o, final


def naive_chunk_linear_attention(q, k, v, *, chunk_size=64, log_decay=None, scale=None,
                                 value_log_decay=None, initial_state=None,
                                 output_final_state=False):
    """Token-causal (gated) linear attention, one token at a time (the reference).

    ``S_t = exp(log_decay_t) S_{t-1} + k_tᵀ v_t`` and ``o_t = scale · q_t S_t``; ``scale=None``
    means 1.0 (not ``D**-0.5``). ``log_decay`` is per head ``[B, T, H]`` or per key channel
    ``[B, T, H, Dk]`` (a row of ``S``); ``value_log_decay [B, T, H, Dv]`` decays each column of
    ``S`` (``S_t = S_{t-1} exp(g_t)[None, :] + k_tᵀ v_t``), alone or after a decay per head.
    ``chunk_size`` only exists to share the fast op's signature.
    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``.
    """
    check_chunk_inputs(q, k, v, chunk_size=chunk_size, log_decay=log_decay,
                       initial_state=initial_state, value_log_decay=value_log_decay)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, vv = q.to(dt), k.to(dt), v.to(dt)
    S = (torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device) if initial_state is None
         else initial_state.to(dt))
    outputs = []
    for t in range(T):
        if log_decay is not None:
            S = torch.exp(log_decay[:, t].to(dt)).reshape(B, H, -1, 1) * S
        if value_log_decay is not None:
            S = torch.exp(value_log_decay[:, t].to(dt)).reshape(B, H, 1, Dv) * S
        S = S + k[:, t, :, :, None] * vv[:, t, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, dim=1)
    if scale is not None:
        o = o * scale
    final = S.to(final_state_dtype(v, initial_state)) if output_final_state else None
    return o.to(v.dtype), final


__all__ = ["naive_block_linear_attention", "naive_chunk_linear_attention", "naive_newton_schulz",
           "check_block_inputs", "check_chunk_inputs", "effective_value", "ns_schedule",
           "RuntimeInputError"]
