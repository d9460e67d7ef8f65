"""A layer whose input is one structured value — a dataclass of the user's, a named tuple or a
dict holding the sequence and a setting — converts: its tensors are found inside it, the plan runs
on them at any shape, and a call that changes the setting is refused naming the field
(``#0.scale``). Before, a dataclass "took no tensor input" and the others let torch's
``AttributeError`` out of the conversion's check."""
import collections
import dataclasses

import pytest
import torch
import torch.nn as nn

import ttt2la
from ttt2la.testing import rel_rms_error

D = 8


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 1.0


Pair = collections.namedtuple("Pair", "x scale", defaults=(1.0,))

MAKERS = {"dataclass": Batch, "tuple": Pair,
          "dict": lambda x, scale=1.0: {"x": x, "scale": scale}}


def _field(b, name):
    return b[name] if isinstance(b, dict) else getattr(b, name)


class Memory(nn.Module):
    """Chunked linear attention on ``b.x``, scaled by ``b.scale``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, b):
        x = _field(b, "x")
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + 0.1 * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return torch.cat(outs, 1) * _field(b, "scale")


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_structured_input_converts_and_runs_the_plan(kind):
    make = MAKERS[kind]
    torch.manual_seed(0)
    layer = Memory().eval()
    conv = ttt2la.convert(layer, level=0, example_inputs=(make(torch.randn(2, 16, D)),))
    for B, T in ((3, 64), (1, 20), (2, 16)):
        x = torch.randn(B, T, D, requires_grad=True)
        got, want = conv(make(x)), layer(make(x))
        assert rel_rms_error(got, want) <= 1e-5
        g = torch.autograd.grad(got.sum(), [x, *conv.parameters()])
        w = torch.autograd.grad(want.sum(), [x, *layer.parameters()])
        assert all(rel_rms_error(a, b) <= 1e-5 for a, b in zip(g, w))
    assert "block_linear_attention" in conv.ttt2la_report.layers[0].runs["batch 3"]
    named = "#0['scale']" if kind == "dict" else "#0.scale"
    other = make(torch.randn(2, 16, D), 2.0)    # a value the conversion built in: as written
    assert rel_rms_error(conv(other), layer(other)) <= 1e-5
    assert any(key.startswith(f"called with {named} = 2.0") and ran.startswith("as written")
               for key, ran in conv.ttt2la_report.layers[0].runs.items()), \
        conv.ttt2la_report.layers[0].runs
