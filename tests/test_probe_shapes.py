"""Layers that run only at some batch sizes still convert: recognition traces them at shapes derived
from the example, the converted layer covers exactly the batch sizes those traces cover, says so in
its report, and refuses any other batch size with ``UnsupportedShapeError``.

The layers here are small linear-TTT loops written for these tests: one tiles per-head fast weights
over a batch with the heads folded in (multiples of the head count only), one keeps an initial fast
weight per batch slot (its example's batch size only).
"""
from __future__ import annotations

import math

import pytest
import module_scoped
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from ttt2la.frontend.recognize import ProbePlan, probe_plans
from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]


class FoldedHeadsTTT(nn.Module):
    """Per-head linear fast weights; the caller folds the heads into the batch ([B·H, L, D])."""

    def __init__(self, heads: int, dim: int, chunk: int):
        super().__init__()
        self.heads, self.chunk = heads, chunk
        self.proj = nn.Linear(dim, 3 * dim, bias=False)
        self.w0 = nn.Parameter(torch.randn(heads, dim, dim) / math.sqrt(dim))

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = self.w0.repeat(x.shape[0] // self.heads, 1, 1)        # [B·H, D, D]
        outs = []
        for s in range(0, x.shape[1], self.chunk):
            outs.append(torch.bmm(q[:, s:s + self.chunk], W))
            W = W + 0.1 * torch.bmm(k[:, s:s + self.chunk].transpose(1, 2), v[:, s:s + self.chunk])
        return torch.cat(outs, dim=1)


class PerSlotTTT(nn.Module):
    """An initial fast weight per batch slot: it runs at batch ``slots`` and nowhere else."""

    def __init__(self, slots: int, dim: int, chunk: int):
        super().__init__()
        self.chunk = chunk
        self.proj = nn.Linear(dim, 3 * dim, bias=False)
        self.w0 = nn.Parameter(torch.randn(slots, dim, dim) / math.sqrt(dim))

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = self.w0
        outs = []
        for s in range(0, x.shape[1], self.chunk):
            outs.append(q[:, s:s + self.chunk] @ W)
            W = W + 0.1 * k[:, s:s + self.chunk].transpose(1, 2) @ v[:, s:s + self.chunk]
        return torch.cat(outs, dim=1)


class LengthPinnedTTT(PerSlotTTT):
    """Runs at its example length only: no probe shape can trace it."""

    def forward(self, x):
        if x.shape[1] != 13:
            raise ValueError("this layer takes sequences of 13 tokens")
        return super().forward(x)


_converted = module_scoped.cache()


def _convert(kind: str):
    if kind not in _converted:
        torch.manual_seed(0)
        if kind == "heads":                      # 3 heads, example batch 2 -> folded batch 6
            layer = FoldedHeadsTTT(3, 4, 4)
            x = torch.randn(6, 13, 4)
        else:                                    # 3 slots, example batch 3
            layer = PerSlotTTT(3, 4, 4)
            x = torch.randn(3, 13, 4)
        _converted[kind] = (layer, ttt2la.convert(layer, level=0, example_inputs=(x,)))
    return _converted[kind]


def _assert_same(conv, layer, x):
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    ya, yb = conv(xa), layer(xb)
    assert rel_rms_error(ya, yb) <= FP32
    g = torch.randn_like(yb)
    ga = torch.autograd.grad((ya * g).sum(), [xa, *conv.parameters()])
    gb = torch.autograd.grad((yb * g).sum(), [xb, *layer.parameters()])
    for a, b in zip(ga, gb):
        assert rel_rms_error(a, b) <= FP32


def test_plans_go_from_general_to_the_example_batch_alone():
    plans = probe_plans(6, 13)
    assert plans[0] == ProbePlan(1, False, False)              # batches 2 and 3, any batch after
    assert [p.unit for p in plans if not p.fixed] == [1, 1, 2, 2, 3, 3, 6, 6]
    assert plans[-2:] == [ProbePlan(6, True, False), ProbePlan(6, True, True)]
    # lengths: the usual three updates and one more token, or the example's chunk remainder kept
    assert ProbePlan().lengths(4, 13) == (14, 15)
    assert ProbePlan(structured=True).lengths(4, 13) == (13, 17)
    assert ProbePlan(structured=True).lengths(4, 16) == (16, 20)
    assert ProbePlan(2, True).batches == (1, 2)


def test_folded_heads_convert_for_multiples_of_the_head_count():
    layer, conv = _convert("heads")
    report = conv.ttt2la_report.layers[0]
    assert report.exact
    (note,) = [n for n in report.notes if "converted for" in n]
    assert "multiples of 3" in note and "batch 6 and 9" in note
    assert "RuntimeError" in note                 # the failure of the general probe, quoted


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(copies=st.integers(1, 4), L=st.integers(1, 27))
def test_folded_heads_equal_the_layer_at_every_multiple(copies, L):
    layer, conv = _convert("heads")
    _assert_same(conv, layer, torch.randn(3 * copies, L, 4))


@pytest.mark.parametrize("batch", [1, 2, 4, 5, 7])
def test_folded_heads_at_other_batch_sizes_fail_as_written(batch):
    """An exact conversion runs a call at a batch size its traces do not cover as written:
    where the code fails there, its own error, naming its line and what the traces cover."""
    layer, conv = _convert("heads")
    with pytest.raises(ttt2la.RejectedCallError, match=f"batch size {batch}.*multiples of 3") \
            as refused:
        conv(torch.randn(batch, 9, 4))
    assert "test_probe_shapes.py" in str(refused.value)


@settings(max_examples=8, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(L=st.integers(1, 27))
def test_a_layer_taking_only_its_example_batch_converts_for_that_batch(L):
    layer, conv = _convert("slots")
    report = conv.ttt2la_report.layers[0]
    assert report.exact
    assert any("converted for batch size 3 only" in n for n in report.notes)
    _assert_same(conv, layer, torch.randn(3, L, 4))


@pytest.mark.parametrize("batch", [2, 6])
def test_a_fixed_batch_layer_at_other_batch_sizes_fails_as_written(batch):
    _layer, conv = _convert("slots")
    with pytest.raises(ttt2la.RejectedCallError, match="batch size 3 only") as info:
        conv(torch.randn(batch, 10, 4))
    assert "Pass inputs the layer as written accepts" in str(info.value)     # what to do


def test_a_fixed_batch_layer_runs_as_written_where_its_code_runs():
    """At batch 1 the per-slot weights broadcast, and the layer as written runs: its exact
    conversion, traced at batch 3 only, was refused there; it runs the code as written, the
    report's runs saying why."""
    layer, conv = _convert("slots")
    _assert_same(conv, layer, torch.randn(1, 10, 4))
    ran = conv.ttt2la_report.layers[0].runs["batch 1, length 10, untraced batch size"]
    assert ran.startswith("as written: batch size 1, where the layer was traced at batch size 3 "
                          "only"), ran


def test_a_layer_that_runs_at_any_batch_keeps_the_general_probe():
    torch.manual_seed(1)
    layer = FoldedHeadsTTT(1, 4, 4)              # one head: any batch works
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 13, 4),))
    assert not any("converted for" in n for n in conv.ttt2la_report.layers[0].notes)
    for batch in (1, 5):
        _assert_same(conv, layer, torch.randn(batch, 11, 4))


