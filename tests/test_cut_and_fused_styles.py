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
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import rel_rms_error
from ttt2la.zoo.fused_styles import (BaddbmmMuonLayer, LerpMomentumLayer, SplitZipLayer,
                                     UnbindDeltaLayer)


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


def test_multiply_adds_split_inside_loop_bodies_only():
    """``nn.Linear`` with a bias stays one ``addmm`` outside the traced code's loops, even when
    the caller itself runs in a loop (this test runner's do); inside a loop body it is a
    product and a sum, which the analysis reads."""
    from ttt2la.frontend.capture import trace

    lin = nn.Linear(4, 4)

    def outside(x):
        return lin(x)

    def inside(x):
        y = x
        for _ in range(2):
            y = lin(y)
        return y

    aten = torch.ops.aten
    ops = lambda fn: {n.target for n in trace(fn, torch.randn(2, 4)).graph.nodes}  # noqa: E731
    assert aten.addmm.default in ops(outside)
    inner = ops(inside)
    assert aten.addmm.default not in inner and aten.mm.default in inner


class NarrowLayer(nn.Module):
    """Chunks by ``narrow`` over whole chunks (``range(L // C)``), tokens by ``select``."""

    def __init__(self, per_token: bool, d: int = 8, chunk: int = 4):
        super().__init__()
        self.per_token, self.c = per_token, 1 if per_token else chunk
        self.proj = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for i in range(x.shape[1] // self.c):
            if self.per_token:
                qc, kc, vc = (t.select(1, i).unsqueeze(1) for t in (q, k, v))
            else:
                qc, kc, vc = (torch.narrow(t, 1, i * self.c, self.c) for t in (q, k, v))
            W = W + 0.5 * kc.mT @ vc
            outs.append(qc @ W)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("per_token", [False, True])
def test_narrow_and_select_cut_the_sequence_like_slices(per_token):
    """Before, discovery saw no slice in such a loop, traced it at a length with one iteration
    and refused it; now ``narrow``/``select`` with int arguments count as the slices they are."""
    torch.manual_seed(0)
    layer = NarrowLayer(per_token)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt2la_report.exact
    for B, L in ((1, 4), (3, 20)):
        assert_same_function(conv, layer, torch.randn(B, L, 8))


class FusedTokenUpdate(nn.Module):
    """A per-token memory decayed by a gate per head and token, its update written with one
    fused op: ``addcmul(a·S, k, v)``, ``lerp(kᵀv, S, a)`` (the step ``1 − a``), ``baddbmm`` on
    the heads flattened and viewed back, or ``addcdiv`` (the value divided by a positive
    norm); read with ``matmul`` into a buffer."""

    def __init__(self, d=16, heads=2, mode="addcmul"):
        super().__init__()
        self.heads, self.mode = heads, mode
        self.proj = nn.Linear(d, 4 * d, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v, g = (t.view(B, T, self.heads, -1).transpose(1, 2)
                      for t in self.proj(x).chunk(4, -1))
        a = torch.sigmoid(g.mean(-1) + 3)
        S = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        o = x.new_empty(B, self.heads, T, d // self.heads)
        for t in range(T):
            qt, kt, vt, at = q[:, :, t], k[:, :, t], v[:, :, t], a[:, :, t, None, None]
            col, row = kt.unsqueeze(-1), vt.unsqueeze(-2)
            if self.mode == "addcmul":
                S = torch.addcmul(S * at, col, row, value=0.5)
            elif self.mode == "addcdiv":
                S = torch.addcdiv(S * at, col, 1 + row.abs() + 0 * col)
            elif self.mode == "lerp":
                S = torch.lerp(col * row, S, at)
            else:
                S = torch.baddbmm((S * at).flatten(0, 1), col.flatten(0, 1),
                                  row.flatten(0, 1)).view_as(S)
            o[:, :, t] = torch.matmul(qt.unsqueeze(-2), S).squeeze(-2)
        return o.transpose(1, 2).reshape(B, T, d)


@pytest.mark.parametrize("mode", ["addcmul", "lerp", "baddbmm"])
def test_a_per_token_update_written_with_one_fused_op_runs_on_the_token_causal_op(mode):
    """Each fused op is read through its definition; ``lerp``'s step ``1 − a`` scales each
    token's values; the state read after a ``baddbmm`` is a view of its result: all on the op,
    exact."""
    from equivalence import converted_onto

    layer = FusedTokenUpdate(mode=mode)
    assert_same_function(converted_onto(layer, "chunk_linear_attention"), layer,
                         [torch.randn(1, 1, 16), torch.randn(3, 40, 16)])


def test_an_update_divided_elementwise_is_read_through_addcdiv_and_stays_exact():
    """``addcdiv`` is decomposed too (the loop body holds its ``div``, no fused op); the
    quotient of the key's column by a value-dependent matrix is no outer product, so the loop
    keeps the generic plan, exact."""
    from ttt2la.converted import is_converted

    layer = FusedTokenUpdate(mode="addcdiv")
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 16),))
    report, = conv.ttt2la_report.layers
    assert "chunk_linear_attention" not in report.runtime, report.runtime
    body = next(m._ttt2la for m in conv.modules() if is_converted(m)).program.body.graph
    targets = {n.target for n in body.nodes}
    assert torch.ops.aten.div.Tensor in targets and torch.ops.aten.addcdiv.default not in targets
    assert_same_function(conv, layer, torch.randn(2, 30, 16))


@pytest.mark.parametrize("how", ["list", "generator"])
def test_chunks_made_before_the_loop_are_the_split_layer(how):
    """The zoo's chunks made before the loop compute ``SplitZipLayer``'s function, lifted as it is."""
    from ttt2la.zoo import ListedChunksLayer

    torch.manual_seed(0)
    split = SplitZipLayer()
    layer = ListedChunksLayer(how=how)
    layer.load_state_dict(split.state_dict())
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt2la_report.exact
    assert conv.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")
    x = torch.randn(3, 13, 8)
    with torch.no_grad():
        assert rel_rms_error(layer(x), split(x)) <= 1e-6
    assert_same_function(conv, layer, [x, torch.randn(1, 4, 8)])
