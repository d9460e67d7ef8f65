"""A layer whose code as written computes another function from one run to the next (random
noise, an input it writes into) or with gradients on (a branch on ``torch.is_grad_enabled()``) is refused with an
``UnsupportedTTTError`` that names the user's line and what to do — not with a message blaming
ttt2la. Noise drawn only in training mode converts: a conversion traces evaluation mode.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ttt2la
from ttt2la.call_variation import call_variation
from ttt2la.testing import TOLERANCE, rel_rms_error

D, C = 8, 4


class VaryingTTT(nn.Module):
    """A linear-TTT loop whose keys get noise (``how="noise"``, or only in training mode with
    ``"training noise"``) or whose queries are scaled with gradients on (``"grad mode"``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.how == "in place":
            x.mul_(2)                                           # MUL_ LINE
        if self.how == "in place operator":
            x /= 2                                              # /= LINE
        if self.how == "grad mode" and torch.is_grad_enabled():
            q = q * 2                                           # GRAD LINE
        if self.how == "noise" or (self.how == "training noise" and self.training):
            k = k + 0.1 * torch.randn_like(k)                   # NOISE LINE
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + k[:, s:s + C].mT @ v[:, s:s + C]
        return torch.cat(outs, 1)


def _line(marker: str) -> int:
    lines, start = inspect.getsourcelines(VaryingTTT.forward)
    return start + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.parametrize("no_grad", [False, True])
def test_a_grad_mode_branch_is_refused_naming_its_line(no_grad):
    torch.manual_seed(0)
    layer = VaryingTTT("grad mode")
    with torch.set_grad_enabled(not no_grad):
        with pytest.raises(ttt2la.UnsupportedTTTError) as raised:
            ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    message = str(raised.value)
    assert "bug in ttt2la" not in message and "report" not in message
    assert f"test_call_variation.py:{_line('GRAD LINE')}" in message
    assert "gradients are enabled" in message and "self.training" in message


def test_noise_is_refused_naming_the_random_call():
    torch.manual_seed(0)
    layer = VaryingTTT("noise")
    with pytest.raises(ttt2la.UnsupportedTTTError) as raised:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    message = str(raised.value)
    assert "bug in ttt2la" not in message and "report" not in message
    assert f"test_call_variation.py:{_line('NOISE LINE')}" in message
    assert "`randn_like`" in message and "random" in message


@pytest.mark.parametrize("how,marker", [("in place", "MUL_ LINE"),
                                         ("in place operator", "/= LINE")])
def test_a_forward_writing_into_its_input_is_refused_naming_the_write(how, marker):
    """Written after its last read, the input changed in place makes the next run's first op
    on it differ: the refusal names the write, not that op as a source of random numbers."""
    torch.manual_seed(0)
    layer = VaryingTTT(how)
    with pytest.raises(ttt2la.UnsupportedTTTError) as raised:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    message = str(raised.value)
    assert f"test_call_variation.py:{_line(marker)}" in message, message
    assert "changes its input in place" in message and "random" not in message, message


def test_noise_in_training_mode_only_converts_as_the_refusal_suggests():
    torch.manual_seed(0)
    layer = VaryingTTT("training noise").eval()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    assert conv.ttt2la_report.layers[0].exact
    x = torch.randn(3, 9, D)
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]


def test_a_layer_computing_the_same_each_time_shows_no_variation():
    torch.manual_seed(0)
    layer = VaryingTTT("none")
    assert call_variation(layer, (torch.randn(2, 12, D),), {}) == ""
    noisy, x = VaryingTTT("noise"), torch.randn(2, 12, D)
    state = torch.get_rng_state()
    assert "randn_like" in call_variation(noisy, (x,), {})
    assert torch.equal(torch.get_rng_state(), state)    # its draws came from a forked generator
