"""LaCT written the way its language-model release writes it: a compiled operator over folded heads.

The operator ``block_causal_swiglu_ttt`` takes tensors whose heads are already folded into the
batch (``[B·H, L, d]``), keeps the fast weights in the ``W @ x`` layout
(``f(x) = w1 @ (silu(w0 @ x) * (w2 @ x))``), reads each chunk with the weights left by the chunks
before it and then fits them to that chunk (shifted block causal); the last chunk is only read.
Outputs go into a preallocated buffer chunk by chunk, the SwiGLU backward is written by hand, and
Muon runs a five-step Newton–Schulz schedule in bf16, as released. The layer folds the heads
itself and hands the folded tensors to an operator submodule that owns the ``[H, dh, d]`` fast
weights and tiles them over the folded batch.

The simplified variants are switches of the same operator, written as the released variant code
writes them: ``use_mlp=False`` feeds the queries and keys straight into ``w1`` (a single linear
fast weight; ``w0`` and ``w2`` stay in the autograd graph at zero weight), and ``use_lr=False``
keeps the per-token rates in the graph but pins them to 1. ``inner_loss="mse"`` trains the fast
weights on ``0.5‖f(k) − v‖²`` instead of the binding score ``−⟨f(k), v⟩``, as the authors'
variant code does: the step follows ``v − f(k)`` where it followed ``v``, so it depends on the
fast weights it changes (a delta rule, not linear attention).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

#: Per-step (a, b, c) of the released Newton–Schulz iteration, a quintic tuned step by step.
NS_SCHEDULE = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)


@torch.compile()
def silu_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy`` times the derivative of ``silu`` at ``x`` (all [b, dh, l])."""
    s = torch.sigmoid(x)
    return dy * s * (1 + x * (1 - s))


