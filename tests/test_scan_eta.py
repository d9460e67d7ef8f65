"""Learning rates computed after the sequence is cut into mini-batches (TTT-Linear's ``get_eta``).

The published TTT-Linear code projects its per-token rates from the pre-chunked input
``[B, N, K, d]`` and multiplies them by a per-position ramp into ``η [B, H, N, K, K]``, scanned
with the other inputs; it may as well compute them inside the scan step from the mini-batch's
inputs. Either way the rate depends on the tokens alone, so the scan-style linear layer is
causal linear attention with per-token rates and converts exactly at levels 0–2 (outputs and
every parameter gradient), at any length, remainder included — the rates spelt by ``einsum`` and
``repeat`` of a unit axis as published code spells them too. A rate that reads the fast weight
is outside the theorem: refused at every level, naming the op and its line.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import ScanEtaTTTLayer


def hand_written(layer: ScanEtaTTTLayer, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: within a mini-batch of ``K`` tokens (the last one shorter),
    ``o_t = q_t + q_t W + Σ_{s ≤ t} r_t l_s (q_t·k_s) v_s`` with ``r_t = max(1/(t+1) + off_t, 0)``
    and ``l_s = (base/f)·σ(x_s·w_h + b_h)``; then ``W += Σ_s r_{last} l_s k_sᵀ v_s``."""
    B, L, d = x.shape
    H, f, K = layer.num_heads, layer.head_dim, layer.mini_batch_size
    q = layer.q_proj(x).view(B, L, H, f)
    k = layer.k_proj(x).view(B, L, H, f)
    v = layer.v_proj(x).view(B, L, H, f)
    rate = (layer.base_lr / f) * torch.sigmoid(
        torch.einsum("bld,hd->blh", x, layer.lr_weight) + layer.lr_bias[:, 0])
    W = layer.W.unsqueeze(0).expand(B, H, f, f)
    out = torch.zeros(B, L, H, f, dtype=x.dtype)
    for start in range(0, L, K):
        size = min(K, L - start)
        ramp = torch.clamp_min(1.0 / torch.arange(1, size + 1, dtype=x.dtype)
                               + layer.position_offset[:size], 0.0)
        for t in range(size):
            a = start + t
            o = q[:, a] + torch.einsum("bhf,bhfg->bhg", q[:, a], W)
            for s in range(t + 1):
                c = start + s
                w = ramp[t] * rate[:, c] * (q[:, a] * k[:, c]).sum(-1)       # [B, H]
                o = o + w[..., None] * v[:, c]
            out[:, a] = o
        last = ramp[size - 1]
        for s in range(size):
            c = start + s
            W = W + (last * rate[:, c])[..., None, None] * \
                torch.einsum("bhf,bhg->bhfg", k[:, c], v[:, c])
    return layer.o_proj(layer.post_norm(out.reshape(B, L, d)))


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 13), K=st.sampled_from([2, 3, 4]),
       eta_from=st.sampled_from(["chunks", "mini_batch"]), seed=st.integers(0, 2**16))
def test_get_eta_layer_is_the_hand_written_loop(B, L, K, eta_from, seed):
    torch.manual_seed(seed)
    layer = ScanEtaTTTLayer(4, 2, K, eta_from=eta_from).double()
    with torch.no_grad():
        layer.position_offset.normal_(0.0, 0.3)
        # the ramp buffer was made in float32; in float64 here, so the reference's own 1/(t+1)
        # is the layer's value
        layer.position_rate.copy_(1.0 / torch.arange(1, K + 1, dtype=torch.float64))
    x = torch.randn(B, L, 4, dtype=torch.float64)
    assert rel_rms_error(layer(x), hand_written(layer, x)) <= TOLERANCE[torch.float64]


@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 3), K=st.sampled_from([2, 4]), rest=st.integers(0, 3),
       heads=st.integers(1, 2), eta_from=st.sampled_from(["chunks", "mini_batch"]),
       level=st.integers(0, 2), others=st.lists(st.integers(1, 19), min_size=1, max_size=2),
       seed=st.integers(0, 2**16))
def test_rates_from_the_tokens_convert_exactly(B, K, rest, heads, eta_from, level, others,
                                               seed):
    torch.manual_seed(seed)
    d = 4 * heads
    layer = ScanEtaTTTLayer(d, heads, K, eta_from=eta_from)
    with torch.no_grad():
        layer.position_offset.normal_(0.0, 0.3)
    x = torch.randn(B, 3 * K + rest % K, d)
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.schedule == "parallel"
    assert_same_function(converted, layer, [x] + [torch.randn(B, n, d) for n in others])


