"""Bidirectional linear attention: one update over all tokens, then every token reads the state.

Single-step TTT (ViTTT's fast weights, LaCT's render step) steps its fast weight once on every
token of a call and reads the stepped weight with every token. As linear attention, per head::

    S = S_0 + Σ_t φ(k_t)ᵀ v_t            o_s = (φ(q_s) S) ⊙ g_s

over the ``T`` key tokens and the ``Tq`` query tokens (LaCT's render step updates on the input
views' tokens and reads all tokens), with an optional *output gate* ``g`` (ViTTT's gated unit
``(q W1) ⊙ silu(q W2)`` with ``W2`` frozen is this with ``g = silu(q W2)``). Nothing is causal:
there is one state and one read.

*Local* linear attention (``window=(height, width, size)``) is the same op whose features are a
neighbourhood's: the tokens lie row-major on a ``height × width`` grid and ``φ(x_t)`` stacks
``x`` at the ``size × size`` tokens around ``t`` (offsets in row-major order, zero outside the
grid), so the state has ``size²·Dk`` rows, one block of ``Dk`` per offset. A depthwise
convolution whose taps are a fast weight is this op with one head per channel and
``Dk = Dv = 1``: the state is the taps.

The torch implementation runs on every device (two matmuls per head, or two grouped
convolutions for a window — there is no Triton kernel: cuBLAS and cuDNN already run them); its
reference, ``naive_bidirectional_linear_attention``, is a token loop with the neighbourhoods
gathered one by one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ttt2la.errors import UnsupportedTTTError
from ttt2la.runtime.naive import RuntimeInputError, compute_dtype, final_state_dtype

OP = "bidirectional_linear_attention"
BIDIRECTIONAL_BACKENDS = ("auto", "torch", "naive", "triton")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeInputError(f"{OP}: {message}")


def window_offsets(size: int) -> list[tuple[int, int]]:
    """The ``(row, column)`` offsets of a ``size × size`` window, row-major."""
    r = size // 2
    return [(di, dj) for di in range(-r, r + 1) for dj in range(-r, r + 1)]


def check_bidirectional_inputs(q, k, v, *, gate, window, initial_state) -> None:
    """Validate the op's arguments (shared by every implementation)."""
    shape = lambda t: tuple(t.shape)  # noqa: E731
    _require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
             f"q, k, v must be [B, T, H, D]; got {shape(q)}, {shape(k)}, {shape(v)}")
    B, T, H, Dk = k.shape
    Tq, Dv = q.shape[1], v.shape[-1]
    _require(q.shape == (B, Tq, H, Dk), f"q must be [B, Tq, H, Dk] = [{B}, Tq, {H}, {Dk}]; "
                                        f"got {shape(q)}")
    _require(v.shape[:3] == (B, T, H), f"v must be [B, T, H, Dv] = [{B}, {T}, {H}, Dv]; "
                                       f"got {shape(v)}")
    _require(gate is None or gate.shape == (B, Tq, H, Dv),
             f"gate must be [B, Tq, H, Dv] = [{B}, {Tq}, {H}, {Dv}]; "
             f"got {None if gate is None else shape(gate)}")
    rows = Dk
    if window is not None:
        ok = (isinstance(window, (tuple, list)) and len(window) == 3
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in window))
        _require(ok and window[2] % 2 == 1,
                 f"window must be (height, width, size) with an odd size, got {window!r}")
        _require(window[0] * window[1] == T == Tq,
                 f"window's grid {window[0]}×{window[1]} does not hold the {T} keys and {Tq} "
                 "queries")
        rows = window[2] ** 2 * Dk
    _require(initial_state is None or initial_state.shape == (B, H, rows, Dv),
             f"initial_state must be [B, H, Dk', Dv] = [{B}, {H}, {rows}, {Dv}]"
             f"{' (Dk′ = size²·Dk)' if window is not None else ''}; "
             f"got {None if initial_state is None else shape(initial_state)}")


