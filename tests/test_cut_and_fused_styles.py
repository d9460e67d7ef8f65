"""TTT loops written with ops the analysis reads through their definitions: chunks cut by the
loop statement (``zip(q.split(C, 1), ...)``, ``x.unbind(1)``), momentum by ``torch.lerp``, the
delta rule's gradient by ``F.mse_loss``, an update by ``torch.baddbmm`` and Muon's Newton–Schulz
by ``baddbmm``; and ``chunk(n)`` pieces, which grow with the length, refused by name.

Every converted layer is compared with the layer as written: outputs and every parameter
gradient within the fp32 tolerance (float64 ≤ 1e-10 with Newton–Schulz).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function


class SplitZipLayer(nn.Module):
    """Chunks from ``split`` zipped in the loop statement, a ``baddbmm`` update."""

    def __init__(self, d=8, chunk=4):
        super().__init__()
        self.c = chunk
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.lr = nn.Linear(d, 1)
        self.W0 = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        lr = F.softplus(self.lr(x))
        W = self.W0.repeat(x.shape[0], 1, 1)
        outs = []
        for qc, kc, vc, lc in zip(q.split(self.c, 1), F.silu(k).split(self.c, 1),
                                  v.split(self.c, 1), lr.split(self.c, 1)):
            outs.append(torch.bmm(qc, W))
            W = torch.baddbmm(W, kc.transpose(1, 2), vc * lc, alpha=0.1)
        return torch.cat(outs, 1)


class UnbindDeltaLayer(nn.Module):
    """A per-token delta rule over ``unbind`` pieces, its gradient from ``F.mse_loss``."""

    def __init__(self, d=8):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        g = torch.func.grad(lambda S, k, v: 0.5 * F.mse_loss(k @ S, v, reduction="sum"))
        ys = []
        for qt, kt, vt in zip(q.unbind(1), F.normalize(k, dim=-1).unbind(1), v.unbind(1)):
            S = S - 0.5 * g(S, kt.unsqueeze(1), vt.unsqueeze(1))
            ys.append(torch.einsum("bi,bij->bj", qt, S))
        return torch.stack(ys, 1)


class LerpMomentumLayer(nn.Module):
    """Chunks sliced in the body, momentum by ``torch.lerp``."""

    def __init__(self, d=8, chunk=4):
        super().__init__()
        self.c = chunk
        self.proj = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        m = torch.zeros_like(W)
        outs = []
        for s in range(0, x.shape[1], self.c):
            outs.append(q[:, s:s + self.c] @ W)
            m = torch.lerp(m, k[:, s:s + self.c].mT @ v[:, s:s + self.c], 0.25)
            W = W + m
        return torch.cat(outs, 1)


def zeropower(G, steps=3):
    """Muon's quintic Newton–Schulz with its multiply-adds fused, as its reference code does."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


class BaddbmmMuonLayer(LerpMomentumLayer):
    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], self.c):
            outs.append(q[:, s:s + self.c] @ W)
            W = W + zeropower(k[:, s:s + self.c].mT @ v[:, s:s + self.c])
        return torch.cat(outs, 1)


def _layer(cls, dtype=torch.float32):
    torch.manual_seed(0)
    return cls().to(dtype)


@settings(max_examples=4, deadline=None)
@given(cls=st.sampled_from([SplitZipLayer, UnbindDeltaLayer, LerpMomentumLayer]),
       B=st.integers(1, 3), L=st.integers(1, 23))
def test_cut_and_fused_styles_convert_exactly(cls, B, L):
    layer = _layer(cls)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt2la_report.exact
    assert_same_function(conv, layer, torch.randn(B, L, 8))


@pytest.mark.parametrize("cls,schedule,rule", [
    (SplitZipLayer, "parallel", "0.1·"),
    (UnbindDeltaLayer, "semi-parallel", None),
    (LerpMomentumLayer, "parallel", None),
])
def test_reads_the_update_through_the_fused_op(cls, schedule, rule):
    """What the fused op computes is what the analysis sees: an additive ``baddbmm`` update
    with its ``alpha``, the delta rule under ``mse_loss``, momentum under ``lerp``."""
    conv = ttt2la.convert(_layer(cls), level=0, example_inputs=(torch.randn(2, 16, 8),))
    layer, = conv.ttt2la_report.layers
    assert layer.schedule == schedule
    if rule is not None:
        assert rule in conv.ttt2la_report.to_markdown()


def test_split_pieces_are_named_by_the_loop_statement():
    conv = ttt2la.convert(_layer(SplitZipLayer), level=0, example_inputs=(torch.randn(2, 16, 8),))
    text = conv.ttt2la_report.to_markdown()
    streams = next(line for line in text.splitlines() if line.startswith("- streams:"))
    assert all(f"`{name}" in streams for name in ("qc", "kc", "vc", "lc")), streams


def test_newton_schulz_written_with_baddbmm_is_recognised_float64():
    layer = _layer(BaddbmmMuonLayer, torch.float64)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8, dtype=torch.float64),))
    assert "NS3" in conv.ttt2la_report.to_markdown()
    assert_same_function(conv, layer, torch.randn(3, 13, 8, dtype=torch.float64), tol=1e-10)


class FixedPiecesLayer(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 24, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], 8, 8)
        outs = []
        for qc, kc, vc in zip(getattr(q, self.how)(4, 1), getattr(k, self.how)(4, 1),
                              getattr(v, self.how)(4, 1)):
            outs.append(qc @ W)
            W = W + kc.mT @ vc
        return torch.cat(outs, 1)


@pytest.mark.parametrize("how", ["chunk", "tensor_split"])
def test_a_fixed_number_of_pieces_is_refused_by_name(how):
    with pytest.raises(ttt2la.ConversionError, match=rf"`{how}\(4\)`.*\.split\(C, dim\)"):
        ttt2la.convert(FixedPiecesLayer(how), level=0, example_inputs=(torch.randn(2, 16, 8),))
