"""Recurrences written the way flash-linear-attention writes its reference loops.

Each kernel of that library ships a ``naive`` recurrence: a function over ``[B, H, T, D]``
tensors that walks the tokens, decays and writes a state ``S [B, H, K, V]`` by broadcasting
(``k[..., None] * v[..., None, :]``), reads it the same way (``(q[..., None] * S).sum(-2)``)
and writes each token's output into a buffer allocated before the loop (``o[:, :, i] = …``).
The functions here are written in that style for eight recurrences:

* ``retention`` — a fixed decay per head, ``1 − 2^(−5−h)`` (RetNet);
* ``scalar_gate`` — a data-dependent decay per head and token, ``exp(g_t)`` with ``g_t ≤ 0``
  (gated retention, Mamba-2's scalar gate);
* ``vector_gate`` — a decay per key channel, ``exp(g_t)`` with ``g_t [K]`` (GLA);
* ``value_gate`` — a decay per value channel, ``exp(g_t)`` with ``g_t [V]`` on the state's columns
  (flash-linear-attention's ``gv``, the second pass of gated slot attention);
* ``gated_delta`` — the gated delta rule: decay, then correct the value the state predicts for
  the key by ``β_t`` (Gated DeltaNet);
* ``ssd`` — Mamba-2's recurrence as its minimal reference steps it: a state ``h [B, H, P, N]``
  laid out value-first, decayed by ``exp(Δ_t A)``, written ``(Δ_t x_t) ⊗ B_t`` and read by
  summing ``h ⊙ C_t`` over its last axis;
* ``normalised`` — linear attention with its normaliser (``φ = elu + 1``): a second memory, the
  keys' running sum, divides each read;
* ``rwkv6`` — RWKV-6's time mixing: a decay per key channel and token, the state read before the
  token is written, plus the token's own product weighted per key channel by a learnt bonus ``u``.

``FlaReferenceLayer`` wraps one of them with projections, the way a model calls the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

RULES = ("retention", "scalar_gate", "vector_gate", "value_gate", "gated_delta", "ssd",
         "normalised", "rwkv6")


def retention_recurrence(q, k, v):
    """``S_t = γ_h S_{t-1} + k_tᵀ v_t``, ``o_t = q_t S_t`` with RetNet's decay per head."""
    B, H, T, K = q.shape
    decay = 1 - 2 ** (-5.0 - torch.arange(H, dtype=q.dtype, device=q.device))
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(T):
        S = S * decay[None, :, None, None] + k[:, :, i, :, None] * v[:, :, i, None, :]
        o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2)
    return o


def gated_recurrence(q, k, v, g):
    """``S_t = exp(g_t) ⊙ S_{t-1} + k_tᵀ v_t``: ``g [B, H, T]`` decays whole heads, ``g [B, H,
    T, K]`` each key channel (broadcast over the value axis)."""
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(T):
        gate = g[:, :, i].exp()
        gate = gate[..., None] if g.dim() == 4 else gate[..., None, None]
        S = S * gate + k[:, :, i].unsqueeze(-1) * v[:, :, i].unsqueeze(-2)
        o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2)
    return o


def value_gated_recurrence(q, k, v, g):
    """``S_t = S_{t-1} ⊙ exp(g_t)[None, :] + k_tᵀ v_t``: ``g [B, H, T, V]`` decays each value
    channel, a column of the state (broadcast over the key axis)."""
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(T):
        S = S * g[:, :, i, None, :].exp() + k[:, :, i, :, None] * v[:, :, i, None, :]
        o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2)
    return o


def gated_delta_recurrence(q, k, v, beta, g):
    """``S_t = α_t S_{t-1} + β_t k_tᵀ (v_t − k_t α_t S_{t-1})``, ``α_t = exp(g_t)``."""
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(T):
        S = S * g[:, :, i].exp()[..., None, None]
        predicted = (S * k[:, :, i, :, None]).sum(-2)
        correction = (v[:, :, i] - predicted) * beta[:, :, i, None]
        S = S + k[:, :, i].unsqueeze(-1) * correction.unsqueeze(-2)
        o[:, :, i] = torch.einsum("bhk,bhkv->bhv", q[:, :, i], S)
    return o


