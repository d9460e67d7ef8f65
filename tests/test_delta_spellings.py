"""The plain delta rule in the spellings other code bases use converts onto ``delta_rule`` like
the usual correction ``S + β k (v − kᵀS)``: as a Householder transition ``(I − β kkᵀ) S + β kvᵀ``
(``I = torch.eye(d)`` made before the loop: an invariant the lift evaluates, not samples), the
same with ``I`` left out (``S − β kkᵀ S + β kvᵀ``) and in fla's identity-plus-low-rank form
``S + k (β v)ᵀ + (β k)((−k)ᵀ S)`` — each exact against the layer as written, outputs and every
parameter gradient. A transition built from two different vectors is not a delta rule and keeps
the generic plan, still exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from equivalence import assert_same_function


class Heads(nn.Module):
    """Two heads of an L2-normalised-key memory ``S [Dk, Dv]`` per head, a sigmoid rate per head
    and token, read ``q S`` after each token's update written as ``spelling``."""

    def __init__(self, spelling: str, d: int = 16, heads: int = 2):
        super().__init__()
        self.spelling, self.heads = spelling, heads
        self.proj = nn.Linear(d, 4 * d, bias=False)       # q, k, v and the look-alike's u
        self.rate = nn.Linear(d, heads)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v, u = (t.reshape(B, T, self.heads, -1) for t in self.proj(x).chunk(4, -1))
        k, u = F.normalize(k, dim=-1), F.normalize(u, dim=-1)
        beta = torch.sigmoid(self.rate(x))
        dk = k.shape[-1]
        eye = torch.eye(dk)
        S = x.new_zeros(B, self.heads, dk, v.shape[-1])
        ys = []
        for t in range(T):
            kt, vt, ut = k[:, t], v[:, t], u[:, t]
            b = beta[:, t].unsqueeze(-1).unsqueeze(-1)            # [B, H, 1, 1]
            col, row = kt.unsqueeze(-1), kt.unsqueeze(-2)
            if self.spelling == "householder":
                S = (eye - b * col * row) @ S + b * col * vt.unsqueeze(-2)
            elif self.spelling == "projector":
                S = S - (b * col * row) @ S + (b * col) @ vt.unsqueeze(-2)
            elif self.spelling == "iplr":
                bs = beta[:, t].unsqueeze(-1)                     # [B, H, 1]
                S = S + col @ (bs * vt).unsqueeze(-2) \
                    + (bs * kt).unsqueeze(-1) * (S * (-kt).unsqueeze(-1)).sum(-2, keepdim=True)
            elif self.spelling == "two_vectors":                  # (I − β u kᵀ) S: no delta rule
                S = (eye - b * ut.unsqueeze(-1) * row) @ S + b * col * vt.unsqueeze(-2)
            else:
                raise ValueError(self.spelling)
            ys.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
        return torch.stack(ys, 1).reshape(B, T, -1)


def _converted(layer):
    torch.manual_seed(1)
    return ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 9, 16),))


@pytest.mark.parametrize("spelling", ["householder", "projector", "iplr"])
def test_delta_rule_spellings_run_on_the_op(spelling):
    torch.manual_seed(0)
    layer = Heads(spelling)
    conv = _converted(layer)
    runtime = conv.ttt2la_report.layers[0].runtime
    assert runtime.startswith("delta_rule"), runtime
    xs = [torch.randn(2, T, 16) for T in (1, 7, 70, 131)]
    assert_same_function(conv, layer, xs)


def test_spellings_are_one_function():
    torch.manual_seed(0)
    layers = [Heads(s) for s in ("householder", "projector", "iplr")]
    for layer in layers[1:]:
        layer.load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 40, 16)
    with torch.no_grad():
        ys = [layer(x) for layer in layers]
    for y in ys[1:]:
        assert torch.allclose(y, ys[0], atol=1e-5)


def test_a_transition_of_two_vectors_keeps_the_generic_plan():
    torch.manual_seed(0)
    layer = Heads("two_vectors")
    conv = _converted(layer)
    runtime = conv.ttt2la_report.layers[0].runtime
    assert not runtime.startswith("delta_rule"), runtime
    assert_same_function(conv, layer, [torch.randn(2, T, 16) for T in (1, 7, 70)])
