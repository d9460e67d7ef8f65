"""A call a converted layer's code rejects raises, under ``torch.compile``, the error the eager
call raises: a ``RejectedCallError`` naming the user's line, not TorchDynamo's own error or
torch's bare one. Inputs of another dtype than the traced ones run between compiled graphs, as
eagerly; under ``fullgraph=True`` TorchDynamo's refusal says so.

References: the eager call's error on the same input (its class, line and message).
"""
from __future__ import annotations

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


def _compiled_error(converted, x, **options):
    torch._dynamo.reset()
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        with pytest.raises(Exception) as raised:
            torch.compile(converted, backend="eager", **options)(x)
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
