"""Newton–Schulz in the spellings people write it is read as Newton–Schulz.

The classic cubic step ``X ← 1.5 X − 0.5 X Xᵀ X`` (a difference, the Gram matrix's constant on
its first factor, as Python's left-to-right ``0.5 * X @ X.mT @ X`` writes it) and a Frobenius
norm taken as ``G.flatten(-2).norm(dim=-1)`` are the iteration ``(a, b, c) = (1.5, −0.5, 0)``
after the normalisation ``remove_muon`` and the block op know: the layer lifts onto
``block_linear_attention`` with that schedule, exact (float64 ≤ 1e-10, outputs and every
gradient), and level 6 removes it. A cubic with another constant than its Gram matrix's is not
the iteration: it is left where it is, exact.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function

F64 = 1e-10


def cubic(G, steps=6, gram=-0.5):
    X = G / (G.flatten(-2).norm(dim=-1)[..., None, None] + 1e-6)
    for _ in range(steps):
        X = 1.5 * X + gram * X @ X.mT @ X
    return X


def cubic_minus(G, steps=6):
    X = G / (G.flatten(-2).norm(dim=-1)[..., None, None] + 1e-6)
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ X.mT @ X
    return X


def quintic(G, steps=5):
    X = G / (G.flatten(-2).norm(dim=-1)[..., None, None] + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


def look_alike(G, steps=6):
    """Not Newton–Schulz: the cubic term scaled apart from its Gram matrix (``X (0.5 Xᵀ X)``
    with an extra factor on one side only of a second product)."""
    X = G / (G.flatten(-2).norm(dim=-1)[..., None, None] + 1e-6)
    for _ in range(steps):
        X = 1.5 * X - 0.5 * X @ (X.mT @ X).tril()
    return X


ITERATIONS = {"cubic": cubic_minus, "cubic_plus": cubic, "quintic": quintic}


class MuonMemory(nn.Module):
    """A fast weight stepped by an orthogonalised momentum, chunk by chunk."""

    def __init__(self, ns, d=8, chunk=4):
        super().__init__()
        self.ns, self.C = ns, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W, m = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        ys = []
        for s in range(0, T, self.C):
            ys.append(q[:, s:s + self.C] @ W)
            m = 0.8 * m + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            W = W + 0.1 * self.ns(m)
        return torch.cat(ys, 1)


@pytest.mark.parametrize("name", sorted(ITERATIONS))
def test_each_spelling_lifts_with_its_schedule_exactly(name):
    torch.manual_seed(0)
    layer = MuonMemory(ITERATIONS[name]).double()
    conv = ttt2la.convert(layer, level=2,
                          example_inputs=(torch.randn(2, 16, 8, dtype=torch.float64),))
    report, = conv.ttt2la_report.layers
    assert report.runtime == "block_linear_attention[torch]", report.runtime
    assert_same_function(conv, layer, [torch.randn(2, 16, 8, dtype=torch.float64),
                                       torch.randn(3, 14, 8, dtype=torch.float64)], tol=F64)


def test_level_6_removes_the_cubic_iteration():
    torch.manual_seed(0)
    conv = ttt2la.convert(MuonMemory(cubic_minus), level=6,
                          example_inputs=(torch.randn(2, 16, 8),))
    muon, = [p for p in conv.ttt2la_report.layers[0].passes if p.name == "remove_muon"]
    assert muon.status == "applied" and "6-step Newton–Schulz" in muon.reason, muon.reason


def test_a_look_alike_is_no_iteration_and_stays_exact():
    torch.manual_seed(0)
    layer = MuonMemory(look_alike).double()
    conv = ttt2la.convert(layer, level=2,
                          example_inputs=(torch.randn(2, 16, 8, dtype=torch.float64),))
    report, = conv.ttt2la_report.layers
    assert not report.runtime.startswith("block_linear_attention"), report.runtime
    assert_same_function(conv, layer, [torch.randn(2, 16, 8, dtype=torch.float64)], tol=F64)
