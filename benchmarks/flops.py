"""Useful FLOPs of the benchmarked layers, counted analytically (matmuls only).

LaCT, per sequence and head, with head dim ``d``, fast-weight hidden dim ``i``, ``N`` chunks of
``C`` tokens and ``U = (N - 1)·C`` tokens that update (the last chunk is only read)::

    kernel φ(x) = silu(x W0) ⊙ (x W2) on the queries (L) and keys (U):  4·d·i·(L + U)
    increments φ(K_j)ᵀ (η ⊙ V_j) of the updating chunks:                2·d·i·U
    outputs φ(Q_j) W1_j:                                                2·d·i·L
    Muon on each of the N-1 increments, s Newton–Schulz steps,
      m = min(d, i), n = max(d, i):                                     (N-1)·s·(4·m²·n + 2·m³)
    with Θ updated (the original only): W1ᵀ V_j and the two Θ increments: 6·d·i·U,
      and Muon on the two Θ increments:                                 2·(N-1)·s·(4·m²·n + 2·m³)

Per-token layer, per sequence, head and token: the update ``η kᵀ v`` and the read ``q W``:
``4·d²``. Projections per token, ``D = H·d``: LaCT ``2·D·(4·D + 4·H)`` (qkv, output, learning
rates, momentum), per-token layer ``2·D·(4·D + H)``. A layer's useful FLOPs are its core plus its
projections, since the timed call runs both. The count is of the variant-2 function for every
converted LaCT row (what the converted layer has to compute), whatever the plan does extra.
"""
from __future__ import annotations

import math


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton–Schulz steps on one ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def lact_core_flops(length: int, chunk: int, head_dim: int, inter_dim: int, *, muon_steps: int,
                    update_theta: bool) -> int:
    """Useful matmul FLOPs of LaCT's TTT core for one sequence and one head."""
    d, i = head_dim, inter_dim
    n_chunks = math.ceil(length / chunk)
    updating = (n_chunks - 1) * chunk
    flops = 4 * d * i * (length + updating) + 2 * d * i * updating + 2 * d * i * length
    muon = (n_chunks - 1) * newton_schulz_flops(d, i, muon_steps)
    flops += muon
    if update_theta:
        flops += 6 * d * i * updating + 2 * muon
    return flops


def lact_flops_per_token(length: int, chunk: int, heads: int, head_dim: int, *, muon_steps: int,
                         update_theta: bool) -> float:
    """Useful FLOPs per token of a whole LaCT layer (core of every head plus projections)."""
    d_model = heads * head_dim
    core = heads * lact_core_flops(length, chunk, head_dim, head_dim, muon_steps=muon_steps,
                                   update_theta=update_theta)
    projections = 2 * length * d_model * (4 * d_model + 4 * heads)
    return (core + projections) / length


def per_token_flops_per_token(d_model: int, heads: int) -> float:
    """Useful FLOPs per token of the per-token layer: ``4·d²`` per head plus projections."""
    d = d_model // heads
    return heads * 4 * d * d + 2 * d_model * (4 * d_model + heads)
