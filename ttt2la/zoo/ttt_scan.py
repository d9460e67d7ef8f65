"""TTT layers written as a scan over pre-chunked mini-batches, the style of TTT-Linear's and
TTT-MLP's published PyTorch code.

The sequence is cut into ``n = L // K`` mini-batches of ``K`` tokens by a reshape, every input
is laid out mini-batch first (``[n, B, H, K, f]``), and ``scan(step, carry, xs, out)`` — a
stand-in for ``jax.lax.scan`` — runs ``carry, y = step(carry, xs[i])`` and writes ``out[i] = y``
into a preallocated buffer. The ``L % K`` remaining tokens are one more call of the same
``ttt`` with mini-batch size ``L % K``, starting from the fast weights the scan left; the
weights that call leaves are dropped.

Inside a mini-batch the fast weights are read in their *dual form*: token ``t`` sees
``W_t = W − Σ_{s≤t} η_ts k_sᵀ ∇_s``, with every gradient ``∇_s`` taken at the mini-batch's
starting weights ``W`` and ``η_ts = scale_t · lr_s`` (a learnable per-position scale times a
per-token rate); the next mini-batch starts from the last token's weights.

* ``ScanTTTLinearLayer``: ``f(x) = LN(x W + b)``, reconstruction loss
  ``½‖f(k) − (v − k)‖²``, output ``q + LN(q W_t + b_t)`` (TTT-Linear);
* ``ScanTTTMLPLayer``: ``f(x) = LN(gelu(x W1 + b1) W2 + b2)``, the same loss (TTT-MLP).

Both take the layer norm's backward by hand. The norm sits inside the loss and after the final
layer, outside the paper's theorem, so ttt2la must refuse them, naming the norm.

* ``ScanLinearTTTLayer``: ``f(x) = x W`` with the dot-product binding loss ``−⟨f(k), v⟩``: its
  gradient does not read ``W``, so the layer is causal linear attention with per-token rates
  and converts exactly.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def scan(step, carry, xs: dict, out: torch.Tensor):
    """``carry, out[i] = step(carry, {name: x[i]})`` for every mini-batch ``i``, in order."""
    count = len(next(iter(xs.values())))
    for i in range(count):
        carry, y = step(carry, {name: x[i] for name, x in xs.items()})
        out[i] = y
    return carry, out


def layer_norm(z, weight, bias, eps: float = 1e-6):
    """Layer norm over the last axis, written out, with per-head ``weight`` and ``bias``."""
    centred = z - z.mean(dim=-1, keepdim=True)
    std = torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps)
    return weight * (centred / std) + bias


def layer_norm_l2_grad(z, target, weight, bias, eps: float = 1e-6):
    """``∂/∂z ½‖layer_norm(z) − target‖²``, the backward of the reconstruction loss by hand."""
    centred = z - z.mean(dim=-1, keepdim=True)
    std = torch.sqrt((centred * centred).mean(dim=-1, keepdim=True) + eps)
    z_hat = centred / std
    g = (weight * z_hat + bias - target) * weight
    g_mean = g.mean(dim=-1, keepdim=True)
    return (g - g_mean - z_hat * (g * z_hat).mean(dim=-1, keepdim=True)) / std


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_slope(x):
    """The derivative of the tanh approximation of GELU."""
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)
    t = torch.tanh(u)
    du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def dual_form_rates(scale, lr):
    """``(η, η_last)``: ``η_ts = scale_t·lr_s`` masked causally ``[.., K, K]``, and the last
    token's rates as a column ``[.., K, 1]`` (what the next mini-batch's weights are made of)."""
    eta = scale[:, None] * lr.transpose(-1, -2)
    return torch.tril(eta), eta[..., -1:, :].transpose(-1, -2)


class _ScanTTTBase(nn.Module):
    """Projections, the mini-batch scan and the remainder call; subclasses hold the fast
    weights (``initial``) and one mini-batch's dual-form step (``mini_batch``)."""

    def __init__(self, d_model: int, num_heads: int, mini_batch_size: int, *,
                 base_lr: float = 1.0) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.width, self.num_heads, self.mini_batch_size = d_model, num_heads, mini_batch_size
        self.head_dim = d_model // num_heads
        self.base_lr = base_lr
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.lr_weight = nn.Parameter(torch.randn(num_heads, d_model) * 0.02)
        self.lr_bias = nn.Parameter(torch.zeros(num_heads, 1))
        self.register_buffer("position_rate", 1.0 / torch.arange(1, mini_batch_size + 1),
                             persistent=False)
        self.position_offset = nn.Parameter(torch.zeros(mini_batch_size))
        self.post_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def initial(self, batch: int) -> dict:
        raise NotImplementedError

    def mini_batch(self, params: dict, x: dict, scale: torch.Tensor):
        raise NotImplementedError

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, L, H·f] -> [B, H, L, f]."""
        B, L, _ = t.shape
        return t.reshape(B, L, self.num_heads, -1).transpose(1, 2)

    def ttt(self, inputs: dict, size: int, params: dict):
        """Mini-batches of ``size`` tokens of ``inputs`` ([B, H, n·size, ·]) through the scan:
        returns the outputs [B, n·size, H·f] and the weights the last mini-batch leaves."""
        B, H, L, f = inputs["q"].shape
        n = L // size
        xs = {name: t.reshape(B, H, n, size, t.shape[-1]).permute(2, 0, 1, 3, 4)
              for name, t in inputs.items()}
        scale = torch.clamp_min(self.position_rate[:size] + self.position_offset[:size], 0.0)
        out = torch.empty(n, B, H, size, f, dtype=inputs["q"].dtype, device=inputs["q"].device)

        def step(carry, x):
            return self.mini_batch(carry, x, scale)

        params, out = scan(step, params, xs, out)
        return out.permute(1, 0, 3, 2, 4).reshape(B, n * size, H * f), params

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, _ = x.shape
        K = self.mini_batch_size
        n, rest = divmod(L, K)
        lr = torch.einsum("bld,hd->bhl", x, self.lr_weight) + self.lr_bias
        lr = (self.base_lr / self.head_dim) * torch.sigmoid(lr).unsqueeze(-1)    # [B, H, L, 1]
        seq = {"q": self.heads(self.q_proj(x)), "k": self.heads(self.k_proj(x)),
               "v": self.heads(self.v_proj(x)), "lr": lr}
        params = self.initial(B)
        outs = []
        if n > 0:
            y, params = self.ttt({k: t[:, :, :n * K] for k, t in seq.items()}, K, params)
            outs.append(y)
        if rest > 0:
            y, _ = self.ttt({k: t[:, :, -rest:] for k, t in seq.items()}, rest, params)
            outs.append(y)
        y = torch.cat(outs, dim=1)
        return self.o_proj(self.post_norm(y))


def _tiled(p: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.tile(p.unsqueeze(0), (batch,) + (1,) * p.dim())


class ScanTTTLinearLayer(_ScanTTTBase):
    """TTT-Linear as a scan: ``f(x) = LN(x W + b)``; see the module docstring."""

    def __init__(self, d_model: int, num_heads: int, mini_batch_size: int, **kw) -> None:
        super().__init__(d_model, num_heads, mini_batch_size, **kw)
        f = self.head_dim
        self.W = nn.Parameter(torch.randn(num_heads, f, f) * 0.02)
        self.b = nn.Parameter(torch.zeros(num_heads, 1, f))
        self.ln_weight = nn.Parameter(torch.ones(num_heads, 1, f))
        self.ln_bias = nn.Parameter(torch.zeros(num_heads, 1, f))

    def initial(self, batch):
        return {"W": _tiled(self.W, batch), "b": _tiled(self.b, batch)}

    def mini_batch(self, params, x, scale):
        W, b = params["W"], params["b"]
        q, k, v = x["q"], x["k"], x["v"]
        causal, last = dual_form_rates(scale, x["lr"])
        grad_z = layer_norm_l2_grad(k @ W + b, v - k, self.ln_weight, self.ln_bias)
        z_bar = q @ W - (causal * (q @ k.transpose(-1, -2))) @ grad_z + b - causal @ grad_z
        W = W - (last * k).transpose(-1, -2) @ grad_z
        b = b - (last * grad_z).sum(dim=-2, keepdim=True)
        return {"W": W, "b": b}, q + layer_norm(z_bar, self.ln_weight, self.ln_bias)


class ScanTTTMLPLayer(_ScanTTTBase):
    """TTT-MLP as a scan: ``f(x) = LN(gelu(x W1 + b1) W2 + b2)``; see the module docstring."""

    def __init__(self, d_model: int, num_heads: int, mini_batch_size: int, *,
                 expansion: int = 4, **kw) -> None:
        super().__init__(d_model, num_heads, mini_batch_size, **kw)
        f, m = self.head_dim, expansion * self.head_dim
        self.W1 = nn.Parameter(torch.randn(num_heads, f, m) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(num_heads, 1, m))
        self.W2 = nn.Parameter(torch.randn(num_heads, m, f) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(num_heads, 1, f))
        self.ln_weight = nn.Parameter(torch.ones(num_heads, 1, f))
        self.ln_bias = nn.Parameter(torch.zeros(num_heads, 1, f))

    def initial(self, batch):
        return {name: _tiled(getattr(self, name), batch) for name in ("W1", "b1", "W2", "b2")}

    def mini_batch(self, params, x, scale):
        W1, b1, W2, b2 = params["W1"], params["b1"], params["W2"], params["b2"]
        q, k, v = x["q"], x["k"], x["v"]
        causal, last = dual_form_rates(scale, x["lr"])
        z1 = k @ W1 + b1
        h = F.gelu(z1, approximate="tanh")
        grad_z2 = layer_norm_l2_grad(h @ W2 + b2, v - k, self.ln_weight, self.ln_bias)
        grad_z1 = (grad_z2 @ W2.transpose(-1, -2)) * gelu_slope(z1)
        z1_bar = q @ W1 - (causal * (q @ k.transpose(-1, -2))) @ grad_z1 + b1 - causal @ grad_z1
        h_bar = F.gelu(z1_bar, approximate="tanh")
        z2_bar = h_bar @ W2 - (causal * (h_bar @ h.transpose(-1, -2))) @ grad_z2 \
            + b2 - causal @ grad_z2
        W1 = W1 - (last * k).transpose(-1, -2) @ grad_z1
        b1 = b1 - (last * grad_z1).sum(dim=-2, keepdim=True)
        W2 = W2 - (last * h).transpose(-1, -2) @ grad_z2
        b2 = b2 - (last * grad_z2).sum(dim=-2, keepdim=True)
        new = {"W1": W1, "b1": b1, "W2": W2, "b2": b2}
        return new, q + layer_norm(z2_bar, self.ln_weight, self.ln_bias)


class ScanLinearTTTLayer(_ScanTTTBase):
    """A scan with a linear fast weight and the dot-product loss: ``f(x) = x W``,
    ``∇_s = −v_s``, so ``o_t = q_t W + Σ_{s≤t} η_ts (q_t·k_s) v_s`` — linear attention."""

    def __init__(self, d_model: int, num_heads: int, mini_batch_size: int, **kw) -> None:
        super().__init__(d_model, num_heads, mini_batch_size, **kw)
        f = self.head_dim
        self.W = nn.Parameter(torch.randn(num_heads, f, f) * f ** -0.5)

    def initial(self, batch):
        return {"W": _tiled(self.W, batch)}

    def mini_batch(self, params, x, scale):
        W = params["W"]
        q, k, v = x["q"], x["k"], x["v"]
        causal, last = dual_form_rates(scale, x["lr"])
        z_bar = q @ W + (causal * (q @ k.transpose(-1, -2))) @ v
        W = W + (last * k).transpose(-1, -2) @ v
        return {"W": W}, q + z_bar


ETA_SOURCES = ("chunks", "mini_batch", "state")


class ScanEtaTTTLayer(ScanLinearTTTLayer):
    """``ScanLinearTTTLayer`` with its rates computed the way TTT-Linear's published code
    computes them (``get_eta``): *after* the sequence is cut into mini-batches.

    ``η_ts = ramp_t · lr_s`` — ``ramp`` the per-position scale (``1/(t+1)`` plus a learnable
    offset), ``lr_s = base_lr/f · σ(x_s·w_lr + b)`` — as a ``[K, K]`` block per mini-batch:

    * ``eta_from="chunks"``: from the pre-chunked input ``[B, N, K, d]``, one ``[B, H, N, K, K]``
      tensor scanned with the other inputs (the published layout);
    * ``eta_from="mini_batch"``: inside the scan step, from the mini-batch's own inputs;
    * ``eta_from="state"``: as ``"mini_batch"``, gated by ``σ(mean(k W))``, which reads the fast
      weight — a state-dependent rate, outside the theorem, to be refused.

    The first two are the same function as ``ScanLinearTTTLayer`` with the same parameters.
    """

    def __init__(self, d_model: int, num_heads: int, mini_batch_size: int, *,
                 eta_from: str = "chunks", **kw) -> None:
        super().__init__(d_model, num_heads, mini_batch_size, **kw)
        if eta_from not in ETA_SOURCES:
            raise ValueError(f"eta_from must be one of {ETA_SOURCES}, got {eta_from!r}")
        self.eta_from = eta_from

    def get_eta(self, X: torch.Tensor, size: int) -> torch.Tensor:
        """``[B, H, N, K, K]`` rates of mini-batches ``X [B, N, K, d]`` of ``size`` tokens."""
        B, n = X.shape[:2]
        lr = (X @ self.lr_weight.T + self.lr_bias[:, 0]).permute(0, 3, 1, 2)     # [B, H, N, K]
        lr = (self.base_lr / self.head_dim) * torch.sigmoid(lr)
        ramp = torch.clamp_min(self.position_rate[:size] + self.position_offset[:size], 0.0)
        token_eta = torch.broadcast_to(ramp.reshape(1, 1, 1, size, 1),
                                       (B, self.num_heads, n, size, 1))
        return token_eta * lr.unsqueeze(-2)

    def ttt_chunks(self, inputs: dict, x: torch.Tensor, size: int, params: dict):
        """Like ``ttt``, with the rates made from ``x [B, n·size, d]`` cut into mini-batches."""
        B, H, L, f = inputs["q"].shape
        n = L // size
        xs = {name: t.reshape(B, H, n, size, f).permute(2, 0, 1, 3, 4)
              for name, t in inputs.items()}
        X = x.reshape(B, n, size, x.shape[-1])
        if self.eta_from == "chunks":
            xs["eta"] = self.get_eta(X, size).permute(2, 0, 1, 3, 4)
        else:
            xs["x"] = X.permute(1, 0, 2, 3)
        out = torch.empty(n, B, H, size, f, dtype=x.dtype, device=x.device)

        def step(carry, xb):
            return self.eta_step(carry, xb, size)

        params, out = scan(step, params, xs, out)
        return out.permute(1, 0, 3, 2, 4).reshape(B, n * size, H * f), params

    def eta_step(self, params: dict, x: dict, size: int):
        W = params["W"]
        q, k, v = x["q"], x["k"], x["v"]
        if self.eta_from == "chunks":
            eta = x["eta"]
        else:
            eta = self.get_eta(x["x"][:, None], size)[:, :, 0]
            if self.eta_from == "state":
                eta = eta * torch.sigmoid((k @ W).mean(dim=-1))[..., None, :]
        causal, last = torch.tril(eta), eta[:, :, -1, :, None]
        z_bar = q @ W + (causal * (q @ k.transpose(-1, -2))) @ v
        W = W + (last * k).transpose(-1, -2) @ v
        return {"W": W}, q + z_bar

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, L, d_model] -> [B, L, d_model]."""
        B, L, _ = x.shape
        K = self.mini_batch_size
        n, rest = divmod(L, K)
        seq = {"q": self.heads(self.q_proj(x)), "k": self.heads(self.k_proj(x)),
               "v": self.heads(self.v_proj(x))}
        params = self.initial(B)
        outs = []
        if n > 0:
            y, params = self.ttt_chunks({k: t[:, :, :n * K] for k, t in seq.items()},
                                        x[:, :n * K], K, params)
            outs.append(y)
        if rest > 0:
            y, _ = self.ttt_chunks({k: t[:, :, -rest:] for k, t in seq.items()}, x[:, -rest:],
                                   rest, params)
            outs.append(y)
        y = torch.cat(outs, dim=1)
        return self.o_proj(self.post_norm(y))


__all__ = ["ScanTTTLinearLayer", "ScanTTTMLPLayer", "ScanLinearTTTLayer", "ScanEtaTTTLayer",
           "scan"]
