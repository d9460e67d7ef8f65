"""A converted model is an ordinary module: it deep-copies, pickles (``pickle``, ``torch.save``),
refuses to be converted again with a clear error, and compiles with
``torch.compile(fullgraph=True)``.

References are the original models (the zoo's own code) or the converted model before the
copy; the language model is converted once per module.
"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, ScanEtaTTTLayer, TinyLaCTLM

FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(5)
    model = TinyLaCTLM(40, 16, 2, 2, 4, muon=False, update_theta=False, weight_norm=False)
    ids = torch.randint(0, 40, (2, 14))
    return model, ttt2la.convert(model, level=2, example_inputs=(ids,))


def _ids(B=2, L=11, seed=0):
    return torch.randint(0, 40, (B, L), generator=torch.Generator().manual_seed(seed))


def test_deepcopy_gives_an_independent_model_with_the_same_outputs(lm):
    model, conv = lm
    ids = _ids()
    with torch.no_grad():
        before = conv(ids)
    twin = copy.deepcopy(conv)
    assert type(twin.blocks[0].ttt) is type(conv.blocks[0].ttt)
    assert twin.lm_head.weight is twin.embed.weight              # the tie survives the copy
    with torch.no_grad():
        assert torch.equal(twin(ids), before)
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(conv(ids), before)                   # the original is untouched
        assert rel_rms_error(twin(ids), before) > 1e-3
    assert rel_rms_error(before, model(ids)) <= FP32
    shallow = copy.copy(conv.blocks[0].ttt)                    # shares parameters, no re-trace
    assert shallow.qkv is conv.blocks[0].ttt.qkv and shallow._ttt2la is conv.blocks[0].ttt._ttt2la


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_model_loads_back_converted_with_identical_outputs(lm, how):
    _model, conv = lm
    ids = _ids(3, 17, seed=1)
    with torch.no_grad():
        before = conv(ids)
    if how == "pickle":
        back = pickle.loads(pickle.dumps(conv))
    else:
        buf = io.BytesIO()
        torch.save(conv, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    layer = back.blocks[1].ttt
    assert type(layer).__name__ == "ConvertedLaCTFoldedLayer" and isinstance(layer,
                                                                             LaCTFoldedLayer)
    assert back.ttt2la_report.level == 2
    with torch.no_grad():
        assert torch.equal(back(ids), before)
    # the report's record of what ran stays live on the loaded model
    assert back.ttt2la_report.layers[1].runs is layer._ttt2la.runs
    assert any("block_linear_attention" in v for v in layer._ttt2la.runs.values())


def test_converting_a_converted_model_says_it_is_converted_already(lm):
    model, conv = lm
    with pytest.raises(ttt2la.AlreadyConvertedError, match="already converted at level 2"):
        ttt2la.convert(conv, level=1)
    with pytest.raises(ttt2la.AlreadyConvertedError, match="blocks.0.ttt"):
        ttt2la.inspect(conv, show=False)
    assert isinstance(ttt2la.AlreadyConvertedError("x"), ttt2la.ConversionError)
    # the model it was converted from still converts
    assert type(model.blocks[0].ttt) is LaCTFoldedLayer


@pytest.mark.parametrize("make", [
    lambda: LaCTFoldedLayer(16, 2, 4, muon=False, update_theta=False, weight_norm=False),
    # features chunk by chunk, the padding of a partial last chunk probed per tail length
    lambda: ScanEtaTTTLayer(16, 2, 4),
], ids=["whole-sequence features", "chunked features"])
def test_torch_compile_fullgraph_runs_the_converted_layer(make):
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 13, 16),))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
        # a second shape recompiles with symbolic sizes, a third runs that graph
        for shape in [(2, 13, 16), (3, 10, 16), (2, 19, 16)]:
            x = torch.randn(*shape, requires_grad=True)
            y = compiled(x)
            assert rel_rms_error(y, layer(x)) <= FP32
            (g_compiled,) = torch.autograd.grad(y.square().sum(), x)
            (g_eager,) = torch.autograd.grad(conv(x).square().sum(), x)
            assert rel_rms_error(g_compiled, g_eager) <= FP32
        torch._dynamo.reset()
