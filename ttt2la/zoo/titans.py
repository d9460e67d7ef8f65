"""Titans-like neural memories: a memory network fitted to key → value at test time, in windows.

The sequence is stored window by window (``window_chunks`` chunks of ``chunk_size`` tokens).
Inside a window every chunk's gradient of the MSE loss ``Σ_t lr_t ‖f(k_t) − v_t‖²`` is taken at
the weights the window *started* with, all chunks at once (``vmap(grad(loss))`` over batch ×
chunks); the surprises then go through an associative scan over the window's chunks — momentum
``S_j = β_j S_{j−1} − g_j`` when enabled — and the weights through another, with weight decay
``W_j = keep_j W_{j−1} + S_j`` (``keep_j`` the product of the chunk's per-token keep gates; 1
without decay; ``β_j`` the chunk mean of the per-token momentum gates). The queries of chunk
``j`` read the weights left by chunk ``j − 1`` (causal: a query never reads its own chunk). The
window's last weights start the next window. Tokens outside ``store_mask`` — and the zero tokens
that pad the last window to full size — have rate, decay and momentum gates 0: they neither
teach the memory nor decay it. The forward returns the retrieved values and a ``MemoryState``
named tuple (position, final weights, last surprise).

``TitansLinearMemory``: ``f(k) = k W`` — the update is affine in ``W`` (a delta rule), so it
converts exactly. ``TitansMLPMemory``: Titans' default memory, a two-layer MLP behind a
residual layer norm ``f(k) = k + LN(gelu(k W1) W2)``; the norm sits after the final layer, so the
layer is outside the linear-attention theorem and must be refused, naming the norm.

The windows' starts come from ``torch.arange(0, L, window).tolist()``: shape-only index code.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap


class MemoryState(NamedTuple):
    """What the memory hands on: the next token's position, the weights it has reached and
    (with momentum) the last surprise."""

    seq_index: int
    weights: torch.Tensor | dict
    momentum: torch.Tensor | dict | None = None


def scan_gates(gates: torch.Tensor, inputs: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """The associative scan ``h_j = gates_j h_{j−1} + inputs_j`` over axis 1 with ``h_{−1} =
    start``, for ``gates [B, n]`` and ``inputs [B, n, ...]``: every ``h_j`` at once, as the
    lower-triangular matrix of gate products ``Π_{i<l≤j} gates_l`` applied to the inputs (no
    logarithms, so a zero gate is exact; ``n`` is a window's few chunks)."""
    n = gates.shape[1]
    idx = torch.arange(n, device=gates.device)
    j, i, l = idx[:, None, None], idx[None, :, None], idx[None, None, :]
    inside = (l > i) & (l <= j)
    between = torch.where(inside, gates[:, None, None, :], 1.0).prod(-1)
    between = between.masked_fill(~(i <= j).squeeze(-1), 0.0)
    flat = inputs.flatten(2)
    scanned = between @ flat + torch.cumprod(gates, dim=1)[..., None] * start.flatten(1)[:, None]
    return scanned.view(inputs.shape)


class _TitansMemory(nn.Module):
    """Projections, gates and the window loop; subclasses give the memory model."""

    def __init__(self, dim: int, chunk_size: int, *, window_chunks: int = 2,
                 max_lr: float = 0.3, weight_decay: bool = True, momentum: bool = False) -> None:
        super().__init__()
        self.dim, self.chunk_size, self.window_chunks = dim, chunk_size, window_chunks
        self.max_lr, self.weight_decay, self.momentum = max_lr, weight_decay, momentum
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_lr = nn.Linear(dim, 1)
        self.to_decay = nn.Linear(dim, 1)
        self.to_momentum = nn.Linear(dim, 1)
        nn.init.constant_(self.to_decay.bias, -3.0)

    def initial_weights(self, batch: int):
        raise NotImplementedError

    def memory(self, weights, x: torch.Tensor) -> torch.Tensor:
        """The memory model ``f(x)`` with the given weights, rows ``x [C, dim]``."""
        raise NotImplementedError

    def loss(self, weights, k, v, lr):
        """MSE of the memory's prediction of the values, each token weighted by its rate."""
        return (lr[:, None] * (self.memory(weights, k) - v) ** 2).sum()

    def store(self, weights, surprise, k, v, lr, log_keep, beta):
        """One window of ``n`` chunks (inputs ``[B, n, C, ...]``): the weights after every chunk
        and the last surprise."""
        B, n = k.shape[:2]
        at_start = {name: w.repeat_interleave(n, dim=0) for name, w in weights.items()}
        grads = vmap(grad(self.loss))(at_start, k.flatten(0, 1), v.flatten(0, 1),
                                      lr.flatten(0, 1))
        keep = log_keep.sum(-1).exp()
        after = {}
        for name, g in grads.items():
            step = -g.view(B, n, *g.shape[1:])
            if self.momentum:
                step = scan_gates(beta, step, surprise[name])
                surprise = {**surprise, name: step[:, -1]}
            after[name] = scan_gates(keep, step, weights[name])
        return after, surprise

    def forward(self, x: torch.Tensor, store_mask: torch.Tensor | None = None):
        """x: ``[B, L, dim]`` → ``(retrieved [B, L, dim], MemoryState)``. ``store_mask [B, L]``
        (all tokens when None): the tokens stored; the others neither teach the memory nor
        decay it or its momentum."""
        B, L, _ = x.shape
        C = self.chunk_size
        n = self.window_chunks
        window = C * n
        stored = x.new_ones(B, L) if store_mask is None else store_mask.to(x.dtype)
        q, k, v = self.to_q(x), F.normalize(self.to_k(x), dim=-1), self.to_v(x)
        lr = self.max_lr * torch.sigmoid(self.to_lr(x)).squeeze(-1)
        log_keep = F.logsigmoid(-self.to_decay(x)).squeeze(-1)
        if not self.weight_decay:
            log_keep = torch.zeros_like(log_keep)
        beta = torch.sigmoid(self.to_momentum(x)).squeeze(-1)
        weights = self.initial_weights(B)
        surprise = {name: torch.zeros_like(w) for name, w in weights.items()}
        outs = []
        for s in torch.arange(0, L, window).tolist():
            e = min(s + window, L)
            pad = window - (e - s)                    # the last window is padded to full size
            qc = F.pad(q[:, s:e], (0, 0, 0, pad)).view(B, n, C, -1)
            kc = F.pad(k[:, s:e], (0, 0, 0, pad)).view(B, n, C, -1)
            vc = F.pad(v[:, s:e], (0, 0, 0, pad)).view(B, n, C, -1)
            mask = F.pad(stored[:, s:e], (0, pad)).view(B, n, C)
            lrc = mask * F.pad(lr[:, s:e], (0, pad)).view(B, n, C)
            keepc = mask * F.pad(log_keep[:, s:e], (0, pad)).view(B, n, C)
            betac = mask * F.pad(beta[:, s:e], (0, pad)).view(B, n, C)
            after, surprise = self.store(weights, surprise, kc, vc, lrc, keepc, betac.mean(-1))
            read = {name: torch.cat([weights[name][:, None], w[:, :-1]], dim=1)
                    for name, w in after.items()}
            y = vmap(self.memory)({name: w.flatten(0, 1) for name, w in read.items()},
                                  qc.flatten(0, 1))
            outs.append(y.view(B, window, -1))
            weights = {name: w[:, -1] for name, w in after.items()}
        state = MemoryState(seq_index=L, weights=self.unwrap(weights),
                            momentum=self.unwrap(surprise) if self.momentum else None)
        return torch.cat(outs, dim=1)[:, :L], state

    def unwrap(self, weights):
        """The weights as the state hands them on (the dict itself, or its one tensor)."""
        return weights


class TitansLinearMemory(_TitansMemory):
    """A linear memory ``f(k) = k W`` (``W [dim, dim]``): the delta rule, converted exactly."""

    def __init__(self, dim: int, chunk_size: int, **kw) -> None:
        super().__init__(dim, chunk_size, **kw)
        self.w = nn.Parameter(torch.randn(dim, dim) * dim ** -0.5)

    def initial_weights(self, batch: int):
        return {"w": self.w.expand(batch, -1, -1)}

    def memory(self, weights, x):
        return x @ weights["w"]

    def unwrap(self, weights):
        return weights["w"]


class TitansMLPMemory(_TitansMemory):
    """Titans' default memory: ``f(k) = k + LN(gelu(k W1) W2)`` — refused (a norm after the
    final layer)."""

    def __init__(self, dim: int, chunk_size: int, *, expansion: int = 2, **kw) -> None:
        super().__init__(dim, chunk_size, **kw)
        hidden = dim * expansion
        self.w1 = nn.Parameter(torch.randn(dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(hidden, dim) * hidden ** -0.5)
        self.ln_weight = nn.Parameter(torch.ones(dim))

    def initial_weights(self, batch: int):
        return {"w1": self.w1.expand(batch, -1, -1), "w2": self.w2.expand(batch, -1, -1)}

    def memory(self, weights, x):
        h = F.gelu(x @ weights["w1"]) @ weights["w2"]
        return x + F.layer_norm(h, (self.dim,), weight=self.ln_weight)


__all__ = ["MemoryState", "TitansLinearMemory", "TitansMLPMemory", "scan_gates"]
