"""LaCT (Large-Chunk Test-Time Training) layer with a SwiGLU fast-weight network, heads folded into the batch.

Fast weights use the ``W @ x`` convention: ``f(x) = w1 @ (silu(w0 @ x) * (w2 @ x))`` for a column ``x``.
The chunk loop is "apply then update" (shifted block causal): chunk j reads the fast weights left by
chunks < j, and the last chunk is only applied.  The backward pass through the SwiGLU is written out by hand.
With ``mlp=False`` the fast weight is one bias-free linear map, ``f(x) = w1 @ x`` (``block_causal_lact_linear``),
and with ``per_token_lr=False`` every learning rate is the constant 1.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def silu_backprop(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Gradient of ``silu`` at ``x`` times the upstream gradient ``dy``."""
    sigma = torch.sigmoid(x)
    return dy * sigma * (1 + x * (1 - sigma))


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz iteration that pushes every singular value of each matrix in ``G`` towards 1.

    G: [b, m, n]; runs in fp32 (fp64 stays fp64) and returns G's dtype.
    """
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G if G.dtype == torch.float64 else G.float()
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.transpose(-2, -1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(-2, -1)
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.transpose(-2, -1)
    return X.to(G.dtype)


def block_causal_lact_swiglu(
    w0: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lr0: torch.Tensor,
    lr1: torch.Tensor,
    lr2: torch.Tensor,
    momentum: torch.Tensor = None,
    chunk_size: int = 2048,
    update_theta: bool = True,
    weight_norm: bool = True,
    use_muon: bool = True,
    muon_steps: int = 5,
    return_final_state: bool = False,
):
    """Shifted block-causal LaCT: apply the fast weights to each chunk, then take one TTT step on it.

    w0, w2: [b, dh, d]   w1: [b, d, dh]     (b = batch * heads, dh = intermediate dim)
    q, k, v: [b, l, d]
    lr0, lr1, lr2: [b, l, 1]   per-token learning rate of w0, w1, w2 (all None: a constant rate of 1)
    momentum: [b, l, 1] or None   per-token momentum; each chunk uses its mean
    Returns the output [b, l, d] (and the final (w0, w1, w2) if ``return_final_state``).
    """
    # weight norm rescales rows back to the norms of the fast weights we started from
    w0_norm = w0.norm(dim=2, keepdim=True)
    w1_norm = w1.norm(dim=2, keepdim=True)
    w2_norm = w2.norm(dim=2, keepdim=True)

    if momentum is not None:
        dw0_momentum = torch.zeros_like(w0)
        dw1_momentum = torch.zeros_like(w1)
        dw2_momentum = torch.zeros_like(w2)

    q = q.transpose(1, 2)  # [b, d, l]
    v = v.transpose(1, 2)  # [b, d, l]

    output = torch.zeros_like(v)

    e_index = 0
    seq_len = k.shape[1]
    for i in range(0, seq_len - chunk_size, chunk_size):
        s_index = i
        e_index = s_index + chunk_size

        ki = k[:, s_index:e_index, :]  # [b, l, d]
        vi = v[:, :, s_index:e_index]  # [b, d, l]
        qi = q[:, :, s_index:e_index]  # [b, d, l]
        if lr1 is not None:
            lr0i = lr0[:, s_index:e_index, :]  # [b, l, 1]
            lr1i = lr1[:, s_index:e_index, :]
            lr2i = lr2[:, s_index:e_index, :]
        else:
            # constant learning rate: the plain gradient step
            lr0i = lr1i = lr2i = 1.0

        # apply the current fast weights: [b, dh, d] @ [b, d, l] -> [b, dh, l]
        h = torch.bmm(w2, qi)
        gate = F.silu(torch.bmm(w0, qi))
        output[:, :, s_index:e_index] = torch.bmm(w1, gate * h)

        # forward on the keys, keeping what the backward needs
        gate_before_act = torch.bmm(w0, ki.transpose(1, 2))  # [b, dh, l]
        hidden_before_mul = torch.bmm(w2, ki.transpose(1, 2))  # [b, dh, l]
        hidden = F.silu(gate_before_act) * hidden_before_mul

        # backward of <f(k), v> by hand
        dhidden = torch.bmm(w1.transpose(1, 2), vi)  # [b, dh, l]
        dhidden_before_mul = dhidden * F.silu(gate_before_act)
        dgate = dhidden * hidden_before_mul
        dgate_before_act = silu_backprop(dgate, gate_before_act)

        # [b, d, l] @ [b, l, dh] -> [b, d, dh]
        dw1 = torch.bmm(vi, hidden.transpose(1, 2) * lr1i)
        if update_theta:
            # [b, dh, l] @ [b, l, d] -> [b, dh, d]
            dw0 = torch.bmm(dgate_before_act, ki * lr0i)
            dw2 = torch.bmm(dhidden_before_mul, ki * lr2i)

        if momentum is not None:
            m_i = momentum[:, s_index:e_index, :].mean(dim=1, keepdim=True)  # [b, 1, 1]
            dw1 = dw1 + dw1_momentum * m_i
            dw1_momentum = dw1
            if update_theta:
                dw0 = dw0 + dw0_momentum * m_i
                dw2 = dw2 + dw2_momentum * m_i
                dw0_momentum = dw0
                dw2_momentum = dw2

        if use_muon:
            dw1 = zeropower_via_newtonschulz5(dw1, muon_steps)
            if update_theta:
                dw0 = zeropower_via_newtonschulz5(dw0, muon_steps)
                dw2 = zeropower_via_newtonschulz5(dw2, muon_steps)

        w1 = w1 + dw1
        if update_theta:
            w0 = w0 + dw0
            w2 = w2 + dw2

        if weight_norm:
            w1 = w1 / (w1.norm(dim=2, keepdim=True) + 1e-5) * w1_norm
            if update_theta:
                w0 = w0 / (w0.norm(dim=2, keepdim=True) + 1e-5) * w0_norm
                w2 = w2 / (w2.norm(dim=2, keepdim=True) + 1e-5) * w2_norm

    # the last chunk is only applied
    s_index = e_index
    e_index = seq_len
    qi = q[:, :, s_index:e_index]
    h = torch.bmm(w2, qi)
    gate = F.silu(torch.bmm(w0, qi))
    output[:, :, s_index:e_index] = torch.bmm(w1, gate * h)

    output = output.transpose(1, 2)  # [b, l, d]
    if return_final_state:
        return output, (w0, w1, w2)
    return output


def block_causal_lact_linear(
    w1: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lr1: torch.Tensor = None,
    momentum: torch.Tensor = None,
    chunk_size: int = 2048,
    weight_norm: bool = True,
    use_muon: bool = True,
    muon_steps: int = 5,
):
    """Shifted block-causal LaCT with a single linear fast weight: ``f(x) = w1 @ x``, no hidden layer.

    The keys and queries go straight into ``w1``, so the gradient of ``-<w1 k, v>`` is ``-v k^T``.
    w1: [b, d, d]   q, k, v: [b, l, d]   lr1: [b, l, 1] or None (constant rate 1)
    momentum: [b, l, 1] or None.  Returns the output [b, l, d].
    """
    if weight_norm:
        w1_norm = w1.norm(dim=2, keepdim=True)
    if momentum is not None:
        dw1_momentum = torch.zeros_like(w1)

    q = q.transpose(1, 2)  # [b, d, l]
    v = v.transpose(1, 2)  # [b, d, l]
    output = torch.zeros_like(v)

    e_index = 0
    seq_len = k.shape[1]
    for i in range(0, seq_len - chunk_size, chunk_size):
        s_index = i
        e_index = s_index + chunk_size

        ki = k[:, s_index:e_index, :]  # [b, l, d]
        vi = v[:, :, s_index:e_index]  # [b, d, l]
        qi = q[:, :, s_index:e_index]  # [b, d, l]

        # apply: the query itself is the hidden state
        output[:, :, s_index:e_index] = torch.bmm(w1, qi)

        # [b, d, l] @ [b, l, d] -> [b, d, d]
        if lr1 is not None:
            dw1 = torch.bmm(vi, ki * lr1[:, s_index:e_index, :])
        else:
            dw1 = torch.bmm(vi, ki)

        if momentum is not None:
            m_i = momentum[:, s_index:e_index, :].mean(dim=1, keepdim=True)  # [b, 1, 1]
            dw1 = dw1 + dw1_momentum * m_i
            dw1_momentum = dw1

        if use_muon:
            dw1 = zeropower_via_newtonschulz5(dw1, muon_steps)

        w1 = w1 + dw1

        if weight_norm:
            w1 = w1 / (w1.norm(dim=2, keepdim=True) + 1e-5) * w1_norm

    # the last chunk is only applied
    qi = q[:, :, e_index:seq_len]
    output[:, :, e_index:seq_len] = torch.bmm(w1, qi)
    return output.transpose(1, 2)  # [b, l, d]


class LaCTFoldedLayer(nn.Module):
    """LaCT layer for causal language modelling: SwiGLU fast weights trained per chunk at test time.

    ``lr_proj`` outputs 3 * num_heads channels ordered ``[lr0 (heads...), lr1 (heads...), lr2 (heads...)]``,
    the per-token learning rates of ``w0``, ``w1`` and ``w2``.  ``mlp=False`` replaces the SwiGLU by one linear
    fast weight ``w1: [H, d, d]`` (no ``w0``/``w2``; ``lr_proj`` then has num_heads channels, and ``inter_dim``
    is unused); ``per_token_lr=False`` drops ``lr_proj`` and steps with a constant rate of 1.
    """

    def __init__(
        self,
        d_model,
        num_heads,
        chunk_size,
        *,
        inter_dim=None,
        update_theta=True,
        weight_norm=True,
        momentum=True,
        muon=True,
        base_lr=1e-2,
        muon_steps=5,
        mlp=True,
        per_token_lr=True,
    ):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.inter_dim = inter_dim or self.head_dim
        self.chunk_size = chunk_size
        self.update_theta = update_theta
        self.weight_norm = weight_norm
        self.use_momentum = momentum
        self.use_muon = muon
        self.muon_steps = muon_steps
        self.mlp = mlp
        self.per_token_lr = per_token_lr

        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        if per_token_lr:
            self.lr_proj = nn.Linear(d_model, (3 if mlp else 1) * num_heads, bias=False)
            self.base_lr_inv = math.log(math.exp(base_lr) - 1)  # softplus^-1(base_lr)
        if momentum:
            self.momentum_proj = nn.Linear(d_model, num_heads, bias=False)

        if mlp:
            self.w0 = nn.Parameter(torch.randn(num_heads, self.inter_dim, self.head_dim) / math.sqrt(self.head_dim))
            self.w1 = nn.Parameter(torch.randn(num_heads, self.head_dim, self.inter_dim) / math.sqrt(self.inter_dim))
            self.w2 = nn.Parameter(torch.randn(num_heads, self.inter_dim, self.head_dim) / math.sqrt(self.head_dim))
        else:
            self.w1 = nn.Parameter(torch.randn(num_heads, self.head_dim, self.head_dim) / math.sqrt(self.head_dim))

        self.o_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def _fold_heads(self, t):
        # [B, L, H*d] -> [B*H, L, d]
        B, L, _ = t.shape
        return t.reshape(B, L, self.num_heads, -1).transpose(1, 2).reshape(B * self.num_heads, L, -1)

    def forward(self, x):
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, _ = x.shape
        H = self.num_heads

        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = F.normalize(F.silu(self._fold_heads(q)), dim=-1)
        k = F.normalize(F.silu(self._fold_heads(k)), dim=-1)
        v = self._fold_heads(v)

        if self.per_token_lr:
            lr = F.softplus(self.lr_proj(x) + self.base_lr_inv)  # [B, L, 3H] (or [B, L, H] without the MLP)
            lrs = [self._fold_heads(t) for t in lr.chunk(3 if self.mlp else 1, dim=-1)]  # [B*H, L, 1] each
        else:
            lrs = [None, None, None] if self.mlp else [None]

        if self.use_momentum:
            momentum = self._fold_heads(torch.sigmoid(self.momentum_proj(x)))  # [B*H, L, 1]
        else:
            momentum = None

        w1 = self.w1.repeat(B, 1, 1)
        if self.mlp:
            w0 = self.w0.repeat(B, 1, 1)
            w2 = self.w2.repeat(B, 1, 1)
            o = block_causal_lact_swiglu(
                w0, w1, w2, q, k, v, *lrs, momentum,
                chunk_size=self.chunk_size,
                update_theta=self.update_theta,
                weight_norm=self.weight_norm,
                use_muon=self.use_muon,
                muon_steps=self.muon_steps,
            )  # [B*H, L, d]
        else:
            o = block_causal_lact_linear(
                w1, q, k, v, lrs[0], momentum,
                chunk_size=self.chunk_size,
                weight_norm=self.weight_norm,
                use_muon=self.use_muon,
                muon_steps=self.muon_steps,
            )  # [B*H, L, d]

        # per-head RMSNorm
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.o_norm_weight

        o = o.reshape(B, H, L, self.head_dim).transpose(1, 2).reshape(B, L, self.d_model)
        return self.o_proj(o)
