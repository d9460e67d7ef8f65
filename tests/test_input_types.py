"""A call with inputs of another dtype than the layer was traced with is not one its graphs
hold: tracing records a cast that did nothing on the example (``x.float()`` of a float32
input) as nothing. Such a call is decided before the plan runs, eagerly and under
``torch.compile`` alike: an exact conversion runs the code as written, a lossy one refuses (or
raises the code's own error where that fails too), a call carrying state refuses. A layer whose
weights were cast since conversion expects its inputs cast as they were.

References: the layer as written (the zoo's own Python loop) on the same inputs.
"""
from __future__ import annotations

import copy

import pytest
import torch

import ttt2la
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, ScanEtaTTTLayer


class _CastingScan(ScanEtaTTTLayer):
    """TTT-Linear's scan on its input cast to float32, its output cast back: at a float32
    example both casts do nothing, so the traced graphs hold neither."""

    def forward(self, x):
        return super().forward(x.float()).to(x.dtype)


class _CastingLaCT(LaCTFoldedLayer):
    """LaCT's folded layer on its input cast to float32, its output cast back."""

    def forward(self, x):
        return super().forward(x.float()).to(x.dtype)


def _call(layer, x, backend):
    if backend is None:
        return layer(x)
    torch._dynamo.reset()
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        return torch.compile(layer, backend=backend)(x)


def _converted(make, level):
    torch.manual_seed(0)
    layer = make().eval()
    return layer, ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 13, 16),))


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_exact_conversion_runs_the_code_as_written_on_inputs_of_another_dtype(dtype,
                                                                                 backend):
    """The graphs hold no cast: run on float64 inputs, the compiled plan raised torch's own
    dtype error where the code as written casts and runs."""
    layer, conv = _converted(lambda: _CastingScan(16, 2, 4), 0)
    x = torch.randn(2, 11, 16, dtype=dtype, requires_grad=True)
    y = _call(conv, x, backend)
    want = layer(x)
    assert y.dtype == dtype and torch.equal(y, want)
    (g,) = torch.autograd.grad(y.float().square().sum(), x)
    (g0,) = torch.autograd.grad(want.float().square().sum(), x)
    assert torch.equal(g, g0)
    runs = conv.ttt2la_report.layers[0].runs
    said = [v for k, v in runs.items() if k.endswith("input types")]
    assert said and f"#0 in {dtype} on cpu, where the layer was traced with torch.float32" \
        in said[0], runs


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_lossy_conversion_refuses_inputs_of_another_dtype(backend):
    """The code as written runs on float64 inputs, but a lossy conversion computes another
    function: refused, naming the input and the dtype it was traced with."""
    _, conv = _converted(lambda: _CastingLaCT(16, 2, 4, muon=False), 2)
    assert not conv.ttt2la_report.layers[0].exact
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with pytest.raises(ttt2la.UnsupportedShapeError, match=r"#0 in torch\.float64 on cpu, where "
                       r"the layer was traced with torch\.float32 on cpu"):
        _call(conv, x, backend)
    assert conv(x.float()).dtype == torch.float32       # the traced dtype still runs


def test_inputs_cast_as_the_weights_were_run_the_plan():
    """After ``.double()`` the layer is converted again at float64, and float64 inputs are the
    ones it expects, compiled or not; float32 inputs, which the code as written rejects now,
    are refused naming its line."""
    layer, conv = _converted(lambda: ScanEtaTTTLayer(16, 2, 4), 0)
    conv, layer = conv.double(), copy.deepcopy(layer).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    for backend in (None, "aot_eager"):
        y = _call(conv, x, backend)
        assert y.dtype == torch.float64 and rel_rms_error(y, layer(x)) <= 1e-10
    runs = conv.ttt2la_report.layers[0].runs
    assert not any(k.endswith("input types") for k in runs), runs
    with pytest.raises(ttt2la.RejectedCallError, match=r"#0 in torch\.float32 on cpu, where the "
                       r"layer was traced with torch\.float64") as e:
        conv(x.float())
    assert "ttt_scan.py:" in e.value.where
    runs = conv.ttt2la_report.layers[0].runs     # a call that failed as written ran nothing
    assert not any(k.endswith("input types") for k in runs), runs


def test_a_call_carrying_state_refuses_inputs_of_another_dtype():
    _, conv = _converted(lambda: _CastingScan(16, 2, 4), 0)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    with pytest.raises(ttt2la.StreamingError, match=r"#0 in torch\.float64 on cpu"):
        conv(x, return_ttt_state=True)