def test_a_layer_no_probe_shape_can_trace_is_refused_with_what_was_tried():
    torch.manual_seed(2)
    layer = LengthPinnedTTT(2, 4, 4)
    with pytest.raises(ttt2la.UnsupportedTTTError,
                       match="runs at its example's shape, but its own code fails at every shape "
                             "ttt2la must trace it at") as info:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 13, 4),))
    assert "ValueError: this layer takes sequences of 13 tokens" in str(info.value)


class PinnedBatchStep(torch.nn.Module):
    """One test-time step over all tokens whose code holds its batch size in an attribute, so
    it runs at that batch size only (at another, its reshape feeds a projection the wrong
    width)."""

    def __init__(self, d: int = 4, batch: int = 2):
        super().__init__()
        self.batch, self.qkv = batch, torch.nn.Linear(d, 3 * d, bias=False)
        self.w = torch.nn.Parameter(torch.randn(d, d))

    def forward(self, x):
        rows = x.reshape(self.batch * x.shape[1], -1)
        q, k, v = self.qkv(rows).reshape(self.batch, x.shape[1], -1).chunk(3, -1)
        return q @ (self.w + k.transpose(1, 2) @ v)


def test_a_single_step_taking_only_its_example_batch_converts_for_that_batch():
    """The step traced at its example's batch size (2) but not at the probe's other (3): it was
    refused, naming no line of its code. It converts for that batch size, exactly, and the
    report says why, naming the line that fails at the other. At another batch size the code
    as written runs, and fails with its own error."""
    torch.manual_seed(0)
    layer = PinnedBatchStep()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 6, 4),))
    report = conv.ttt2la_report.layers[0]
    assert any(n.startswith("converted for batch size 2 only: the layer's own code fails at "
                            "batch size 3, length ") and "test_probe_shapes.py" in n
               for n in report.notes), report.notes
    _assert_same(conv, layer, torch.randn(2, 9, 4))
    with pytest.raises(ttt2la.RejectedCallError, match="batch size 2 only"):
        conv(torch.randn(3, 6, 4))
