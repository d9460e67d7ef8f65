"""TTT-Linear's scan in mini-batches decides ``if n > 0:`` and ``if rest > 0:`` on
``n, rest = divmod(L, K)`` around its loop: decisions its plan, one loop with a partial last
chunk, makes by itself. Converted at a lossy level it runs at every length, as a conversion at
that length would; at an exact level it computes the code as written at every length (outputs
and parameter gradients); a branch the plan does not make keeps the lengths held.

The lossy layer is the scan with momentum on its fast weight, at level 5 with the momentum's
fold replayed as 1: its function is then the momentum-free scan as written
(``ScanLinearTTTLayer`` with the same weights), the reference at every length.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.errors import UnsupportedShapeError
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo.ttt_scan import ScanLinearTTTLayer, _tiled, dual_form_rates

FP32 = TOLERANCE[torch.float32]
K, D, H = 4, 8, 2
FOLDS = {"": {"remove_momentum": {"m": 1.0}}}       # the increment alone: no momentum


class ScanMomentumLayer(ScanLinearTTTLayer):
    """The linear scan with a momentum on its fast weight's increment (lossy at level 5)."""

    def initial(self, batch):
        W = _tiled(self.W, batch)
        return {"W": W, "m": torch.zeros_like(W)}

    def mini_batch(self, params, x, scale):
        W, m = params["W"], params["m"]
        q, k, v = x["q"], x["k"], x["v"]
        causal, last = dual_form_rates(scale, x["lr"])
        z_bar = q @ W + (causal * (q @ k.transpose(-1, -2))) @ v
        m = 0.5 * m + (last * k).transpose(-1, -2) @ v
        return {"W": W + m, "m": m}, q + z_bar


class EightsBranch(ScanMomentumLayer):
    """A branch around the scan's output on ``T % 8``, which the plan does not make."""

    def forward(self, x):
        o = super().forward(x)
        T = x.shape[1]
        return o * 2 if T % 8 else o + 2


class RestBranch(ScanMomentumLayer):
    """``if rest > 0:`` as the scan decides it, around code the plan does not run."""

    def forward(self, x):
        o = super().forward(x)
        rest = x.shape[1] % self.mini_batch_size
        if rest > 0:
            o = o * 2
        return o


def _layer(cls=ScanMomentumLayer, mini_batch=K):
    torch.manual_seed(3)
    layer = cls(D, H, mini_batch)
    with torch.no_grad():
        layer.lr_weight.normal_(0.0, 0.5)
        layer.position_offset.uniform_(-0.2, 0.3)
    return layer


def _x(B, L, seed=0):
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def scan():
    layer = _layer()
    example = (_x(2, 13),)
    reference = ScanLinearTTTLayer(D, H, K)
    reference.load_state_dict(layer.state_dict())
    return (layer, reference, ttt2la.convert(layer, level=5, example_inputs=example, folds=FOLDS),
            ttt2la.convert(layer, level=2, example_inputs=example))


def _same_function(mine, theirs, x):
    """Outputs and every parameter gradient agree to the fp32 tolerance."""
    y, y0 = mine(x), theirs(x)
    assert rel_rms_error(y, y0) <= FP32
    names = [n for n, _ in theirs.named_parameters()]
    grads = torch.autograd.grad(y.square().sum(), [dict(mine.named_parameters())[n]
                                                   for n in names])
    grads0 = torch.autograd.grad(y0.square().sum(), list(theirs.parameters()))
    for name, g, g0 in zip(names, grads, grads0):
        assert rel_rms_error(g, g0) <= FP32, name


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 3 * K + 3), seed=st.integers(0, 99))
def test_a_lossy_conversion_of_the_scan_holds_at_every_length(scan, B, L, seed):
    _layer_, reference, lossy, _exact = scan
    assert lossy._ttt2la.length_vouching is None
    _same_function(lossy, reference, _x(B, L, seed))


@pytest.mark.parametrize("L", [3, 8, 10], ids=["shorter than a mini-batch", "whole mini-batches",
                                               "a remainder"])
def test_the_lossy_layer_at_a_length_is_its_conversion_at_that_length(scan, L):
    layer, _reference, lossy, _exact = scan
    fresh = ttt2la.convert(layer, level=5, example_inputs=(_x(2, L, 1),), folds=FOLDS)
    x = _x(3, L, 2)
    with torch.no_grad():
        assert rel_rms_error(lossy(x), fresh(x)) <= FP32


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 3 * K + 3), seed=st.integers(0, 99))
def test_an_exact_conversion_of_the_scan_is_its_code_at_every_length(scan, B, L, seed):
    layer, _reference, _lossy, exact = scan
    assert exact._ttt2la.length_vouching is None and not exact._ttt2la.compile_break
    _same_function(exact, layer, _x(B, L, seed))


def test_an_unpickled_lossy_conversion_holds_at_every_length(scan):
    _layer_, reference, lossy, _exact = scan
    back = pickle.loads(pickle.dumps(lossy))
    x = _x(2, 8, 4)
    with torch.no_grad():
        assert rel_rms_error(back(x), reference(x)) <= FP32


@pytest.mark.parametrize("cls,mini_batch", [(EightsBranch, 4), (EightsBranch, 8),
                                            (RestBranch, 4)],
                         ids=["no case of the plan", "a case around other code",
                              "the scan's own test around other code"])
def test_a_branch_the_plan_does_not_make_keeps_the_lengths_held(cls, mini_batch):
    layer = _layer(cls, mini_batch)
    lossy = ttt2la.convert(layer, level=5, example_inputs=(_x(2, 13),), folds=FOLDS)
    line = "o * 2 if T % 8" if cls is EightsBranch else "if rest > 0:` at " + __file__
    assert line in lossy._ttt2la.length_vouching.what
    with pytest.raises(UnsupportedShapeError, match="computes Python values of the length"):
        lossy(_x(2, 16))


def test_the_exact_conversion_of_the_scan_compiles_as_one_graph(scan):
    """No length is checked against the code as written when called, so nothing breaks the
    graph: ``torch.compile(fullgraph=True)`` runs it, shorter than a mini-batch and at whole
    mini-batches (lengths the probe traces did not show)."""
    layer, _reference, _lossy, exact = scan
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(exact, fullgraph=True, backend="eager", dynamic=False)
        for B, L in [(2, 8), (3, 3)]:
            x = _x(B, L, 6)
            with torch.no_grad():
                assert rel_rms_error(compiled(x), layer(x)) <= FP32
        torch._dynamo.reset()