class PublishedSpellings(ScanEtaTTTLayer):
    """``get_eta`` spelt as the published TTT layers spell it: the rates projected by
    ``einsum("bnkc,hdc->bhnkd", X, w)`` and copied over the positions by ``repeat`` of a unit
    axis (``eta.repeat(1, 1, 1, K, 1)``) — the same rates as the zoo layer's."""

    def get_eta(self, X, size):
        w = self.lr_weight.reshape(self.num_heads, 1, -1)
        lr = torch.einsum("bnkc,hdc->bhnkd", X, w) + self.lr_bias.reshape(1, -1, 1, 1, 1)
        lr = (self.base_lr / self.head_dim) * torch.sigmoid(lr).permute(0, 1, 2, 4, 3)
        ramp = torch.clamp_min(self.position_rate[:size] + self.position_offset[:size], 0.0)
        return ramp.reshape(1, 1, 1, size, 1) * lr.repeat(1, 1, 1, size, 1)


@pytest.mark.parametrize("level", [0, 2])
def test_rates_spelt_by_einsum_and_repeat_convert_exactly(level):
    """Both spellings were refused: ``repeat`` was no op whose mini-batches are read, and the
    einsum's product lays its rows out with unit axes around the contracted one."""
    torch.manual_seed(0)
    layer = PublishedSpellings(8, 2, 4)
    with torch.no_grad():
        layer.position_offset.normal_(0.0, 0.3)
    zoo_layer = ScanEtaTTTLayer(8, 2, 4)
    zoo_layer.load_state_dict(layer.state_dict())
    x = torch.randn(2, 14, 8)
    with torch.no_grad():
        assert rel_rms_error(layer(x), zoo_layer(x)) <= TOLERANCE[torch.float32]
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
    assert converted.ttt2la_report.exact
    assert_same_function(converted, layer, [x, torch.randn(1, 7, 8), torch.randn(3, 20, 8)])


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_rate_that_reads_the_fast_weight_is_refused_by_name(level):
    torch.manual_seed(0)
    layer = ScanEtaTTTLayer(8, 2, 4, eta_from="state")
    with pytest.raises(ttt2la.NonReducibleError) as refused:
        ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 14, 8),))
    assert "sigmoid" in refused.value.op
    assert "ttt_scan.py:" in refused.value.where
    assert "learning rate" in str(refused.value)


def test_a_computed_tensor_no_identity_covers_is_refused_by_line():
    """A rate summed over the mini-batch's tokens before the scan (a mean per mini-batch) has no
    axis of the mini-batch's size left and is no elementwise op of one: refused, naming it."""

    class MeanRate(ScanEtaTTTLayer):
        def get_eta(self, X, size):
            eta = super().get_eta(X, size)
            return eta.mean(dim=-1, keepdim=True).expand_as(eta).contiguous()  # <- named

    torch.manual_seed(0)
    layer = MeanRate(8, 2, 4)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 14, 8),))
    assert "computed after the sequence was cut" in str(refused.value)
    assert "test_scan_eta.py:" in str(refused.value)
    # and the op where reading the mini-batches back stopped, at its own line
    assert re.search(r"ttt2la stopped at `torch\.mean` at \S*test_scan_eta\.py:\d+ ",
                     str(refused.value)), str(refused.value)


@pytest.mark.parametrize("eta_from", ["chunks", "mini_batch"])
def test_level_4_says_it_keeps_the_rate_the_loop_computes_from_the_tokens(eta_from):
    """TTT-Linear's rate σ(x·w + b) per token, computed in the loop body: absorb_lr does not
    fold it, and says so — never that the step is already satisfied."""
    torch.manual_seed(0)
    layer = ScanEtaTTTLayer(16, 2, 4, eta_from=eta_from)
    x = torch.randn(2, 16, 16)
    conv = ttt2la.convert(layer, level=4, example_inputs=(x,))
    step, = [p for p in conv.ttt2la_report.layers[0].passes if p.name == "absorb_lr"]
    assert (step.status, step.exact) == ("not_applicable", True), step.reason
    assert "named as learning rates" in step.reason and "keeps the per-token rate" in step.reason
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]
