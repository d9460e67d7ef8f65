"""LaCT layer written head-major (``[B, H, L, d]``) with ``x @ W`` fast weights and ``torch.func.grad``.

The fast-weight network is a bias-free SwiGLU, ``f(x) = (silu(x @ W0) * (x @ W2)) @ W1`` for a row ``x``.
The stored parameters keep the ``W @ x`` layout (``w0: [H, inter, d]``); the forward works on their
transposes.  Each chunk is read with the weights of the previous chunks, then used for one test-time step.
``mlp=False`` trains a single linear fast weight ``f(x) = x @ W1`` instead, and ``per_token_lr=False`` steps at
a fixed rate of 1.  The chunk outputs are joined by ``torch.cat`` after the loop, or (``outputs="buffer"``)
written into a tensor allocated before it, ``o[:, :, s:e] = ...``.
"""
from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F
from torch.func import grad


@torch.compile(fullgraph=True, dynamic=False)
def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Orthogonalise the trailing two dims of ``G`` (Muon's quintic Newton-Schulz), in fp32 or better."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(torch.promote_types(G.dtype, torch.float32))
    tall = G.shape[-2] > G.shape[-1]
    if tall:
        X = X.mT
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def swiglu(x: torch.Tensor, W0: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
    """The fast-weight network on rows: ``(silu(x W0) * (x W2)) W1``."""
    return (F.silu(x @ W0) * (x @ W2)) @ W1


def kv_binding_loss(W0, W1, W2, k, v):
    """LaCT's dot-product key-value binding loss ``-sum <f(k), v>``; fold per-token lrs into ``v``."""
    return -(swiglu(k, W0, W1, W2) * v).sum()


def linear_binding_loss(W1, k, v):
    """The same binding loss for a single linear fast weight, ``f(x) = x @ W1``."""
    return -((k @ W1) * v).sum()


def fast_weight_grads(W0, W1, W2, k, v, lr0, lr1, lr2, update_theta=True):
    """One test-time step's increments ``-lr * dL/dW`` for each fast weight (None for a frozen one).

    k, v: [B, H, C, d]; lr*: [B, H, C, 1] (or a float).  Weighting v by a matrix's lr gives that matrix's
    lr-weighted loss.  Without ``W0``/``W2`` (None) the fast weight is linear and only ``W1`` moves.
    """
    if W0 is None:
        return None, -grad(linear_binding_loss)(W1, k, v * lr1), None
    dW1 = -grad(kv_binding_loss, argnums=1)(W0, W1, W2, k, v * lr1)
    if not update_theta:
        return None, dW1, None
    dW0 = -grad(kv_binding_loss, argnums=0)(W0, W1, W2, k, v * lr0)
    dW2 = -grad(kv_binding_loss, argnums=2)(W0, W1, W2, k, v * lr2)
    return dW0, dW1, dW2


class LaCTHeadsLayer(nn.Module):
    """Causal LaCT layer: per chunk, read q through the SwiGLU fast weights, then fit them to (k, v).

    Options follow the LaCT paper: momentum over chunk updates, Muon on each update, and row-wise weight
    normalisation back to the initial norms.  ``update_theta=False`` trains only the final layer ``w1``.
    ``lr_proj`` channels are ordered ``[lr0 heads..., lr1 heads..., lr2 heads...]``.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        chunk_size: int,
        *,
        inter_dim: int | None = None,
        update_theta: bool = True,
        weight_norm: bool = True,
        momentum: bool = True,
        muon: bool = True,
        base_lr: float = 1e-2,
        muon_steps: int = 5,
        mlp: bool = True,
        per_token_lr: bool = True,
        outputs: str = "list",
    ) -> None:
        super().__init__()
        if outputs not in ("list", "buffer"):
            raise ValueError(f"outputs must be 'list' or 'buffer', got {outputs!r}")
        self.outputs = outputs
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model, self.num_heads, self.chunk_size = d_model, num_heads, chunk_size
        self.head_dim = d_model // num_heads
        self.inter_dim = inter_dim if inter_dim is not None else self.head_dim
        self.update_theta, self.weight_norm = update_theta, weight_norm
        self.momentum, self.muon, self.muon_steps = momentum, muon, muon_steps
        self.mlp, self.per_token_lr = mlp, per_token_lr
        H, D, I = num_heads, self.head_dim, self.inter_dim
        n_lrs = 3 if mlp else 1

        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        if per_token_lr:
            self.lr_proj = nn.Linear(d_model, n_lrs * H, bias=False)
            self.base_lr_inv = math.log(math.expm1(base_lr))
        if momentum:
            self.momentum_proj = nn.Linear(d_model, H, bias=False)
        # stored in the W @ x layout; fan-in is the last dim
        if mlp:
            self.w0 = nn.Parameter(torch.randn(H, I, D) * D**-0.5)
            self.w1 = nn.Parameter(torch.randn(H, D, I) * I**-0.5)
            self.w2 = nn.Parameter(torch.randn(H, I, D) * D**-0.5)
        else:
            self.w1 = nn.Parameter(torch.randn(H, D, D) * D**-0.5)
        self.o_norm_weight = nn.Parameter(torch.ones(D))
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, _ = x.shape
        H, C = self.num_heads, self.chunk_size

        q, k, v = self.qkv(x).view(B, L, 3, H, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, H, L, D] each
        q = F.normalize(F.silu(q), dim=-1)
        k = F.normalize(F.silu(k), dim=-1)

        n_lrs = 3 if self.mlp else 1
        if self.per_token_lr:
            lr = F.softplus(self.lr_proj(x) + self.base_lr_inv)
            lrs = list(lr.view(B, L, n_lrs, H).permute(2, 0, 3, 1).unsqueeze(-1))  # [B, H, L, 1] each
        if self.momentum:
            alpha = torch.sigmoid(self.momentum_proj(x)).transpose(1, 2).unsqueeze(-1)  # [B, H, L, 1]

        # x @ W views of the initial fast weights, one copy per batch element
        W1 = self.w1.mT.expand(B, H, -1, -1)
        W0 = self.w0.mT.expand(B, H, -1, -1) if self.mlp else None
        W2 = self.w2.mT.expand(B, H, -1, -1) if self.mlp else None
        # row norms in the W @ x layout = column norms here
        W0_norm, W1_norm, W2_norm = (None if W is None else W.norm(dim=-2, keepdim=True) for W in (W0, W1, W2))
        update_theta = self.update_theta and self.mlp
        M0 = M1 = M2 = None

        n_chunks = -(-L // C)
        o = torch.empty_like(q) if self.outputs == "buffer" else None  # [B, H, L, D]
        outputs = []
        for j in range(n_chunks):
            s, e = j * C, min((j + 1) * C, L)
            o_j = swiglu(q[:, :, s:e], W0, W1, W2) if self.mlp else q[:, :, s:e] @ W1
            if o is not None:
                o[:, :, s:e] = o_j
            else:
                outputs.append(o_j)

            if j < n_chunks - 1:
                if not self.per_token_lr:
                    lr0 = lr1 = lr2 = 1.0
                elif self.mlp:
                    lr0, lr1, lr2 = (t[:, :, s:e] for t in lrs)
                else:
                    lr0, lr1, lr2 = None, lrs[0][:, :, s:e], None
                dW0, dW1, dW2 = fast_weight_grads(
                    W0, W1, W2, k[:, :, s:e], v[:, :, s:e], lr0, lr1, lr2, update_theta,
                )
                if self.momentum:
                    a_j = alpha[:, :, s:e].mean(dim=2, keepdim=True)  # [B, H, 1, 1]
                    dW1 = M1 = dW1 if M1 is None else dW1 + a_j * M1
                    if update_theta:
                        dW0 = M0 = dW0 if M0 is None else dW0 + a_j * M0
                        dW2 = M2 = dW2 if M2 is None else dW2 + a_j * M2
                if self.muon:
                    dW1 = newton_schulz(dW1, self.muon_steps)
                    if update_theta:
                        dW0 = newton_schulz(dW0, self.muon_steps)
                        dW2 = newton_schulz(dW2, self.muon_steps)
                W1 = W1 + dW1
                if update_theta:
                    W0, W2 = W0 + dW0, W2 + dW2
                if self.weight_norm:
                    W1 = W1 / (W1.norm(dim=-2, keepdim=True) + 1e-5) * W1_norm
                    if update_theta:
                        W0 = W0 / (W0.norm(dim=-2, keepdim=True) + 1e-5) * W0_norm
                        W2 = W2 / (W2.norm(dim=-2, keepdim=True) + 1e-5) * W2_norm

        if o is None:
            o = torch.cat(outputs, dim=2)  # [B, H, L, D]
        o = F.rms_norm(o, (self.head_dim,), self.o_norm_weight, eps=1e-6)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.d_model))
