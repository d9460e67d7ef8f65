"""Momentum, decay and Muon's step read however they are written, and lifted onto the block op.

``M' = β M + G`` is written ``0.75 * m + g``, ``β * m + (1 - β) * g``, ``torch.lerp(m, g, w)``
(``m + w (g − m)``) or by hand as ``m + w * (g - m)``; a decay as ``0.9 * W + Δ`` or
``W - λ W + Δ``; Muon's step as ``W + η NS(G)`` or ``W - η NS(G)`` with ``η`` a constant or a
rate per chunk. Each must lift onto ``block_linear_attention`` with the coefficients the code
computes (read as polynomials over constants and per-matrix values) and equal the layer's own
loop: float64 relative RMS ≤ 1e-10, outputs and every gradient, over batch and length (fp32 ≤ 1e-5
where no Newton–Schulz runs). Look-alikes — a step factor per row, a rate read from the state,
a constant added to the state — must not be lifted and must still convert exactly.
"""
from __future__ import annotations

import pytest
import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import FP32, assert_same_function
from ttt2la.lowering import LiftedPlan

F64 = 1e-10


def zeropower(G, steps: int = 2):
    """Muon's quintic Newton–Schulz, as its reference code writes it."""
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


class AffineStyles(nn.Module):
    """A chunked linear memory whose momentum, decay or step is written as ``kind`` says."""

    def __init__(self, kind: str, d: int = 8, chunk: int = 4):
        super().__init__()
        self.kind, self.c = kind, chunk
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, 1)

    def _update(self, W, m, G, x):
        kind = self.kind
        w = torch.sigmoid(self.gate(x).mean(1, keepdim=True))        # [B, 1, 1] per chunk
        if kind == "constant momentum":
            m = 0.75 * m + G
        elif kind == "ema momentum":
            m = 0.9 * m + (1 - 0.9) * G
        elif kind == "lerp momentum":
            m = torch.lerp(m, G, 0.25)
        elif kind == "gated lerp momentum":
            m = torch.lerp(m, G, w)
        elif kind == "momentum by hand":
            m = m + w * (G - m)
        elif kind == "constant decay":
            return 0.9 * W + G, m
        elif kind == "weight decay":
            return W - 0.01 * W + G, m
        elif kind == "scaled muon":
            return W + 0.1 * zeropower(G), m
        elif kind == "muon descent":
            return W - w * zeropower(-G), m
        elif kind == "muon momentum":
            m = 0.9 * m + G
            return W + 0.05 * zeropower(m), m
        elif kind == "row step":                                    # a factor per row
            return W + torch.sigmoid(G.mean(-1, keepdim=True)) * zeropower(G), m
        elif kind == "state step":                                  # the rate reads the state
            return W + torch.sigmoid(W.mean((-2, -1), keepdim=True)) * G, m
        elif kind == "constant added":
            return W + 0.01 + G, m
        else:
            raise ValueError(kind)
        return W + m, m

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        k = F.normalize(k, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        m = torch.zeros_like(W)
        outs = []
        for s in range(0, x.shape[1], self.c):
            e = s + self.c
            outs.append(q[:, s:e] @ W)
            W, m = self._update(W, m, k[:, s:e].mT @ v[:, s:e], x[:, s:e])
        return torch.cat(outs, 1)


class HeadDecay(nn.Module):
    """A fixed decay per head, ``[H, 1, 1]`` beside a ``[B, H, d, d]`` state (RetNet's form): a
    factor with fewer axes than the state, broadcast from the right."""

    def __init__(self, d: int = 8, heads: int = 2, chunk: int = 4):
        super().__init__()
        self.h, self.c = heads, chunk
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.logit = nn.Parameter(torch.linspace(-1.0, 2.0, heads).view(heads, 1, 1))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (t.view(B, L, self.h, -1).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        W = x.new_zeros(B, self.h, D // self.h, D // self.h)
        gamma = torch.sigmoid(self.logit)
        outs = []
        for s in range(0, L, self.c):
            e = s + self.c
            outs.append(q[:, :, s:e] @ W)
            W = gamma * W + k[:, :, s:e].mT @ v[:, :, s:e]
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, D)


LIFTED = {  # kind: (momentum α, decay γ, step s after Newton–Schulz) as the plan reads them
    "constant momentum": ("0.75", None, None),
    "ema momentum": ("0.9", None, None),
    "lerp momentum": ("0.75", None, None),
    "gated lerp momentum": ("1 - w", None, None),
    "momentum by hand": ("1 - w", None, None),
    "constant decay": (None, "0.9", None),
    "weight decay": (None, "0.99", None),
    "scaled muon": (None, None, "0.1"),
    "muon descent": (None, None, "-w"),
    "muon momentum": ("0.9", None, "0.05"),
    "head decay": (None, "w", None),
}
MUON = ("scaled muon", "muon descent", "muon momentum")
NOT_LIFTED = ("row step", "state step", "constant added")

_cache = module_scoped.cache()


def _converted(kind: str, dtype=torch.float64):
    if (kind, dtype) not in _cache:
        torch.manual_seed(0)
        layer = (HeadDecay() if kind == "head decay" else AffineStyles(kind)).to(dtype)
        x = torch.randn(2, 24, 8, dtype=dtype)
        _cache[kind, dtype] = layer, ttt2la.convert(layer, level=0, example_inputs=(x,))
    return _cache[kind, dtype]


def _plan(conv, B):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


def _spelled(p) -> str | None:
    """A coefficient polynomial in the notation of ``LIFTED`` (its one factor named ``w``)."""
    if p is None:
        return None
    terms = []
    for c, factors in p:
        name = "w" * len(factors)
        terms.append(f"{c:g}" if not name else
                     name if c == 1 else "-" + name if c == -1 else f"{c:g}{name}")
    return " + ".join(terms).replace("+ -", "- ")


@pytest.mark.parametrize("kind", sorted(LIFTED))
def test_each_spelling_lifts_with_the_coefficients_it_computes(kind):
    layer, conv = _converted(kind)
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan), plan.implementation
    assert plan.implementation == "block_linear_attention[torch]"
    lp = plan.lifted
    got = tuple(_spelled(p) for p in (lp.alpha, lp.gamma, lp.step))
    assert got == LIFTED[kind]
    assert (lp.newton_schulz is not None) == (kind in MUON)


@settings(max_examples=6, deadline=None)
@given(kind=st.sampled_from(sorted(LIFTED)), B=st.integers(1, 3), chunks=st.integers(1, 7),
       tail=st.integers(0, 3))
def test_lifted_spellings_equal_their_loop_in_float64(kind, B, chunks, tail):
    layer, conv = _converted(kind)
    x = torch.randn(B, 4 * chunks + tail, 8, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(B * 31 + chunks))
    assert_same_function(conv, layer, [x], tol=F64)


@pytest.mark.parametrize("kind", sorted(k for k in LIFTED if k not in MUON))
def test_lifted_spellings_equal_their_loop_in_fp32(kind):
    layer, conv = _converted(kind, torch.float32)
    assert _plan(conv, 3).implementation == "block_linear_attention[torch]"
    for B, L in ((1, 4), (3, 27)):
        x = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(L))
        assert_same_function(conv, layer, [x], tol=FP32)