def normalised_recurrence(q, k, v, eps: float = 1e-6):
    """``o_t = φ(q_t) S_t / (φ(q_t)·z_t + ε)``, ``S_t = Σ φ(k)ᵀv``, ``z_t = Σ φ(k)``."""
    q, k = F.elu(q) + 1, F.elu(k) + 1
    B, H, T, K = q.shape
    S, z = q.new_zeros(B, H, K, v.shape[-1]), q.new_zeros(B, H, K)
    o = torch.zeros_like(v)
    for i in range(T):
        S = S + k[:, :, i, :, None] * v[:, :, i, None, :]
        z = z + k[:, :, i]
        o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2) / \
            ((q[:, :, i] * z).sum(-1, keepdim=True) + eps)
    return o


def rwkv6_recurrence(r, k, v, w, u):
    """``o_t = r_t (S_{t-1} + diag(u) k_tᵀ v_t)``, then ``S_t = diag(exp(w_t)) S_{t-1} + k_tᵀ v_t``:
    ``w [B, H, T, K]`` log decays per key channel, ``u [H, K]`` the bonus of the current token."""
    B, H, T, K = r.shape
    S = r.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for i in range(T):
        kv = k[:, :, i, :, None] * v[:, :, i, None, :]
        o[:, :, i] = ((S + u[None, :, :, None] * kv) * r[:, :, i, :, None]).sum(-2)
        S = S * w[:, :, i].exp()[..., None] + kv
    return o


def ssd_recurrence(x, dt, A, B, C):
    """``h_t = exp(Δ_t A) h_{t-1} + (Δ_t x_t) ⊗ B_t``, ``y_t = Σ_n h_t[..., n] C_t[n]``:
    ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, ``B, C [B, T, H, N]``."""
    batch, T, H, P = x.shape
    h = x.new_zeros(batch, H, P, B.shape[-1])
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        h = h * decay + (dt[:, t, :, None] * x[:, t])[..., :, None] * B[:, t, :, None, :]
        ys.append((h * C[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, 1)


class FlaReferenceLayer(nn.Module):
    """Multi-head token mixer running one reference recurrence (``rule``, one of ``RULES``):
    projections to heads, the recurrence, heads merged and projected out."""

    def __init__(self, d_model: int = 64, num_heads: int = 4, rule: str = "scalar_gate"):
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.rule, self.num_heads = rule, num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        gates = {"scalar_gate": num_heads, "vector_gate": d_model, "value_gate": d_model,
                 "gated_delta": 2 * num_heads,
                 "ssd": num_heads, "rwkv6": d_model}
        self.gate = nn.Linear(d_model, gates[rule]) if rule in gates else None
        self.A_log = nn.Parameter(torch.zeros(num_heads)) if rule == "ssd" else None
        self.bonus = nn.Parameter(0.5 * torch.randn(num_heads, d_model // num_heads)) \
            if rule == "rwkv6" else None
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, d_model] -> [B, T, d_model]."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.rule == "ssd":                    # C, B and x: query, key and value
            C, Bk, xs = (t.view(B, T, H, -1) for t in self.qkv(x).chunk(3, -1))
            y = ssd_recurrence(xs, F.softplus(self.gate(x)), -torch.exp(self.A_log), Bk, C)
            return self.out(y.reshape(B, T, -1))
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q = q * q.shape[-1] ** -0.5
        if self.rule == "retention":
            o = retention_recurrence(q, k, v)
        elif self.rule == "normalised":
            o = normalised_recurrence(q, k, v)
        elif self.rule == "scalar_gate":
            o = gated_recurrence(q, k, v, F.logsigmoid(self.gate(x) + 4).transpose(1, 2))
        elif self.rule == "rwkv6":              # decays about e^-0.02 per token and channel
            w = -torch.exp(self.gate(x).view(B, T, H, -1).transpose(1, 2) - 4)
            o = rwkv6_recurrence(q, k, v, w, self.bonus)
        elif self.rule == "vector_gate":
            g = F.logsigmoid(self.gate(x) + 4).view(B, T, H, -1).transpose(1, 2) / 16
            o = gated_recurrence(q, k, v, g)
        elif self.rule == "value_gate":
            g = F.logsigmoid(self.gate(x) + 4).view(B, T, H, -1).transpose(1, 2) / 16
            o = value_gated_recurrence(q, k, v, g)
        else:
            b, a = self.gate(x).transpose(1, 2).chunk(2, 1)
            o = gated_delta_recurrence(q, F.normalize(k, dim=-1), v, torch.sigmoid(b),
                                       F.logsigmoid(a + 3))
        return self.out(o.transpose(1, 2).reshape(B, T, -1))


__all__ = ["FlaReferenceLayer", "RULES", "gated_delta_recurrence", "gated_recurrence",
           "normalised_recurrence", "retention_recurrence", "rwkv6_recurrence", "ssd_recurrence",
           "value_gated_recurrence"]
