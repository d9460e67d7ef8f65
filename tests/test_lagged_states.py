"""Loops that read a value made two or more iterations back: refused, never converted wrongly.

The roll-up takes iteration 1 as the body. A value kept from the iteration before the last
(`Wp, W = W, W + dW`, an `E = W` before the update, `Ws[-2]` of a list of states) is, in
iteration 1, still the value made before the loop, so it looked loop-invariant: the layer was
reported exact and ran every chunk with the initial fast weights in its place (0.4 relative RMS
off from the third chunk on, gradients too). The later traced iterations show the lag; the loop
is refused with ``LaggedStateError`` naming the reading line, and inside a model the layer runs
as written.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from ttt2la.testing import rel_rms_error

D, C = 8, 4


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def qkv_(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return q, F.normalize(k, dim=-1), v


class PreviousWeights(_Layer):
    """Reads the mean of the fast weights and those before the last update."""

    def forward(self, x):
        q, k, v = self.qkv_(x)
        W = x.new_zeros(x.shape[0], D, D)
        Wp, outs = W, []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ (0.5 * (W + Wp)))
            Wp, W = W, W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


class PreviousFromParameter(_Layer):
    """The same lag with learned initial fast weights, kept by `E = W` before the update."""

    def __init__(self):
        super().__init__()
        self.W0 = nn.Parameter(torch.randn(D, D) * 0.1)

    def forward(self, x):
        q, k, v = self.qkv_(x)
        W = self.W0.expand(x.shape[0], D, D)
        E, outs = W, []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ (0.5 * (W + E)))
            E = W
            W = W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


class ListOfStates(_Layer):
    """Keeps every state in a list and reads the last two."""

    def forward(self, x):
        q, k, v = self.qkv_(x)
        Ws, outs = [x.new_zeros(x.shape[0], D, D)], []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ (0.5 * (Ws[-1] + Ws[max(len(Ws) - 2, 0)])))
            Ws.append(Ws[-1] + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C])
        return torch.cat(outs, 1)


class ThreeBack(_Layer):
    """Reads the fast weights of three iterations back."""

    def forward(self, x):
        q, k, v = self.qkv_(x)
        W = x.new_zeros(x.shape[0], D, D)
        W2, W1, outs = W, W, []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ (W + W2))
            W2, W1, W = W1, W, W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


class FirstUpdate(_Layer):
    """Reads, from the second chunk on, the fast weights after the first chunk (`Ws[1]`)."""

    def forward(self, x):
        q, k, v = self.qkv_(x)
        Ws, outs = [x.new_zeros(x.shape[0], D, D)], []
        for s in range(0, x.shape[1], C):
            anchor = Ws[1] if len(Ws) > 1 else Ws[0]
            outs.append(q[:, s:s + C] @ (Ws[-1] + anchor))
            Ws.append(Ws[-1] + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C])
        return torch.cat(outs, 1)


class Latest(_Layer):
    """Reads the latest fast weights only: converts."""

    def forward(self, x):
        q, k, v = self.qkv_(x)
        W, outs = x.new_zeros(x.shape[0], D, D), []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


def _no_fx_text(message: str) -> None:
    assert "%" not in message and "call_function[" not in message and "num_users" not in message


@pytest.mark.parametrize("layer, example_len, line, strict", [
    (PreviousWeights, 2 * C, "(0.5 * (W + Wp))", True),
    (PreviousWeights, 12 * C, "(0.5 * (W + Wp))", False),
    (PreviousFromParameter, 2 * C, "(0.5 * (W + E))", False),
    (ListOfStates, C, "Ws[max(len(Ws) - 2, 0)]", True),
    (ThreeBack, 2 * C, "(W + W2)", False),
])
def test_a_value_of_an_earlier_iteration_is_refused_naming_the_line(layer, example_len, line,
                                                                     strict):
    torch.manual_seed(0)
    with pytest.raises(ttt2la.LaggedStateError) as e:
        ttt2la.convert(layer(), level=0, example_inputs=(torch.randn(2, example_len, D),),
                       strict=strict)
    message = str(e.value)
    assert "iterations back" in message and line in message and __file__ in message
    assert "bug in ttt2la" not in message
    _no_fx_text(message)
    assert e.value.where.startswith(f"{__file__}:")
    assert e.value.lag == (3 if layer is ThreeBack else 2)


def test_a_value_kept_from_one_iteration_is_refused_by_its_line():
    with pytest.raises(ttt2la.LaggedStateError) as e:
        ttt2la.convert(FirstUpdate(), level=0, example_inputs=(torch.randn(2, 4 * C, D),))
    assert "(Ws[-1] + anchor)" in str(e.value)
    _no_fx_text(str(e.value))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Latest(), PreviousFromParameter()

    def forward(self, x):
        return self.b(x + self.a(x))


def test_inside_a_model_the_layer_runs_as_written():
    torch.manual_seed(0)
    model = _Model()
    f = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 4 * C, D),), strict=False)
    assert [layer.module_path for layer in f.ttt2la_report.layers] == ["a"]
    assert any("b:" in n and "iterations back" in n for n in f.ttt2la_report.notes)
    for L in (24, 48, 50):
        x = torch.randn(2, L, D)
        want, got = model(x), f(x)
        assert rel_rms_error(got, want) <= 1e-5
        want.square().sum().backward()
        got.square().sum().backward()
        grads = dict(f.named_parameters())
        for name, p in model.named_parameters():
            assert rel_rms_error(grads[name].grad, p.grad) <= 1e-5, name
        model.zero_grad(), f.zero_grad()
