"""A ViTTT-like block: one test-time gradient step over a whole image, then every token reads it.

Written the way vision TTT code is written: the tokens of an ``h × w`` image (fixed by the
block's configuration) train two fast-weight parts by *one* gradient step on all tokens, and the
queries of all tokens then read the stepped weights (bidirectional, no loop over the sequence):

* a gated linear unit ``f(x) = (x W1) ⊙ silu(x W2)`` per head: ``W1`` is the final layer (linear
  attention with an output gate), ``W2`` the gate's kernel weight Θ, stepped too unless
  ``update_gate=False``;
* a 3×3 depthwise convolution whose nine taps per channel are a fast weight (local linear
  attention over 3×3 neighbourhoods), computed by a Python loop over the nine offsets.

Both are trained on the dot-product binding score ``<f(k), v>`` by ``torch.func.grad``; each
gradient is normalised ``g / (‖g‖ + 1)`` per output column (per channel for the taps) before the
step, unless ``grad_norm=False``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

#: (row, column) offsets of a 3×3 neighbourhood, in the order the taps are stored
OFFSETS = tuple((di, dj) for di in (-1, 0, 1) for dj in (-1, 0, 1))


def glu(x: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
    """The gated fast-weight unit on rows ``x`` [B, H, N, D]: ``(x W1) * silu(x W2)``."""
    return (x @ W1) * F.silu(x @ W2)


def depthwise_conv3x3(image: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """``image`` [B, C, h, w] convolved per channel with ``taps`` [B, C, 9] (zero padding)."""
    h, w = image.shape[-2:]
    padded = F.pad(image, (1, 1, 1, 1))
    out = torch.zeros_like(image)
    for n, (di, dj) in enumerate(OFFSETS):
        window = padded[:, :, 1 + di:1 + di + h, 1 + dj:1 + dj + w]
        out = out + window * taps[:, :, n, None, None]
    return out


def glu_score(W1, W2, k, v):
    """How well the gated unit binds keys to values: ``sum <f(k), v>``."""
    return (glu(k, W1, W2) * v).sum()


def conv_score(taps, k_image, v_image):
    """How well the depthwise convolution binds key pixels to value pixels."""
    return (depthwise_conv3x3(k_image, taps) * v_image).sum()


def normalised(g: torch.Tensor, dim: int) -> torch.Tensor:
    """``g / (‖g‖ + 1)``, the norm taken along ``dim``."""
    return g / (g.norm(dim=dim, keepdim=True) + 1.0)


class ViTTTBlock(nn.Module):
    """Token mixer of a ViTTT-like vision block over an ``height × width`` image of tokens."""

    def __init__(self, dim: int, num_heads: int, height: int, width: int, *,
                 update_gate: bool = True, grad_norm: bool = True, lr: float = 1.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.height, self.width = height, width
        self.update_gate, self.grad_norm, self.lr = update_gate, grad_norm, lr
        D = self.head_dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_heads, D, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_heads, D, D) * D ** -0.5)
        self.taps = nn.Parameter(torch.randn(dim, 9) / 3.0)
        self.proj = nn.Linear(dim, dim, bias=False)

    def step(self, W: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
        """One (normalised) gradient-ascent step on the binding score."""
        if self.grad_norm:
            g = normalised(g, dim)
        return W + self.lr * g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, height·width, dim] -> [B, height·width, dim]."""
        B, N, C = x.shape
        H, D, h, w = self.num_heads, self.head_dim, self.height, self.width
        q, k, v = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        W1 = self.w1.expand(B, -1, -1, -1)
        W2 = self.w2.expand(B, -1, -1, -1)
        g1, g2 = grad(glu_score, argnums=(0, 1))(W1, W2, k, v / N)
        W1 = self.step(W1, g1, -2)
        if self.update_gate:
            W2 = self.step(W2, g2, -2)
        o_glu = glu(q, W1, W2).transpose(1, 2).reshape(B, N, C)

        def image(t):
            return t.transpose(1, 2).reshape(B, N, C).transpose(1, 2).reshape(B, C, h, w)

        q_img, k_img, v_img = image(q), image(k), image(v) / N
        taps = self.taps.expand(B, -1, -1)
        taps = self.step(taps, grad(conv_score)(taps, k_img, v_img), -1)
        o_conv = depthwise_conv3x3(q_img, taps).reshape(B, C, N).transpose(1, 2)
        return self.proj(o_glu + o_conv)


__all__ = ["ViTTTBlock", "depthwise_conv3x3", "glu", "OFFSETS"]
