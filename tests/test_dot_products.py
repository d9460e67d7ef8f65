"""A dot product is a dot product however it is spelt (``frontend.dot_products``): a normalised
linear attention whose normaliser is read by ``einsum`` converts as the one that reads it by
``(q * z).sum(-1)``, exactly at every level, instead of having its normaliser taken for a kernel
weight Θ (a matrix product of a state and stream data) and frozen at zero."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function
from ttt2la.frontend.capture import trace

aten = torch.ops.aten


class Normalised(nn.Module):
    """Linear attention with its normaliser ``z`` (φ = elu + 1), per token, in ``[B, T, H, D]``;
    the normaliser read by ``read``: "einsum" or "sum"."""

    def __init__(self, read: str, d: int = 8, heads: int = 2):
        super().__init__()
        self.read, self.h, self.dk = read, heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dk).unbind(2)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        S = x.new_zeros(B, self.h, self.dk, self.dk)
        z = x.new_zeros(B, self.h, self.dk)
        ys = []
        for t in range(T):
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            z = z + k[:, t]
            den = torch.einsum("bhk,bhk->bh", q[:, t], z) if self.read == "einsum" \
                else (q[:, t] * z).sum(-1)
            ys.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) / (den[..., None] + 1e-3))
        return torch.stack(ys, 1).reshape(B, T, -1)


def test_a_bmm_of_one_row_by_one_column_is_traced_as_a_product_and_sum():
    def loop(q, z):
        outs = []
        for t in range(3):
            z = z + q[:, t]
            outs.append(torch.einsum("bhk,bhk->bh", q[:, t], z))
        return torch.stack(outs, 1)

    q, z = torch.randn(2, 3, 2, 4), torch.randn(2, 2, 4)
    gm = trace(loop, q, z)
    ops = {n.target for n in gm.graph.nodes}
    assert aten.bmm.default not in ops and aten.sum.dim_IntList in ops
    torch.testing.assert_close(gm(q, z), loop(q, z))


@pytest.mark.parametrize("read", ["einsum", "sum"])
def test_the_normaliser_is_no_theta_and_every_level_is_exact(read):
    torch.manual_seed(0)
    layer = Normalised(read)
    x = torch.randn(2, 12, 8)
    for level in (0, 2):
        conv = ttt2la.convert(layer, level=level, example_inputs=(x,))
        report, = conv.ttt2la_report.layers
        roles = {s.name: s.role for s in report.states}
        assert roles["z"] != "theta", roles
        assert conv.ttt2la_report.exact
        assert_same_function(conv, layer, [x, torch.randn(1, 5, 8)])


@settings(max_examples=3, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 20))
def test_both_spellings_are_one_function_at_other_shapes(B, T):
    torch.manual_seed(1)
    layer = Normalised("einsum")
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 12, 8),))
    assert_same_function(conv, layer, torch.randn(B, T, 8))
