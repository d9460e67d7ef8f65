"""A converted layer's call walks its modules once (``ModuleWalk``) and finds its call's shape
case once per input shape (``ConvertedState.decide``); what the user changes between calls is
still seen.

The walk's weights are ``params_and_buffers``'s, name for name and tensor for tensor, with
a module shared, empty child slots and absent parameters. After conversion, a hook on
a nested submodule, a submodule added with a hook, an empty slot filled with a hooked module, a
submodule of another class, a changed attribute and a replaced parameter each make the walk look
closer, and the call runs as the original (float32, ≤ 1e-5) with the report's runs naming what
changed. A call at a shape remembered from an accepted one is still refused where another of
its sizes differs from the example's.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from ttt2la.errors import UnsupportedShapeError
from ttt2la.ir import params_and_buffers
from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]
D = 8


class Chunked(nn.Module):
    """A fast weight stepped per chunk of 4, with a nested submodule, a buffer, an empty child
    slot and an absent parameter."""

    def __init__(self):
        super().__init__()
        self.C, self.eta = 4, 0.1
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.inner = nn.Sequential(nn.LayerNorm(D))
        self.k_norm = nn.LayerNorm(D)
        self.extra = None                       # an empty child slot
        self.register_buffer("scale", torch.ones(D))
        self.register_parameter("unused", None)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = self.inner(q), self.k_norm(k)
        v = v * self.scale
        if self.extra is not None:
            v = self.extra(v)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], self.C):
            kc, vc = k[:, i:i + self.C], v[:, i:i + self.C]
            W = W + self.eta * kc.transpose(1, 2) @ vc
            outs.append(q[:, i:i + self.C] @ W)
        return torch.cat(outs, 1)


def _pair():
    torch.manual_seed(0)
    original = Chunked()
    x = torch.randn(2, 16, D)
    return original, ttt2la.convert(original, level=0, example_inputs=(x,))


def _x(seed: int = 1, length: int = 16, features: int = D) -> torch.Tensor:
    return torch.randn(2, length, features, generator=torch.Generator().manual_seed(seed))


def _same_call(converted, original, x):
    with torch.no_grad():
        assert rel_rms_error(converted(x), original(x)) <= FP32


def test_the_walks_weights_are_params_and_buffers():
    original, converted = _pair()
    walk = converted._ttt2la.walk
    found = walk.quiet(converted)
    assert found is not None
    got, want = walk.weights(found), params_and_buffers(converted)
    assert list(got) == list(want)
    assert all(got[n] is want[n] for n in want)
    # a module shared after conversion (of the same class: no change the guards see): its
    # weights once, under the first name, as ``params_and_buffers`` gives them
    converted.k_norm = converted.inner[0]
    found = walk.quiet(converted)
    assert found is not None
    got, want = walk.weights(found), params_and_buffers(converted)
    assert list(got) == list(want) and "k_norm.weight" not in got


def test_a_replaced_parameter_is_read_at_the_call():
    original, converted = _pair()
    new = torch.randn(3 * D, D)
    for m in (original, converted):
        m.qkv.weight = nn.Parameter(new.clone())
    _same_call(converted, original, _x(2))


def _runs(converted) -> dict:
    return converted.ttt2la_report.layers[0].runs


def test_a_hook_two_levels_down_runs_the_code_as_written():
    original, converted = _pair()
    _same_call(converted, original, _x(2))
    for m in (original, converted):
        m.inner[0].register_forward_hook(lambda _m, _a, y: y * 2)
    _same_call(converted, original, _x(3))
    assert "batch 2, length 16, hooks on submodules" in _runs(converted)


def test_a_submodule_added_with_a_hook_runs_the_code_as_written():
    original, converted = _pair()
    for m in (original, converted):
        m.watcher = nn.Identity()           # never called: its hook would never run
        m.watcher.register_forward_hook(lambda _m, _a, y: y)
    _same_call(converted, original, _x(2))
    assert "batch 2, length 16, hooks on submodules" in _runs(converted)


def test_an_empty_slot_filled_with_a_hooked_module_runs_the_code_as_written():
    original, converted = _pair()
    for m in (original, converted):
        m.extra = nn.Identity()
        m.extra.register_forward_hook(lambda _m, _a, y: y * 3)
    _same_call(converted, original, _x(2))
    assert "batch 2, length 16, hooks on submodules" in _runs(converted)


def test_a_submodule_of_another_class_runs_the_code_as_written():
    original, converted = _pair()
    for m in (original, converted):
        m.extra = nn.Tanh()
    _same_call(converted, original, _x(2))
    assert "batch 2, length 16, attribute changed" in _runs(converted)


def test_a_changed_nested_attribute_runs_the_code_as_written():
    original, converted = _pair()
    for m in (original, converted):
        m.inner[0].eps = 0.5
    _same_call(converted, original, _x(2))
    assert "batch 2, length 16, attribute changed" in _runs(converted)


@pytest.mark.parametrize("features,length", [(D + 1, 16), (D, 15)])
def test_a_remembered_shape_does_not_pass_another_call(features, length):
    """The shape case is remembered per input shape: a call that differs in any size from one
    accepted before is checked again (refused for its features, a partial chunk run as
    written)."""
    original, converted = _pair()
    _same_call(converted, original, _x(2))
    _same_call(converted, original, _x(3))
    if features != D:
        with pytest.raises(UnsupportedShapeError, match="axis 2 has size 9"):
            with torch.no_grad():
                converted(_x(4, length, features))
    else:
        _same_call(converted, original, _x(4, length, features))
