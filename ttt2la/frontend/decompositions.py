"""Ops traced as their definitions, so that the analysis reads what they compute.

``torch.lerp(m, g, β)`` is ``m + β (g − m)``: an affine map of a momentum ``m``. ``F.mse_loss``
is a mean (or sum) of squares, and its backward ``2 (x − y) / N`` times the seed: for ``x = kW``
the delta rule's gradient, affine in ``W``. Inside a loop body, ``torch.baddbmm(W, kᵀ, v,
alpha=η)`` is ``W + η·kᵀv``, an additive update, ``torch.addcmul(γ·S, k[..., None], v[..., None, :])``
the same written elementwise, and Muon's ``baddbmm(A, A, A, beta=b, alpha=c)`` a step of
Newton–Schulz; and a softmax attention inside a loop body is its math (``vmap`` batches that,
not the fused CPU kernel). Traced as single aten ops they are opaque to the dependence analysis and
the matchers, which must then take them for nonlinear and refuse updates that are affine. Each
definition is the one the op documents, with the gradient autograd gives it; values agree up to
rounding (the fused kernels round differently). Multiply-adds outside loops (every ``nn.Linear``
with a bias is an ``addmm``) stay fused: there they are no update.
"""
from __future__ import annotations

import sys

import torch

aten = torch.ops.aten

#: ``reduction`` codes of the loss ops, as ``torch.nn._reduction`` numbers them (0: none).
_MEAN, _SUM = 1, 2


def lerp(start, end, weight):
    """``start + weight · (end − start)``, ``weight`` a number or a tensor."""
    return start + weight * (end - start)


def mse_loss(x, y, reduction: int = _MEAN):
    """``(x − y)²``, reduced by mean, sum or not at all."""
    squares = (x - y) * (x - y)
    if reduction == _MEAN:
        return squares.mean()
    if reduction == _SUM:
        return squares.sum()
    return squares


def mse_loss_backward(seed, x, y, reduction: int):
    """The gradient of ``mse_loss`` with respect to ``x``: ``2 (x − y) / N · seed`` (``N`` the
    elements averaged over; 1 for a sum or no reduction)."""
    scale = 2.0 / x.numel() if reduction == _MEAN else 2.0
    return seed * ((x - y) * scale)


def _in_loop_body() -> bool:
    """Whether the user code calling the op being traced runs inside a loop's body. Only the
    traced code's frames count: the walk out stops at ``capture``, which runs the trace; beyond
    it lie the frames of whoever called ``convert`` (a script's loop, a test runner)."""
    from ..ir import SourceLoc
    from . import capture
    from .loops import _loops_in_file

    f = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_filename == capture.__file__:
            return False
        if capture._is_user_file(code.co_filename):
            here = SourceLoc(code.co_filename, f.f_lineno, code.co_name)
            if any(loop.contains(here) for loop in _loops_in_file(code.co_filename)):
                return True
        f = f.f_back
    return False


def _multiply_add(product):
    """``beta·input + alpha·product(a, b)`` inside a loop body; the fused op elsewhere."""
    def decomposed(input, a, b, *, beta=1, alpha=1):
        if not _in_loop_body():
            return NotImplemented
        ab = product(a, b)
        ab = ab if alpha == 1 else ab * alpha
        if beta == 0:                          # the op ignores ``input`` then, NaNs included
            return ab + torch.zeros_like(input)
        return (input if beta == 1 else input * beta) + ab
    return decomposed


def _pointwise_add(combine):
    """``input + value·combine(a, b)`` inside a loop body (``addcmul``, ``addcdiv``); the fused
    op elsewhere."""
    def decomposed(input, a, b, *, value=1):
        if not _in_loop_body():
            return NotImplemented
        ab = combine(a, b)
        return input + (ab if value == 1 else ab * value)
    return decomposed


def unfold(x, dim: int, size: int, step: int):
    """``x.unfold(dim, K, K)``, windows that do not overlap: the sequence cut into ``N`` chunks
    of ``K`` (a remainder dropped), the chunk axis at ``dim`` and the tokens last — a reshape
    and a move, as pre-chunked code writes it (``prechunked``). Overlapping windows stay one op."""
    if size != step or size < 1:
        return NotImplemented
    dim = dim % max(x.dim(), 1)
    n = x.shape[dim] // size
    chunks = x.narrow(dim, 0, n * size).unflatten(dim, (n, size))
    return chunks.movedim(dim + 1, -1)


def _attention_in_loop_body(query, key, value, dropout_p: float = 0.0, is_causal: bool = False,
                            *, attn_mask=None, scale=None):
    """``F.scaled_dot_product_attention`` on CPU inside a loop body, as torch's own decomposition
    spells it (its math: products, mask, softmax). The fused CPU kernel has no ``vmap`` batching
    rule, so a plan batching the body over chunks would run it chunk by chunk, warning at every
    call; its math batches. Elsewhere, and with dropout, the fused op stays."""
    if dropout_p != 0.0 or not _in_loop_body():
        return NotImplemented
    from torch._decomp import decomposition_table
    return decomposition_table[aten._scaled_dot_product_flash_attention_for_cpu.default](
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


#: The table ``make_fx`` traces with: each overload to the definition above.
DECOMPOSITIONS = {
    aten.lerp.Scalar: lerp,
    aten.lerp.Tensor: lerp,
    aten.mse_loss.default: mse_loss,
    aten.mse_loss_backward.default: mse_loss_backward,
    aten.baddbmm.default: _multiply_add(torch.bmm),
    aten.addmm.default: _multiply_add(torch.mm),
    aten.addcmul.default: _pointwise_add(torch.mul),
    aten.addcdiv.default: _pointwise_add(torch.div),
    aten.unfold.default: unfold,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_in_loop_body,
}

__all__ = ["DECOMPOSITIONS", "lerp", "mse_loss", "mse_loss_backward", "unfold"]
