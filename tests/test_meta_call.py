"""A converted model on the meta device: a dry run gives the outputs' shapes and dtypes as the
original on meta does, and ``to_empty`` then ``load_state_dict`` gives back a working converted
model (the conversion's own plan).

References: the original layer moved the same way; the converted layer before the move.
"""
from __future__ import annotations

import copy

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.zoo import TitansLinearMemory, lact_layer

# LaCT with two Newton–Schulz steps: the meta device, not the iteration, is under test
LAYERS = {
    "lact": lambda: lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4,
                               muon_steps=2),
    "titans": lambda: TitansLinearMemory(16, 4),
}


def _out(y):
    return y[0] if isinstance(y, tuple) else y


_CONVERTED = module_scoped.cache()


def _converted(name: str, level: int):
    """The original layer and a copy of its conversion at ``level``, converted once per module:
    each caller gets a copy that nothing has called yet, its report's runs as conversion left
    them."""
    if (name, level) not in _CONVERTED:
        torch.manual_seed(0)
        original = LAYERS[name]()
        _CONVERTED[name, level] = original, ttt2la.convert(
            original, level=level, example_inputs=(torch.randn(2, 16, 16),))
    original, converted = _CONVERTED[name, level]
    return original, copy.deepcopy(converted)


@pytest.mark.parametrize("name", LAYERS)
@settings(max_examples=3)
@given(batch=st.integers(1, 3), length=st.integers(1, 20), level=st.sampled_from([2, 4]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_on_meta_the_outputs_have_the_originals_shapes_and_dtypes(name, batch, length, level,
                                                                   dtype):
    original, converted = _converted(name, level)
    x = torch.empty(batch, length, 16, device="meta", dtype=dtype)
    on_meta = copy.deepcopy(converted).to(device="meta", dtype=dtype)
    y, y0 = _out(on_meta(x)), _out(copy.deepcopy(original).to(device="meta", dtype=dtype)(x))
    assert y.is_meta and y.shape == y0.shape and y.dtype == y0.dtype == dtype
    assert "meta tensors" in on_meta._ttt2la.runs


@pytest.mark.parametrize("name", LAYERS)
def test_meta_then_to_empty_and_the_weights_runs_the_conversion(name):
    """The conversion's own plan again: the outputs and every gradient of the converted layer
    before the move, to the bit."""
    _original, converted = _converted(name, 2)
    model = copy.deepcopy(converted).to("meta")
    model(torch.empty(2, 16, 16, device="meta"))
    model.to_empty(device="cpu")
    model.load_state_dict(converted.state_dict())
    x = torch.randn(3, 13, 16, generator=torch.Generator().manual_seed(1))
    y, y1 = _out(model(x)), _out(converted(x))
    assert torch.equal(y, y1)
    assert any("as written" not in plan and "meta" not in shape
               for shape, plan in model._ttt2la.runs.items())
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((y * g).sum(), list(model.parameters()), allow_unused=True)
    grads1 = torch.autograd.grad((y1 * g).sum(), list(converted.parameters()), allow_unused=True)
    for (n, _), a, b in zip(converted.named_parameters(), grads, grads1):
        assert (a is None and b is None) or torch.equal(a, b), n


def test_a_stateful_call_on_meta_is_refused_with_what_to_do():
    _original, converted = _converted("lact", 2)
    on_meta = copy.deepcopy(converted).to("meta")
    with pytest.raises(ttt2la.StreamingError, match="meta tensors hold no values"):
        on_meta(torch.empty(2, 8, 16, device="meta"), return_ttt_state=True)
