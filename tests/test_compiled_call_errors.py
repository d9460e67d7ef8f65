"""A call a converted layer's code rejects raises, under ``torch.compile``, the error the eager
call raises: a ``RejectedCallError`` naming the user's line, not TorchDynamo's own error or
torch's bare one. Inputs of another dtype than the traced ones run between compiled graphs, as
eagerly; under ``fullgraph=True`` TorchDynamo's refusal says so.

References: the eager call's error on the same input (its class, line and message).
"""
from __future__ import annotations

import warnings

import pytest
import torch

import ttt2la
from ttt2la.zoo import GatedChunkMemory, LaCTFoldedLayer

LAYERS = {
    # the exact conversion's plan fails when the compiled graph runs it
    "exact": (lambda: GatedChunkMemory(16, 2, 4), 16, 0, "gated_memory.py"),
    # the lossy conversion's plan fails while TorchDynamo traces it on fake tensors
    "lossy": (lambda: LaCTFoldedLayer(8, 2, 4, muon=False), 8, 2, "lact_folded.py"),
}


def _converted(name):
    make, d, level, _ = LAYERS[name]
    torch.manual_seed(0)
    return ttt2la.convert(make().eval(), level=level, example_inputs=(torch.randn(1, 16, d),)), d


def _compiled_call(converted, x, breaks: list, **options):
    """``torch.compile(converted, **options)(x)`` with TorchDynamo on, appending to ``breaks``
    the graph breaks it made."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
            return torch.compile(converted, backend="eager", **options)(x)
    finally:
        breaks.extend(counters["graph_break"])


def _compiled_error(converted, x, **options):
    with pytest.raises(Exception) as raised:
        _compiled_call(converted, x, [], **options)
    return raised.value


@pytest.mark.parametrize("name", LAYERS)
def test_a_compiled_call_the_code_rejects_names_the_users_line(name):
    converted, d = _converted(name)
    x = torch.randn(2, 16, d, dtype=torch.float64)     # the weights are float32
    with pytest.raises(ttt2la.RejectedCallError) as eager:
        converted(x)
    compiled = _compiled_error(converted, x)
    assert isinstance(compiled, ttt2la.RejectedCallError), repr(compiled)
    assert isinstance(compiled, RuntimeError)
    assert compiled.where == eager.value.where and LAYERS[name][3] in compiled.where
    assert str(compiled) == str(eager.value)


def test_under_fullgraph_the_refusal_says_the_inputs_are_not_as_traced():
    """Inputs of another dtype than the traced ones are decided before the plan runs, between
    graphs: under ``fullgraph=True`` TorchDynamo's refusal says so and what to do."""
    converted, d = _converted("lossy")
    x = torch.randn(2, 16, d, dtype=torch.float64)
    compiled = _compiled_error(converted, x, fullgraph=True)
    assert "another dtype or on another device than the layer was traced with" in str(compiled) \
        and "without fullgraph=True" in str(compiled), str(compiled)


#: Where a planted fault fails the converted loop: on the real tensors of the compiled graph's
#: run, on the fake tensors TorchDynamo traces the call with, or on both.
FAULTS = {"in_the_compiled_graph": (False,), "while_traced": (True,), "on_every_call": (False, True)}


def _loop_fails(converted, B, fault: str):
    """The converted loop at batch size ``B`` raising a bare torch error where ``fault`` says: a
    fault of the converted graphs that no input decides before the plan runs."""
    from torch._guards import detect_fake_mode

    loop = converted._ttt2la.loop_for(B)
    forward = loop.forward

    def failing(*args, **kwargs):
        if (detect_fake_mode(args) is not None) in FAULTS[fault]:
            raise RuntimeError("a fault planted in the converted loop")
        return forward(*args, **kwargs)
    loop.forward = failing




def _answer(call):
    """What ``call()`` answers: its output, its error and the warnings ttt2la gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out, error = call(), None
        except Exception as e:      # the answer compared, whatever its class
            out, error = None, e
    return out, error, [str(w.message) for w in caught if "ttt2la" in str(w.message)]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", LAYERS)
def test_a_loop_failing_under_compile_answers_as_the_eager_call(name, fault):
    """A converted loop failing on a call answers under ``torch.compile`` as the eager call
    does, never with torch's bare error: failing in the compiled graph's run, an exact
    conversion answers with the code as written (which takes the call) and a warning, a lossy
    one refuses the call; failing while TorchDynamo traces it on fake tensors, the call runs
    eagerly after a graph break, where the plan takes it — run eagerly, not traced by
    TorchDynamo again (whose graph breaks on the converted layer's own code would follow)."""
    (converted, d), (reference, _) = _converted(name), _converted(name)
    x = torch.randn(2, 16, d)
    for layer in (converted, reference):
        _loop_fails(layer, 2, fault)
    breaks = []
    out, error, said = _answer(lambda: _compiled_call(converted, x, breaks))
    eager_out, eager_error, eager_said = _answer(lambda: reference(x))
    if False in FAULTS[fault]:      # the eager call meets the fault too: not the plan's answer
        assert eager_said or isinstance(eager_error, ttt2la.ConversionError), eager_error
    assert type(error) is type(eager_error) and str(error) == str(eager_error), repr(error)
    assert said == eager_said
    assert all(b.startswith("ttt2la:") for b in breaks), breaks
    if eager_out is not None:
        torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
