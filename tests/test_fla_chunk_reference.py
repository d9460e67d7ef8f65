"""Gated linear attention written chunk by chunk (``zoo.fla_chunk_reference``): the state read
before each chunk, the in-chunk attention built by the layer, the state decayed per head, per
key channel or per value channel and given the chunk's keys and values.

The gated rules lift onto ``block_linear_attention`` with their decay — one factor per head and
chunk, one per key channel (a row of the state) and chunk, or one per value channel (a column,
the op's ``value_decay``) and chunk — and convert exactly (outputs and every gradient within the
fp32 bound, ≤ 1e-10 in float64) on the op and on the loop over chunks the CPU's cost rule falls
back to; linear attention's normaliser rides the op as a value column. A state multiplied on the
right by a whole matrix (``S @ M``) is no decay per column: the generic plan, exact.
"""
from __future__ import annotations

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function, converted_onto
from ttt2la.lowering import LiftedPlan, scan_choice
from ttt2la.zoo import FlaChunkReferenceLayer
from ttt2la.zoo.fla_chunk_reference import CHUNK_RULES

F64 = 1e-10
D, HEADS, CHUNK = 16, 2, 4


def _plan(conv, B):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


_cache = module_scoped.cache()


def _converted(rule, dtype=torch.float32):
    if (rule, dtype) not in _cache:
        torch.manual_seed(0)
        layer = FlaChunkReferenceLayer(D, HEADS, rule, CHUNK).to(dtype)
        _cache[rule, dtype] = layer, converted_onto(layer, "block_linear_attention",
                                                    (2, 6 * CHUNK, D), dtype)
    return _cache[rule, dtype]


@pytest.mark.parametrize("rule,axis", [("simple_gla", None), ("gla", -2), ("gla_value", -1)])
def test_each_rule_lifts_with_its_decay(rule, axis):
    """Per head: one factor per matrix; per key channel: one per row of the state; per value
    channel: one per column."""
    _, conv = _converted(rule)
    plan = _plan(conv, 2)
    assert isinstance(plan, LiftedPlan) and plan.lifted.decayed
    assert plan.lifted.decay_axis == axis
    assert plan.lifted.decays_values == (rule == "gla_value")


def test_the_normaliser_rides_the_op_as_a_value_column():
    """``z`` is the column of ones under the state's keys: one op call, no decay."""
    _, conv = _converted("linear_attn")
    report, = conv.ttt2la_report.layers
    assert report.runtime == "block_linear_attention[torch], z as value columns", report.runtime
    assert not _plan(conv, 2).lifted.decayed


@settings(max_examples=8, deadline=None)
@given(rule=st.sampled_from(CHUNK_RULES), B=st.integers(1, 3), chunks=st.integers(1, 9),
       op=st.booleans())
def test_chunked_references_convert_exactly_float64(rule, B, chunks, op):
    """On the op (forced) and, for a decayed state, on the loop over chunks; the plan that ran
    is the one forced (an undecayed state always runs the op)."""
    layer, conv = _converted(rule, torch.float64)
    x = torch.randn(B, CHUNK * chunks, D, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(B * chunks))
    with scan_choice.scanning(op):
        assert_same_function(conv, layer, x, tol=F64)
        plan = _plan(conv, B)
        assert plan.looped == (not op and plan.lifted.decayed)


@pytest.mark.parametrize("rule", CHUNK_RULES)
def test_chunked_references_convert_exactly_fp32(rule):
    layer, conv = _converted(rule)
    with scan_choice.scanning(True):
        assert_same_function(conv, layer, [torch.randn(2, 8 * CHUNK, D),
                                           torch.randn(3, 3 * CHUNK, D)])