# ------------------------------------------------------------------------------- reference

def naive_bidirectional_linear_attention(q, k, v, *, gate=None, window=None, initial_state=None,
                                         output_final_state=False):
    """The specification: the state summed token by token, each token's features gathered from
    its window one offset at a time, then every token read. Returns
    ``(o [B, Tq, H, Dv], final_state [B, H, Dk', Dv] or None)``."""
    check_bidirectional_inputs(q, k, v, gate=gate, window=window, initial_state=initial_state)
    dt, dtype = compute_dtype(v.dtype), v.dtype
    final_dtype = final_state_dtype(v, initial_state)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    B, T, H, Dk = k.shape

    def features(x, t):                      # [B, H, Dk'] for token t
        if window is None:
            return x[:, t]
        height, width, size = window
        row, col = divmod(t, width)
        parts = []
        for di, dj in window_offsets(size):
            i, j = row + di, col + dj
            inside = 0 <= i < height and 0 <= j < width
            parts.append(x[:, i * width + j] if inside else torch.zeros_like(x[:, 0]))
        return torch.cat(parts, dim=-1)

    S = (torch.zeros(B, H, features(k, 0).shape[-1], v.shape[-1], dtype=dt, device=v.device)
         if initial_state is None else initial_state.to(dt))
    for t in range(T):
        S = S + features(k, t).unsqueeze(-1) * v[:, t].unsqueeze(-2)
    outs = []
    for t in range(q.shape[1]):
        o = (features(q, t).unsqueeze(-2) @ S).squeeze(-2)
        outs.append(o if gate is None else o * gate[:, t].to(dt))
    o = torch.stack(outs, dim=1).to(dtype)
    return o, (S.to(final_dtype) if output_final_state else None)


# ----------------------------------------------------------------------------------- torch

