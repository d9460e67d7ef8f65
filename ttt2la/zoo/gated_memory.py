"""A gated linear memory written for lengths that are multiples of its chunk.

The style of gated linear-attention layers as they are often published: heads as an axis, the
products as ``torch.einsum``, a preallocated output written chunk by chunk, and a loop over the
sequence's whole chunks (``range(L // C)``). Each chunk reads the memory, which is then decayed by
a gate computed from the chunk's tokens and stepped by ``η kᵀ v`` with a learned rate per head:
``W ← γ_c W + η Kᵀ V``, scalar-affine in ``W``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedChunkMemory(nn.Module):
    """Heads of a linear memory decayed once per chunk by a data-dependent gate; reads before it
    steps; lengths that are multiples of ``chunk`` (the loop leaves any further tokens out)."""

    def __init__(self, d_model: int, num_heads: int, chunk: int, lr: float = 0.1):
        super().__init__()
        self.h, self.dh, self.chunk = num_heads, d_model // num_heads, chunk
        self.q, self.k, self.v = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.gate = nn.Linear(d_model, num_heads)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.lr = nn.Parameter(torch.full((num_heads,), lr))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, D = x.shape
        heads = lambda t: t.view(B, L, self.h, self.dh).permute(0, 2, 1, 3)   # noqa: E731
        q, v = heads(self.q(x)), heads(self.v(x))
        k = heads(F.normalize(self.k(x).view(B, L, self.h, self.dh), dim=-1).reshape(B, L, D))
        gate = torch.sigmoid(self.gate(x)).permute(0, 2, 1)                    # [B, h, L]
        W = torch.zeros(B, self.h, self.dh, self.dh, dtype=x.dtype, device=x.device)
        out = torch.empty_like(q)
        for i in range(L // self.chunk):
            s, e = i * self.chunk, (i + 1) * self.chunk
            out[:, :, s:e] = torch.einsum("bhnd,bhde->bhne", q[:, :, s:e], W)
            decay = gate[:, :, s:e].mean(-1)[..., None, None]
            W = decay * W + self.lr[None, :, None, None] * torch.einsum(
                "bhnd,bhne->bhde", k[:, :, s:e], v[:, :, s:e])
        return self.out(out.permute(0, 2, 1, 3).reshape(B, L, D))


__all__ = ["GatedChunkMemory"]
