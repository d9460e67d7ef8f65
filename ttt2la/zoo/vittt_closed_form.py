"""A ViTTT-like gated fast weight stepped once, written as straight-line code with no loop at all.

Vision TTT code often derives the inner gradient by hand instead of calling autograd: the
binding loss ``ℓ = −(scale/N) Σ_n ⟨f(k_n), v_n⟩`` of the gated unit ``f(x) = (x W1) ⊙ silu(x
W2)`` has the closed-form gradients

    e = −(scale/N)·v,   ∇W1 = kᵀ (e ⊙ silu(k W2)),   ∇W2 = kᵀ (e ⊙ (k W1) ⊙ silu'(k W2)),

each clipped to ``g / (‖g‖ + 1)`` per output column, and one descent step ``W − lr·g`` is taken
from the shared weights (stored ``[1, H, D, D]``, broadcast over the batch). Every token's query
then reads the stepped unit. There is no Python loop anywhere, so nothing marks a sequence loop:
the layer is a single test-time step over all its tokens. ``update_gate=False`` keeps ``W2``
(the gate's kernel weight Θ) fixed, and the layer is then gated linear attention, exactly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_slope(z: torch.Tensor) -> torch.Tensor:
    """``d/dz silu(z) = σ(z)(1 + z(1 − σ(z)))``."""
    sig = torch.sigmoid(z)
    return sig * (1.0 + z * (1.0 - sig))


def clipped(g: torch.Tensor) -> torch.Tensor:
    """``g / (‖g‖ + 1)``, the norm of every output column."""
    return g / (g.norm(dim=-2, keepdim=True) + 1.0)


class ViTTTClosedFormBlock(nn.Module):
    """Token mixer: one hand-derived gradient step of a gated fast weight, then every query
    reads it; see the module docstring."""

    def __init__(self, dim: int, num_heads: int, *, update_gate: bool = True,
                 clip: bool = True, lr: float = 1.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.update_gate, self.clip, self.lr = update_gate, clip, lr
        D = self.head_dim
        self.scale = D ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.w1 = nn.Parameter(torch.randn(1, num_heads, D, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(1, num_heads, D, D) * D ** -0.5)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, N, dim] -> [B, N, dim]."""
        b, n, c = x.shape
        h, d = self.num_heads, self.head_dim
        q, k, v = torch.split(self.qkv(x), [c, c, c], dim=-1)
        q = q.reshape(b, n, h, d).transpose(1, 2)
        k = k.reshape(b, n, h, d).transpose(1, 2)
        v = v.reshape(b, n, h, d).transpose(1, 2)

        z1, z2 = k @ self.w1, k @ self.w2
        e = -v / float(v.shape[2]) * self.scale
        g1 = k.transpose(-2, -1) @ (e * F.silu(z2))
        g2 = k.transpose(-2, -1) @ (e * z1 * silu_slope(z2))
        if self.clip:
            g1, g2 = clipped(g1), clipped(g2)
        w1 = self.w1 - self.lr * g1
        w2 = self.w2 - self.lr * g2 if self.update_gate else self.w2

        o = (q @ w1) * F.silu(q @ w2)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


__all__ = ["ViTTTClosedFormBlock", "silu_slope", "clipped"]
