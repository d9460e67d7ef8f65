"""Block (chunk-level) TTT-as-linear-attention in plain torch: LaCT's update rule, chunk-parallel.

Every chunk's increment ``G_j = φ(K_j)ᵀ (lr ⊙ V_j)`` is state-independent, so the op runs as

1. all increments by batched matmuls (``ChunkIncrements``);
2. momentum as a blocked affine scan over the increments (``scan.blocked_scan``: log-depth,
   factors only ever multiplied);
3. Newton–Schulz on every chunk's ``M_j`` in one batched call;
4. the state pass: a blocked prefix sum over chunks (*parallel*), or, with ``weight_norm``,
   ``W ← norm(W + Δ_j)`` chunk after chunk (*semi-parallel*: the norm is not associative, but
   only this cheap map is sequential, and it is exact);
5. all outputs by batched matmuls against the per-chunk states (``ReadStates``).

Steps 1 and 5 move all the ``[B, T, H, D]`` data. They are autograd Functions with explicit
backwards, one ``bmm`` per (batch, head) over all its chunks, reading each head's chunks as
strided views of the input and writing results straight into strided views of the output with
``out=``: no padding, no per-head stacking, no transposed copies, forward or backward (a
compiler tracing the op gets the same products as plain batched ops instead, ``_traced``). The
per-chunk states live head-major, ``[B, H, N, Dk, Dv]``, so every state-sized step (scans,
Newton–Schulz, the norm) works on contiguous views. Steps 2-4 act on those small tensors under
ordinary autograd. A state with neither momentum, Newton–Schulz nor a weight norm, short chunks
and narrow features runs in groups of chunks instead (``grouped_chunks``).

Precision follows the source: the op accumulates in the inputs' dtype (fp32 for bf16/fp16,
float64 only for float64 inputs), and Newton–Schulz iterates in ``ns_dtype`` — the dtype the
user's code iterates in (LaCT casts to bf16), the accumulation dtype by default.

Measured on CPU (``benchmarks/runtime_cpu.py``, ``docs/runtime.md``): faster than a plain loop
over chunks doing the same math at 2048-token chunks, forward and backward, with and without
Newton–Schulz; at chunks shorter than the features the forward is slower (every chunk's state
is read from memory). The Appendix-H masked form ``((ΦQ ΦKᵀ) ⊙ mask) U`` over the whole sequence was
measured 10-100× slower than the state form except on sequences of a few dozen tokens; it runs
only inside groups of chunks (``grouped_chunks``).
"""
from __future__ import annotations

import torch

from ttt2la.runtime.grouped_chunks import group_chunks, grouped_block_linear_attention
from ttt2la.runtime.higher_order import backward_as_graph, recording_graph
from ttt2la.runtime.naive import (NS_EPS, WEIGHT_NORM_EPS, check_block_inputs, compute_dtype,
                                  effective_value, final_state_dtype, ns_schedule)
from ttt2la.runtime.newton_schulz import newton_schulz
from ttt2la.runtime.scan import blocked_scan, summed_scan


