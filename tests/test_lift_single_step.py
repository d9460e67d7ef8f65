"""Single-step TTT lifted onto ``bidirectional_linear_attention``.

ViTTT's gated unit with the gate's Θ frozen is linear attention with an output gate, its
depthwise convolution with fast taps local linear attention: the converted block runs both on
the op (the report names it) and equals the block as written, outputs and every gradient. A
gradient normalised ``g/(‖g‖+1)`` is not linear in the values, so that block keeps the generic
executor until level 6 takes the normalisation out. LaCT's render step (update on the input
views, read every token) runs on it too. A look-alike whose gate reads the stepped
weight itself is not linear attention and stays on the generic executor, still exact.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function
from ttt2la.zoo import ScheduleTTTLayer, ViTTTBlock, ViTTTClosedFormBlock

OP = "bidirectional_linear_attention"


def runtime(converted) -> str:
    return converted.ttt2la_report.layers[0].runtime


def frozen_gate_twin(block: ViTTTBlock) -> ViTTTBlock:
    """The same block (same parameters) written with the gate's Θ not stepped."""
    twin = ViTTTBlock(block.dim, block.num_heads, block.height, block.width, update_gate=False,
                      grad_norm=block.grad_norm, lr=block.lr)
    twin.load_state_dict(block.state_dict())
    return twin


# Θ stepped (update_gate=True): frozen by level 1 on, the block then equals its frozen twin
@pytest.mark.parametrize("update_gate, level", [(False, 0), (False, 1), (False, 2), (True, 1),
                                                (True, 2)])
@settings(max_examples=1, deadline=None)
@given(B=st.integers(1, 2), h=st.integers(2, 3), w=st.integers(2, 3), heads=st.integers(1, 2),
       head_dim=st.sampled_from([2, 3]), seed=st.integers(0, 2**16))
def test_vittt_block_runs_on_the_op(update_gate, level, B, h, w, heads, head_dim, seed):
    torch.manual_seed(seed)
    block = ViTTTBlock(heads * head_dim, heads, h, w, update_gate=update_gate, grad_norm=False,
                       lr=0.7)
    reference = frozen_gate_twin(block) if update_gate else block
    x = torch.randn(B, h * w, heads * head_dim)
    converted = ttt2la.convert(block, level=level, example_inputs=(x,))
    assert runtime(converted) == f"{OP}[torch](W1: gated; taps: local 3×3)"
    assert_same_function(converted, reference, [x, torch.randn(B % 2 + 1, h * w, x.shape[-1])])


def test_normalised_gradients_stay_generic_until_level_6_removes_the_normalisation():
    torch.manual_seed(1)
    block = ViTTTBlock(8, 2, 2, 3, update_gate=False, grad_norm=True)
    x = torch.randn(2, 6, 8)
    kept = ttt2la.convert(block, level=2, example_inputs=(x,))
    assert OP not in runtime(kept) and runtime(kept).startswith("torch.vmap")
    reduced = ttt2la.convert(block, level=6, example_inputs=(x,))
    assert runtime(reduced) == f"{OP}[torch](W1: gated; taps: local 3×3)"
    # level 6 changes the function (the normalisation folded into constant steps): the lifted
    # layer equals the same reduced program run by the reference executor
    reference = ttt2la.convert(block, level=6, example_inputs=(x,), backend="naive")
    assert OP not in runtime(reference)
    assert_same_function(reduced, reference, x)


def test_any_length_step_runs_on_the_op_and_the_report_names_it():
    torch.manual_seed(2)
    block = ViTTTClosedFormBlock(8, 2, update_gate=False, clip=False)
    converted = ttt2la.convert(block, level=0, example_inputs=(torch.randn(2, 7, 8),))
    assert runtime(converted) == f"{OP}[torch](w1: linear)"
    assert f"runtime {OP}[torch](w1: linear)" in str(converted.ttt2la_report)
    assert_same_function(converted, block, [torch.randn(3, 11, 8), torch.randn(1, 2, 8)])


def test_render_schedule_updates_on_the_input_views_and_reads_every_token_on_the_op():
    torch.manual_seed(5)
    layer = ScheduleTTTLayer(8, 2, schedule="render", input_tokens=6)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 14, 8),))
    assert runtime(converted) == f"{OP}[torch](W1: linear)"
    assert_same_function(converted, layer, [torch.randn(2, 14, 8), torch.randn(1, 9, 8)])


class StepThenRead(nn.Module):
    """One step ``W' = W + kᵀv/N`` over all tokens, then every query reads ``q W'`` times a gate:
    ``sigmoid(q W2)`` (a fixed weight: linear attention with an output gate) or, with
    ``self_gated``, ``sigmoid(q W')`` — a second read of the stepped weight, which no linear
    attention computes."""

    def __init__(self, dim: int, heads: int, self_gated: bool) -> None:
        super().__init__()
        self.heads, self.self_gated = heads, self_gated
        d = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.w1 = nn.Parameter(torch.randn(1, heads, d, d) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(1, heads, d, d) * d ** -0.5)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        w1 = self.w1 + k.transpose(-2, -1) @ v / n
        gate = torch.sigmoid(q @ (w1 if self.self_gated else self.w2))
        return ((q @ w1) * gate).transpose(1, 2).reshape(b, n, c)


class TransposedStep(nn.Module):
    """The step and read with the fast weight stored ``[out, in]``: ``W' = W + vᵀk·η``, read
    ``(W' qᵀ)ᵀ``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.w = nn.Parameter(torch.randn(1, heads, d, d) * d ** -0.5)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        w = self.w + 0.3 * (v.transpose(-2, -1) @ k)
        return (w @ q.transpose(-2, -1)).transpose(-2, -1).transpose(1, 2).reshape(b, n, c)


def test_a_weight_stored_out_by_in_runs_on_the_op():
    torch.manual_seed(6)
    layer = TransposedStep(8, 2)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 5, 8),))
    assert runtime(converted) == f"{OP}[torch](w: linear)"
    assert_same_function(converted, layer, [torch.randn(2, 5, 8), torch.randn(3, 8, 8)])


@pytest.mark.parametrize("self_gated", [False, True])
def test_a_gate_that_reads_the_stepped_weight_is_not_lifted(self_gated):
    torch.manual_seed(3)
    layer = StepThenRead(8, 2, self_gated)
    x = torch.randn(2, 5, 8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    if self_gated:
        assert OP not in runtime(converted)
    else:
        assert runtime(converted) == f"{OP}[torch](w1: linear)"   # the gate runs after it
    assert_same_function(converted, layer, [x, torch.randn(3, 9, 8)])


def test_triton_is_refused_by_name():
    torch.manual_seed(4)
    block = ViTTTClosedFormBlock(8, 2, update_gate=False, clip=False)
    with pytest.raises(ttt2la.UnsupportedTTTError, match=f"{OP}.*no Triton kernel"):
        ttt2la.convert(block, level=0, example_inputs=(torch.randn(2, 7, 8),),
                       backend="triton")
