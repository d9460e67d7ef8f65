"""The per-token TTT layer whose token loop is written inline in ``forward``: it is the closed form
``o_t = q_t (S0 + sum_{i<=t} eta_i k_iᵀ v_i)``, and it converts exactly onto token-causal linear
attention (fp32, outputs and every gradient within 1e-5, at any batch size and length)."""
from __future__ import annotations

import math

import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import PerTokenInlineTTTLayer

FP32 = TOLERANCE[torch.float32]
_converted = module_scoped.cache()


def _layer_and_converted():
    if not _converted:
        torch.manual_seed(0)
        layer = PerTokenInlineTTTLayer(16, 2)
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 24, 16),))
        _converted["pair"] = (layer, conv)
    return _converted["pair"]


def closed_form(layer, x):
    """Every token's read of the fast weight after its own write, as one masked sum (float64)."""
    B, L, d = x.shape
    H = layer.num_heads
    D = d // H
    q = F.normalize(layer.q_proj(x).view(B, L, H, D), dim=-1)
    k = F.normalize(layer.k_proj(x).view(B, L, H, D), dim=-1)
    v = layer.v_proj(x).view(B, L, H, D)
    eta = F.softplus(layer.lr_proj(x) + math.log(math.expm1(0.5)))              # [B, L, H]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * eta.permute(0, 2, 1)[:, :, None, :]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    y = torch.einsum("bhts,bshe->bthe", scores.masked_fill(~causal, 0), v)
    y = y + torch.einsum("bthd,hde->bthe", q, layer.s0)
    return layer.out(y.reshape(B, L, d))


@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_layer_is_the_closed_form(B, L, seed):
    torch.manual_seed(seed)
    layer = PerTokenInlineTTTLayer(12, 3).double()
    x = torch.randn(B, L, 12, dtype=torch.float64)
    assert rel_rms_error(layer(x), closed_form(layer, x)) <= TOLERANCE[torch.float64]


def test_converts_to_token_causal_linear_attention():
    _layer, conv = _layer_and_converted()
    report = conv.ttt2la_report.layers[0]
    assert report.schedule == "parallel" and report.exact and report.reducible
    assert "chunk_linear_attention" in report.runtime


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@example(B=1, L=1)
@example(B=2, L=300)
@given(B=st.integers(1, 3), L=st.integers(1, 80))
def test_converted_layer_equals_the_loop_in_fp32(B, L):
    layer, conv = _layer_and_converted()
    x = torch.randn(B, L, 16)
    g = torch.randn(B, L, 16)
    results = []
    for module in (conv, layer):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        grads = torch.autograd.grad((y * g).sum(), [xi, *module.parameters()])
        results.append((y, grads))
    (yc, gc), (yr, gr) = results
    assert rel_rms_error(yc, yr) <= FP32
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, gc, gr):
        assert rel_rms_error(a, b) <= FP32, name
