"""Hooks and parametrizations around a converted layer: the layer's own hooks run once around its
converted forward; a hook on one of its submodules, which the converted graphs never call, makes
an exact conversion run the code as written while it is there and a lossy one refuse, and is
refused at conversion; a parametrization registered after conversion converts the layer again.

References: the original layer with the same hooks or parametrizations, outputs and every
gradient (float32, ≤ 1e-5); the hooks' own calls, counted and compared.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.utils.parametrize as parametrize

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import MuonStepLayer, ScanEtaTTTLayer, TinyLaCTLM

FP32 = TOLERANCE[torch.float32]
SHAPE = (2, 13, 16)


def _layer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ScanEtaTTTLayer(16, 2, 4)


def _x(seed: int = 1, grad: bool = False) -> torch.Tensor:
    x = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(grad)


def _outputs_and_grads(module, x):
    """The output and the gradients of every parameter and of the input."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.square().sum().backward()
    return [y, x.grad, *(p.grad for p in module.parameters())]


def _assert_same(converted, original, x):
    for got, want in zip(_outputs_and_grads(converted, x), _outputs_and_grads(original, x),
                         strict=True):
        assert rel_rms_error(got, want) <= FP32


def _own_hooks(module):
    """A forward pre-hook, a forward hook and a full backward hook, each changing what passes."""
    module.register_forward_pre_hook(lambda _m, args: (args[0] * 3,))
    module.register_forward_hook(lambda _m, _args, y: y * 2 + 1)
    module.register_full_backward_hook(lambda _m, grad_in, _out: (grad_in[0] * 5,))


def test_the_layers_own_hooks_run_once_around_the_converted_forward():
    """Hooks registered on the layer before conversion are not traced into its graphs (they
    would run twice, and the graphs, disagreeing with the code, would never run: every call
    would run the code as written); a later conversion of a layer without them is not served
    their trace."""
    original = _layer()
    _own_hooks(original)
    converted = ttt2la.convert(original, level=2, example_inputs=(_x(),))
    _assert_same(converted, original, _x(2))
    runs = converted.ttt2la_report.layers[0].runs
    assert not [k for k, v in runs.items() if v.startswith("as written")], runs   # the plan ran
    plain = _layer()
    _assert_same(ttt2la.convert(plain, level=2, example_inputs=(_x(),)), plain, _x(2))


def _observe_and_change(module, seen: list):
    """On ``o_proj``: a hook that records every output it sees and one that changes it."""
    module.o_proj.register_forward_hook(lambda _m, _a, y: seen.append(y.detach().clone()))
    return module.o_proj.register_forward_hook(lambda _m, _a, y: y * 2)


def test_a_hook_on_a_submodule_after_conversion_runs_the_code_as_written():
    original = _layer()
    converted = ttt2la.convert(original, level=2, example_inputs=(_x(),))
    seen_converted, seen_original = [], []
    handle = _observe_and_change(converted, seen_converted)
    _observe_and_change(original, seen_original)
    _assert_same(converted, original, _x(2))
    assert len(seen_converted) == len(seen_original) == 1
    assert all(torch.equal(a, b) for a, b in zip(seen_converted, seen_original))
    runs = converted.ttt2la_report.layers[0].runs
    assert runs["batch 2, length 13, hooks on submodules"].startswith(
        "as written: a forward hook on o_proj")
    # once the hooks are gone, the converted graphs run again
    handle.remove()
    converted.o_proj._forward_hooks.clear()
    with torch.no_grad():
        y = converted(_x(3))
    assert len(seen_converted) == 1
    assert rel_rms_error(y, _layer()(_x(3))) <= FP32


