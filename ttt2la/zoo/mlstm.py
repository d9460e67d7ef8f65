"""xLSTM's matrix memory (mLSTM) with sigmoid gates, stepped token by token.

The cell keeps a memory ``C`` and a normaliser ``n`` of the same keys, both decayed by a forget
gate ``f_t`` and written through an input gate ``i_t``, one of each per head and token:

    C_t = f_t C + i_t k_tᵀ v_t,   n_t = f_t n + i_t k_t,   h_t = q_t C_t / max(|q_t · n_t|, 1)

Sigmoid gates keep it a linear recurrence (the exponential input gate with its running-max
stabiliser would not be). The normaliser is a gated column of the memory (``shared_keys``).
"""
from __future__ import annotations

import torch
from torch import nn

#: Where the input gate is written: on the memory's update (``i (kᵀv)``), on the values
#: (``kᵀ(i v)``) or on the key both memories are written with (``(i k)ᵀ v``, ``n += i k``).
GATE_PLACES = ("update", "values", "keys")


class MLSTMLayer(nn.Module):
    """Heads of an mLSTM cell over ``[B, T, d_model]``: queries, keys and values from one
    projection (keys scaled by ``dh^-½``), gates per head from another, an output projection.
    ``gated=False`` drops both gates (normalised linear attention); ``gate`` says where the
    input gate is written (``GATE_PLACES``)."""

    def __init__(self, d_model: int = 32, num_heads: int = 2, gated: bool = True,
                 gate: str = "update"):
        super().__init__()
        if gate not in GATE_PLACES:
            raise ValueError(f"unknown gate place {gate!r}; choose one of {GATE_PLACES}")
        self.h, self.dh, self.gated, self.gate = num_heads, d_model // num_heads, gated, gate
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.gates = nn.Linear(d_model, 2 * num_heads)
        self.out = nn.Linear(d_model, d_model, bias=False)
        with torch.no_grad():               # forget gates start near 1, as xLSTM initialises them
            self.gates.bias[num_heads:].fill_(3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).unbind(2)     # [B, T, h, dh]
        k = k / self.dh ** 0.5
        i, f = torch.sigmoid(self.gates(x)).chunk(2, dim=-1)                # [B, T, h]
        C = x.new_zeros(B, self.h, self.dh, self.dh)
        n = x.new_zeros(B, self.h, self.dh)
        hs = []
        for t in range(T):
            C, n = self._step(C, n, k[:, t], v[:, t], i[:, t, :, None], f[:, t, :, None])
            num = torch.einsum("bhk,bhkv->bhv", q[:, t], C)
            den = torch.einsum("bhk,bhk->bh", q[:, t], n).abs().clamp(min=1.0)
            hs.append(num / den[..., None])
        return self.out(torch.stack(hs, 1).reshape(B, T, D))

    def _step(self, C, n, k, v, i, f):
        """One token's write: ``k, v [B, h, dh]``, gates ``[B, h, 1]``."""
        if not self.gated:
            return C + torch.einsum("bhk,bhv->bhkv", k, v), n + k
        if self.gate == "keys":
            k = i * k
            return f[..., None] * C + torch.einsum("bhk,bhv->bhkv", k, v), f * n + k
        if self.gate == "values":
            return f[..., None] * C + torch.einsum("bhk,bhv->bhkv", k, i * v), f * n + i * k
        return f[..., None] * C + i[..., None] * torch.einsum("bhk,bhv->bhkv", k, v), f * n + i * k


__all__ = ["GATE_PLACES", "MLSTMLayer"]
