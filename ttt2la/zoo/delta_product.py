"""Gated DeltaProduct written as its reference recurrence: several delta-rule steps per token.

DeltaProduct (Siems et al., 2025) makes each token's state transition a product of ``n_h``
generalised Householder maps instead of one: every token carries ``n_h`` keys, values and step
sizes, one projection each reshaped into ``n_h`` parts, and the memory ``S [Dk, Dv]`` of a head
takes ``n_h`` delta-rule steps ``S ← S − β_j k_jᵀ (k_j S) + β_j k_jᵀ v_j`` before the token's
query reads it, ``o_t = q_t S``. With the gate (``gate=True``) the memory first decays once per
token by ``α_t = exp(g_t)``, ``g_t = logsigmoid(·)`` per head. The loop walks the tokens and,
inside, the sub-steps, broadcasting its products (``(S * k[..., None]).sum(-2)``) and writing
each output into a buffer allocated before it, the way flash-linear-attention's naive reference
is written. ``gate_every_step=True`` and ``read_after`` other than ``n_h`` give two look-alikes:
the gate applied before every sub-step, and the output read after sub-step ``read_after``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def delta_product_recurrence(q, k, v, beta, g=None, *, gate_every_step=False, read_after=None):
    """``q [B, H, T, Dk]``, ``k [B, H, T, n, Dk]``, ``v [B, H, T, n, Dv]``, ``beta [B, H, T, n]``,
    ``g [B, H, T]`` log-decays or None -> ``o [B, H, T, Dv]``: ``n`` delta-rule steps per token,
    the decay before the first (before each with ``gate_every_step``), read after the last (after
    step ``read_after`` when given)."""
    B, H, T, n, K = k.shape
    read_after = n if read_after is None else read_after
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
    for i in range(T):
        for j in range(n):
            if g is not None and (j == 0 or gate_every_step):
                S = S * g[:, :, i].exp()[..., None, None]
            k_ij = k[:, :, i, j]
            predicted = (S * k_ij[..., None]).sum(-2)
            correction = (v[:, :, i, j] - predicted) * beta[:, :, i, j, None]
            S = S + k_ij[..., None] * correction[..., None, :]
            if j + 1 == read_after:
                o[:, :, i] = torch.einsum("bhk,bhkv->bhv", q[:, :, i], S)
    return o


class DeltaProductLayer(nn.Module):
    """Multi-head gated DeltaProduct with ``num_householder`` steps per token; see the module
    docstring. Keys are L2-normalised per head and step, queries scaled by ``Dk^-½``,
    ``β = sigmoid(·)`` per head, token and step; the memory starts at zero."""

    def __init__(self, d_model: int, num_heads: int, num_householder: int = 2, *,
                 gate: bool = True, gate_every_step: bool = False,
                 read_after: int | None = None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if num_householder < 1:
            raise ValueError(f"num_householder must be at least 1, got {num_householder}")
        self.num_heads, self.n = num_heads, num_householder
        self.gate_every_step, self.read_after = gate_every_step, read_after
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, num_householder * d_model, bias=False)
        self.v_proj = nn.Linear(d_model, num_householder * d_model, bias=False)
        self.b_proj = nn.Linear(d_model, num_householder * num_heads)
        self.a_proj = nn.Linear(d_model, num_heads) if gate else None
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]."""
        B, T, d_model = x.shape
        H, n = self.num_heads, self.n
        q = self.q_proj(x).view(B, T, H, -1).transpose(1, 2)
        q = q * q.shape[-1] ** -0.5
        # n keys and values per token from one projection each: [B, H, T, n, D]
        k = self.k_proj(x).view(B, T, n, H, -1).permute(0, 3, 1, 2, 4)
        k = F.normalize(k, dim=-1)
        v = self.v_proj(x).view(B, T, n, H, -1).permute(0, 3, 1, 2, 4)
        beta = torch.sigmoid(self.b_proj(x)).view(B, T, n, H).permute(0, 3, 1, 2)
        g = None if self.a_proj is None else F.logsigmoid(self.a_proj(x) + 3).transpose(1, 2)
        o = delta_product_recurrence(q, k, v, beta, g, gate_every_step=self.gate_every_step,
                                     read_after=self.read_after)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, d_model))


__all__ = ["DeltaProductLayer", "delta_product_recurrence"]
