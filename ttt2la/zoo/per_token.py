"""Per-token test-time training with a linear fast weight and a dot-product binding loss.

Every token first writes itself into the fast weight (one gradient step on ``-<k_t W, v_t>``), then the
query of the same token reads it: ``W_t = W_{t-1} + eta_t k_t^T v_t``, ``o_t = q_t W_t``; or, with
``read="before"``, the query reads the fast weight before the token writes (retrieve, then store:
``o_t = q_t W_{t-1}``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


@torch.compile(dynamic=False)
def ttt_step(W, q_t, k_t, v_t, eta_t):
    """One token: update ``W`` [B, H, D, D] with (k_t, v_t) at rate eta_t, then read it with q_t [B, H, D]."""
    W = W + eta_t[..., None, None] * (k_t.unsqueeze(-1) * v_t.unsqueeze(-2))
    o_t = (q_t.unsqueeze(-2) @ W).squeeze(-2)
    return W, o_t


@torch.compile(dynamic=False)
def ttt_read_then_step(W, q_t, k_t, v_t, eta_t):
    """One token read before it writes: ``o_t = q_t W``, then ``W + eta_t k_tᵀ v_t``."""
    o_t = (q_t.unsqueeze(-2) @ W).squeeze(-2)
    W = W + eta_t[..., None, None] * (k_t.unsqueeze(-1) * v_t.unsqueeze(-2))
    return W, o_t


STEPS = {"after": ttt_step, "before": ttt_read_then_step}


class PerTokenTTTLayer(nn.Module):
    """Multi-head linear TTT layer updated token by token (update, then read).

    With ``lr=True`` the step size of each head is ``softplus(lr_proj(x) + softplus^-1(base_lr))`` per
    token; otherwise it is the constant ``base_lr``. ``outputs="buffer"`` writes every token's output into a
    tensor allocated before the scan (``o[:, t] = o_t``) instead of stacking a list after it.
    ``read="before"`` reads the fast weight before each token's update instead of after it.
    """

    def __init__(self, d_model: int, num_heads: int, *, lr: bool = True, base_lr: float = 1.0,
                 outputs: str = "list", read: str = "after"):
        super().__init__()
        if read not in STEPS:
            raise ValueError(f"read must be one of {sorted(STEPS)}, got {read!r}")
        self.step = STEPS[read]
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if outputs not in ("list", "buffer"):
            raise ValueError(f"outputs must be 'list' or 'buffer', got {outputs!r}")
        self.outputs = outputs
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = D = d_model // num_heads
        self.base_lr = base_lr
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        if lr:
            self.lr_proj = nn.Linear(d_model, num_heads, bias=False)
            self.base_lr_inv = math.log(math.expm1(base_lr))
        else:
            self.lr_proj = None
        self.w0 = nn.Parameter(torch.randn(num_heads, D, D) / math.sqrt(D))
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def _scan(self, q, k, v, eta):
        """Sequential scan over tokens. q, k, v: [B, L, H, D]; eta: [B, L, H] -> o: [B, L, H, D]."""
        B, L = q.shape[:2]
        W = self.w0.unsqueeze(0).expand(B, -1, -1, -1)
        if self.outputs == "buffer":
            o = torch.empty_like(q)
            for t in range(L):
                W, o[:, t] = self.step(W, q[:, t], k[:, t], v[:, t], eta[:, t])
            return o
        outs = []
        for t in range(L):
            W, o_t = self.step(W, q[:, t], k[:, t], v[:, t], eta[:, t])
            outs.append(o_t)
        return torch.stack(outs, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).unbind(dim=2)
        q = F.normalize(q, dim=-1)
        k = F.normalize(k, dim=-1)
        if self.lr_proj is not None:
            eta = F.softplus(self.lr_proj(x) + self.base_lr_inv)
        else:
            eta = x.new_full((B, L, self.num_heads), self.base_lr)
        o = self._scan(q, k, v, eta)
        return self.o_proj(o.reshape(B, L, self.d_model))
