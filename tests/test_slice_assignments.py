"""Slice assignments (``a[:, i, :i] = y``) in a layer's code, outside its loop and inside it.

Functionalization writes them as ``slice_scatter`` of an ``aten.copy``, which torch cannot
differentiate; ``frontend/slice_assignments`` reads each copy as the value it writes. Converted
layers that assign into slices — broadcast, cast, before the loop, or inside the loop on a tensor
the body builds (the forward substitution of a chunk's UT transform, as flash-linear-attention's
references write it) — give the original's outputs and every gradient, at any length.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.frontend.capture import trace
from ttt2la.frontend.slice_assignments import select_writes_as_slice_writes
from ttt2la.testing import TOLERANCE, rel_rms_error

aten = torch.ops.aten


class AssignsBeforeTheLoop(torch.nn.Module):
    """A chunked linear-attention layer whose keys are edited by slice assignment before the
    loop: scaled in place, one feature set to a learned vector (broadcast), one written back
    from float64 (cast)."""

    def __init__(self, d: int = 8, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.first = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = k.clone()
        k[:, :, :2] = k[:, :, :2] * 2.0
        k[:, 0] = self.first
        k[:, :, -1:] = k[:, :, -1:].double() * 0.5
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], self.C):
            outs.append(q[:, s:s + self.C] @ S)
            S = S + k[:, s:s + self.C].transpose(1, 2) @ v[:, s:s + self.C]
        return torch.cat(outs, 1)


class ForwardSubstitutionInTheLoop(torch.nn.Module):
    """Each chunk's attention matrix built row by row in place (``a[:, i, :i] = …``), as the
    UT transform's forward substitution is written in flash-linear-attention's references."""

    def __init__(self, d: int = 8, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], self.C):
            qc, kc, vc = q[:, s:s + self.C], k[:, s:s + self.C], v[:, s:s + self.C]
            c = kc.shape[1]
            a = -(kc @ kc.transpose(-1, -2)).tril(-1) * 0.1
            for i in range(1, c):
                a[:, i, :i] = a[:, i, :i] + (a[:, i, :, None].clone() * a[:, :, :i].clone()).sum(-2)
            a = a + torch.eye(c)
            outs.append(qc @ S + a @ vc)
            S = S + kc.transpose(-1, -2) @ vc
        return torch.cat(outs, 1)


class DeltaRuleChunks(torch.nn.Module):
    """DeltaNet chunk by chunk with its UT transform solved by forward substitution in place,
    in the style of flash-linear-attention's chunkwise reference: a state update the generic
    executor runs, its body vmapped over chunks."""

    def __init__(self, d: int = 8, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.beta = torch.nn.Linear(d, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = torch.nn.functional.normalize(k, dim=-1)
        beta = torch.sigmoid(self.beta(x))
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], self.C):
            qc, kc, vc, bc = (t[:, s:s + self.C] for t in (q, k, v, beta))
            c = kc.shape[1]
            kb = kc * bc
            a = -(kb @ kc.transpose(-1, -2)).tril(-1)
            for i in range(1, c):
                a[:, i, :i] = a[:, i, :i] + (a[:, i, :, None].clone() * a[:, :, :i].clone()).sum(-2)
            t = a + torch.eye(c)
            u = t @ (vc * bc) - (t @ kb) @ S
            outs.append(qc @ S + (qc @ kc.transpose(-1, -2)).tril() @ u)
            S = S + kc.transpose(-1, -2) @ u
        return torch.cat(outs, 1)


def test_traced_slice_assignments_leave_no_copy_and_keep_their_values():
    layer = AssignsBeforeTheLoop()
    x = torch.randn(2, 8, 8)
    gm = trace(layer, x)
    assert not [n for n in gm.graph.nodes if n.target is aten.copy.default]
    assert [n for n in gm.graph.nodes if n.target is aten.slice_scatter.default]
    torch.testing.assert_close(gm(x), layer(x))


@pytest.mark.parametrize("cls", [AssignsBeforeTheLoop, ForwardSubstitutionInTheLoop,
                                 DeltaRuleChunks])
@settings(max_examples=2)
@given(B=st.integers(1, 3), n=st.integers(2, 4), r=st.integers(0, 3))
def test_layers_assigning_into_slices_convert_exactly_gradients_included(cls, B, n, r):
    torch.manual_seed(n + 4 * r)
    layer = cls()
    x = torch.randn(B, n * 4 + r, 8)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact, report.runtime
    assert_same_function(converted, layer, [x, torch.randn(B + 1, 4 * (n + 2) + 3, 8),
                                            torch.randn(1, 3, 8)])


def test_select_writes_run_vmapped_give_the_gradient_of_the_loop_they_replace():
    """torch differentiates ``select_scatter`` wrongly under ``vmap``; the rewritten write
    gives, vmapped, the gradient of the same function run chunk by chunk."""
    def write(a):                       # a[1] = 3·a[1], as functionalization writes it
        return aten.select_scatter.default(a, a[1] * 3.0, 0, 1)

    gm = trace(write, torch.randn(4, 5))
    select_writes_as_slice_writes(gm.graph)
    gm.recompile()
    assert not [n for n in gm.graph.nodes if n.target is aten.select_scatter.default]
    k = torch.randn(3, 4, 5, requires_grad=True)
    g = torch.randn(3, 4, 5)
    (want,) = torch.autograd.grad(torch.stack([write(k[j]) for j in range(3)]), k, g)
    (got,) = torch.autograd.grad(torch.vmap(gm)(k), k, g)
    torch.testing.assert_close(got, want)


def test_delta_rule_chunks_run_generic_with_the_gradients_of_the_original():
    torch.manual_seed(0)
    layer = DeltaRuleChunks()
    x = torch.randn(2, 16, 8)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert converted.ttt2la_report.layers[0].runtime.startswith("torch.vmap")
    assert_same_function(converted, layer, [x, torch.randn(1, 10, 8)])


class WrittenAfterItsViews(torch.nn.Module):
    """A chunked linear memory reading chunk-first views (``_q[i]`` of
    ``q.reshape(B, N, C, D).permute(1, 0, 2, 3)``) of tensors written in place before the loop,
    as flash-linear-attention's naive TTT reference does: ``q *= scale`` after the views are
    taken, and the rates' last row written by a slice assignment where the sequence is padded."""

    C, D = 4, 8

    def __init__(self, write: str):
        super().__init__()
        self.write = write
        self.qkv = torch.nn.Linear(self.D, 3 * self.D, bias=False)
        self.rate = torch.nn.Linear(self.D, 1)

    def forward(self, x):
        B, T, D = x.shape
        C = self.C
        q, k, v = self.qkv(x).chunk(3, -1)
        eta = torch.sigmoid(self.rate(x))
        padded = -T % C
        q, k, v, eta = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k, v, eta))
        if padded and self.write == "padding":
            eta[:, -1, :] = eta[:, -(padded + 1), :]
        N = q.shape[1] // C
        _q, _k, _v, _eta = (t.reshape(B, N, C, -1).permute(1, 0, 2, 3) for t in (q, k, v, eta))
        if self.write == "scale":
            q *= D ** -0.5
        W = x.new_zeros(B, D, D)
        o = torch.empty_like(_v)
        for i in range(N):
            q_i, k_i, v_i, eta_i = [t[i] for t in (_q, _k, _v, _eta)]
            o[i] = q_i @ W
            W = W + k_i.transpose(-1, -2) @ (eta_i * v_i)
        return o.permute(1, 0, 2, 3).reshape(B, N * C, D)[:, :T]


