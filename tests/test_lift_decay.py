"""A state decayed once per chunk, ``W ← γ W + η Kᵀ V``, lifts onto ``block_linear_attention``.

The layers are gated memories written in the style of published gated linear-attention code:
heads as an axis and the products as ``torch.einsum``, whose trace moves unit axes in and out
around every product (``zoo.GatedChunkMemory``). The lifted layer must equal the layer's own
loop in float64 (relative RMS ≤ 1e-10, outputs and every gradient) on the op and on the loop
over chunks its cost rule falls back to. One factor per row of the state (a gate per key channel)
lifts too, the op decaying each row, and one per column (a gate per value channel), the op's
``value_decay``; look-alikes — a decay read from the state, an increment transposed by its
einsum — must not be lifted as the decayed rule and must still convert exactly.
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
from equivalence import assert_same_function
from ttt2la.lowering import LiftedPlan, scan_choice
from ttt2la.zoo import GatedChunkMemory

F64 = 1e-10


class ChunkMemory(nn.Module):
    """A gated memory whose decay, increment and read are chosen by ``kind``."""

    def __init__(self, kind: str, d=8, heads=2, chunk=4):
        super().__init__()
        self.kind, self.h, self.dh, self.chunk = kind, heads, d // heads, chunk
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gate = nn.Linear(d, heads)

    def forward(self, x):
        B, L, D = x.shape
        heads = lambda t: t.view(B, L, self.h, self.dh).transpose(1, 2)   # noqa: E731
        q, k, v = heads(self.q(x)), heads(F.normalize(self.k(x), dim=-1)), heads(self.v(x))
        gate = torch.sigmoid(self.gate(x)).transpose(1, 2)                 # [B, h, L]
        W = torch.zeros(B, self.h, self.dh, self.dh, dtype=x.dtype)
        outs = []
        for i in range(L // self.chunk):
            s, e = i * self.chunk, (i + 1) * self.chunk
            outs.append(torch.einsum("bhnd,bhde->bhne", q[:, :, s:e], W))
            g = gate[:, :, s:e].mean(-1)[..., None, None]                  # [B, h, 1, 1]
            if self.kind == "state_gate":       # the decay read from the state itself
                g = torch.sigmoid(W.square().sum((-2, -1), keepdim=True))
            elif self.kind == "row_gate":       # one factor per row of the state
                g = torch.sigmoid(k[:, :, s:e].mean(-2))[..., None]       # [B, h, dh, 1]
            elif self.kind == "column_gate":    # one factor per column of the state
                g = torch.sigmoid(k[:, :, s:e].mean(-2))[..., None, :]    # [B, h, 1, dh]
            step = ("bhnd,bhne->bhed" if self.kind == "transposed" else "bhnd,bhne->bhde")
            W = g * W + torch.einsum(step, k[:, :, s:e], v[:, :, s:e])
        return torch.cat(outs, dim=2).transpose(1, 2).reshape(B, -1, D)


def _plan(conv, B):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


def _assert_matches(conv, layer, B, L, d):
    x = torch.randn(B, L, d, dtype=torch.float64, generator=torch.Generator().manual_seed(B * L))
    assert_same_function(conv, layer, [x], tol=F64)


_cache = module_scoped.cache()


def _converted(make, key, d, chunk):
    if key not in _cache:
        torch.manual_seed(0)
        layer = make().double()
        x = torch.randn(2, 6 * chunk, d, dtype=torch.float64)
        _cache[key] = layer, ttt2la.convert(layer, level=0, example_inputs=(x,))
    return _cache[key]


def _gated():
    return _converted(lambda: GatedChunkMemory(24, 3, 4), "zoo", 24, 4)


def test_the_zoo_gated_memory_lifts_with_its_decay():
    layer, conv = _gated()
    assert conv.ttt2la_report.layers[0].runtime == "block_linear_attention[torch]"
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan) and plan.lifted.decayed
    # einsum's moves of unit axes are read through, so features run over whole sequences
    assert plan.lifted.whole_sequence


@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), chunks=st.integers(1, 9), op=st.booleans())
def test_the_lifted_gated_memory_equals_its_loop(B, chunks, op):
    """On the op (forced) and on the loop over chunks the cost rule falls back to."""
    layer, conv = _gated()
    with scan_choice.scanning(op):
        _assert_matches(conv, layer, B, 4 * chunks, 24)
        plan = _plan(conv, B)
        assert plan.looped == (not op)
        assert ("block_linear_attention" in plan.implementation)
        assert plan.implementation.startswith("torch.vmap(") == (not op)


def test_the_cost_rule_loops_over_large_states_on_a_cpu():
    layer, conv = _gated()
    _assert_matches(conv, layer, 1, 16, 24)
    assert not _plan(conv, 1).looped                # 3 heads of 8 x 8: 192 elements
    wide = torch.zeros(4, 4, 64, 64)
    assert scan_choice.decayed_op_pays(torch.zeros(1, 3, 8, 8))
    assert not scan_choice.decayed_op_pays(wide)


def test_a_plain_decayed_memory_lifts():
    layer, conv = _converted(lambda: ChunkMemory("gate"), "gate", 8, 4)
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan) and plan.lifted.decayed
    for B, L in ((1, 4), (2, 12), (3, 28)):
        _assert_matches(conv, layer, B, L, 8)


@pytest.mark.parametrize("kind,axis", [("row_gate", -2), ("column_gate", -1)])
def test_a_decay_per_state_row_or_column_lifts(kind, axis):
    """One factor per row (column) of the state and chunk: the op's decay per key (value)
    channel, on the op and on the loop over chunks."""
    layer, conv = _converted(lambda: ChunkMemory(kind), kind, 8, 4)
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan) and plan.lifted.decayed
    assert plan.lifted.decay_axis == axis
    assert plan.lifted.decays_values == (kind == "column_gate")
    for op in (True, False):
        with scan_choice.scanning(op):
            for B, L in ((1, 4), (2, 20)):
                _assert_matches(conv, layer, B, L, 8)


class RowDecayMomentum(nn.Module):
    """A memory with momentum, optionally orthogonalised (two Newton–Schulz steps), decayed per
    row of the state (a gate per key channel; ``columns``: per column, a value channel) before
    each chunk's step."""

    def __init__(self, muon: bool, d=8, heads=2, chunk=4, columns=False):
        super().__init__()
        self.h, self.dh, self.chunk, self.muon, self.columns = heads, d // heads, chunk, muon, columns
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gate = nn.Linear(d, d)

    def forward(self, x):
        B, L, D = x.shape
        heads = lambda t: t.view(B, L, self.h, self.dh).transpose(1, 2)   # noqa: E731
        q, k, v = heads(self.q(x)), heads(F.normalize(self.k(x), dim=-1)), heads(self.v(x))
        gate = heads(torch.sigmoid(self.gate(x)))
        W = torch.zeros(B, self.h, self.dh, self.dh, dtype=x.dtype)
        M = torch.zeros_like(W)
        outs = []
        for s in range(0, L, self.chunk):
            e = s + self.chunk
            outs.append(q[:, :, s:e] @ W)
            M = 0.9 * M + k[:, :, s:e].mT @ v[:, :, s:e]
            step = M
            if self.muon:
                X = M / (M.norm(dim=(-2, -1), keepdim=True) + 1e-7)
                for _ in range(2):
                    A = X @ X.mT
                    X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
                step = X
            g = gate[:, :, s:e].mean(-2)
            W = (g[..., None, :] if self.columns else g[..., None]) * W + step
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, D)


