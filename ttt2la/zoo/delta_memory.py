"""A DeltaNet-style memory trained token by token: the (gated) delta rule as a TTT loop.

Every head keeps a linear memory ``S`` [B, H, Dk, Dv] that maps keys to values. Each token
takes one gradient step of size ``β_t`` on the squared error ``½‖k_t S − v_t‖²`` of the memory's
prediction of its value, optionally after the memory is decayed by a gate ``α_t ∈ (0, 1)``
(gated DeltaNet); the query reads the memory after the step (``read="after"``, DeltaNet) or
before it (``read="before"``, read-then-write). The gradient is written out by hand,
``k_tᵀ (k_t S − v_t)``, or taken with ``torch.func.grad`` of the loss (``grad="func"``), the two
ways such layers are published. Written as a Python loop over tokens in ``forward``: what the
converter recognises and lowers onto the chunked delta-rule op. The outputs are stacked after
the loop, or (``outputs="buffer"``) written into a tensor allocated before it, ``o[:, t] = …``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

READS = ("after", "before")
GRADS = ("manual", "func")
OUTPUTS = ("list", "buffer")


def memory_loss(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``½‖k S − v‖²`` summed over batch and heads (each head's gradient is its own)."""
    prediction = (k.unsqueeze(-2) @ S).squeeze(-2)
    return 0.5 * ((prediction - v) ** 2).sum()


class DeltaMemoryLayer(nn.Module):
    """Multi-head delta-rule memory: ``S_t = α_t S_{t-1} − β_t ∇_S ½‖k_t α_t S_{t-1} − v_t‖²``.

    ``β_t = sigmoid(b_proj(x_t))`` per head and token (DeltaNet's writing strength); with
    ``decay=True`` ``α_t = sigmoid(a_proj(x_t) + 3)`` (close to 1 at initialisation). Keys and
    queries are L2-normalised per head, queries scaled by ``Dk^-½``. The memory starts at zero.
    ``outputs`` is ``"list"`` (stacked after the loop) or ``"buffer"`` (written into
    ``torch.zeros_like(v)``).
    """

    def __init__(self, d_model: int, num_heads: int, *, decay: bool = False,
                 read: str = "after", grad: str = "manual", outputs: str = "list"):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if read not in READS:
            raise ValueError(f"read must be one of {READS}, got {read!r}")
        if grad not in GRADS:
            raise ValueError(f"grad must be one of {GRADS}, got {grad!r}")
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be one of {OUTPUTS}, got {outputs!r}")
        self.outputs = outputs
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.read, self.grad = read, grad
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.b_proj = nn.Linear(d_model, num_heads)
        self.a_proj = nn.Linear(d_model, num_heads) if decay else None
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def gradient(self, S, k_t, v_t):
        """``∇_S ½‖k_t S − v_t‖²`` per head: ``k_tᵀ (k_t S − v_t)``."""
        if self.grad == "func":
            return torch.func.grad(memory_loss)(S, k_t, v_t)
        error = (k_t.unsqueeze(-2) @ S).squeeze(-2) - v_t             # [B, H, Dv]
        return k_t.unsqueeze(-1) * error.unsqueeze(-2)                 # [B, H, Dk, Dv]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, d_model = x.shape
        H, D = self.num_heads, self.head_dim
        q = F.normalize(self.q_proj(x).view(B, L, H, D), dim=-1) * D ** -0.5
        k = F.normalize(self.k_proj(x).view(B, L, H, D), dim=-1)
        v = self.v_proj(x).view(B, L, H, D)
        beta = torch.sigmoid(self.b_proj(x))                          # [B, L, H]
        alpha = None if self.a_proj is None else torch.sigmoid(self.a_proj(x) + 3.0)

        S = x.new_zeros(B, H, D, D)
        o = torch.zeros_like(v) if self.outputs == "buffer" else None  # [B, L, H, D]
        outs = []
        for t in range(L):
            q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]
            if self.read == "before":
                o_t = (q_t.unsqueeze(-2) @ S).squeeze(-2)
            if alpha is not None:
                S = alpha[:, t, :, None, None] * S
            S = S - beta[:, t, :, None, None] * self.gradient(S, k_t, v_t)
            if self.read == "after":
                o_t = (q_t.unsqueeze(-2) @ S).squeeze(-2)
            if o is not None:
                o[:, t] = o_t
            else:
                outs.append(o_t)
        if o is None:
            o = torch.stack(outs, dim=1)                               # [B, L, H, D]
        return self.o_proj(o.reshape(B, L, d_model))


__all__ = ["DeltaMemoryLayer"]