@pytest.mark.parametrize("write", ["scale", "padding"])
def test_views_of_a_tensor_written_in_place_before_the_loop_are_its_chunks(write):
    """After an in-place write, functionalization makes the tensor's views again wherever they
    are read, in every iteration: their chunks were refused as no stream, naming an op of the
    loop's body. The views made again are one value, read before the loop: the layer converts,
    exactly, at lengths with and without a partial last chunk."""
    torch.manual_seed(0)
    layer = WrittenAfterItsViews(write)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt2la_report.exact
    for L in (16, 13, 3):
        assert_same_function(conv, layer, torch.randn(2, L, 8))


class SplitViewsWritten(torch.nn.Module):
    """Keys, values and queries as the chunks of one projection (``qkv.chunk(3, -1)``, views of
    it), their chunk-first views taken, then the keys scaled in place: every view of the
    projection is made again after the write, through the split and its items."""

    C, D = 4, 8

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(self.D, 3 * self.D, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        N = T // self.C
        q, k, v = self.qkv(x).chunk(3, -1)
        _q, _k, _v = (t.reshape(B, N, self.C, D).permute(1, 0, 2, 3) for t in (q, k, v))
        k *= 0.5
        W, outs = x.new_zeros(B, D, D), []
        for i in range(N):
            outs.append(_q[i] @ W)
            W = W + _k[i].transpose(-1, -2) @ _v[i]
        return torch.cat(outs, 1)


def test_views_of_a_split_written_in_place_before_the_loop_are_its_chunks():
    """The split and its items are made again too, the same in every iteration: read as one
    value before the loop, the layer converts onto the block op, exactly. (Autograd refuses
    the layer's in-place write into a split's view when it records gradients: the comparison
    runs without.)"""
    torch.manual_seed(0)
    layer = SplitViewsWritten()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt2la_report.layers[0].runtime == "block_linear_attention[torch]"
    with torch.no_grad(), ttt2la.race_as_written(False):
        for L in (16, 8):
            x = torch.randn(2, L, 8)
            assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]
