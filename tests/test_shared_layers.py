"""One layer held twice in a model (``nn.ModuleList([t, t])``, weights shared across depth) and
weights tied between two submodules of one layer, traced through every name they are set by.

The layer held twice converts exactly — outputs and every gradient within the fp32 bound at other
lengths — where it was refused with torch's internal functionalization error (or, after another
conversion, a raw fake-tensor error escaped): tracing the model's loop over its layers set the
shared layer's weights through both names, and torch's restore left the traced tensors in the
module. A weight tied between two submodules still reaches both uses in the trace: its gradient
is the sum of both, and both read its new values and dtype.

References: the models as written.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function

D, C = 8, 4


class ChunkMemory(nn.Module):
    """Additive fast weights over chunks; ``tied``: the key projection is the query's."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        if tied:
            self.k.weight = self.q.weight

    def forward(self, x):
        q, k, v = self.q(x), torch.nn.functional.normalize(self.k(x), dim=-1), self.v(x)
        W, outs = x.new_zeros(x.shape[0], D, D), []
        for s in range(0, x.shape[1], C):
            outs.append(q[:, s:s + C] @ W)
            W = W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
        return torch.cat(outs, 1)


class Depth(nn.Module):
    """``layers`` applied in turn with residuals: one layer twice when ``shared``."""

    def __init__(self, shared: bool):
        super().__init__()
        first = ChunkMemory()
        self.layers = nn.ModuleList([first, first if shared else ChunkMemory()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("after_another", [False, True])
def test_a_layer_held_twice_in_a_module_list_converts_exactly(after_another):
    if after_another:       # a conversion earlier in the process changed the failure's kind
        torch.manual_seed(1)
        ttt2la.convert(Depth(shared=False), level=0, example_inputs=(torch.randn(2, 12, D),))
    torch.manual_seed(0)
    model = Depth(shared=True)
    conv = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 12, D),))
    assert conv.ttt2la_report.exact and len(conv.ttt2la_report.layers) == 1
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for length in (12, 7, 20):
        assert_same_function(conv, model, torch.randn(2, length, D))


def test_a_weight_tied_between_two_submodules_reaches_both_uses():
    torch.manual_seed(0)
    layer = ChunkMemory(tied=True)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    assert conv.k.weight is conv.q.weight
    for length in (12, 9):
        assert_same_function(conv, layer, torch.randn(2, length, D))
    with torch.no_grad():                   # new values, in place: both uses read them
        layer.q.weight.mul_(0.5)
        conv.q.weight.mul_(0.5)
    conv, layer = conv.double(), layer.double()     # the graphs built again for float64
    assert_same_function(conv, layer, torch.randn(2, 12, D, dtype=torch.float64), tol=1e-12)
