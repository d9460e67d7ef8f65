"""Linear attention's normaliser written chunk by chunk rides the block op as a value column.

A loop over chunks keeping ``S' = γ S + Kᵀ V`` and ``z' = γ z + Σ_chunk k`` and reading
``Q z`` beside ``Q S`` runs ``block_linear_attention`` once on values widened by a column of ones
(``lowering.shared_keys``): ``[S | z]' = γ [S | z] + Kᵀ [V | 1]``. Wherever the read is spelt
(a product with ``z`` as a column, an ``einsum``, a summed product), read before the chunk's
update (with the chunk's own attention) or after it, gated once per chunk or not, the layer
converts exactly on the op, at levels 0–2, outputs and every parameter gradient; so does a
normaliser of twice the keys (a column of twos) or beside a state written at a constant rate.
Look-alikes — a normaliser of other keys, decayed by a gate of its own, or beside a state whose
increment has a rate per chunk the column would take too — are no column of the state: the
generic plan, still exact.
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
from equivalence import assert_same_function, assert_streams

F64 = 1e-10
COLUMN = "block_linear_attention[torch], z as value columns"
READS = ("matmul", "einsum", "summed")
LOOK_ALIKES = ("other_keys", "own_decay", "rated_state")
COLUMNS = ("twice_keys", "half_rate")


class ChunkedNormalised(nn.Module):
    """Normalised linear attention over chunks of ``chunk`` tokens, heads ``[B, H, T, d]``:
    ``read`` spells ``q·z``, ``after`` reads once the chunk is written (no in-chunk attention),
    ``gated`` decays both memories by one factor per head and chunk (from the chunk's keys, a
    learnt bias per head; ``"fixed"``: the bias alone); ``variant`` makes one of the
    look-alikes."""

    def __init__(self, read="matmul", after=False, gated=False, variant=None, d=16, heads=2,
                 chunk=4):
        super().__init__()
        self.read, self.after, self.gated, self.variant = read, after, gated, variant
        self.h, self.chunk = heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.decay = nn.Parameter(torch.linspace(1.0, 3.0, heads))

    def _qz(self, qc, z):
        if self.read == "matmul":
            return qc @ z.unsqueeze(-1)
        if self.read == "einsum":
            return torch.einsum("bhck,bhk->bhc", qc, z).unsqueeze(-1)
        return (qc * z.unsqueeze(2)).sum(-1, keepdim=True)

    def _write(self, S, z, kc, vc):
        g = None
        if self.gated == "fixed":
            g = torch.sigmoid(self.decay)[:, None]
        elif self.gated:
            g = torch.sigmoid(kc.mean(2).mean(-1, keepdim=True) + self.decay[:, None])
        kv = kc.mT @ vc
        keys = vc.sum(2) if self.variant == "other_keys" else kc.sum(2)
        if self.variant == "twice_keys":
            keys = 2 * keys
        elif self.variant == "half_rate":
            kv = 0.5 * kv
        elif self.variant == "rated_state":          # a rate per head and chunk
            kv = torch.sigmoid(kc.mean((2, 3)))[..., None, None] * kv
        if g is None:
            return S + kv, z + keys
        gz = g * g if self.variant == "own_decay" else g
        return g[..., None] * S + kv, gz * z + keys

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        S = q.new_zeros(B, self.h, q.shape[-1], q.shape[-1])
        z = q.new_zeros(B, self.h, q.shape[-1])
        outs = []
        for s in range(0, T, self.chunk):
            qc, kc, vc = (t[:, :, s:s + self.chunk] for t in (q, k, v))
            if self.after:
                S, z = self._write(S, z, kc, vc)
                outs.append(qc @ S / (self._qz(qc, z) + 1e-6))
                continue
            attn = (qc @ kc.mT).tril()
            outs.append((qc @ S + attn @ vc) / (self._qz(qc, z) + attn.sum(-1, keepdim=True)))
            S, z = self._write(S, z, kc, vc)
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, T, D)


_cache = module_scoped.cache()


def _converted(level=2, dtype=torch.float32, **options):
    key = (level, dtype, *sorted(options.items()))
    if key not in _cache:
        torch.manual_seed(0)
        layer = ChunkedNormalised(**options).to(dtype)
        x = torch.randn(2, 24, 16, dtype=dtype)
        _cache[key] = layer, ttt2la.convert(layer, level=level, example_inputs=(x,))
    return _cache[key]


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("read", READS)
def test_the_normaliser_rides_the_block_op(read, after):
    layer, conv = _converted(read=read, after=after)
    report, = conv.ttt2la_report.layers
    assert report.runtime == COLUMN, report.runtime
    assert report.exact
    assert_same_function(conv, layer, [torch.randn(1, 1, 16), torch.randn(3, 22, 16)])


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("variant", COLUMNS)
def test_a_constant_column_or_rate_rides_the_op(variant, after):
    layer, conv = _converted(variant=variant, gated=True, after=after)
    assert conv.ttt2la_report.layers[0].runtime == COLUMN
    assert_same_function(conv, layer, [torch.randn(2, 24, 16), torch.randn(1, 13, 16)])


@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 40), read=st.sampled_from(READS),
       after=st.booleans(), gated=st.booleans(), level=st.integers(0, 2))
def test_chunked_normalisers_convert_exactly_fp32(B, L, read, after, gated, level):
    layer, conv = _converted(level, read=read, after=after, gated=gated)
    assert conv.ttt2la_report.layers[0].runtime == COLUMN
    x = torch.randn(B, L, 16, generator=torch.Generator().manual_seed(B * 100 + L))
    assert_same_function(conv, layer, x)


@pytest.mark.parametrize("after", [False, True])
def test_a_gated_normaliser_is_exact_in_float64(after):
    layer, conv = _converted(dtype=torch.float64, after=after, gated=True)
    assert conv.ttt2la_report.layers[0].runtime == COLUMN
    assert_same_function(conv, layer, [torch.randn(2, 30, 16, dtype=torch.float64)], tol=F64)


def test_a_fixed_gate_converts_exactly():
    """A gate from parameters alone reaches the loop as two inputs (``g`` and its view), which
    the lift cannot confirm are one decay: whatever plan runs, the layer is exact."""
    layer, conv = _converted(gated="fixed")
    assert conv.ttt2la_report.exact
    assert_same_function(conv, layer, [torch.randn(2, 24, 16), torch.randn(1, 13, 16)])


@pytest.mark.parametrize("after", [False, True])
@pytest.mark.parametrize("variant", LOOK_ALIKES)
def test_a_normaliser_unlike_the_state_keeps_the_generic_plan(variant, after):
    layer, conv = _converted(variant=variant, gated=variant == "own_decay", after=after)
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("torch.vmap"), report.runtime
    assert report.exact
    assert_same_function(conv, layer, [torch.randn(2, 24, 16), torch.randn(1, 13, 16)])


@pytest.mark.parametrize("after", [False, True])
def test_the_normaliser_streams(after):
    """Whole chunks carried from call to call, the column's state with the memory's."""
    layer, conv = _converted(level=0, after=after, gated=True)
    assert_streams(conv, layer, torch.randn(2, 24, 16), [8, 4, 12])