@pytest.mark.parametrize("muon,columns", [(False, False), (True, False), (True, True)])
def test_a_decay_per_state_row_lifts_with_momentum_and_newton_schulz(muon, columns):
    layer, conv = _converted(lambda: RowDecayMomentum(muon, columns=columns),
                             ("row_momentum", muon, columns), 8, 4)
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan) and plan.lifted.decay_axis == (-1 if columns else -2)
    assert (plan.lifted.newton_schulz is not None) == muon
    with scan_choice.scanning(True):
        for B, L in ((1, 4), (3, 28)):
            _assert_matches(conv, layer, B, L, 8)


@pytest.mark.parametrize("kind", ["state_gate", "transposed"])
def test_look_alikes_are_not_lifted_as_decayed_and_stay_exact(kind):
    """A decay that reads the state, or an increment ``Vᵀ K`` written by the einsum where the
    read takes ``Kᵀ V``: each converts, none as the decayed block rule computing something
    else."""
    layer, conv = _converted(lambda: ChunkMemory(kind), kind, 8, 4)
    plan = _plan(conv, 2)
    assert not (isinstance(plan, LiftedPlan) and plan.lifted.decayed and kind == "state_gate")
    for B, L in ((1, 8), (2, 20)):
        _assert_matches(conv, layer, B, L, 8)
