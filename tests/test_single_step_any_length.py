"""Single-step TTT at any length, and written with no loop at all.

A single step over all tokens has no chunk structure to keep, so the converted layer takes any
length the original takes: converted at one length, it is called at others and must give the
original's outputs and every parameter gradient. Where the traced step cannot run at another
length — the layer's own code fixes it (an ``h × w`` image), or a slice reaches a fixed number
of tokens — the converted layer refuses with an ``UnsupportedShapeError`` that says which
lengths work and why. The ViTTT-like block with hand-derived gradients has no Python loop
anywhere and is still recognised as a single step.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import ScheduleTTTLayer, ViTTTBlock, ViTTTClosedFormBlock


def frozen_gate_twin(block: ViTTTClosedFormBlock) -> ViTTTClosedFormBlock:
    """The same block (same parameters) written with the gate's kernel Θ not stepped."""
    twin = ViTTTClosedFormBlock(block.dim, block.num_heads, update_gate=False, clip=block.clip,
                                lr=block.lr)
    twin.load_state_dict(block.state_dict())
    return twin


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(2, 9), heads=st.integers(1, 2),
       head_dim=st.sampled_from([2, 4]), update_gate=st.booleans(), clip=st.booleans(),
       level=st.integers(0, 2), others=st.lists(st.tuples(st.integers(1, 4), st.integers(2, 40)),
                                                min_size=2, max_size=3),
       seed=st.integers(0, 2**16))
def test_closed_form_block_converts_at_any_length(B, L, heads, head_dim, update_gate, clip,
                                                  level, others, seed):
    torch.manual_seed(seed)
    block = ViTTTClosedFormBlock(heads * head_dim, heads, update_gate=update_gate, clip=clip)
    x = torch.randn(B, L, heads * head_dim)
    converted = ttt2la.convert(block, level=level, example_inputs=(x,))
    layer = converted.ttt2la_report.layers[0]
    lossy = update_gate and level >= 1           # freeze_theta stops stepping the gate's Θ
    assert layer.exact == (not lossy)
    assert layer.order == "inclusive"
    reference = frozen_gate_twin(block) if lossy else block
    xs = [x] + [torch.randn(b, n, heads * head_dim) for b, n in others]
    assert_same_function(converted, reference, xs)


def gated_linear_attention(block: ViTTTClosedFormBlock, x: torch.Tensor) -> torch.Tensor:
    """The block with Θ fixed and no clipping, in closed form: ``o = (q W1') ⊙ silu(q W2)``
    with ``W1' = W1 + (lr·scale/N) Σ_n k_nᵀ (v_n ⊙ silu(k_n W2))`` — linear attention with a
    gate on the values and on the output."""
    B, N, C = x.shape
    H, D = block.num_heads, C // block.num_heads
    q, k, v = block.qkv(x).view(B, N, 3, H, D).unbind(2)                   # [B, N, H, D]
    w1, w2 = block.w1[0], block.w2[0]
    gk = F.silu(torch.einsum("bnhd,hde->bnhe", k, w2))
    W1 = w1 + (block.lr * D ** -0.5 / N) * torch.einsum("bnhd,bnhe->bhde", k, v * gk)
    o = torch.einsum("bnhd,bhde->bnhe", q, W1) * F.silu(torch.einsum("bnhd,hde->bnhe", q, w2))
    return block.proj(o.reshape(B, N, C))


@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 3), N=st.integers(1, 12), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_closed_form_block_is_gated_linear_attention(B, N, heads, seed):
    torch.manual_seed(seed)
    block = ViTTTClosedFormBlock(2 * heads, heads, update_gate=False, clip=False).double()
    x = torch.randn(B, N, 2 * heads, dtype=torch.float64)
    assert rel_rms_error(block(x), gated_linear_attention(block, x)) <= \
        TOLERANCE[torch.float64]


def test_no_loop_step_is_one_chunk_and_keeps_no_state():
    torch.manual_seed(0)
    block = ViTTTClosedFormBlock(8, 2, update_gate=False)
    converted = ttt2la.convert(block, level=0, example_inputs=(torch.randn(2, 6, 8),))
    layer = converted.ttt2la_report.layers[0]
    assert {s.name for s in layer.states} == {"w1"}
    assert any("any length" not in n and "lengths from 2" in n for n in layer.notes)
    with pytest.raises(ttt2la.UnsupportedShapeError, match="2 tokens or more"):
        converted(torch.randn(2, 1, 8))
    with pytest.raises(ttt2la.StreamingError, match="single-step"):
        converted(torch.randn(2, 6, 8), return_ttt_state=True)