class ColumnDecay(nn.Module):
    """A chunk loop whose state is decayed on its columns, per value channel (``mix=False``:
    ``S * last[:, :, None, :]``, the state laid out key-first or, ``value_first``, transposed)
    or by a whole matrix on the right (``mix=True``: ``S @ M``, which no decay per column is)."""

    def __init__(self, mix=False, value_first=False, dv=D):
        super().__init__()
        self.mix, self.value_first, self.dv = mix, value_first, dv
        self.qkv = nn.Linear(D, 2 * D + dv, bias=False)
        self.gate = nn.Linear(D, dv)
        self.M = nn.Parameter(torch.eye(dv // HEADS) * 0.9 + 0.01) if mix else None

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, HEADS, -1).transpose(1, 2)
                   for t in self.qkv(x).split([D, D, self.dv], -1))
        g = torch.nn.functional.logsigmoid(self.gate(x)).view(B, T, HEADS, -1).transpose(1, 2)
        S = q.new_zeros(B, HEADS, D // HEADS, self.dv // HEADS)
        if self.value_first:
            S = S.mT
        outs = []
        for s in range(0, T, CHUNK):
            qc, kc, vc = q[:, :, s:s + CHUNK], k[:, :, s:s + CHUNK], v[:, :, s:s + CHUNK]
            last = g[:, :, s:s + CHUNK].sum(-2).exp()                 # [B, H, Dv]
            if self.value_first:
                outs.append((S @ qc.mT).mT)
                S = last[..., None] * S + vc.mT @ kc
            elif self.mix:
                outs.append(qc @ S)
                S = S @ self.M + kc.mT @ vc
            else:
                outs.append(qc @ S)
                S = S * last[:, :, None, :] + kc.mT @ vc
        return torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, self.dv)


@pytest.mark.parametrize("value_first,dv", [(False, D), (True, 2 * D)])
def test_a_decay_per_value_channel_runs_on_the_block_op(value_first, dv):
    """Whichever way the state is laid out, square or not: the op's ``value_decay``, exact in
    float64 on the op at ragged lengths."""
    torch.manual_seed(0)
    layer = ColumnDecay(value_first=value_first, dv=dv).double()
    conv = converted_onto(layer, "block_linear_attention", (2, 6 * CHUNK, D), torch.float64)
    assert _plan(conv, 2).lifted.decays_values
    with scan_choice.scanning(True):
        assert_same_function(conv, layer, [torch.randn(2, 5 * CHUNK + 3, D, dtype=torch.float64),
                                           torch.randn(1, 2, D, dtype=torch.float64)], tol=F64)


def test_a_state_mixed_by_a_matrix_on_the_right_keeps_the_generic_plan():
    """``S @ M`` mixes the columns: no decay per column, the generic plan, exact."""
    torch.manual_seed(0)
    layer = ColumnDecay(mix=True).double()
    conv = converted_onto(layer, "torch.vmap", (2, 6 * CHUNK, D), torch.float64)
    assert not isinstance(_plan(conv, 2), LiftedPlan)
    assert_same_function(conv, layer, [torch.randn(2, 5 * CHUNK, D, dtype=torch.float64)],
                         tol=F64)


def test_an_explicit_triton_backend_is_refused_at_convert_time_for_columns():
    """No Triton kernel takes ``value_decay``: ``backend="triton"`` says so when converting."""
    layer = FlaChunkReferenceLayer(D, HEADS, "gla_value", CHUNK)
    with scan_choice.scanning(True), pytest.raises(ttt2la.UnsupportedTTTError,
                                                   match="block_linear_attention.*triton"):
        ttt2la.convert(layer, level=0, backend="triton",
                       example_inputs=(torch.randn(2, 6 * CHUNK, D),))


@pytest.mark.parametrize("rule", CHUNK_RULES)
def test_every_level_converts_exactly_with_nothing_to_simplify(rule):
    """No Θ, no weight norm, no MLP kernel, no per-token rate, momentum or Muon: every step
    finds nothing to do (the keys weighted by their decay are no MLP of Θ for collapse_mlp),
    and every level is the layer itself on the op."""
    layer, _ = _converted(rule)
    x = torch.randn(2, 6 * CHUNK, D)
    for level in range(7):
        conv = ttt2la.convert(layer, level=level, example_inputs=(x,))
        report, = conv.ttt2la_report.layers
        assert report.exact and report.runtime.startswith("block_linear_attention"), level
        assert_same_function(conv, layer, x)


@pytest.mark.parametrize("rule", CHUNK_RULES)
def test_a_gradient_penalty_through_the_converted_layer_is_the_originals(rule):
    """Second-order gradients (``create_graph=True``, as a gradient penalty takes them) through
    the block op with its decay equal the layer's own, float64: the op's hand-written backward
    is differentiated through its plain form, no second-order term dropped."""
    layer, conv = _converted(rule, torch.float64)
    x = torch.randn(2, 6 * CHUNK, D, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(4))
    results = []
    for module in (conv, layer):
        xr = x.clone().requires_grad_(True)
        with scan_choice.scanning(True):                     # the op, not a loop over chunks
            first, = torch.autograd.grad(module(xr).pow(2).sum(), xr, create_graph=True)
        results.append(torch.autograd.grad(first.pow(2).sum(), [xr, *module.parameters()]))
    for got, want in zip(*results):
        assert ttt2la.testing.rel_rms_error(got, want) <= F64
