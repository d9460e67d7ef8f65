"""A normaliser written with the memory's gates rides the token-causal op as a value column.

xLSTM's mLSTM (``zoo.MLSTMLayer``) keeps ``C' = f C + i kᵀv`` and ``n' = f n + i k`` and reads
``q C / max(|q·n|, 1)``: ``n`` is the column of values ``i_t`` under the memory's keys, or of ones
where the gate is written on the key both are built from (``shared_keys``). Wherever the gate is
written, the layer must run on ``chunk_linear_attention`` with ``n`` as a value column, exact at
levels 0–2 (outputs and every parameter gradient within the fp32 tolerance, ≤ 1e-10 in float64).
Look-alikes — a normaliser decayed by another gate, gated per key channel, or written without the
gate the memory's key carries or with another — are no column of the memory: they keep the
generic plan, still exact. With the memory's gate on its values, a normaliser through a gate of
its own is that gate's column, and lifts.
"""
from __future__ import annotations

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function, assert_streams, converted_onto
from ttt2la.zoo import MLSTMLayer
from ttt2la.zoo.mlstm import GATE_PLACES

F64 = 1e-10
COLUMN = "chunk_linear_attention[torch], n as value columns"


class MLSTMLookAlike(nn.Module):
    """An mLSTM whose memory has its input gate on the key (``memory_gate="keys"``) or on the
    values (``"values"``) and whose normaliser is written its own way: ``"own_decay"`` decayed by
    a forget gate of its own, ``"channel_gate"`` gated per key channel, ``"bare"`` with the bare
    key, ``"other_gate"`` through an input gate of its own."""

    def __init__(self, normaliser: str, memory_gate: str = "keys", d_model: int = 16,
                 num_heads: int = 2):
        super().__init__()
        self.normaliser, self.memory_gate = normaliser, memory_gate
        self.h, self.dh = num_heads, d_model // num_heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.gates = torch.nn.Linear(d_model, 3 * num_heads)
        self.channels = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).unbind(2)
        i, f, g = torch.sigmoid(self.gates(x)).chunk(3, dim=-1)            # [B, T, h]
        channel = torch.sigmoid(self.channels(x)).view(B, T, self.h, self.dh)
        C, n = x.new_zeros(B, self.h, self.dh, self.dh), x.new_zeros(B, self.h, self.dh)
        hs = []
        for t in range(T):
            f_t, g_t = f[:, t, :, None], g[:, t, :, None]
            i_t, gated_k = i[:, t, :, None], i[:, t, :, None] * k[:, t]
            C = f_t[..., None] * C + (
                torch.einsum("bhk,bhv->bhkv", gated_k, v[:, t]) if self.memory_gate == "keys"
                else torch.einsum("bhk,bhv->bhkv", k[:, t], i_t * v[:, t]))
            if self.normaliser == "own_decay":
                n = g_t * n + gated_k
            elif self.normaliser == "channel_gate":
                n = f_t * n + channel[:, t] * k[:, t]
            elif self.normaliser == "bare":
                n = f_t * n + k[:, t]
            else:
                n = f_t * n + g_t * k[:, t]
            num = torch.einsum("bhk,bhkv->bhv", q[:, t], C)
            den = torch.einsum("bhk,bhk->bh", q[:, t], n).abs().clamp(min=1.0)
            hs.append(num / den[..., None])
        return torch.stack(hs, 1).reshape(B, T, D)


_cache = module_scoped.cache()


def _converted(level, gated=True, gate="update", d=16, heads=2, dtype=torch.float32):
    """The layer and its conversion at ``level``, converted once per configuration."""
    key = (level, gated, gate, d, heads, dtype)
    if key not in _cache:
        torch.manual_seed(0)
        layer = MLSTMLayer(d, heads, gated, gate).to(dtype)
        x = torch.randn(2, 9, d, dtype=dtype)
        _cache[key] = layer, ttt2la.convert(layer, level=level, example_inputs=(x,))
    return _cache[key]


@pytest.mark.parametrize("gate", GATE_PLACES)
@pytest.mark.parametrize("level", [0, 1, 2])
def test_the_gated_normaliser_rides_the_token_causal_op(level, gate):
    layer, conv = _converted(level, gate=gate)
    report, = conv.ttt2la_report.layers
    assert report.runtime == COLUMN, report.runtime
    assert conv.ttt2la_report.exact
    assert_same_function(conv, layer, [torch.randn(1, 1, 16), torch.randn(2, 23, 16)])


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 60), gated=st.booleans(),
       gate=st.sampled_from(GATE_PLACES), level=st.integers(0, 2),
       shape=st.sampled_from([(16, 2), (12, 3), (8, 1)]))
def test_mlstm_converts_exactly_on_the_op_fp32(B, L, gated, gate, level, shape):
    d, heads = shape
    layer, conv = _converted(level, gated, gate, d, heads)
    assert conv.ttt2la_report.layers[0].runtime == COLUMN
    x = torch.randn(B, L, d, generator=torch.Generator().manual_seed(B * 100 + L))
    assert_same_function(conv, layer, x)


@pytest.mark.parametrize("gate", GATE_PLACES)
def test_mlstm_converts_exactly_on_the_op_float64(gate):
    layer, conv = _converted(2, gate=gate, d=12, heads=3, dtype=torch.float64)
    assert conv.ttt2la_report.layers[0].runtime == COLUMN
    assert_same_function(conv, layer, torch.randn(2, 41, 12, dtype=torch.float64), tol=F64)


@pytest.mark.parametrize("normaliser, memory_gate", [
    ("own_decay", "keys"), ("own_decay", "values"), ("channel_gate", "values"),
    ("bare", "keys"), ("other_gate", "keys")])
def test_a_normaliser_unlike_the_memory_keeps_the_generic_plan(normaliser, memory_gate):
    """Decayed by another gate, gated per key channel, or written without the gate the memory's
    key carries or with another (a column of ``g_t / i_t``, which the loop never computes): no
    column of the memory — not lifted, exact on the generic plan."""
    torch.manual_seed(0)
    layer = MLSTMLookAlike(normaliser, memory_gate)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 9, 16),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("torch.vmap("), report.runtime
    assert_same_function(conv, layer, torch.randn(2, 30, 16))


@pytest.mark.parametrize("normaliser", ["other_gate", "bare"])
def test_a_normaliser_of_the_memorys_keys_is_a_column_whatever_its_gate(normaliser):
    """With the memory's gate on its values, its keys are the bare ``k``: a normaliser written
    through an input gate of its own is the column of that gate's values, one written with the
    bare key the column of ones — both lifted, exact."""
    torch.manual_seed(0)
    layer = MLSTMLookAlike(normaliser, "values")
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 9, 16),))
    report, = conv.ttt2la_report.layers
    assert report.runtime == COLUMN, report.runtime
    assert_same_function(conv, layer, [torch.randn(1, 1, 16), torch.randn(2, 30, 16)])


def test_the_gated_normaliser_streams():
    """Fed in pieces, the converted layer carries the normaliser with the memory: the pieces
    give the whole sequence's outputs."""
    torch.manual_seed(0)
    layer = MLSTMLayer(16, 2)
    assert_streams(converted_onto(layer, "chunk_linear_attention"), layer, torch.randn(2, 29, 16))
