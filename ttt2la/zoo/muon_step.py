"""Fast weights stepped the way Muon steps slow weights.

Each chunk's gradient of a dot-product binding loss feeds a momentum buffer with a constant
``β`` (``m ← β m + g``); the weights take a step of ``lr`` along the buffer orthogonalised by
Newton–Schulz (``W ← W − lr · NS(m)``), as the Muon optimizer writes its update. The rate sits
after the orthogonalisation, where it is not a scale of the increment.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def newton_schulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration, normalised by the Frobenius norm."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


class MuonStepLayer(nn.Module):
    """Heads of a linear memory read before each chunk's Muon step (``[B, H, d, d]`` state)."""

    def __init__(self, dim: int, heads: int, chunk: int, lr: float = 0.1, beta: float = 0.9,
                 ns_steps: int = 5):
        super().__init__()
        self.h, self.c, self.lr, self.beta, self.ns_steps = heads, chunk, lr, beta, ns_steps
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (t.view(B, L, self.h, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        k = F.normalize(k, dim=-1)
        W = x.new_zeros(B, self.h, D // self.h, D // self.h)
        m = torch.zeros_like(W)
        outs = []
        for s in range(0, L, self.c):
            qc, kc, vc = q[:, :, s:s + self.c], k[:, :, s:s + self.c], v[:, :, s:s + self.c]
            outs.append(qc @ W)
            g = -(kc.mT @ vc)                  # ∂/∂W of the binding loss −⟨k W, v⟩
            m = self.beta * m + g
            W = W - self.lr * newton_schulz5(m, self.ns_steps)
        o = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, L, D)
        return self.out(o)


__all__ = ["MuonStepLayer", "newton_schulz5"]
