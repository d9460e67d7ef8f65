"""Per-token test-time training written inline in ``forward``: one loop over tokens, nothing else.

The fast weight ``S`` [B, H, D, D] of every head takes one gradient step on the binding loss
``-<k_t S, v_t>`` per token (step size ``eta_t``) and the same token's query then reads it:
``S_t = S_{t-1} + eta_t k_tᵀ v_t``, ``o_t = q_t S_t``. The outputs are collected in a list and
stacked after the loop, the way such layers are usually first written, or (``outputs="buffer"``)
written token by token into a tensor allocated before the loop, ``y[:, t] = q_t S_t``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

OUTPUTS = ("list", "buffer")


class PerTokenInlineTTTLayer(nn.Module):
    """Multi-head linear TTT layer whose token loop sits directly in ``forward``.

    ``eta_t = softplus(lr_proj(x_t) + softplus^-1(base_lr))`` per head and token, or the constant
    ``base_lr`` with ``lr=False`` (no ``lr_proj``); the initial fast weight ``s0`` [H, D, D] is
    learned. ``outputs`` is ``"list"`` (stacked after the loop) or ``"buffer"`` (written into
    ``torch.empty_like(v)``).
    """

    def __init__(self, d_model: int, num_heads: int, *, base_lr: float = 0.5, lr: bool = True,
                 outputs: str = "list"):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        self.outputs = outputs
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.base_lr = base_lr
        self.lr_offset = math.log(math.expm1(base_lr))
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.lr_proj = nn.Linear(d_model, num_heads, bias=False) if lr else None
        self.s0 = nn.Parameter(torch.randn(num_heads, self.head_dim, self.head_dim)
                               / math.sqrt(self.head_dim))
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, d_model = x.shape
        H, D = self.num_heads, self.head_dim
        q = F.normalize(self.q_proj(x).view(B, L, H, D), dim=-1)
        k = F.normalize(self.k_proj(x).view(B, L, H, D), dim=-1)
        v = self.v_proj(x).view(B, L, H, D)
        if self.lr_proj is not None:
            eta = F.softplus(self.lr_proj(x) + self.lr_offset)        # [B, L, H]

        S = self.s0.expand(B, H, D, D)
        y = torch.empty_like(v) if self.outputs == "buffer" else None  # [B, L, H, D]
        ys = []
        for t in range(L):
            write = k[:, t, :, :, None] * v[:, t, :, None, :]        # k_tᵀ v_t: [B, H, D, D]
            if self.lr_proj is not None:
                S = S + eta[:, t, :, None, None] * write
            else:
                S = S + self.base_lr * write
            y_t = (q[:, t, :, None, :] @ S)[:, :, 0]                  # q_t S_t: [B, H, D]
            if y is not None:
                y[:, t] = y_t
            else:
                ys.append(y_t)
        if y is None:
            y = torch.stack(ys, dim=1)                                # [B, L, H, D]
        return self.out(y.reshape(B, L, d_model))


__all__ = ["PerTokenInlineTTTLayer"]
