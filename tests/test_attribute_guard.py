"""Plain attributes a converted layer was traced with are guarded at every call.

A trace bakes a layer's plain attributes (a step size, a decay, its chunk size, a tensor held
as no parameter or buffer, a list of options) into its graphs. Changed after conversion, an
exact conversion runs the code as written — the original's output with the same change — and
its report's runs name the attribute with its old and new value; set back, the plan runs
again. A lossy conversion refuses with a ``ChangedAttributeError`` naming the attribute. What
torch and ttt2la themselves set (the mode, hooks, the report) changes nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer

FP32 = TOLERANCE[torch.float32]
D = 8


class Scaled(nn.Module):
    """A decayed fast weight stepped per chunk, steered by plain attributes of itself and of a
    submodule (the norm's ``eps``)."""

    def __init__(self):
        super().__init__()
        self.C, self.eta, self.decay = 4, 0.1, 1.0
        self.gain = torch.tensor(1.0)           # a tensor that is no parameter or buffer
        self.signs = [1.0, 1.0]
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        q = self.norm(q) * self.signs[0]
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], self.C):
            kc, vc = k[:, i:i + self.C], v[:, i:i + self.C] * self.signs[1]
            W = self.decay * W + self.eta * self.gain * kc.transpose(1, 2) @ vc
            outs.append(q[:, i:i + self.C] @ W)
        return torch.cat(outs, 1)


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    layer = Scaled()
    x = torch.randn(2, 16, D)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(x,)), x


CHANGES = [("eta", 0.7), ("decay", 0.5), ("C", 8), ("gain", torch.tensor(3.0)),
           ("norm.eps", 1.0)]


@pytest.mark.parametrize("name,value", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_changed_attribute_runs_the_code_as_written(converted, name, value):
    layer, conv, x = converted
    layer, conv = copy.deepcopy(layer), copy.deepcopy(conv)
    *path, attr = name.split(".")
    was = getattr(conv.get_submodule(".".join(path)), attr)
    for m in (layer, conv):
        setattr(m.get_submodule(".".join(path)), attr, value)
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32
    runs = conv.ttt2la_report.layers[0].runs
    ran = runs["batch 2, length 16, attribute changed"]
    assert ran.startswith("as written") and f"`{name}`" in ran and repr(was)[:5] in ran, runs
    assert "convert the layer again" in ran


def test_a_list_changed_in_place_is_seen_and_setting_it_back_runs_the_plan(converted):
    layer, conv, x = converted
    layer, conv = copy.deepcopy(layer), copy.deepcopy(conv)
    for m in (layer, conv):
        m.signs[1] = -1.0
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32
    assert "`signs`" in conv.ttt2la_report.layers[0].runs["batch 2, length 16, attribute changed"]
    for m in (layer, conv):
        m.signs[1] = 1.0
    assert conv._ttt2la.attributes.changed(conv) is None
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32


def test_what_torch_and_ttt2la_set_is_no_change(converted):
    _layer, conv, x = converted
    conv = copy.deepcopy(conv)
    conv.train()
    conv.eval()
    conv.register_forward_hook(lambda m, a, out: None)      # the layer's own hook
    conv.ttt2la_report = conv.ttt2la_report                 # set on the model ttt2la returns
    assert conv._ttt2la.attributes.changed(conv) is None
    with torch.no_grad():
        conv(x)
    assert not any("attribute changed" in k for k in conv.ttt2la_report.layers[0].runs)


def test_a_lossy_conversion_refuses_naming_the_attribute():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, 4, muon=False)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(1, 16, 8),))
    assert not conv.ttt2la_report.exact
    conv.chunk_size = 2
    with pytest.raises(ttt2la.ChangedAttributeError, match="`chunk_size` was 4 .* now 2") as e:
        conv(torch.randn(1, 16, 8))
    assert (e.value.attribute, e.value.then, e.value.now) == ("chunk_size", 4, 2)
    with pytest.raises(ttt2la.StreamingError, match="chunk_size"):
        conv(torch.randn(1, 16, 8), return_ttt_state=True)
    conv.chunk_size = 4
    conv(torch.randn(1, 16, 8))


class Settings:
    """Settings in an object of a class of their own, which compares by identity."""

    def __init__(self, eta: float):
        self.eta = eta
        self.inner = types.SimpleNamespace(sign=1.0)


@dataclasses.dataclass(eq=False)
class Unequal:
    eta: float


