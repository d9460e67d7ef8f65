"""Gated linear attention written chunk by chunk, the way flash-linear-attention's chunked
references are written.

Beside its token loops, that library checks its kernels against references in the chunk form:
a loop over chunks of ``C`` tokens that reads the state carried in from the chunks before, adds
the attention inside the chunk — built from cumulative log decays and a causal mask — and then
decays the state and adds the chunk's keys and values, each key weighted by the decay left to the
chunk's end. Two rules here:

* ``simple_gla`` — one log decay per head and token (gated retention, Mamba-2's scalar gate);
  the in-chunk decays are the matrix ``exp(G_t − G_i)`` masked to ``i ≤ t``;
* ``gla`` — one log decay per key channel and token (GLA); the in-chunk decay is factored into
  the queries (``q ⊙ exp(G)``) and the keys (``k ⊙ exp(−G)``), which keeps to fp32's range for
  the chunk sizes and gates GLA uses (``logsigmoid / 16``);
* ``gla_value`` — one log decay per value channel and token (flash-linear-attention's ``gv``, the
  second pass of gated slot attention): the state decays per column, and the in-chunk decay is
  factored into the values (``v ⊙ exp(−G)``) and the outputs (``⊙ exp(G)``);
* ``linear_attn`` — linear attention with its normaliser (positive features ``elu + 1``): the
  output divided by ``q·z``, the chunk's own masked attention summed beside it, where ``z``
  gains the chunk's summed keys as the state gains its keys and values.

``FlaChunkReferenceLayer`` wraps one with projections. The loop's state decays once per chunk,
per head, per key channel or per value channel, and gains the chunk's keys and values:
``block_linear_attention`` with its decay (``value_decay`` for the columns), the in-chunk
attention computed as the layer writes it; the normaliser rides the op as one more value column
of ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_RULES = ("simple_gla", "gla", "gla_value", "linear_attn")


def simple_gla_chunks(q, k, v, g, chunk_size: int):
    """``o = q S + in-chunk attention`` chunk by chunk, ``g [B, H, T]`` log decays per head."""
    B, H, T, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    after = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    o = torch.empty_like(v)
    for s in range(0, T, chunk_size):
        e = s + chunk_size
        qc, kc, vc = q[:, :, s:e], k[:, :, s:e], v[:, :, s:e]
        G = g[:, :, s:e].cumsum(-1)                                  # [B, H, C]
        decays = (G[..., :, None] - G[..., None, :]).masked_fill(after, float("-inf")).exp()
        o[:, :, s:e] = (qc * G[..., None].exp()) @ S + ((qc @ kc.mT) * decays) @ vc
        left = (G[..., -1:] - G).exp()                               # decay to the chunk's end
        S = S * G[..., -1, None, None].exp() + (kc * left[..., None]).mT @ vc
    return o


def gla_chunks(q, k, v, g, chunk_size: int):
    """The same with ``g [B, H, T, K]`` log decays per key channel, factored into q and k."""
    T = q.shape[2]
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    after = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    outs = []
    for s in range(0, T, chunk_size):
        e = s + chunk_size
        G = g[:, :, s:e].cumsum(-2)                                  # [B, H, C, K]
        q_in, k_in = q[:, :, s:e] * G.exp(), k[:, :, s:e] * (-G).exp()
        attn = (q_in @ k_in.mT).masked_fill(after, 0.0)
        outs.append(q_in @ S + attn @ v[:, :, s:e])
        last = G[:, :, -1]                                           # [B, H, K]
        S = last.exp()[..., None] * S + (k_in * last.exp()[:, :, None]).mT @ v[:, :, s:e]
    return torch.cat(outs, dim=2)


def gla_value_chunks(q, k, v, g, chunk_size: int):
    """The same with ``g [B, H, T, V]`` log decays per value channel: a column of the state each,
    the in-chunk decay factored into the values and the outputs."""
    T = q.shape[2]
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    after = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    outs = []
    for s in range(0, T, chunk_size):
        e = s + chunk_size
        qc, kc = q[:, :, s:e], k[:, :, s:e]
        G = g[:, :, s:e].cumsum(-2)                                  # [B, H, C, V]
        attn = (qc @ kc.mT).masked_fill(after, 0.0)
        outs.append((qc @ S + attn @ (v[:, :, s:e] * (-G).exp())) * G.exp())
        last = G[:, :, -1]                                           # [B, H, V]
        S = S * last.exp()[:, :, None, :] + kc.mT @ (v[:, :, s:e] * (last[:, :, None] - G).exp())
    return torch.cat(outs, dim=2)


def linear_attn_chunks(q, k, v, chunk_size: int, eps: float = 1e-6):
    """``o = (q S + A v) / (q·z + A 1 + ε)`` chunk by chunk, ``A`` the chunk's causal attention
    of positive features, ``z`` the keys summed so far."""
    S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:2], q.shape[-1])                        # [B, H, K]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    outs = []
    for s in range(0, q.shape[2], chunk_size):
        qc, kc, vc = q[:, :, s:s + chunk_size], k[:, :, s:s + chunk_size], v[:, :, s:s + chunk_size]
        n = qc.shape[2]
        attn = (qc @ kc.mT) * causal[:n, :n]
        num = qc @ S + attn @ vc
        den = qc @ z.unsqueeze(-1) + attn.sum(-1, keepdim=True) + eps
        outs.append(num / den)
        S = S + kc.mT @ vc
        z = z + kc.sum(2)
    return torch.cat(outs, dim=2)


class FlaChunkReferenceLayer(nn.Module):
    """Projections around one chunked reference: ``qkv``, a gate, the rule, ``o_proj``."""

    def __init__(self, hidden_size: int = 256, num_heads: int = 4, rule: str = "gla",
                 chunk_size: int = 64):
        super().__init__()
        if rule not in CHUNK_RULES:
            raise ValueError(f"rule must be one of {CHUNK_RULES}, got {rule!r}")
        self.rule, self.num_heads, self.chunk_size = rule, num_heads, chunk_size
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        if rule != "linear_attn":
            self.gate = nn.Linear(hidden_size, num_heads if rule == "simple_gla" else hidden_size)
            with torch.no_grad():
                self.gate.bias.fill_(4.0)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        H = self.num_heads
        q, k, v = (t.view(B, T, H, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q = q * q.shape[-1] ** -0.5
        if self.rule == "linear_attn":
            o = linear_attn_chunks(F.elu(q) + 1, F.elu(k) + 1, v, self.chunk_size)
        elif self.rule in ("gla", "gla_value"):
            g = (F.logsigmoid(self.gate(x)) / 16).view(B, T, H, -1).transpose(1, 2)
            chunks = gla_chunks if self.rule == "gla" else gla_value_chunks
            o = chunks(q, k, v, g, self.chunk_size)
        else:
            g = F.logsigmoid(self.gate(x)).transpose(1, 2)
            o = simple_gla_chunks(q, k, v, g, self.chunk_size)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))


__all__ = ["CHUNK_RULES", "FlaChunkReferenceLayer", "gla_chunks", "gla_value_chunks",
           "linear_attn_chunks", "simple_gla_chunks"]
