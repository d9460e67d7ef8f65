"""Block linear attention over groups of chunks: masked attention inside a group, states between.

The state form (``block.py``) keeps one state per chunk: ``Dk·Dv`` values read back for every
chunk of ``C`` tokens, which on a CPU costs more than the products once the chunks are shorter
than the features. Without momentum, Newton–Schulz or a weight norm the state is a decayed sum
of increments, ``W_j = γ_j W_{j-1} + φ(K_j)ᵀ U_j``, so a chunk's read of it unrolls over the
chunks before it in its group of ``s`` chunks and the state ``P`` entering the group:

* exclusive order (chunk ``j`` reads ``W_{j-1}``):
  ``o_j = (γ_0 ⋯ γ_{j-1}) φ(Q_j) P + Σ_{m<j} (γ_{m+1} ⋯ γ_{j-1}) (φ(Q_j) φ(K_m)ᵀ) U_m``;
* inclusive order (chunk ``j`` reads ``W_j``): the same with ``m ≤ j`` and the products up to
  ``γ_j``.

Inside a group that is one masked attention product over its ``s·C`` tokens, the mask holding
the chunks' segment products (``scan._transfer``: cumulative products, never quotients); across
groups only the groups' end states are scanned (``scan.blocked_scan``). ``s = 1`` is the state
form again, so ``group_chunks`` — the cost rule — decides how many chunks a group holds.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ttt2la.runtime.chunk import _head_major
from ttt2la.runtime.scan import _transfer, blocked_scan

#: Tokens a group aims at, and the widest state feature that groups: on a CPU the masked
#: product over 32 tokens cost less than the per-chunk states it replaces for features of
#: 8-32 and chunks of 1-16 tokens (1.2-4x faster than the state form), not for wider features
#: (``docs/runtime.md``, "Groups of chunks").
GROUP_TOKENS = 32
GROUP_MAX_FEATURES = 32
#: A call of at most this many state matrices (batch × heads) keeps the state form while its
#: tokens over all matrices number fewer than ``SHORT_CALL_FACTOR · C²``: grouping's fixed cost
#: (the masks, the scan over groups) is not repaid there, and the state form's loop over the
#: matrices is short (``docs/runtime.md``, "Groups of chunks").
SHORT_CALL_MATRICES = 2
SHORT_CALL_FACTOR = 16


def group_chunks(chunk_size: int, Dk: int, Dv: int, n: int, matrices: int | None = None) -> int:
    """Chunks per group for ``n`` chunks of ``chunk_size`` tokens with ``matrices`` ``[Dk, Dv]``
    states (batch × heads; ``None``: not known): 1 (the state form) unless two or more chunks
    fit in ``GROUP_TOKENS``, the features are at most ``GROUP_MAX_FEATURES`` wide, and the call
    is not a short one of few matrices (``SHORT_CALL_MATRICES``)."""
    if min(Dk, Dv) > GROUP_MAX_FEATURES or 2 * chunk_size > GROUP_TOKENS or n < 2:
        return 1
    if matrices is not None and matrices <= SHORT_CALL_MATRICES \
            and matrices * n < SHORT_CALL_FACTOR * chunk_size:
        return 1
    return min(n, GROUP_TOKENS // chunk_size)


def _chunk_factors(decay, BH: int, n: int, m: int, s: int, exclusive: bool, like):
    """The per-chunk factors ``[BH, m, s]``: the decays (1 past the last chunk and, in the
    exclusive order, for the last chunk, which never updates), or ``None`` without decay."""
    if decay is None:
        return None
    d = decay.to(like.dtype).movedim(2, 1).reshape(BH, n)
    if exclusive:                   # the last chunk's factor is 1, as the padding's: one pad
        return F.pad(d[:, :-1], (0, m * s - n + 1), value=1.0).reshape(BH, m, s)
    return F.pad(d, (0, m * s - n), value=1.0).reshape(BH, m, s)


def _mask_and_weights(factors, BH: int, m: int, s: int, n: int, exclusive: bool, like):
    """``(A [BH|1, m|1, s, s], read [BH, m, s] or None, end [BH|1, m|1, s], through [BH, m] or
    None)``: the chunk-to-chunk factors inside a group, the factor of the entering state in each
    chunk's read, each chunk's weight in the group's end state and the group's whole decay."""
    L = _transfer(None if factors is None else factors, s, like)   # [.., j, m] = γ_{m+1} ⋯ γ_j
    A = F.pad(L[..., :-1, :], (0, 0, 1, 0)) if exclusive else L
    end = L[..., -1, :]
    if exclusive:                              # the last chunk adds nothing to the final state
        keep = torch.ones(m * s, dtype=like.dtype, device=like.device)
        keep[n - 1:] = 0.0
        end = end * keep.view(m, s)
    if factors is None:
        return A, None, end, None
    through = torch.cumprod(factors, dim=-1)   # γ_0 ⋯ γ_j
    read = F.pad(through[..., :-1], (1, 0), value=1.0) if exclusive else through
    return A, read, end, through[..., -1]


def _per_token(x: torch.Tensor, factors: torch.Tensor, C: int) -> torch.Tensor:
    """``x [BH, m, s·C, D]`` times one factor per chunk, ``factors [BH|1, m|1, s]``."""
    BH, m, S, D = x.shape
    s = S // C
    return (x.view(BH, m, s, C, D) * factors.unsqueeze(-1).unsqueeze(-1)).view(BH, m, S, D)


def grouped_block_linear_attention(phi_q, phi_k, u, *, chunk_size: int, order: str,
                                   decay=None, initial_state=None, group: int):
    """``(o [B, T, H, Dv], final [B, H, Dk, Dv])`` of the decayed block rule in groups of
    ``group`` chunks; ``u`` is the effective value, every tensor already in the compute dtype,
    ``decay [B, N, H]`` or None. The contract is ``naive_block_linear_attention``'s without
    momentum, Newton–Schulz or weight norm, plus ``decay``."""
    B, T, H, Dk = phi_k.shape
    Dv = u.shape[-1]
    C, s = chunk_size, group
    n = math.ceil(T / C)
    m = math.ceil(n / s)
    BH, S = B * H, s * C
    exclusive = order == "exclusive"
    q, k, v = (_head_major(x, m, S) for x in (phi_q, phi_k, u))        # [BH, m, S, D]
    factors = _chunk_factors(decay, BH, n, m, s, exclusive, u)
    A, read, end, through = _mask_and_weights(factors, BH, m, s, n, exclusive, u)

    # inside each group: (φQ φKᵀ ⊙ mask) U, the mask A[j, m] broadcast over the chunks' tokens
    attn = (q @ k.mT).view(BH, m, s, C, s, C)                            # [BH, m, S, S]
    o = (attn * A.unsqueeze(-1).unsqueeze(-3)).view(BH, m, S, S) @ v
    # the groups' end states, scanned across groups
    increments = _per_token(k, end.expand(BH, m, s), C).mT @ v            # [BH, m, Dk, Dv]
    W0 = None if initial_state is None else initial_state.reshape(BH, Dk * Dv)
    states = blocked_scan(through, increments.reshape(BH, m, Dk * Dv), W0)
    states = states.view(BH, m, Dk, Dv)
    # every chunk's read of the state entering its group
    first = (torch.zeros_like(states[:, :1]) if W0 is None
             else initial_state.reshape(BH, 1, Dk, Dv))
    entering = torch.cat([first, states[:, :-1]], dim=1)
    q_read = q if read is None else _per_token(q, read, C)
    o = torch.baddbmm(o.view(BH * m, S, Dv), q_read.view(BH * m, S, Dk),
                      entering.view(BH * m, Dk, Dv))
    o = o.view(B, H, m * S, Dv)[:, :, :T].movedim(1, 2)
    return o, states[:, -1].reshape(B, H, Dk, Dv)


__all__ = ["grouped_block_linear_attention", "group_chunks", "GROUP_TOKENS", "GROUP_MAX_FEATURES",
           "SHORT_CALL_MATRICES", "SHORT_CALL_FACTOR"]