HOLDERS = {"namespace": lambda: types.SimpleNamespace(eta=0.1),
           "plain class": lambda: Settings(0.1),
           "dataclass without eq": lambda: Unequal(0.1)}


class Configured(Scaled):
    """``Scaled`` stepped by ``self.cfg.eta``: a field of a settings object it holds."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, x):
        eta = self.cfg.eta * getattr(getattr(self.cfg, "inner", None), "sign", 1.0)
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], 4):
            W = W + eta * k[:, i:i + 4].transpose(1, 2) @ v[:, i:i + 4]
            outs.append(q[:, i:i + 4] @ W)
        return torch.cat(outs, 1)


@settings(max_examples=6, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(holder=st.sampled_from(sorted(HOLDERS)), eta=st.floats(0.2, 2.0),
       nested=st.booleans(), level=st.sampled_from([0, 5]))
def test_a_changed_field_of_a_settings_object_is_seen(holder, eta, nested, level):
    """A field of a settings object the layer holds (``self.cfg.eta``), set after conversion,
    runs the code as written (exact) or is refused (lossy); set back, the plan runs again."""
    torch.manual_seed(0)
    layer = Configured(HOLDERS[holder]())
    x = torch.randn(2, 16, D)
    conv = ttt2la.convert(layer, level=level, example_inputs=(x,))
    assert conv._ttt2la.attributes.changed(conv) is None
    nested = nested and holder == "plain class"
    for m in (layer, conv):
        if nested:
            m.cfg.inner.sign = -eta
        else:
            m.cfg.eta = eta
    if conv.ttt2la_report.exact:
        with torch.no_grad():
            assert rel_rms_error(conv(x), layer(x)) <= FP32
        assert "`cfg`" in conv.ttt2la_report.layers[0].runs["batch 2, length 16, attribute changed"]
    else:
        with pytest.raises(ttt2la.ChangedAttributeError, match="`cfg`"):
            conv(x)
    for m in (layer, conv):
        m.cfg.eta, m.cfg.__dict__.get("inner", types.SimpleNamespace()).sign = 0.1, 1.0
    assert conv._ttt2la.attributes.changed(conv) is None


class Closed(Scaled):
    """``Scaled`` finished by a method and a class constant, both looked up on ``self``."""

    SIGN = 1.0

    def forward(self, x):
        return self.close(super().forward(x))

    def close(self, o):
        return o * self.SIGN


#: attributes set on a module since conversion over its class's: what is set, and the value
PATCHES = {
    "method": ("close", lambda m: lambda o: o * 3.0),
    "class constant": ("SIGN", lambda m: -1.0),
    "submodule's forward": ("qkv.forward", lambda m: lambda t: nn.functional.linear(
        t, m.qkv.weight) * 2.0),
    "library submodule's forward": ("norm.forward", lambda m: lambda t: t * 2.0),
}


@pytest.mark.parametrize("kind", sorted(PATCHES))
def test_an_attribute_set_over_its_classs_runs_the_code_as_written(kind):
    """A method, a class constant or a submodule's ``forward`` shadowed on the instance since
    conversion (as wrappers that patch a module's ``forward`` do): the exact conversion runs
    the code as written, naming it; deleted again, the plan runs."""
    name, value = PATCHES[kind]
    torch.manual_seed(0)
    layer = Closed()
    x = torch.randn(2, 16, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    *path, attr = name.split(".")
    for m in (layer, conv):
        setattr(m.get_submodule(".".join(path)), attr, value(m))
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32
    ran = conv.ttt2la_report.layers[0].runs["batch 2, length 16, attribute changed"]
    assert ran.startswith("as written") and f"`{name}` was set on the module" in ran, ran
    for m in (layer, conv):
        delattr(m.get_submodule(".".join(path)), attr)
    assert conv._ttt2la.attributes.changed(conv) is None
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32


def test_a_lossy_conversion_refuses_a_patched_forward():
    torch.manual_seed(0)
    conv = ttt2la.convert(LaCTFoldedLayer(8, 2, 4, muon=False), level=2,
                          example_inputs=(torch.randn(1, 16, 8),))
    conv.qkv.forward = lambda t: t.repeat(1, 1, 3)
    with pytest.raises(ttt2la.ChangedAttributeError, match="`qkv.forward` was set"):
        conv(torch.randn(1, 16, 8))
