"""A LaCT-like layer driven by a list of ``(start, end, update, apply)`` steps.

Novel-view-synthesis TTT code does not hard-code its order of updates and reads: the caller
hands the fast-weight operator a schedule, one step per entry. A step with ``update`` takes one
gradient step on the tokens ``start:end``; a step with ``apply`` reads the tokens ``start:end``
through the weights as they were *before* that step's own update. Two schedules are built in:

* ``"causal"``: ``(s, s + C, True, True)`` for every chunk — each chunk is read with the weights
  of the chunks before it (a language-model order);
* ``"render"``: ``(0, n, True, False), (0, L, False, True)`` — one update over the ``n`` tokens
  of the input views, then one read of every token with the stepped weights (bidirectional,
  a single-step TTT).

The fast weight is a bias-free SwiGLU ``f(x) = (silu(x W0) ⊙ (x W2)) W1`` per head, trained on
the dot-product binding loss with per-token rates; ``update_theta`` also steps the kernel
weights ``W0, W2`` (LaCT as published), ``weight_norm`` rescales every column of a stepped
weight back to its norm before the step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad


def swiglu(x, W0, W1, W2):
    """``(silu(x W0) * (x W2)) W1`` on rows ``x`` [B, H, n, D]."""
    return (F.silu(x @ W0) * (x @ W2)) @ W1


def binding_loss(W0, W1, W2, k, v):
    """Dot-product key-value binding loss (per-token rates already folded into ``v``)."""
    return -(swiglu(k, W0, W1, W2) * v).sum()


def renormed(W: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``W`` with every column rescaled to ``norm``."""
    return W / (W.norm(dim=-2, keepdim=True) + 1e-5) * norm


def causal_schedule(length: int, chunk_size: int) -> list[tuple[int, int, bool, bool]]:
    """Every chunk read with the weights of the chunks before it, then stepped on."""
    return [(s, min(s + chunk_size, length), True, True) for s in range(0, length, chunk_size)]


def render_schedule(length: int, input_tokens: int) -> list[tuple[int, int, bool, bool]]:
    """One step on the input views' tokens, then every token read with the stepped weights."""
    return [(0, input_tokens, True, False), (0, length, False, True)]


def fast_weight_apply(weights, q, k, v, lr, steps, *, update_theta: bool, weight_norm: bool):
    """Run ``steps`` over ``q, k, v`` [B, H, L, D] with rates ``lr`` [B, H, L, 1]; the reads
    of every ``apply`` step, concatenated along the token axis."""
    W0, W1, W2 = weights
    norms = [W.norm(dim=-2, keepdim=True) for W in weights]
    outs = []
    for start, end, update, apply in steps:
        if apply:           # reads the weights as they were before this step's update
            outs.append(swiglu(q[:, :, start:end], W0, W1, W2))
        if update:
            ki = k[:, :, start:end]
            vi = v[:, :, start:end] * lr[:, :, start:end]
            g0, g1, g2 = grad(binding_loss, argnums=(0, 1, 2))(W0, W1, W2, ki, vi)
            W1 = W1 - g1
            if update_theta:
                W0, W2 = W0 - g0, W2 - g2
            if weight_norm:
                W1 = renormed(W1, norms[1])
                if update_theta:
                    W0, W2 = renormed(W0, norms[0]), renormed(W2, norms[2])
    return torch.cat(outs, dim=2)


class ScheduleTTTLayer(nn.Module):
    """SwiGLU fast weights run on an update/apply schedule; see the module docstring."""

    def __init__(self, d_model: int, num_heads: int, *, schedule: str = "render",
                 input_tokens: int = 16, chunk_size: int = 16, update_theta: bool = False,
                 weight_norm: bool = False, base_lr: float = 0.1) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if schedule not in ("causal", "render"):
            raise ValueError(f"schedule must be 'causal' or 'render', got {schedule!r}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.schedule, self.input_tokens, self.chunk_size = schedule, input_tokens, chunk_size
        self.update_theta, self.weight_norm = update_theta, weight_norm
        D = self.head_dim
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.lr_proj = nn.Linear(d_model, num_heads, bias=False)
        self.base_lr_inv = math.log(math.expm1(base_lr))
        self.w0 = nn.Parameter(torch.randn(num_heads, D, D) * D ** -0.5)
        self.w1 = nn.Parameter(torch.randn(num_heads, D, D) * D ** -0.5)
        self.w2 = nn.Parameter(torch.randn(num_heads, D, D) * D ** -0.5)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def steps(self, length: int) -> list[tuple[int, int, bool, bool]]:
        """The schedule for a sequence of ``length`` tokens."""
        if self.schedule == "causal":
            return causal_schedule(length, self.chunk_size)
        return render_schedule(length, self.input_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] (the input views' tokens first) -> [B, L, d_model]."""
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        lr = F.softplus(self.lr_proj(x) + self.base_lr_inv).transpose(1, 2).unsqueeze(-1)
        weights = [W.expand(B, -1, -1, -1) for W in (self.w0, self.w1, self.w2)]
        o = fast_weight_apply(weights, q, k, v, lr, self.steps(L),
                              update_theta=self.update_theta, weight_norm=self.weight_norm)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, d))


__all__ = ["ScheduleTTTLayer", "causal_schedule", "render_schedule", "fast_weight_apply"]
