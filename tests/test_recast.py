"""A converted layer cast or moved after conversion (``.float()``, ``.double()``,
``functional_call`` with weights of another dtype) is converted again for its new weights and
computes what the original computes with them.

References: the original layer cast the same way, exact levels judged as every conversion is
(outputs and every parameter gradient); a lossy level against a fresh conversion of the cast
original replaying the same folds. Several of these layers failed before on a cast (fills and
folded constants held in the plan's graphs, the precision chosen from the trace).
"""
from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call
from torch.nn.utils import parametrize

import ttt2la
from ttt2la.original_class import original_class
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import (GatedChunkMemory, LaCTFoldedLayer, LaCTHeadsLayer, TitansLinearMemory,
                        ViTTTBlock, lact_layer)

LAYERS = {
    "titans (affine scan, fills in its graphs)": lambda: TitansLinearMemory(8, 4),
    # the two below as written are what level 2 makes of them: their conversions are exact
    "vittt (vmap plan)": lambda: ViTTTBlock(8, 2, 4, 4, update_gate=False, grad_norm=False),
    "lact heads (block op)": lambda: LaCTHeadsLayer(8, 2, 4, update_theta=False,
                                                    weight_norm=False, muon_steps=2),
}
SHAPE = (2, 16, 8)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _layer(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return LAYERS[name]().to(dtype)


def _x(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


_CONVERTED = module_scoped.cache()


def _copies(key, convert):
    """Copies of the (original, converted) pair ``convert()`` makes, made once per module under
    ``key``: each test gets copies that nothing has called yet, the conversion's report and
    runs as conversion left them."""
    if key not in _CONVERTED:
        _CONVERTED[key] = convert()
    return tuple(copy.deepcopy(module) for module in _CONVERTED[key])


def _converted(name: str, dtype: torch.dtype, level: int):
    """``_layer(name, dtype)`` and its conversion at ``level`` on ``_x(dtype, 0)`` (copies)."""
    def convert():
        original = _layer(name, dtype)
        return original, ttt2la.convert(original, level=level, example_inputs=(_x(dtype, 0),))
    return _copies((name, dtype, level), convert)


def _grads(module, x) -> dict[str, torch.Tensor]:
    module.zero_grad()
    _out(module(x)).pow(2).sum().backward()
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


CASTS = [(name, torch.float64, torch.float32) for name in LAYERS] + [
    (next(iter(LAYERS)), torch.float32, torch.float64)]


@pytest.mark.parametrize("name,was,now", CASTS)
def test_a_cast_converted_layer_computes_the_cast_original(name, was, now):
    """The same outputs as the cast original, and the same outputs and gradients as the cast
    original converted afresh (the gradients of fp32 originals can be less exact than the
    tolerance against themselves; the conversions' own tests judge those)."""
    original, converted = _converted(name, was, 2)
    assert converted.ttt2la_report.exact
    cast, reference = copy.deepcopy(converted).to(now), copy.deepcopy(original).to(now)
    _, afresh = _converted(name, now, 2)    # the same weights as ``reference``, converted
    x = _x(now)
    y, y0 = _out(cast(x)), _out(reference(x))
    assert y.dtype == y0.dtype == now
    assert rel_rms_error(y, y0) <= TOLERANCE[now]
    assert rel_rms_error(y, _out(afresh(x))) <= TOLERANCE[now]
    grads, grads0 = _grads(cast, x), _grads(afresh, x)
    assert grads.keys() == grads0.keys() == _grads(reference, x).keys()
    for n in grads:
        assert rel_rms_error(grads[n], grads0[n]) <= TOLERANCE[now], n
    assert any(f"weights in {now}" in shape for shape in cast._ttt2la.runs)


def _traces_while(monkeypatch, call) -> int:
    """How many times the recognizer traces a layer while ``call()`` runs."""
    from ttt2la.frontend import trace_cache

    traced, real = [], trace_cache.trace
    monkeypatch.setattr(trace_cache, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))
    call()
    monkeypatch.setattr(trace_cache, "trace", real)
    return len(traced)


def test_copies_of_a_converted_layer_cast_together_are_traced_again_once(monkeypatch):
    """A converted layer copied into a model's blocks, cast after conversion, is converted again
    from one block's traces, as it was converted: what ttt2la keeps on a converted layer (its
    report, its state) steers none of the layer's code, so it is no part of what the traces
    are cached by. Each block then computes what the cast original does."""
    from ttt2la.frontend import recognize, trace_cache

    monkeypatch.setattr(recognize, "_CACHE", type(recognize._CACHE)())   # none cached before
    monkeypatch.setattr(trace_cache, "_TRACES", type(trace_cache._TRACES)())
    original = _layer("titans (affine scan, fills in its graphs)", torch.float32)
    converted = ttt2la.convert(original, level=2, example_inputs=(_x(torch.float32, 0),))
    blocks = [copy.deepcopy(converted).double() for _ in range(2)]
    reference, x = copy.deepcopy(original).double(), _x(torch.float64)
    with torch.no_grad():
        first = _traces_while(monkeypatch, lambda: blocks[0](x))
        second = _traces_while(monkeypatch, lambda: blocks[1](x))
        assert first > 0 and second == 0
        for block in blocks:
            assert rel_rms_error(_out(block(x)), _out(reference(x))) <= TOLERANCE[torch.float64]


def test_a_lossy_level_cast_replays_its_folds_at_the_new_dtype():
    torch.manual_seed(0)
    original = LaCTFoldedLayer(8, 2, 4, muon=False).double()     # Muon folds nothing: left out
    converted = ttt2la.convert(original, level=6, calibration=(_x(torch.float64, 0),))
    assert not converted.ttt2la_report.exact
    folds = {"": converted._ttt2la.recipe.folds}
    assert {"collapse_mlp", "absorb_lr"} <= set(folds[""])  # a matrix and a learning rate
    fresh = ttt2la.convert(copy.deepcopy(original).float(), level=6,
                           example_inputs=(_x(torch.float32, 0),), folds=folds)
    x = _x(torch.float32)
    assert rel_rms_error(_out(copy.deepcopy(converted).float()(x)),
                         _out(fresh(x))) <= TOLERANCE[torch.float32]


def test_functional_call_with_weights_of_another_dtype_and_back():
    original, converted = _converted("titans (affine scan, fills in its graphs)",
                                     torch.float64, 0)
    weights = {n: p.detach().float() * 1.1 for n, p in original.named_parameters()}
    x = _x(torch.float32)
    assert rel_rms_error(_out(functional_call(converted, weights, (x,))),
                         _out(functional_call(original, weights, (x,)))) \
        <= TOLERANCE[torch.float32]
    x64 = _x(torch.float64)                  # its own weights again: the state it was built with
    assert rel_rms_error(_out(converted(x64)), _out(original(x64))) <= TOLERANCE[torch.float64]
    assert len(converted._ttt2la._recast) == 1
    functional_call(converted, weights, (x,))
    assert len(converted._ttt2la._recast) == 1      # built once per signature


def test_a_cast_layer_without_a_recipe_says_how_to_convert_it():
    _, converted = _converted("titans (affine scan, fills in its graphs)", torch.float64, 0)
    converted._ttt2la.recipe = None
    converted.float()
    with pytest.raises(ttt2la.UnsupportedTTTError, match="torch.float64 on cpu.*torch.float32 "
                                                           "on cpu.*Change the original model"):
        converted(_x(torch.float32))


def test_first_call_after_a_cast_inside_activation_checkpointing():
    """The conversion runs out of sight of the call that needs it: the checkpoint's
    recomputation saves as many tensors as its forward did, and the gradients are right."""
    original, converted = _converted("titans (affine scan, fills in its graphs)",
                                     torch.float64, 0)
    cast, reference = copy.deepcopy(converted).float(), copy.deepcopy(original).float()
    x, x0 = _x(torch.float32).requires_grad_(True), _x(torch.float32).requires_grad_(True)
    y = torch.utils.checkpoint.checkpoint(cast, x, use_reentrant=False)
    _out(y).pow(2).sum().backward()
    _out(reference(x0)).pow(2).sum().backward()
    assert rel_rms_error(x.grad, x0.grad) <= TOLERANCE[torch.float32]


def test_a_stream_as_the_first_call_after_a_cast():
    """The layer converts again for its new dtype without the stream's hooks, which pass the
    state to the converted layer, not to the code as written that the conversion traces."""
    torch.manual_seed(0)
    original = GatedChunkMemory(8, 2, 4)
    x = torch.randn(2, 16, 8)
    cast = ttt2la.convert(original, level=0, example_inputs=(x,)).double()
    stream = ttt2la.Stream(cast)
    xd = x.double()
    with torch.no_grad():
        got = torch.cat([stream.stream(xd[:, :8]), stream.stream(xd[:, 8:])], 1)
        want = copy.deepcopy(original).double()(xd)
    assert rel_rms_error(got, want) <= TOLERANCE[torch.float64]


# -- torch.func transforms over a converted layer ------------------------------------------------

#: LaCT with two Newton–Schulz steps: the transforms, not the iteration, are under test
BLOCK_OP_LAYERS = {
    "gated memory, level 0": (lambda: GatedChunkMemory(8, 2, 4), 0),
    "lact folded variant 2, level 2": (
        lambda: lact_layer("folded", variant=2, d_model=8, num_heads=2, chunk_size=4,
                           muon_steps=2), 2),
}


def _block_op_pair(name: str):
    """The original layer and its conversion (copies, converted once per module)."""
    def convert():
        make, level = BLOCK_OP_LAYERS[name]
        torch.manual_seed(0)
        original = make().double()
        return original, ttt2la.convert(original, level=level,
                                        example_inputs=(_x(torch.float64, 0),))
    original, converted = _copies(name, convert)
    assert converted.ttt2la_report.exact
    assert converted.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")
    return original, converted


def _func_grads(module, x) -> dict[str, torch.Tensor]:
    weights = {n: p.detach() for n, p in module.named_parameters()}
    return torch.func.grad(
        lambda w: _out(functional_call(module, w, (x,))).pow(2).mean())(weights)


def _per_sample_grads(module, x) -> dict[str, torch.Tensor]:
    weights = {n: p.detach() for n, p in module.named_parameters()}

    def loss(w, sample):
        return _out(functional_call(module, w, (sample[None],))).pow(2).mean()
    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(weights, x)


def _jacobian(module, x) -> torch.Tensor:
    return torch.func.jacrev(lambda inputs: _out(module(inputs)))(x)


@pytest.mark.parametrize("name", BLOCK_OP_LAYERS)
@pytest.mark.parametrize("transform", [_func_grads, _per_sample_grads, _jacobian],
                         ids=["grad", "vmap_grad", "jacrev"])
def test_torch_func_transforms_over_the_block_op_give_the_originals_gradients(name, transform):
    """The block op's autograd Functions have no ``torch.func`` rules: under ``grad``,
    ``vmap(grad)`` (per-sample gradients) and ``jacrev`` an exact conversion runs the code as
    written, the same function, and says so by a warning and the report's runs."""
    original, converted = _block_op_pair(name)
    x = _x(torch.float64)
    want = transform(original, x)
    with pytest.warns(RuntimeWarning, match="under a torch.func transform"):
        got = transform(converted, x)
    pairs = [(got[n], want[n]) for n in want] if isinstance(want, dict) else [(got, want)]
    assert isinstance(got, torch.Tensor) or got.keys() == want.keys()
    for a, b in pairs:
        assert rel_rms_error(a, b) <= 1e-5
    assert any("torch.func transform" in key for key in converted._ttt2la.runs)
    assert rel_rms_error(_out(converted(x)), _out(original(x))) <= TOLERANCE[torch.float64]


def test_a_lossy_block_op_conversion_under_torch_func_is_refused_by_name():
    """A lossy conversion computes another function than the code as written: under a
    ``torch.func`` transform its block op cannot run, and the call is refused, naming why."""
    torch.manual_seed(0)
    original = LaCTHeadsLayer(8, 2, 4, update_theta=False, weight_norm=False,
                              muon_steps=2).double()
    converted = ttt2la.convert(original, level=6, calibration=(_x(torch.float64, 0),))
    assert not converted.ttt2la_report.exact
    with pytest.raises(ttt2la.UnsupportedTTTError,
                       match=r"torch\.func transform .*block op's autograd functions"):
        _func_grads(converted, _x(torch.float64))


def _saved_and_loaded(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("now", [torch.float64, torch.bfloat16], ids=str)
@settings(max_examples=3)
@given(batch=st.integers(1, 3), length=st.integers(1, 20), called=st.booleans())
def test_a_cast_layer_saved_whole_loads_back_for_its_weights(now, batch, length, called):
    """``torch.save`` of a converted layer cast after conversion (called at the new dtype or
    not), then ``torch.load``: it loads at the cast dtype, converted again for it, and computes
    what the cast original computes (no Newton–Schulz: the dtype's bound)."""
    original, converted = _converted("titans (affine scan, fills in its graphs)",
                                     torch.float32, 2)
    cast, reference = copy.deepcopy(converted).to(now), copy.deepcopy(original).to(now)
    x = torch.randn(batch, length, SHAPE[2],
                    generator=torch.Generator().manual_seed(length)).to(now)
    if called:
        with torch.no_grad():
            cast(x)
    back = _saved_and_loaded(cast)
    assert {p.dtype for p in back.parameters()} == {now}
    with torch.no_grad():
        y, y0 = _out(back(x)), _out(reference(x))
        assert torch.equal(y, _out(cast(x)))        # the same plan as before saving
    assert y.dtype == now and rel_rms_error(y, y0) <= TOLERANCE[now]
    if now == torch.float64:
        grads, grads0 = _grads(back, x), _grads(reference, x)
        assert grads.keys() == grads0.keys()
        for n in grads:
            assert rel_rms_error(grads[n], grads0[n]) <= TOLERANCE[now], n


def test_a_pickled_layer_that_cannot_be_converted_again_says_what_to_do():
    """A record the layer cannot be converted again from (here, examples of a width its
    projections do not take) fails on load with a ``ConversionError`` naming the class and
    what to save instead, not a request for example inputs the user never passed."""
    _, converted = _converted(next(iter(LAYERS)), torch.float32, 2)
    state = converted._ttt2la
    state.recipe = dataclasses.replace(state.recipe, args=(torch.randn(2, 16, SHAPE[2] + 1),))
    with pytest.raises(ttt2la.ConversionError) as info:
        _saved_and_loaded(converted)
    message = str(info.value)
    assert "TitansLinearMemory was unpickled" in message
    assert "Save its weights instead" in message and "pass inputs" not in message


class _Half(torch.nn.Module):
    def forward(self, w):
        return w * 0.5


@settings(max_examples=3)
@given(batch=st.integers(1, 3), length=st.integers(1, 20))
def test_a_parametrization_on_the_layers_own_weight_converts_it_again(batch, length):
    """``register_parametrization`` on the converted layer itself (its class is then a subclass
    of the converted class): converted again with the parametrized weight, the outputs and
    every gradient — the parametrization's original parameter's too — those of the original
    parametrized the same way (float64: Newton–Schulz's bound; two steps of it, as the
    parametrization, not the iteration, is under test)."""
    def convert():
        torch.manual_seed(0)
        original = lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4,
                              muon_steps=2).double()
        return original, ttt2la.convert(
            original, level=2, example_inputs=(torch.randn(2, 16, 16, dtype=torch.float64),))
    original, converted = _copies("parametrized", convert)     # each example parametrizes copies
    assert converted.ttt2la_report.exact
    for module in (converted, original):
        parametrize.register_parametrization(module, "w0", _Half())
    assert original_class(type(converted)) is LaCTFoldedLayer
    x = torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(length),
                    dtype=torch.float64)
    with torch.no_grad():
        assert rel_rms_error(converted(x), original(x)) <= TOLERANCE[torch.float64]
    grads, grads0 = _grads(converted, x), _grads(original, x)
    assert "parametrizations.w0.original" in grads0 and grads.keys() == grads0.keys()
    for n in grads:
        assert rel_rms_error(grads[n], grads0[n]) <= TOLERANCE[torch.float64], n
    with pytest.raises(ttt2la.ConversionError, match="save its state_dict"):
        torch.save(converted, io.BytesIO())     # as torch refuses a parametrized module
    runs = converted._ttt2la.runs
    assert any("added parametrizations.w0.original; removed w0" in shape and
               "as written" not in plan for shape, plan in runs.items()), runs
