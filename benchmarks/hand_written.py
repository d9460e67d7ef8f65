"""LaCT's variant 2 written by hand as a plain loop: the yardstick a conversion has to beat.

Variant 2 freezes Θ = (W0, W2) and drops the weight norm, so only W1 learns and the SwiGLU
features φ(x) = silu(x W0ᵀ) ⊙ (x W2ᵀ) are the same for every chunk. Written by hand, the best
equivalent computes the features of the whole sequence once, then loops over chunks: read the
chunk with the current W1, add its increment (momentum, Newton–Schulz) — fp32, all heads of all
sequences in one batched matmul, nothing kept for autograd under ``no_grad``. The projections
around the core are the layer's own modules, so the function is the layer's variant 2.

Newton–Schulz constants are written out here, as each layer style publishes them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Muon's classic quintic (a, b, c), used at every step (``LaCTFoldedLayer``).
CLASSIC = ((3.4445, -4.7750, 2.0315),)
#: LaCT's released per-step schedule (``LaCTPublishedLayer``).
RELEASED = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))


def newton_schulz(G: torch.Tensor, schedule, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """``steps`` quintic steps on every matrix of ``G`` [b, m, n] in ``dtype``, step s using
    ``schedule[s]`` (the last triple repeats); returns ``G``'s dtype."""
    X = G.to(dtype)
    tall = G.size(1) > G.size(2)
    if tall:
        X = X.transpose(1, 2)
    X = X / (X.norm(dim=(1, 2), keepdim=True) + 1e-7)
    for s in range(steps):
        a, b, c = schedule[min(s, len(schedule) - 1)]
        A = X @ X.transpose(1, 2)
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.transpose(1, 2)
    return X.to(G.dtype)


def variant2_loop(w0, w1, w2, q, k, v, lr1, momentum, chunk: int, muon) -> torch.Tensor:
    """Shifted block-causal variant 2 on folded heads; ``muon`` is None or (schedule, steps, dtype).

    w0, w2: [b, dh, d]; w1: [b, d, dh]; q, k, v: [b, l, d]; lr1, momentum: [b, l, 1] (momentum
    may be None). Chunk j is read with the W1 left by chunks < j; the last chunk only reads.
    """
    L = q.shape[1]
    updates = max(0, -(-L // chunk) - 1)
    U = updates * chunk
    phi_q = F.silu(q @ w0.transpose(1, 2)) * (q @ w2.transpose(1, 2))               # [b, l, dh]
    k_u = k[:, :U]
    scaled_phi_k = F.silu(k_u @ w0.transpose(1, 2)) * (k_u @ w2.transpose(1, 2)) * lr1[:, :U]
    v_t = v.transpose(1, 2)                                                        # [b, d, l]
    out = torch.empty(q.shape[0], L, w1.shape[1], dtype=q.dtype, device=q.device)
    velocity = None
    for j in range(updates):
        s, e = j * chunk, (j + 1) * chunk
        out[:, s:e] = phi_q[:, s:e] @ w1.transpose(1, 2)
        g = torch.bmm(v_t[:, :, s:e], scaled_phi_k[:, s:e])                        # [b, d, dh]
        if momentum is not None:
            beta = momentum[:, s:e].mean(dim=1, keepdim=True)                      # [b, 1, 1]
            g = g if velocity is None else g + velocity * beta
            velocity = g
        if muon is not None:
            g = newton_schulz(g, *muon)
        w1 = w1 + g
    out[:, U:] = phi_q[:, U:] @ w1.transpose(1, 2)
    return out


class HandWrittenVariant2(nn.Module):
    """The variant-2 function of a LaCT zoo layer (folded or published style), core by hand.

    Holds the layer (its projections and fast weights are used as they are); ``forward`` takes
    and returns what the layer does.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.published = hasattr(layer, "ttt")

    def _muon(self):
        core = self.layer.ttt if self.published else self.layer
        if not core.use_muon:
            return None
        if self.published:
            return RELEASED, core.muon_steps, getattr(core, "ns_dtype", torch.bfloat16)
        return CLASSIC, core.muon_steps, torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._published(x) if self.published else self._folded(x)

    def _folded(self, x):
        m, B, H = self.layer, x.shape[0], self.layer.num_heads
        q, k, v = m.qkv(x).chunk(3, dim=-1)
        q = F.normalize(F.silu(m._fold_heads(q)), dim=-1)
        k = F.normalize(F.silu(m._fold_heads(k)), dim=-1)
        lr1 = m._fold_heads(F.softplus(m.lr_proj(x) + m.base_lr_inv).chunk(3, dim=-1)[1])
        momentum = m._fold_heads(torch.sigmoid(m.momentum_proj(x))) if m.use_momentum else None
        o = variant2_loop(m.w0.repeat(B, 1, 1), m.w1.repeat(B, 1, 1), m.w2.repeat(B, 1, 1),
                          q, k, m._fold_heads(v), lr1, momentum, m.chunk_size, self._muon())
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * m.o_norm_weight
        L = x.shape[1]
        return m.o_proj(o.reshape(B, H, L, m.head_dim).transpose(1, 2).reshape(B, L, -1))

    def _published(self, x):
        m, B = self.layer, x.shape[0]
        q, k, v = (F.silu(m._fold(t)) for t in m.qkv(x).chunk(3, dim=-1))
        q, k = (t / (t.norm(dim=-1, keepdim=True) + 1e-5) for t in (q, k))
        lr1 = m._fold(F.softplus(m.lr_proj(x) + m.base_lr_inv)).chunk(3, dim=-1)[1]
        momentum = m._fold(m.momentum_proj(x)) if m.use_momentum else None
        core = m.ttt
        copies = q.shape[0] // core.num_heads
        o = variant2_loop(core.w0.repeat(copies, 1, 1), core.w1.repeat(copies, 1, 1),
                          core.w2.repeat(copies, 1, 1), q, k, v, lr1, momentum,
                          core.chunk_size, self._muon())
        return m.o_proj(m._unfold(m.ttt_norm(o), B))
