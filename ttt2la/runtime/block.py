"""Block (chunk-level) TTT-as-linear-attention in plain torch: LaCT's update rule, chunk-parallel.

Every chunk's increment ``G_j = φ(K_j)ᵀ (lr ⊙ V_j)`` is state-independent, so the op runs as

1. all increments in one batched matmul;
2. momentum as an affine scan over the increments (``scan.affine_scan``), never a cumulative
   product of momentum factors that is divided out later;
3. Newton–Schulz on every chunk's ``M_j`` in one batched call;
4. the state pass, O(N·Dk·Dv): a prefix sum over chunks (*parallel*), or, with ``weight_norm``,
   ``W ← norm(W + Δ_j)`` chunk after chunk (*semi-parallel*: the norm is not associative, but
   only this cheap map is sequential, and it is exact);
5. all outputs in one batched matmul against the stacked per-chunk states.

The matmuls of steps 1 and 5 batch over batch and chunks, one call per head: a head's chunks
are strided views of the ``[B, T, H, D]`` input that BLAS reads in place, while batching heads
too forces transposed copies of every input (measured 2.3× slower for 4 heads of 128 features
in 2048-token chunks, on par for 8-16 heads of 64).

Precision follows the source: the op accumulates in the inputs' dtype (fp32 for bf16/fp16,
float64 only for float64 inputs), and Newton–Schulz iterates in ``ns_dtype`` — the dtype the
user's code iterates in (LaCT casts to bf16), the accumulation dtype by default.

Measured on CPU (``benchmarks/runtime_cpu.py``): the Appendix-H masked form
``((ΦQ ΦKᵀ) ⊙ mask) U`` is 10-100× slower than the state form except on sequences of a few
dozen tokens, where every form takes well under a millisecond, so only the state form is kept.
Without Muon the op runs at about the recurrent reference's speed on CPU (the same matmuls;
the momentum and state passes are loops of small adds as well): chunk parallelism pays on GPUs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ttt2la.runtime.naive import (NS_EPS, check_block_inputs, compute_dtype, effective_value,
                                  final_state_dtype, ns_schedule, WEIGHT_NORM_EPS)
from ttt2la.runtime.newton_schulz import newton_schulz
from ttt2la.runtime.scan import affine_scan, prefix_sum


def split_chunks(x: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, ...] → [B, n, chunk_size, ...]``, zero-padding the tokens after ``T``."""
    pad = n * chunk_size - x.shape[1]
    if pad > 0:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    elif pad < 0:
        x = x[:, :n * chunk_size]
    return x.reshape(x.shape[0], n, chunk_size, *x.shape[2:])


def normalise_columns(W: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Rescale every column ``W[..., :, c]`` of ``[B, H, Dk, Dv]`` states to ``target[..., c]``."""
    norms = torch.linalg.vector_norm(W, dim=-2, keepdim=True)
    return W / (norms + WEIGHT_NORM_EPS) * target.unsqueeze(-2)


def chunk_increments(phi_k: torch.Tensor, u: torch.Tensor, n: int,
                     chunk_size: int) -> torch.Tensor:
    """``G_j = φ(K_j)ᵀ U_j`` of the first ``n`` chunks, ``[B, n, H, Dk, Dv]``; a matmul per head."""
    kc = split_chunks(phi_k, n, chunk_size).unbind(3)
    uc = split_chunks(u, n, chunk_size).unbind(3)
    return torch.stack([k.mT @ v for k, v in zip(kc, uc)], dim=2)


def read_states(phi_q: torch.Tensor, states: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """``o_j = φ(Q_j) W_j`` for chunk ``j`` and state ``states[:, j]``, as ``[B, T, H, Dv]``."""
    B, T, H, _ = phi_q.shape
    qc = split_chunks(phi_q, n, chunk_size).unbind(3)
    o = torch.stack([q @ W for q, W in zip(qc, states.unbind(2))], dim=3)  # [B, n, C, H, Dv]
    return o.reshape(B, n * chunk_size, H, -1)[:, :T]


def _semi_parallel_states(delta: torch.Tensor, W0: torch.Tensor | None,
                          weight_norm: torch.Tensor) -> torch.Tensor:
    W = W0
    states = []
    for d in delta.unbind(1):
        W = normalise_columns(d if W is None else W + d, weight_norm)
        states.append(W)
    return torch.stack(states, dim=1)


def torch_block_linear_attention(phi_q, phi_k, v, *, chunk_size, order="exclusive", lr=None,
                                 momentum=None, muon_steps=0, ns_coefficients=None,
                                 ns_eps=NS_EPS, ns_dtype=None, weight_norm=None,
                                 initial_state=None, output_final_state=False):
    """Chunk-parallel block linear attention; same contract as ``naive_block_linear_attention``.

    Returns ``(o [B, T, H, Dv], final_state [B, H, Dk, Dv] or None)``; exact (up to rounding)
    for every option combination, differentiable through autograd.
    """
    n = check_block_inputs(phi_q, phi_k, v, chunk_size=chunk_size, order=order, lr=lr,
                           momentum=momentum, muon_steps=muon_steps, weight_norm=weight_norm,
                           initial_state=initial_state, ns_coefficients=ns_coefficients)
    schedule = ns_schedule(muon_steps, ns_coefficients)
    dt = compute_dtype(v.dtype)
    B, T, H, Dk = phi_k.shape
    Dv = v.shape[-1]
    C = T if order == "full" else chunk_size
    n_update = n - 1 if order == "exclusive" else n
    W0 = None if initial_state is None else initial_state.to(dt)

    if n_update > 0:
        u = effective_value(v.to(dt), None if lr is None else lr.to(dt))
        M = chunk_increments(phi_k.to(dt), u, n_update, C)
        if momentum is not None and n_update > 1:
            M = affine_scan(momentum[:, :n_update].to(dt)[..., None, None], M, dim=1)
        delta = newton_schulz(M, 0, schedule, ns_eps, dtype=ns_dtype) if schedule else M
        if weight_norm is None:
            states = prefix_sum(delta, dim=1, initial=W0)
        else:
            states = _semi_parallel_states(delta, W0, weight_norm.to(dt))
    else:
        states = torch.zeros(B, 0, H, Dk, Dv, dtype=dt, device=v.device)

    if order == "exclusive":
        first = (torch.zeros(B, 1, H, Dk, Dv, dtype=dt, device=v.device) if W0 is None
                 else W0.unsqueeze(1))
        read = torch.cat([first, states], dim=1)
    else:
        read = states
    o = read_states(phi_q.to(dt), read, n, C)

    final = None
    if output_final_state:
        if n_update > 0:
            final = states[:, -1]
        else:
            final = (W0.clone() if W0 is not None
                     else torch.zeros(B, H, Dk, Dv, dtype=dt, device=v.device))
        final = final.to(final_state_dtype(v, initial_state))
    return o.to(v.dtype), final


__all__ = ["torch_block_linear_attention", "chunk_increments",
           "read_states", "normalise_columns", "split_chunks"]