def _global(q, k, v, S0):
    """``S = S0 + Kᵀ V`` and ``Q S`` per head, head-major ``[B, H, ·, ·]``."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    S = kh.mT @ vh
    if S0 is not None:
        S = S + S0
    return qh @ S, S


def _local(q, k, v, S0, window):
    """Local linear attention on the ``height × width`` grid, channel-major, one group per head
    (a depthwise layer's images are read and written without a copy):

    * the update ``S[j, d, e] = Σ_x k[d, x + off_j] v[e, x]`` is the zero-padded keys correlated
      with the values (a ``height × width`` kernel, a ``size × size`` result);
    * the read ``o[e, x] = Σ_{j,d} q[d, x + off_j] S[j, d, e]`` is the queries convolved with the
      state as a ``size × size`` kernel — a depthwise convolution when ``Dk = Dv = 1``.

    Both are grouped convolutions, measured 1.1–30× faster on CPU (fp32) than gathering the
    windows (``F.unfold`` or shifted slices) and multiplying, forward and backward. float64 on
    CPU has no fast convolution (the update's image-sized kernel took seconds at 14×14 × 768
    channels), so there the windows are gathered (``_gathered``)."""
    height, width, size = window
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    n, BH, r = size * size, B * H, size // 2
    if k.dtype == torch.float64 and k.device.type == "cpu":
        return _gathered(q, k, v, S0, window)

    def image(x):                            # [B, T, H, D] -> [1, B·H·D, height, width]
        return x.permute(0, 2, 3, 1).reshape(1, BH * x.shape[-1], height, width)

    values = v.permute(0, 2, 3, 1).reshape(BH, 1, Dv, height, width)
    if Dk > 1:                               # one group per (head, key feature)
        values = values.expand(BH, Dk, Dv, height, width)
    kernel = values.reshape(BH * Dk * Dv, 1, height, width)
    S = F.conv2d(F.pad(image(k), (r, r, r, r)), kernel, groups=BH * Dk)  # [1, BH·Dk·Dv, s, s]
    S = S.reshape(BH, Dk, Dv, n).permute(0, 3, 1, 2).reshape(BH, n * Dk, Dv)
    if S0 is not None:
        S = S + S0.reshape(BH, n * Dk, Dv)
    weight = S.reshape(BH, n, Dk, Dv).permute(0, 3, 2, 1).reshape(BH * Dv, Dk, size, size)
    o = F.conv2d(image(q), weight, padding=r, groups=BH)                 # [1, BH·Dv, h, w]
    return o.reshape(B, H, Dv, T).mT, S.reshape(B, H, n * Dk, Dv)


def _gathered(q, k, v, S0, window):
    """``_local`` with every token's window gathered (shifted slices of the zero-padded image,
    offset-major rows) and two matmuls per head."""
    height, width, size = window
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    BH, r = B * H, size // 2

    def windows(x):                          # [B, T, H, Dk] -> [B·H, size²·Dk, T]
        image = F.pad(x.permute(0, 2, 3, 1).reshape(BH, Dk, height, width), (r, r, r, r))
        shifts = [image[..., r + di:r + di + height, r + dj:r + dj + width]
                  for di, dj in window_offsets(size)]
        return torch.stack(shifts, dim=1).reshape(BH, size * size * Dk, T)

    S = windows(k) @ v.permute(0, 2, 1, 3).reshape(BH, T, Dv)
    if S0 is not None:
        S = S + S0.reshape(BH, -1, Dv)
    o = S.mT @ windows(q)                                              # [B·H, Dv, T]
    return o.reshape(B, H, Dv, T).mT, S.reshape(B, H, -1, Dv)


def torch_bidirectional_linear_attention(q, k, v, *, gate=None, window=None, initial_state=None,
                                         output_final_state=False):
    """The op in plain torch (any device, autograd); same contract as the reference."""
    check_bidirectional_inputs(q, k, v, gate=gate, window=window, initial_state=initial_state)
    dt, dtype = compute_dtype(v.dtype), v.dtype
    final_dtype = final_state_dtype(v, initial_state)
    S0 = None if initial_state is None else initial_state.to(dt)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    o, S = _global(q, k, v, S0) if window is None else _local(q, k, v, S0, window)
    o = o.transpose(1, 2)                                              # [B, T, H, Dv]
    if gate is not None:
        o = o * gate.to(dt)
    return o.to(dtype), (S.to(final_dtype) if output_final_state else None)


def bidirectional_linear_attention(q, k, v, *, gate=None, window=None, initial_state=None,
                                   output_final_state=False, backend="auto"):
    """``S = S_0 + Σ_t φ(k_t)ᵀ v_t``, ``o_s = (φ(q_s) S) ⊙ gate_s`` (see the module docstring):
    ``q [B, Tq, H, Dk]``, ``k [B, T, H, Dk]``, ``v [B, T, H, Dv]``, ``gate [B, Tq, H, Dv]``.

    ``backend``: ``"auto"`` and ``"torch"`` run the torch implementation on every device,
    ``"naive"`` the reference; ``"triton"`` raises ``UnsupportedTTTError`` (no kernel: the op is
    two matmuls per head). Returns ``(o [B, Tq, H, Dv], final_state or None)``.
    """
    _require(backend in BIDIRECTIONAL_BACKENDS,
             f"backend must be one of {BIDIRECTIONAL_BACKENDS}, got {backend!r}")
    if backend == "triton":
        raise UnsupportedTTTError(
            f"backend='triton' was requested for {OP}, which has no Triton kernel (its torch "
            "implementation runs on every device); use backend='auto' or 'torch'")
    fn = naive_bidirectional_linear_attention if backend == "naive" else \
        torch_bidirectional_linear_attention
    return fn(q, k, v, gate=gate, window=window, initial_state=initial_state,
              output_final_state=output_final_state)


__all__ = ["bidirectional_linear_attention", "naive_bidirectional_linear_attention",
           "torch_bidirectional_linear_attention", "check_bidirectional_inputs",
           "window_offsets", "BIDIRECTIONAL_BACKENDS"]
