"""A LaCT-like layer whose loop slices its chunk of q, k and v in one statement.

``qi, ki, vi = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]`` is how much published TTT code reads a
chunk. The fast-weight network is a bias-free SwiGLU ``f(x) = (silu(x W0) * (x W2)) W1`` whose
kernel weights ``W0, W2`` are trained as parameters and held fixed inside the loop (the paper's
variant 1), so only the final layer ``W1`` learns at test time, by one ``torch.func.grad`` step
per chunk on the dot-product binding loss ``-sum lr * <f(k), v>``.

``order="apply_first"`` reads every chunk with the weights of the chunks before it (the last
chunk's update is never used); ``order="update_first"`` steps on a chunk first and then reads
it, so the last chunk, full or partial, updates too.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad


def swiglu_features(x: torch.Tensor, W0: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
    """The kernel of the fast-weight network: ``silu(x W0) * (x W2)`` on rows ``x``."""
    return F.silu(x @ W0) * (x @ W2)


def binding_loss(W1, W0, W2, k, v):
    """Dot-product key-value binding loss of one chunk (per-token rates already folded into v)."""
    return -((swiglu_features(k, W0, W2) @ W1) * v).sum()


def inner_step(W1, W0, W2, ki, vi, lri):
    """One test-time step on a chunk: ``W1 - dL/dW1`` with the rates ``lri`` weighting the values."""
    return W1 - grad(binding_loss)(W1, W0, W2, ki, vi * lri)


class OneLineSliceLayer(nn.Module):
    """Causal chunked TTT, chunks sliced in one statement; see the module docstring."""

    def __init__(self, d_model: int, num_heads: int, chunk_size: int, *,
                 inter_dim: int | None = None, order: str = "apply_first",
                 base_lr: float = 0.1) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if order not in ("apply_first", "update_first"):
            raise ValueError(f"order must be 'apply_first' or 'update_first', got {order!r}")
        self.num_heads, self.chunk_size, self.order = num_heads, chunk_size, order
        self.head_dim = D = d_model // num_heads
        I = inter_dim or D
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.lr_proj = nn.Linear(d_model, num_heads, bias=False)
        self.base_lr_inv = math.log(math.expm1(base_lr))
        self.w0 = nn.Parameter(torch.randn(num_heads, D, I) * D ** -0.5)
        self.w1 = nn.Parameter(torch.randn(num_heads, I, D) * I ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_heads, D, I) * D ** -0.5)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, d = x.shape
        H, C = self.num_heads, self.chunk_size
        q, k, v = self.qkv(x).view(B, L, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        lr = F.softplus(self.lr_proj(x) + self.base_lr_inv).transpose(1, 2).unsqueeze(-1)
        W0, W2 = self.w0.expand(B, -1, -1, -1), self.w2.expand(B, -1, -1, -1)
        W1 = self.w1.expand(B, -1, -1, -1)
        outs = []
        for s in range(0, L, C):
            e = min(s + C, L)
            qi, ki, vi = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
            if self.order == "update_first":
                W1 = inner_step(W1, W0, W2, ki, vi, lr[:, :, s:e])
            outs.append(swiglu_features(qi, W0, W2) @ W1)
            if self.order == "apply_first":
                W1 = inner_step(W1, W0, W2, ki, vi, lr[:, :, s:e])
        o = torch.cat(outs, dim=2)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, d))