def test_a_global_module_hook_runs_the_code_as_written():
    original = _layer()
    converted = ttt2la.convert(original, level=2, example_inputs=(_x(),))
    calls = []

    def double_linear(module, _args, y):
        if isinstance(module, torch.nn.Linear):
            calls.append(type(module).__name__)
            return y * 2
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(double_linear)
    try:
        with torch.no_grad():
            got, want = converted(_x(2)), original(_x(2))
    finally:
        handle.remove()
    assert calls == ["Linear"] * 8
    assert rel_rms_error(got, want) <= FP32


def test_a_lossy_conversion_refuses_a_call_with_hooks_on_its_submodules():
    torch.manual_seed(0)
    layer = MuonStepLayer(8, 2, 4, beta=0.9)
    converted = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, 16, 8),))
    converted.out.register_forward_pre_hook(lambda _m, _a: None)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="a forward pre-hook on out"):
        converted(torch.randn(2, 16, 8))


def test_a_call_carrying_state_with_hooks_on_submodules_is_refused():
    converted = ttt2la.convert(_layer(), level=2, example_inputs=(_x(),))
    converted.q_proj.register_forward_hook(lambda _m, _a, y: None)
    with pytest.raises(ttt2la.StreamingError, match="a forward hook on q_proj"):
        converted(_x(), return_ttt_state=True)


def test_hooks_on_submodules_at_conversion_are_refused_naming_the_hook():
    layer = _layer()
    layer.v_proj.register_full_backward_hook(lambda _m, g, _o: None)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="a backward hook on v_proj"):
        ttt2la.convert(layer, level=2, example_inputs=(_x(),))


def test_in_a_model_the_hooked_layer_stays_as_written_and_the_others_convert():
    torch.manual_seed(5)
    model = TinyLaCTLM(40, 16, 2, 2, 4, muon=False, update_theta=False, weight_norm=False)
    model.blocks[0].ttt.o_proj.register_forward_hook(lambda _m, _a, y: y * 2)
    ids = torch.randint(0, 40, (2, 14))
    converted = ttt2la.convert(model, level=2, example_inputs=(ids,))
    assert not hasattr(converted.blocks[0].ttt, "_ttt2la")
    assert hasattr(converted.blocks[1].ttt, "_ttt2la")
    assert any("blocks.0.ttt" in n and "forward hook on o_proj" in n
               for n in converted.ttt2la_report.notes)
    with torch.no_grad():
        assert rel_rms_error(converted(ids), model(ids)) <= FP32


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return w * 2


def test_a_parametrization_registered_after_conversion_converts_the_layer_again():
    original = _layer()
    converted = ttt2la.convert(original, level=2, example_inputs=(_x(),))
    for module in (converted, original):
        parametrize.register_parametrization(module.o_proj, "weight", _Doubled())
    _assert_same(converted, original, _x(2))
    runs = converted.ttt2la_report.layers[0].runs
    assert any("added o_proj.parametrizations.weight.original; removed o_proj.weight" in shape
               for shape in runs)


def test_a_model_that_cannot_be_copied_is_refused_with_what_to_do():
    layer = _layer()
    torch.nn.utils.weight_norm(layer.o_proj)
    with pytest.raises(ttt2la.InvalidInputError, match="parametrizations"):
        ttt2la.convert(layer, level=2, example_inputs=(_x(),))


def test_a_call_the_code_as_written_fails_on_names_the_users_line():
    """With a hook on a submodule the layer runs its code as written; a call that code cannot take
    (float64 inputs for float32 weights) raises a ``RejectedCallError`` that is still the original
    class, naming the user's line and why the code ran as written — not a raw torch error."""
    converted = ttt2la.convert(_layer(), level=2, example_inputs=(_x(),))
    converted.o_proj.register_forward_hook(lambda _m, _a, y: y)
    with pytest.raises(ttt2la.RejectedCallError) as info:
        converted(_x().double())
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "ran its code as written (while there is a forward hook on o_proj" in message
    assert re.search(r"ttt_scan\.py:\d+", info.value.where), info.value.where
    with pytest.raises(RuntimeError):            # the layer as written fails on it too
        _layer()(_x().double())