@pytest.mark.parametrize("kind", NOT_LIFTED)
def test_look_alikes_are_not_lifted_and_stay_exact(kind):
    """A step factor per row, a rate read from the state or a constant added to it is not the
    block rule: each runs on the generic executor (or is refused by name), never on the op."""
    try:
        layer, conv = _converted(kind)
    except ttt2la.NonReducibleError as e:
        assert kind == "state step" and "W" in str(e)
        return
    assert not isinstance(_plan(conv, 2), LiftedPlan)
    for B, L in ((1, 8), (2, 21)):
        x = torch.randn(B, L, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(L))
        assert_same_function(conv, layer, [x], tol=F64)


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 70))
def test_the_zoo_muon_step_lifts_with_its_rate_after_newton_schulz(B, L):
    """``zoo.MuonStepLayer``: momentum ``0.9``, then ``W − 0.1 · NS(m)``, heads as an axis."""
    from ttt2la.zoo import MuonStepLayer

    if "muon step" not in _cache:
        torch.manual_seed(0)
        layer = MuonStepLayer(16, 2, 8).double()
        x = torch.randn(2, 32, 16, dtype=torch.float64)
        _cache["muon step"] = layer, ttt2la.convert(layer, level=0, example_inputs=(x,))
    layer, conv = _cache["muon step"]
    lp = _plan(conv, B).lifted
    assert (_spelled(lp.alpha), _spelled(lp.step), lp.newton_schulz.steps) == ("0.9", "-0.1", 5)
    x = torch.randn(B, L, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(L))
    assert_same_function(conv, layer, [x], tol=F64)
