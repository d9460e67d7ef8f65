"""LaCT written the way its language-model layer writes it, rotary embedding included.

The released layer calls its operator from the layer's own ``forward`` (no operator submodule:
the ``[H, dh, d]`` fast weights are tiled over the batch there) and turns the fast queries and
keys by a rotary embedding after their l2 norm. The embedding keeps its cos/sin table on itself,
as flash-linear-attention's ``RotaryEmbedding`` does: built at the first call for
``max(L, max_position_embeddings)`` positions, and built again only when a call asks for more
(or for another device or dtype). The table is a cache the forward fills, so the layer computes
one function whether or not it was called before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lact_published import LaCTPublishedLayer, block_causal_swiglu_ttt, unit_rows


class RotaryEmbedding(nn.Module):
    """Rotary position embedding of ``[B, L, H, d]`` queries and keys (halves rotated), its
    cos/sin table cached on the module for the longest length asked for so far."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None):
        stale = self._cos_cached is None or self._cos_cached.device != device \
            or self._cos_cached.dtype != dtype
        if seqlen > self._seq_len_cached or stale:
            self._seq_len_cached = seqlen
            angles = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32),
                                 self.inv_freq.to(device))
            self._cos_cached = angles.cos().to(dtype)
            self._sin_cached = angles.sin().to(dtype)

    def forward(self, q, k, seqlen_offset: int = 0, max_seqlen: int | None = None):
        seqlen = q.shape[1]
        self._update_cos_sin_cache(max_seqlen if max_seqlen is not None else seqlen + seqlen_offset,
                                   device=q.device, dtype=q.dtype)
        cos = self._cos_cached[seqlen_offset:seqlen_offset + seqlen, None, :]
        sin = self._sin_cached[seqlen_offset:seqlen_offset + seqlen, None, :]

        def turned(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return turned(q), turned(k)


class LaCTRotaryLayer(LaCTPublishedLayer):
    """``LaCTPublishedLayer`` as the released layer writes its forward: the operator called
    there, rotary positions on the fast queries and keys (``max_position_embeddings``: the
    shortest table the embedding builds, as the release's configuration sets it)."""

    def __init__(self, d_model, num_heads, chunk_size, *, max_position_embeddings=None,
                 rope_theta=10000.0, **kw):
        super().__init__(d_model, num_heads, chunk_size, **kw)
        self.rotary = RotaryEmbedding(self.head_dim, base=rope_theta)
        self.max_position_embeddings = max_position_embeddings

    def _heads_last(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """[b·H, s, d] -> [b, s, H, d]."""
        return t.view(b, self.num_heads, t.shape[1], -1).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, q_len, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        q, k, v = (F.silu(self._fold(t)) for t in (q, k, v))
        q, k = unit_rows(q), unit_rows(k)

        max_seqlen = q_len
        if self.max_position_embeddings is not None:
            max_seqlen = max(max_seqlen, self.max_position_embeddings)
        q, k = self.rotary(self._heads_last(q, b), self._heads_last(k, b), max_seqlen=max_seqlen)
        q, k = (t.transpose(1, 2).reshape(b * self.num_heads, q_len, -1) for t in (q, k))

        lr = F.softplus(self.lr_proj(hidden_states) + self.base_lr_inv)
        lr0, lr1, lr2 = self._fold(lr).chunk(3, dim=-1)
        momentum = self._fold(self.momentum_proj(hidden_states)) if self.use_momentum else None
        fw = self.ttt
        o = block_causal_swiglu_ttt(
            fw.w0.repeat(b, 1, 1), fw.w1.repeat(b, 1, 1), fw.w2.repeat(b, 1, 1),
            q, k, v, lr0, lr1, lr2, chunk_size=fw.chunk_size, use_muon=fw.use_muon,
            momentum=momentum, update_theta=fw.update_theta, weight_norm=fw.weight_norm,
            muon_steps=fw.muon_steps, ns_dtype=fw.ns_dtype, use_mlp=fw.use_mlp,
            use_lr=fw.use_lr, inner_loss=fw.inner_loss)
        return self.o_proj(self._unfold(self.ttt_norm(o), b))


__all__ = ["LaCTRotaryLayer", "RotaryEmbedding"]