@settings(max_examples=2, deadline=None)
@given(B=st.integers(1, 3), n_in=st.integers(2, 5), extra=st.lists(st.integers(0, 9),
                                                                     min_size=2, max_size=3),
       weight_norm=st.booleans(), seed=st.integers(0, 2**16))
def test_render_schedule_runs_at_every_length_its_slices_reach(B, n_in, extra, weight_norm,
                                                                seed):
    torch.manual_seed(seed)
    layer = ScheduleTTTLayer(8, 2, schedule="render", input_tokens=n_in, weight_norm=weight_norm)
    x = torch.randn(B, n_in + 3, 8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert_same_function(converted, layer, [torch.randn(B, n_in + e, 8) for e in extra])
    if n_in > 2:
        with pytest.raises(ttt2la.UnsupportedShapeError, match=f"{n_in} tokens or more") as e:
            converted(torch.randn(B, n_in - 1, 8))
        assert "schedule.py:" in str(e.value) and "clamped" in str(e.value)


def test_a_layer_whose_own_code_fixes_the_length_says_so():
    torch.manual_seed(0)
    block = ViTTTBlock(8, 2, 2, 3, update_gate=False)
    converted = ttt2la.convert(block, level=0, example_inputs=(torch.randn(2, 6, 8),))
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(2, 8, 8))
    text = str(refused.value)
    assert "6 tokens only" in text and "own code fails at" in text
    assert "vittt.py:" in text


class LengthDependentStep(torch.nn.Module):
    """One step of a weight over all tokens, with code around it that depends on the length
    in a way no converted layer reads at another length: ``case`` picks it."""

    def __init__(self, case: str, d: int = 8):
        super().__init__()
        self.case = case
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) * 0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = self.w0.unsqueeze(0)
        W = W - 0.1 * k.mT @ (k @ W - v) / x.shape[1]
        if self.case == "steps again" and x.shape[1] % 2:
            W = W - 0.1 * k.mT @ (k @ W - v) / x.shape[1]  # <- steps again
        o = q @ W
        if self.case == "other ops":
            o = o * 2 if x.shape[1] % 2 else o + 2  # <- other ops
        if self.case == "squared length":
            o = o * x.shape[1] ** 2  # <- squared length
        if self.case == "batch constant":
            o = o * (x.shape[0] * 0.5)  # <- batch constant
        return o


@pytest.mark.parametrize("case, says, op", [
    ("other ops", "runs different ops at different lengths", "`torch.mul` at "),
    ("squared length", "is not an affine function a + c·L of the length", "`torch.mul` at "),
    ("steps again", "the stepped weights are stepped again", "`torch.sub` at "),
    ("batch constant", "the constant 1.0 of `torch.mul`", "`torch.mul` at "),
])
def test_a_step_fixed_to_its_length_names_the_line_that_fixes_it(case, says, op):
    """Converted for its example length only; the call at another says why, naming the op by
    the torch call and the line of the layer that made it, not by the traced graph's text."""
    torch.manual_seed(0)
    converted = ttt2la.convert(LengthDependentStep(case), level=0,
                               example_inputs=(torch.randn(2, 6, 8),))
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(2, 10, 8))
    text = str(refused.value)
    lines, start = inspect.getsourcelines(LengthDependentStep.forward)
    (line,) = [start + i for i, s in enumerate(lines) if s.rstrip().endswith(f"# <- {case}")]
    assert "6 tokens only" in text and says in text, text
    assert f"{op}{__file__}:{line} (`" in text, text
    assert not re.search(r"%\w", text), text         # the code's own `% 2` is no fx name
    assert "call_function" not in text and "num_users" not in text, text


class _ReturnsItsFastWeight(torch.nn.Module):
    """One step over all tokens that returns the stepped fast weight beside the output."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        w = self.w0.expand(x.shape[0], -1, -1) + 0.1 * k.transpose(1, 2) @ v
        return q @ w, w


def test_a_step_returning_its_fast_weight_is_refused_naming_the_update():
    with pytest.raises(ttt2la.UnsupportedTTTError,
                       match=r"returns its stepped fast weights \(`torch.add` at .*"
                             r"test_single_step_any_length.py:\d+"):
        ttt2la.convert(_ReturnsItsFastWeight(), level=0, example_inputs=(torch.randn(2, 12, 8),))
