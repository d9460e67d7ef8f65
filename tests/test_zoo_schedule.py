"""The update/apply-schedule layer (a list of ``(start, end, update, apply)`` steps).

The *render* schedule — one step on the input views' tokens, then one read of every token — is
a single-step TTT: it converts as one chunk, exactly, at any length its update's slice of the
input views reaches. The *causal* schedule is a loop over chunks and converts at any length.
Verdicts at levels 0–2: stepping the kernel weights Θ (``update_theta``) is refused at level 0
naming the ``silu`` (or its derivative) through which the updates read them; at level k the
converted layer is the layer written with the switches of steps 1..k off (outputs and every
gradient within fp32 tolerance).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import ScheduleTTTLayer



def variant(layer: ScheduleTTTLayer, level: int, **kw) -> ScheduleTTTLayer:
    """The same layer (same parameters) written with the switches of steps 1..level off."""
    twin = ScheduleTTTLayer(
        layer.num_heads * layer.head_dim, layer.num_heads, schedule=layer.schedule,
        input_tokens=layer.input_tokens, chunk_size=layer.chunk_size,
        update_theta=layer.update_theta and level < 1, weight_norm=layer.weight_norm and level < 2)
    twin.load_state_dict(layer.state_dict())
    return twin


def check_verdicts(layer: ScheduleTTTLayer, x: torch.Tensor, others: list[torch.Tensor]):
    for level in (0, 1, 2):
        if layer.update_theta and level == 0:
            with pytest.raises(ttt2la.NonReducibleError) as refused:
                ttt2la.convert(layer, level=0, example_inputs=(x,))
            # silu, or the sigmoid of its derivative inside the gradient: either names the
            # kernel φ through which Θ's update breaks associativity, with its line
            assert any(f in refused.value.op for f in ("silu", "sigmoid"))
            assert "schedule.py:" in refused.value.where
            assert "freeze_theta" in str(refused.value)
            continue
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        report = converted.ttt2la_report.layers[0]
        lossy = (layer.update_theta and level >= 1) or (layer.weight_norm and level >= 2)
        assert report.exact == (not lossy)
        roles = {s.name: s.role for s in report.states}
        assert roles["W1"] == "final"
        reference = variant(layer, level)
        for xi in [x, *others]:
            assert_same_function(converted, reference, xi)


@settings(max_examples=2, deadline=None)
@given(B=st.integers(1, 3), n_in=st.integers(2, 6), n_out=st.integers(1, 5),
       heads=st.integers(1, 2), head_dim=st.sampled_from([2, 4]), update_theta=st.booleans(),
       weight_norm=st.booleans(), seed=st.integers(0, 2**16))
def test_render_schedule_converts_as_one_step(B, n_in, n_out, heads, head_dim, update_theta,
                                              weight_norm, seed):
    torch.manual_seed(seed)
    d = heads * head_dim
    layer = ScheduleTTTLayer(d, heads, schedule="render", input_tokens=n_in,
                             update_theta=update_theta, weight_norm=weight_norm)
    L = n_in + n_out
    check_verdicts(layer, torch.randn(B, L, d), [torch.randn(B % 3 + 1, L, d)])


def test_render_is_one_step_at_any_length_its_update_slice_reaches():
    torch.manual_seed(0)
    layer = ScheduleTTTLayer(8, 2, schedule="render", input_tokens=4)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 7, 8),))
    report = converted.ttt2la_report.layers[0]
    assert report.order == "inclusive"          # one chunk: the whole sequence, read after
    assert_same_function(converted, layer, [torch.randn(2, 9, 8), torch.randn(1, 4, 8)])
    with pytest.raises(ttt2la.UnsupportedShapeError, match="4 tokens or more"):
        converted(torch.randn(2, 3, 8))


@settings(max_examples=1, deadline=None)
@example(B=2, C=3, update_theta=True, seed=1)
@given(B=st.integers(1, 3), C=st.sampled_from([2, 3]), update_theta=st.booleans(),
       seed=st.integers(0, 2**16))
def test_causal_schedule_converts_at_any_length(B, C, update_theta, seed):
    torch.manual_seed(seed)
    layer = ScheduleTTTLayer(8, 2, schedule="causal", chunk_size=C, update_theta=update_theta)
    check_verdicts(layer, torch.randn(B, 3 * C + 1, 8),
                   [torch.randn(B, 1, 8), torch.randn(B % 3 + 1, 5 * C, 8)])


def hand_written_render(layer: ScheduleTTTLayer, x: torch.Tensor) -> torch.Tensor:
    """Render with Θ fixed and no weight norm, in closed form: every token reads
    ``W1 + Σ_{input tokens} φ(k)ᵀ (lr · v)`` through ``φ(q) = silu(q W0) ⊙ (q W2)``."""
    B, L, d = x.shape
    H, n = layer.num_heads, layer.input_tokens
    q, k, v = layer.qkv(x).view(B, L, 3, H, d // H).unbind(2)                 # [B, L, H, D]
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    lr = F.softplus(layer.lr_proj(x) + layer.base_lr_inv)                     # [B, L, H]

    def phi(t):
        return F.silu(torch.einsum("blhd,hde->blhe", t, layer.w0)) * \
            torch.einsum("blhd,hde->blhe", t, layer.w2)
    W1 = layer.w1 + torch.einsum("blhd,blhe->bhde", phi(k)[:, :n], (v * lr[..., None])[:, :n])
    o = torch.einsum("blhd,bhde->blhe", phi(q), W1)
    return layer.o_proj(o.reshape(B, L, d))


@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 3), n_in=st.integers(1, 6), n_out=st.integers(0, 5),
       seed=st.integers(0, 2**16))
def test_render_layer_is_one_linear_attention_step(B, n_in, n_out, seed):
    torch.manual_seed(seed)
    layer = ScheduleTTTLayer(6, 2, schedule="render", input_tokens=n_in).double()
    x = torch.randn(B, n_in + n_out, 6, dtype=torch.float64)
    assert rel_rms_error(layer(x), hand_written_render(layer, x)) <= TOLERANCE[torch.float64]