def chunk_pieces(T: int, C: int, first: int, stop: int):
    """Token ranges of chunks ``first .. stop-1`` of a ``T``-token sequence cut every ``C``:
    ``(chunk, count, length)`` — ``count`` whole chunks from ``chunk`` on, or the ragged last one."""
    whole = min(stop, T // C)
    pieces = [(first, whole - first, C)] if whole > first else []
    if stop > max(whole, first):
        pieces.append((stop - 1, 1, T - (stop - 1) * C))
    return pieces


def _tokens(x: torch.Tensor, b: int, h: int, chunk: int, count: int, length: int, C: int):
    """Chunks ``chunk .. chunk+count-1`` of ``x[b, :, h]`` as a ``[count, length, D]`` view
    (one ``as_strided``: indexing and viewing dispatched four ops per (batch, head))."""
    sB, sT, sH, sD = x.stride()
    return x.as_strided((count, length, x.shape[-1]), (length * sT, sT, sD),
                        x.storage_offset() + b * sB + chunk * C * sT + h * sH)


def _states(S: torch.Tensor, b: int, h: int, s: int, count: int):
    """``S[b, h, s:s+count]`` of ``[B, H, n, R, K]`` states, as one ``as_strided``."""
    sB, sH, sN, sR, sK = S.stride()
    return S.as_strided((count, *S.shape[-2:]), (sN, sR, sK),
                        S.storage_offset() + b * sB + h * sH + s * sN)


def _chunked(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """The first ``n`` chunks of ``x [B, T, H, D]`` as ``[B, n, C, H, D]``, a ragged last
    chunk padded with zeros (a differentiable copy)."""
    covered = min(n * C, x.shape[1])
    x = torch.nn.functional.pad(x[:, :covered], (0, 0, 0, 0, 0, n * C - covered))
    return x.reshape(x.shape[0], n, C, *x.shape[2:])


def plain_increments(phi_k, u, n: int, C: int) -> torch.Tensor:
    """``ChunkIncrements`` in plain differentiable ops."""
    return torch.einsum("bjchk,bjchv->bhjkv", _chunked(phi_k, n, C), _chunked(u, n, C))


def plain_read(phi_q, states, first, C: int, shift: int) -> torch.Tensor:
    """``ReadStates`` in plain differentiable ops."""
    B, T, H, _ = phi_q.shape
    if shift:
        head = states.new_zeros(B, H, 1, *states.shape[3:]) if first is None \
            else first.unsqueeze(2)
        states = torch.cat([head, states], dim=2)
    n = states.shape[2]
    o = torch.einsum("bjchk,bhjkv->bjchv", _chunked(phi_q, n, C), states)
    return o.reshape(B, n * C, H, -1)[:, :T]


def _traced() -> bool:
    """Whether a compiler traces the op (``torch.compile``, ``torch.export``): it then runs the
    increments and reads as plain batched products (``plain_increments``, ``plain_read``),
    which the compiler fuses and plans memory for itself, where the Functions' per-head ``out=``
    writes would trace into copies (a compiled LaCT step at chunk 2048 ran 21 % faster so);
    and an exported program keeps no ``out=`` write, which could not run on weights that
    require grad."""
    return torch.compiler.is_compiling()


class ChunkIncrements(torch.autograd.Function):
    """``G[b, h, j] = φ(K_j)ᵀ U_j`` for the first ``n`` chunks: ``[B, H, n, Dk, Dv]``."""

    @staticmethod
    def forward(ctx, phi_k, u, n: int, C: int):
        B, T, H, Dk = phi_k.shape
        G = phi_k.new_empty(B, H, n, Dk, u.shape[-1])
        for chunk, count, length in chunk_pieces(T, C, 0, n):
            for b in range(B):
                for h in range(H):
                    torch.bmm(_tokens(phi_k, b, h, chunk, count, length, C).mT,
                              _tokens(u, b, h, chunk, count, length, C),
                              out=_states(G, b, h, chunk, count))
        ctx.save_for_backward(phi_k, u)
        ctx.n, ctx.C = n, C
        return G

    @staticmethod
    def backward(ctx, dG):
        phi_k, u = ctx.saved_tensors
        if recording_graph():
            return (*backward_as_graph(lambda k, v: plain_increments(k, v, ctx.n, ctx.C),
                                       (phi_k, u), ctx.needs_input_grad[:2], dG), None, None)
        B, T, H, _ = phi_k.shape
        dG = dG.contiguous()
        covered = min(ctx.n * ctx.C, T)     # tokens past the increments get a zero gradient
        dk = torch.empty_like(phi_k) if ctx.needs_input_grad[0] else None
        du = torch.empty_like(u) if ctx.needs_input_grad[1] else None
        for d in (dk, du):
            if d is not None and covered < T:
                d[:, covered:].zero_()
        for chunk, count, length in chunk_pieces(T, ctx.C, 0, ctx.n):
            for b in range(B):
                for h in range(H):
                    g = _states(dG, b, h, chunk, count)
                    if dk is not None:
                        torch.bmm(_tokens(u, b, h, chunk, count, length, ctx.C), g.mT,
                                  out=_tokens(dk, b, h, chunk, count, length, ctx.C))
                    if du is not None:
                        torch.bmm(_tokens(phi_k, b, h, chunk, count, length, ctx.C), g,
                                  out=_tokens(du, b, h, chunk, count, length, ctx.C))
        return dk, du, None, None


def _read_sources(T, C, n, shift):
    """``(chunk, count, length, state index)`` pieces: chunk ``j`` reads state ``j - shift``."""
    return [(chunk, count, length, chunk - shift)
            for chunk, count, length in chunk_pieces(T, C, shift, n)]


class ReadStates(torch.autograd.Function):
    """``o_j = φ(Q_j) W_j`` with ``W_j = states[:, :, j - shift]``, and (``shift=1``) chunk 0 read
    through ``first`` (zeros when None). Returns ``o [B, T, H, Dv]``."""

    @staticmethod
    def forward(ctx, phi_q, states, first, C: int, shift: int):
        B, T, H, _ = phi_q.shape
        n = states.shape[2] + shift
        o = phi_q.new_empty(B, T, H, states.shape[-1])
        if shift:
            head = min(C, T)
            if first is None:
                o[:, :head].zero_()
            else:
                for h in range(H):          # chunk 0 of every batch entry: one bmm
                    torch.bmm(phi_q[:, :head, h], first[:, h], out=o[:, :head, h])
        for chunk, count, length, s in _read_sources(T, C, n, shift):
            for b in range(B):
                for h in range(H):
                    torch.bmm(_tokens(phi_q, b, h, chunk, count, length, C),
                              _states(states, b, h, s, count),
                              out=_tokens(o, b, h, chunk, count, length, C))
        ctx.save_for_backward(phi_q, states, first)
        ctx.C, ctx.shift = C, shift
        return o

    @staticmethod
    def backward(ctx, do):
        phi_q, states, first = ctx.saved_tensors
        C, shift = ctx.C, ctx.shift
        if recording_graph():
            return (*backward_as_graph(lambda q, s, f: plain_read(q, s, f, C, shift),
                                       (phi_q, states, first), ctx.needs_input_grad[:3], do),
                    None, None)
        B, T, H, _ = phi_q.shape
        do = do.contiguous()
        dq = torch.empty_like(phi_q) if ctx.needs_input_grad[0] else None
        dstates = torch.empty_like(states) if ctx.needs_input_grad[1] else None
        dfirst = None
        if shift:
            head = min(C, T)
            if first is None:
                if dq is not None:
                    dq[:, :head].zero_()
            else:
                if ctx.needs_input_grad[2]:
                    dfirst = torch.empty_like(first)
                for h in range(H):
                    if dq is not None:
                        torch.bmm(do[:, :head, h], first[:, h].mT, out=dq[:, :head, h])
                    if dfirst is not None:
                        torch.bmm(phi_q[:, :head, h].mT, do[:, :head, h], out=dfirst[:, h])
        for chunk, count, length, s in _read_sources(T, C, states.shape[2] + shift, shift):
            for b in range(B):
                for h in range(H):
                    d = _tokens(do, b, h, chunk, count, length, C)
                    if dq is not None:
                        torch.bmm(d, _states(states, b, h, s, count).mT,
                                  out=_tokens(dq, b, h, chunk, count, length, C))
                    if dstates is not None:
                        torch.bmm(_tokens(phi_q, b, h, chunk, count, length, C).mT, d,
                                  out=_states(dstates, b, h, s, count))
        return dq, dstates, dfirst, None, None


def normalise_columns(W: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rescale every column ``W[..., :, c]`` of ``[..., Dk, Dv]`` states to ``target[..., c]``."""
    norms = torch.linalg.vector_norm(W, dim=-2, keepdim=True)
    return W / (norms + WEIGHT_NORM_EPS) * target.unsqueeze(-2)


def _on_states(gamma: torch.Tensor, columns: bool = False) -> torch.Tensor:
    """Decays ``[B, H, n]`` (per matrix), ``[B, H, n, Dk]`` (per state row) or, with
    ``columns``, ``[B, H, n, Dv]`` (per state column) broadcast against states
    ``[B, H, n, Dk, Dv]``."""
    if gamma.dim() == 3:
        return gamma[..., None, None]
    return gamma[..., None, :] if columns else gamma[..., None]


def _semi_parallel_states(delta, W0, weight_norm, decay, columns=False):
    """``W_j = norm(γ_j W_{j-1} + Δ_j)`` chunk after chunk over axis 2 of ``[B, H, n, Dk, Dv]``
    (``decay [B, H, n]``, ``[B, H, n, Dk]`` or, with ``columns``, ``[B, H, n, Dv]`` holds the
    ``γ_j``, or is None)."""
    W = W0
    states = []
    gamma = None if decay is None else _on_states(decay, columns)
    for j, d in enumerate(delta.unbind(2)):
        if W is not None and gamma is not None:
            W = gamma[:, :, j] * W
        W = normalise_columns(d if W is None else W + d, weight_norm)
        states.append(W)
    return torch.stack(states, dim=2)


def _scan_rows(factors, f, initial, scan=blocked_scan, columns=False):
    """``scan`` over axis 2 of ``f [B, H, n, Dk, Dv]`` (``factors [B, H, n]`` or None; ``[B,
    H, n, Dk]``: one factor per state row, each row its own scan; with ``columns``, ``[B, H,
    n, Dv]``: one per state column, each a row of the transposed states)."""
    if columns and factors is not None and factors.dim() == 4:
        return _scan_rows(factors, f.mT, None if initial is None else initial.mT, scan).mT
    B, H, n, Dk, Dv = f.shape
    if factors is not None and factors.dim() == 4:
        rows = f.transpose(2, 3).reshape(B * H * Dk, n, Dv)
        S = scan(factors.transpose(2, 3).reshape(B * H * Dk, n), rows,
                 None if initial is None else initial.reshape(B * H * Dk, Dv))
        return S.view(B, H, Dk, n, Dv).transpose(2, 3)
    S = scan(None if factors is None else factors.reshape(B * H, n),
             f.reshape(B * H, n, Dk * Dv),
             None if initial is None else initial.reshape(B * H, Dk * Dv))
    return S.view(B, H, n, Dk, Dv)


def chunk_states(G, *, momentum, schedule, ns_eps, ns_dtype, weight_norm, W0, decay=None,
                 step_scale=None, value_decay=None):
    """States after every update, ``[B, H, n, Dk, Dv]``, from the increments ``G``; ``decay
    [B, N, H]`` (or ``[B, N, H, Dk]``, per state row) and ``value_decay [B, N, H, Dv]`` (per
    state column) multiply the state before each chunk's update, ``step_scale [B, N, H]`` each
    chunk's step after Newton–Schulz (None: 1)."""
    n = G.shape[2]
    M = G
    columns = value_decay is not None
    if columns:                         # a decay per matrix folds into the one per column
        decay = value_decay if decay is None else value_decay * decay.unsqueeze(-1)
    gamma = None if decay is None else decay[:, :n].transpose(1, 2)     # [B, H, n(, D)]
    if momentum is not None and n > 1:
        factors = momentum[:, :n].transpose(1, 2)
        if not schedule and weight_norm is None and gamma is None and step_scale is None:
            return _scan_rows(factors, G, W0, summed_scan)   # momentum then the sum: one map
        M = _scan_rows(factors, G, None)
    delta = newton_schulz(M, 0, schedule, ns_eps, dtype=ns_dtype) if schedule else M
    if step_scale is not None:
        delta = delta * step_scale[:, :n].transpose(1, 2)[..., None, None]
    if weight_norm is not None:
        return _semi_parallel_states(delta, W0, weight_norm, gamma, columns)
    if n == 1:
        if W0 is None:
            return delta
        first = W0.unsqueeze(2)
        return delta + (first if gamma is None else _on_states(gamma, columns) * first)
    return _scan_rows(gamma, delta, W0, columns=columns)


def block_group(n: int, C: int, Dk: int, Dv: int, *, order, momentum, schedule,
                weight_norm, decay=None, value_decay=None, matrices: int | None = None) -> int:
    """Chunks per group the torch op runs (1: the state form): groups only for a state that is
    a sum of increments decayed per matrix (no momentum, Newton–Schulz, weight norm or decay
    per state row or column), where ``group_chunks`` says so for ``matrices`` (batch × heads)
    states."""
    if order == "full" or momentum is not None or schedule or weight_norm is not None \
            or (decay is not None and decay.dim() == 4) or value_decay is not None:
        return 1
    return group_chunks(C, Dk, Dv, n, matrices)


def torch_block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None,
                                 momentum=None, muon_steps=0, ns_coefficients=None,
                                 ns_eps=NS_EPS, ns_dtype=None, weight_norm=None, decay=None,
                                 step_scale=None, value_decay=None, initial_state=None,
                                 output_final_state=False):
    """Chunk-parallel block linear attention; same contract as ``naive_block_linear_attention``.

    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``; exact (up to rounding)
    for every option combination, differentiable through autograd. Without momentum,
    Newton–Schulz and weight norm, chunks shorter than their features run in groups
    (``grouped_chunks``) where ``group_chunks`` says so.
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
    shift = 1 if order == "exclusive" else 0
    # a tensor already in ``dt`` is passed as it is: ``.to`` would return it, at a dispatch each
    cast = lambda x: x if x is None or x.dtype == dt else x.to(dt)  # noqa: E731
    W0, phi_q, phi_k = cast(initial_state), cast(phi_q), cast(phi_k)
    u = effective_value(cast(v), cast(lr))
    if step_scale is not None and not schedule and momentum is None:
        # nothing between the increment and the step: s_j φ(K_j)ᵀU_j = φ(K_j)ᵀ(s_j U_j)
        per_token = step_scale.to(dt).repeat_interleave(C, dim=1)[:, :T]
        u, step_scale = u * per_token.unsqueeze(-1), None
    group = block_group(n, C, Dk, Dv, order=order, momentum=momentum, schedule=schedule,
                        weight_norm=weight_norm, decay=decay, value_decay=value_decay,
                        matrices=B * H)

    if group > 1:
        o, final = grouped_block_linear_attention(
            phi_q, phi_k, u, chunk_size=C, order=order, decay=cast(decay),
            initial_state=W0, group=group)
        final = final.to(final_state_dtype(v, initial_state)) if output_final_state else None
        return o.to(v.dtype), final
    if n - shift > 0:
        G = plain_increments(phi_k, u, n - shift, C) if _traced() \
            else ChunkIncrements.apply(phi_k, u, n - shift, C)
        states = chunk_states(G, momentum=cast(momentum), schedule=schedule, ns_eps=ns_eps,
                              ns_dtype=ns_dtype, weight_norm=cast(weight_norm), W0=W0,
                              decay=cast(decay), step_scale=cast(step_scale),
                              value_decay=cast(value_decay))
        final = states[:, :, -1]
    else:
        states = phi_k.new_empty(B, H, 0, Dk, Dv, dtype=dt)
        final = W0 if W0 is not None else phi_k.new_zeros(B, H, Dk, Dv, dtype=dt)
    o = plain_read(phi_q, states, W0, C, shift) if _traced() \
        else ReadStates.apply(phi_q, states, W0, C, shift)
    if output_final_state:
        final = (final.clone() if final is W0 else final).to(final_state_dtype(v, initial_state))
    else:
        final = None
    return o.to(v.dtype), final


__all__ = ["torch_block_linear_attention", "block_group", "ChunkIncrements", "ReadStates",
           "chunk_states", "chunk_pieces", "normalise_columns"]
