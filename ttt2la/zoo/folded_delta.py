"""A gated DeltaNet written recurrently with its heads folded into the batch and batched matmuls.

Code that runs a per-head recurrence with ``torch.bmm`` folds the heads into the batch: every
sequence becomes ``[B·H, L, D]`` and the memory ``[B·H, Dk, Dv]``. Each iteration then takes its
token as a slice one wide, ``k[:, t:t + 1]`` (``[B·H, 1, D]``), so that the token is already the
row matrix ``bmm`` multiplies; the prediction ``bmm(k_t, S)``, the write
``baddbmm(S, k_tᵀ, β_t (v_t − k_t S))`` and the read ``bmm(q_t, S)`` all keep that unit axis, and
the outputs are joined by ``cat`` along it. The rule is the gated delta rule
``S_t = α_t (I − β_t k_tᵀ k_t) S_{t-1} + β_t k_tᵀ v_t`` with a decay gate ``α_t ∈ (0, 1)`` per head
and token (``decay=True``), read after the write (``read="after"``) or before it (``"before"``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

READS = ("after", "before")


class FoldedDeltaLayer(nn.Module):
    """Multi-head gated delta rule, heads folded into the batch, one-token slices through
    ``torch.bmm`` / ``torch.baddbmm``; see the module docstring.

    ``β_t = sigmoid(·)`` per head and token; with ``decay=True`` ``α_t = exp(logsigmoid(· + 2))``
    (close to 1 at initialisation). Keys are L2-normalised per head, queries scaled by
    ``Dk^-½``; the memory starts at zero.
    """

    def __init__(self, d_model: int, num_heads: int, *, decay: bool = True, read: str = "after"):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if read not in READS:
            raise ValueError(f"read must be one of {READS}, got {read!r}")
        self.num_heads, self.head_dim, self.read = num_heads, d_model // num_heads, read
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.gates = nn.Linear(d_model, 2 * num_heads)
        self.decay = decay
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def fold(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L, H·D]`` -> ``[B·H, L, D]``: every head a batch entry of its own."""
        B, L, _ = x.shape
        return x.view(B, L, self.num_heads, -1).transpose(1, 2).reshape(B * self.num_heads, L, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, d_model = x.shape
        D = self.head_dim
        q, k, v = (self.fold(p) for p in self.qkv(x).chunk(3, dim=-1))
        q, k = q * D ** -0.5, F.normalize(k, dim=-1)
        a, b = self.gates(x).chunk(2, dim=-1)
        alpha = self.fold(F.logsigmoid(a + 2.0)).exp()            # [B·H, L, 1]
        beta = self.fold(torch.sigmoid(b))                         # [B·H, L, 1]
        S = x.new_zeros(B * self.num_heads, D, D)
        ys = []
        for t in range(L):
            q_t, k_t, v_t = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]   # [B·H, 1, D]
            if self.read == "before":
                ys.append(torch.bmm(q_t, S))
            if self.decay:
                S = S * alpha[:, t:t + 1]
            u = beta[:, t:t + 1] * (v_t - torch.bmm(k_t, S))
            S = torch.baddbmm(S, k_t.transpose(1, 2), u)
            if self.read == "after":
                ys.append(torch.bmm(q_t, S))
        y = torch.cat(ys, dim=1)                                   # [B·H, L, D]
        y = y.view(B, self.num_heads, L, D).transpose(1, 2).reshape(B, L, d_model)
        return self.o_proj(y)


__all__ = ["FoldedDeltaLayer"]