@torch.compile()
def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Scale every row of ``x`` [b, l, d] to unit L2 norm (eps 1e-5), keeping its dtype."""
    dtype = x.dtype
    y = x / (x.norm(dim=-1, keepdim=True) + 1e-5)
    return y.type(dtype)


@torch.compile()
def orthogonalize(G: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16):
    """Push the singular values of each [m, n] matrix of ``G`` [b, m, n] towards one.

    Runs ``steps`` steps of the released schedule in ``dtype`` (bf16 as released; float64 gives
    an exact-arithmetic reference of the same function) and returns the result in that dtype.
    """
    X = G.to(dtype)
    wide = G.size(1) <= G.size(2)
    if not wide:
        X = X.transpose(1, 2)
    X = X / (X.norm(dim=(1, 2), keepdim=True) + 1e-7)      # spectral norm <= 1
    for a, b, c in NS_SCHEDULE[:steps]:
        A = X @ X.transpose(1, 2)
        P = b * A + c * A @ A
        X = a * X + P @ X
    if not wide:
        X = X.transpose(1, 2)
    return X


@torch.compile()
def block_causal_swiglu_ttt(
    w0: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lr0: torch.Tensor,
    lr1: torch.Tensor,
    lr2: torch.Tensor,
    chunk_size: int = 2048,
    use_muon: bool = True,
    momentum: torch.Tensor | None = None,
    update_theta: bool = True,
    weight_norm: bool = True,
    muon_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    use_mlp: bool = True,
    use_lr: bool = True,
    inner_loss: str = "dot",
) -> torch.Tensor:
    """Shifted block-causal test-time training of a SwiGLU fast-weight MLP.

    w0, w2: [b, dh, d]; w1: [b, d, dh]; q, k, v: [b, l, d] with b = batch·heads;
    lr0, lr1, lr2: [b, l, 1] per-token step sizes; momentum: [b, l, 1] or None (a chunk uses the
    mean over its tokens). Returns the output [b, l, d].
    use_mlp=False: only w1 [b, d, d] is used and trained, read straight from q and k (dh = d).
    use_lr=False: every step size is 1.
    inner_loss="mse": the loss 0.5‖f(k) − v‖², whose step follows v − f(k).
    """
    if not use_mlp:
        update_theta = False
    # row norms the weight normalisation restores after every step
    n0 = w0.norm(dim=2, keepdim=True)
    n1 = w1.norm(dim=2, keepdim=True)
    n2 = w2.norm(dim=2, keepdim=True)
    if momentum is not None:
        m0, m1, m2 = torch.zeros_like(w0), torch.zeros_like(w1), torch.zeros_like(w2)

    q = q.transpose(1, 2)                                    # [b, d, l]
    v = v.transpose(1, 2)                                    # [b, d, l]
    out = torch.zeros_like(v)                                # [b, d, l], written chunk by chunk

    seq_len = k.shape[1]
    end = 0
    for start in range(0, seq_len - chunk_size, chunk_size):
        end = start + chunk_size
        kc = k[:, start:end, :]                              # [b, c, d]
        vc = v[:, :, start:end]                              # [b, d, c]
        qc = q[:, :, start:end]                              # [b, d, c]
        if use_lr:
            lr0c = lr0[:, start:end, :]                      # [b, c, 1]
            lr1c = lr1[:, start:end, :]
            lr2c = lr2[:, start:end, :]
        else:
            # rates pinned to one; the lr projection stays in the graph
            lr0c = lr0[:, start:end, :] * 0.0 + 1.0
            lr1c = lr1[:, start:end, :] * 0.0 + 1.0
            lr2c = lr2[:, start:end, :] * 0.0 + 1.0

        if not use_mlp:
            # q and k are the hidden states of a single linear fast weight
            out[:, :, start:end] = torch.bmm(w1, qc)         # [b, d, c]
            hid = kc.transpose(1, 2)                         # [b, d, c]
        else:
            # read: the weights of the previous chunks applied to this chunk's queries
            up = torch.bmm(w2, qc)                           # [b, dh, c]
            gate = F.silu(torch.bmm(w0, qc), inplace=True)
            out[:, :, start:end] = torch.bmm(w1, gate * up)  # [b, d, c]

            # forward on the keys
            pre_gate = torch.bmm(w0, kc.transpose(1, 2))     # [b, dh, c]
            pre_up = torch.bmm(w2, kc.transpose(1, 2))       # [b, dh, c]
            act = F.silu(pre_gate, inplace=False)
            hid = act * pre_up
        if inner_loss == "mse":
            # 0.5‖f(k) − v‖²: the step follows v − f(k) where the binding score's follows v
            vc = vc - torch.bmm(w1, hid)                     # [b, d, c]
        if use_mlp:
            # backward of the loss, by hand
            d_hid = torch.bmm(w1.transpose(1, 2), vc)        # [b, dh, c]
            d_up = d_hid * act
            d_pre_gate = silu_grad(d_hid * pre_up, pre_gate)

        # per-token rates folded into the chunk sums: [b, d, c] @ [b, c, dh] -> [b, d, dh]
        g1 = torch.bmm(vc, (hid.transpose(1, 2) * lr1c).type_as(vc))
        if update_theta:
            g0 = torch.bmm(d_pre_gate, (kc * lr0c).type_as(d_pre_gate))   # [b, dh, d]
            g2 = torch.bmm(d_up, (kc * lr2c).type_as(d_up))

        if momentum is not None:
            beta = momentum[:, start:end, :].mean(dim=1, keepdim=True)     # [b, 1, 1]
            g1 = g1 + m1 * beta
            m1 = g1
            if update_theta:
                g0 = g0 + m0 * beta
                g2 = g2 + m2 * beta
                m0, m2 = g0, g2

        if use_muon:
            g1 = orthogonalize(g1, muon_steps, ns_dtype)
            if update_theta:
                g0 = orthogonalize(g0, muon_steps, ns_dtype)
                g2 = orthogonalize(g2, muon_steps, ns_dtype)

        w1 = w1 + g1
        if update_theta:
            w0 = w0 + g0
            w2 = w2 + g2

        if weight_norm:
            w1 = w1 / (w1.norm(dim=2, keepdim=True) + 1e-5) * n1
            if update_theta:
                w0 = w0 / (w0.norm(dim=2, keepdim=True) + 1e-5) * n0
                w2 = w2 / (w2.norm(dim=2, keepdim=True) + 1e-5) * n2

    # the last chunk is read, never trained on
    qc = q[:, :, end:seq_len]
    if not use_mlp:
        out[:, :, end:seq_len] = torch.bmm(w1, qc)
        # w0 and w2 take no part; keep them in the graph so they still get (zero) gradients
        return out.transpose(1, 2) + w0.sum() * 0.0 + w2.sum() * 0.0
    up = torch.bmm(w2, qc)
    gate = F.silu(torch.bmm(w0, qc), inplace=True)
    out[:, :, end:seq_len] = torch.bmm(w1, gate * up)
    return out.transpose(1, 2)                               # [b, l, d]


class SwiGLUFastWeights(nn.Module):
    """The test-time-trained SwiGLU of every head; called with heads already folded into the batch.

    Owns ``w0, w2: [H, dh, d]`` and ``w1: [H, d, dh]`` and tiles them over the folded batch, so the
    folded batch must be a multiple of ``num_heads``. With ``mlp=False`` dh is d and only ``w1``
    is trained; ``w0`` and ``w2`` are kept, unused, as the released variant code keeps them.
    """

    def __init__(self, num_heads: int, head_dim: int, inter_dim: int, chunk_size: int, *,
                 update_theta: bool = True, weight_norm: bool = True, muon: bool = True,
                 muon_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16, mlp: bool = True,
                 per_token_lr: bool = True, inner_loss: str = "dot"):
        super().__init__()
        if inner_loss not in ("dot", "mse"):
            raise ValueError(f"inner_loss must be 'dot' or 'mse', got {inner_loss!r}")
        self.num_heads = num_heads
        self.inner_loss = inner_loss
        self.chunk_size = chunk_size
        self.update_theta, self.weight_norm = update_theta, weight_norm
        self.use_muon, self.muon_steps, self.ns_dtype = muon, muon_steps, ns_dtype
        self.use_mlp, self.use_lr = mlp, per_token_lr
        if not mlp:
            inter_dim = head_dim
        self.w0 = nn.Parameter(torch.randn(num_heads, inter_dim, head_dim) / math.sqrt(head_dim))
        self.w1 = nn.Parameter(torch.randn(num_heads, head_dim, inter_dim) / math.sqrt(inter_dim))
        self.w2 = nn.Parameter(torch.randn(num_heads, inter_dim, head_dim) / math.sqrt(head_dim))

    def forward(self, q, k, v, lr0, lr1, lr2, momentum=None):
        """q, k, v: [B·H, L, d]; lr*: [B·H, L, 1]; momentum: [B·H, L, 1] or None -> [B·H, L, d]."""
        copies = q.shape[0] // self.num_heads
        w0 = self.w0.repeat(copies, 1, 1)                    # [H, dh, d] -> [B·H, dh, d]
        w1 = self.w1.repeat(copies, 1, 1)
        w2 = self.w2.repeat(copies, 1, 1)
        return block_causal_swiglu_ttt(
            w0, w1, w2, q, k, v, lr0, lr1, lr2,
            chunk_size=self.chunk_size, use_muon=self.use_muon, momentum=momentum,
            update_theta=self.update_theta, weight_norm=self.weight_norm,
            muon_steps=self.muon_steps, ns_dtype=self.ns_dtype, use_mlp=self.use_mlp,
            use_lr=self.use_lr, inner_loss=self.inner_loss)


class LaCTPublishedLayer(nn.Module):
    """Causal LaCT layer (no window attention) in the style of its released language model.

    Constructor keywords match ``LaCTFoldedLayer``; ``ns_dtype`` is the dtype Newton–Schulz runs in
    (bf16 as released). ``lr_proj`` channels are grouped per head: ``[lr0, lr1, lr2]`` of head 0,
    then of head 1, ... — all three kept whatever the switches, as in the released variants.
    """

    def __init__(self, d_model, num_heads, chunk_size, *, inter_dim=None, update_theta=True,
                 weight_norm=True, momentum=True, muon=True, base_lr=1e-2, muon_steps=5,
                 ns_dtype=torch.bfloat16, mlp=True, per_token_lr=True, inner_loss="dot"):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.chunk_size = chunk_size
        self.use_momentum = momentum
        self.base_lr_inv = base_lr + math.log(-math.expm1(-base_lr))   # softplus^-1(base_lr)

        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.lr_proj = nn.Linear(d_model, 3 * num_heads, bias=False)
        if momentum:
            self.momentum_proj = nn.Sequential(nn.Linear(d_model, num_heads, bias=False),
                                               nn.Sigmoid())
        self.ttt = SwiGLUFastWeights(num_heads, self.head_dim, inter_dim or self.head_dim,
                                     chunk_size, update_theta=update_theta,
                                     weight_norm=weight_norm, muon=muon, muon_steps=muon_steps,
                                     ns_dtype=ns_dtype, mlp=mlp, per_token_lr=per_token_lr,
                                     inner_loss=inner_loss)
        self.ttt_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def _fold(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s, H·d] -> [b·H, s, d]."""
        b, s, _ = t.shape
        return t.view(b, s, self.num_heads, -1).permute(0, 2, 1, 3).reshape(b * self.num_heads, s, -1)

    def _unfold(self, t: torch.Tensor, b: int) -> torch.Tensor:
        """[b·H, s, d] -> [b, s, H·d]."""
        _, s, d = t.shape
        return t.view(b, self.num_heads, s, d).permute(0, 2, 1, 3).reshape(b, s, -1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [b, s, d_model] -> [b, s, d_model]."""
        b = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        q, k, v = (F.silu(self._fold(t)) for t in (q, k, v))
        q, k = unit_rows(q), unit_rows(k)

        lr = F.softplus(self.lr_proj(hidden_states) + self.base_lr_inv)    # [b, s, H·3]
        lr0, lr1, lr2 = self._fold(lr).chunk(3, dim=-1)                     # [b·H, s, 1] each
        momentum = self._fold(self.momentum_proj(hidden_states)) if self.use_momentum else None

        o = self.ttt(q, k, v, lr0, lr1, lr2, momentum)                     # [b·H, s, d]
        return self.o_proj(self._unfold(self.ttt_norm(o), b))


__all__ = ["LaCTPublishedLayer", "SwiGLUFastWeights", "block_causal_swiglu_ttt", "orthogonalize",
           "NS_SCHEDULE"]
