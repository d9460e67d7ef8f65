"""TTT-Linear-like layers: a linear fast weight fitted through a layer norm, in two coding styles.

Per mini-batch of ``C`` tokens the fast weight ``W`` (with bias ``b``) takes one gradient step
on the reconstruction loss ``sum_t lr_t/2 * ||LN(k_t W + b) - (v_t - k_t)||^2``, then reads the
queries of the same mini-batch: ``o_t = q_t + LN(q_t W' + b')``. The layer norm sits inside the
loss and after the final layer, so the layer is outside the paper's theorem: its gradient is not
``φ(k)ᵀ·(something independent of W)``, and no step of the paper removes the norm. ttt2la must
refuse it, naming the norm.

With ``bias=False`` the weight ``W`` is the only fast weight. ``TTTLinearFuncGradLayer`` takes the gradient with ``torch.func.grad`` and a library layer norm;
``TTTLinearAutogradLayer`` writes the norm out by hand and takes the gradient with
``torch.autograd.grad`` after ``requires_grad_()`` — the two styles met in published code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad


class _TTTLinearBase(nn.Module):
    """Projections, initial fast weights and the chunk loop; subclasses say how the step is taken."""

    def __init__(self, d_model: int, num_heads: int, chunk_size: int, *,
                 base_lr: float = 1.0, bias: bool = True) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.chunk_size, self.base_lr = num_heads, chunk_size, base_lr
        self.head_dim = D = d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.lr_gate = nn.Linear(d_model, num_heads)
        self.W = nn.Parameter(torch.randn(num_heads, D, D) * 0.02)
        self.b = nn.Parameter(torch.zeros(num_heads, 1, D)) if bias else None
        self.ln_weight = nn.Parameter(torch.ones(num_heads, 1, D))
        self.ln_bias = nn.Parameter(torch.zeros(num_heads, 1, D))
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def norm(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, W, b, k, v, lr):
        """One gradient step of ``(W, b)`` on a mini-batch (``b`` None without a bias): returns
        the new ``(W, b)``."""
        raise NotImplementedError

    @staticmethod
    def affine(x, W, b):
        return x @ W if b is None else x @ W + b

    def loss(self, W, b, k, v, lr):
        """Reconstruction loss of ``v - k`` from ``k`` through the normed fast weight."""
        z = self.norm(self.affine(k, W, b))
        return 0.5 * (lr * (z - (v - k)) ** 2).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, d = x.shape
        H, C = self.num_heads, self.chunk_size
        q, k, v = self.qkv(x).view(B, L, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)
        lr = (self.base_lr / self.head_dim) * torch.sigmoid(self.lr_gate(x))
        lr = lr.transpose(1, 2).unsqueeze(-1)                       # [B, H, L, 1]
        W = self.W.expand(B, -1, -1, -1)
        b = None if self.b is None else self.b.expand(B, -1, -1, -1)
        outs = []
        for s in range(0, L, C):
            qi = q[:, :, s:s + C]
            W, b = self.step(W, b, k[:, :, s:s + C], v[:, :, s:s + C], lr[:, :, s:s + C])
            outs.append(qi + self.norm(self.affine(qi, W, b)))
        o = torch.cat(outs, dim=2)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, d))


class TTTLinearFuncGradLayer(_TTTLinearBase):
    """TTT-Linear-like layer, gradient by ``torch.func.grad``, norm by ``F.layer_norm``."""

    def norm(self, z):
        z = F.layer_norm(z, (self.head_dim,), eps=1e-6)
        return z * self.ln_weight + self.ln_bias

    def step(self, W, b, k, v, lr):
        if b is None:
            return W - grad(self.loss)(W, b, k, v, lr), None
        gW, gb = grad(self.loss, argnums=(0, 1))(W, b, k, v, lr)
        return W - gW, b - gb


class TTTLinearAutogradLayer(_TTTLinearBase):
    """TTT-Linear-like layer, gradient by ``torch.autograd.grad``, norm written out by hand."""

    def norm(self, z):
        mu = z.mean(dim=-1, keepdim=True)
        var = ((z - mu) ** 2).mean(dim=-1, keepdim=True)
        return (z - mu) / torch.sqrt(var + 1e-6) * self.ln_weight + self.ln_bias

    def step(self, W, b, k, v, lr):
        with torch.enable_grad():
            W = W.requires_grad_()
            if b is None:
                (gW,) = torch.autograd.grad(self.loss(W, None, k, v, lr), W, create_graph=True)
                return W - gW, None
            b = b.requires_grad_()
            gW, gb = torch.autograd.grad(self.loss(W, b, k, v, lr), (W, b), create_graph=True)
        return W - gW, b - gb
