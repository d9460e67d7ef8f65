"""TTT layers written with the loop statement cutting the sequence and with fused torch ops.

``for qc, kc in zip(q.split(C, 1), k.split(C, 1))`` and ``for x_t in x.unbind(1)`` hand every
iteration its chunk without slicing; ``torch.lerp`` keeps a momentum, ``F.mse_loss`` under
``torch.func.grad`` gives the delta rule's gradient, ``torch.baddbmm`` adds an update, and Muon's
reference Newton–Schulz fuses its multiply-adds the same way. Each computes what the plain
arithmetic computes; ttt2la reads the ops through their definitions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SplitZipLayer(nn.Module):
    """Chunks from ``split`` zipped in the loop statement, a per-token rate, a ``baddbmm``
    update: block-causal linear attention."""

    def __init__(self, dim: int = 8, chunk: int = 4):
        super().__init__()
        self.c = chunk
        self.proj = nn.Linear(dim, 3 * dim, bias=False)
        self.lr = nn.Linear(dim, 1)
        self.W0 = nn.Parameter(torch.randn(dim, dim) / dim)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        lr = F.softplus(self.lr(x))
        W = self.W0.repeat(x.shape[0], 1, 1)
        outs = []
        for qc, kc, vc, lc in zip(q.split(self.c, 1), F.silu(k).split(self.c, 1),
                                  v.split(self.c, 1), lr.split(self.c, 1)):
            outs.append(torch.bmm(qc, W))
            W = torch.baddbmm(W, kc.transpose(1, 2), vc * lc, alpha=0.1)
        return torch.cat(outs, 1)


class ListedChunksLayer(SplitZipLayer):
    """``SplitZipLayer``'s function with its chunks made before the loop: a list of the
    ``split`` pieces zipped (``how="list"``), or a generator of slices the loop statement
    iterates (``how="generator"``)."""

    def __init__(self, dim: int = 8, chunk: int = 4, how: str = "list"):
        super().__init__(dim, chunk)
        if how not in ("list", "generator"):
            raise ValueError(f"how must be 'list' or 'generator', got {how!r}")
        self.how = how

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        streams = (q, F.silu(k), v, F.softplus(self.lr(x)))
        if self.how == "list":
            chunks = list(zip(*(t.split(self.c, 1) for t in streams)))
        else:
            chunks = (tuple(t[:, s:s + self.c] for t in streams) for s in range(0, x.shape[1], self.c))
        W = self.W0.repeat(x.shape[0], 1, 1)
        outs = []
        for qc, kc, vc, lc in chunks:
            outs.append(torch.bmm(qc, W))
            W = torch.baddbmm(W, kc.transpose(1, 2), vc * lc, alpha=0.1)
        return torch.cat(outs, 1)


class UnbindDeltaLayer(nn.Module):
    """A per-token delta rule over ``unbind`` pieces, its gradient from ``F.mse_loss``."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        g = torch.func.grad(lambda S, k, v: 0.5 * F.mse_loss(k @ S, v, reduction="sum"))
        ys = []
        for qt, kt, vt in zip(q.unbind(1), F.normalize(k, dim=-1).unbind(1), v.unbind(1)):
            S = S - 0.5 * g(S, kt.unsqueeze(1), vt.unsqueeze(1))
            ys.append(torch.einsum("bi,bij->bj", qt, S))
        return torch.stack(ys, 1)


class LerpMomentumLayer(nn.Module):
    """Chunks sliced in the body, momentum kept by ``torch.lerp``."""

    def __init__(self, dim: int = 8, chunk: int = 4):
        super().__init__()
        self.c = chunk
        self.proj = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        m = torch.zeros_like(W)
        outs = []
        for s in range(0, x.shape[1], self.c):
            outs.append(q[:, s:s + self.c] @ W)
            m = torch.lerp(m, k[:, s:s + self.c].mT @ v[:, s:s + self.c], 0.25)
            W = W + m
        return torch.cat(outs, 1)


def zeropower(G, steps: int = 3):
    """Muon's quintic Newton–Schulz with its multiply-adds fused, as its reference code does."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


class BaddbmmMuonLayer(LerpMomentumLayer):
    """Each chunk's update orthogonalised by ``zeropower`` before it is added."""

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], self.c):
            outs.append(q[:, s:s + self.c] @ W)
            W = W + zeropower(k[:, s:s + self.c].mT @ v[:, s:s + self.c])
        return torch.cat(outs, 1)


__all__ = ["SplitZipLayer", "UnbindDeltaLayer", "LerpMomentumLayer", "BaddbmmMuonLayer",
           "zeropower"]
