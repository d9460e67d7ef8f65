"""Values a converted layer's code reads from outside the layer — a class attribute, a
module-level global, a global read in a helper function it calls or holds, a variable of a
closure (a class or helper made by a factory function) — changed after
conversion: the converted layer computes the original's new function (an exact conversion runs
the code as written and says so) or refuses (a lossy one); never the old value's output."""
import pytest
import torch
import torch.nn as nn

import ttt2la
from ttt2la.errors import ChangedAttributeError
from ttt2la.testing import rel_rms_error

D = 8
CONFIG = {"scale": 1.0}
STEP = 0.1


def scaled(o):
    return o * CONFIG["scale"]


class Memory(nn.Module):
    """Chunked linear attention with momentum; ``close`` says how its output is finished."""

    GAIN = 1.0

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = 0.5 * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + STEP * M
        return self.close(torch.cat(outs, 1))

    def close(self, o):
        return o


class ClassGain(Memory):
    def close(self, o):
        return o * self.GAIN


class GlobalScale(Memory):
    def close(self, o):
        return o * CONFIG["scale"]


class HelperScale(Memory):
    def close(self, o):
        return scaled(o)


def finish(o):
    return o


class HelperFinish(Memory):
    def close(self, o):
        return finish(o)


class Rebound(Memory):
    """A layer whose ``close`` and ``forward`` are rebound on its class after conversion."""


def _times(v, fn):
    return lambda *a: fn(*a) * v


_FINISH, _CLOSE, _FORWARD = finish, Rebound.close, Rebound.forward


def _rebind(owner, name, original):
    """Set ``owner.name`` to ``original`` times ``v`` (``original`` itself at 1)."""
    def change(v):
        value = original if v == 1.0 else _times(v, original)
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)
    return change


class HeldScale(Memory):
    """Finished by a helper it is given, which its code names by no global."""

    def __init__(self, finish):
        super().__init__()
        self.finish = finish

    def close(self, o):
        return self.finish(o)


def _closing_class():
    """A layer class made by a factory, its ``close`` reading the factory's variable, and what
    sets that variable (``nonlocal``)."""
    scale = 1.0

    class ClosureScale(Memory):
        def close(self, o):
            return o * scale

    def change(v):
        nonlocal scale
        scale = v
    return ClosureScale, change


def _closing_helper():
    """A helper made by a factory, reading its variable, and what sets that variable."""
    scale = 1.0

    def finish(o):
        return o * scale

    def change(v):
        nonlocal scale
        scale = v
    return finish, change


ClosureScale, _SET_CLOSURE_SCALE = _closing_class()
_HELD_FINISH, _SET_HELD_SCALE = _closing_helper()


LAYERS = {"class attribute": (ClassGain, lambda v: setattr(ClassGain, "GAIN", v), "ClassGain.GAIN"),
          "method": (Rebound, _rebind(Rebound, "close", _CLOSE), "Rebound.close (a method)"),
          "forward": (Rebound, _rebind(Rebound, "forward", _FORWARD),
                      "Rebound.forward (a method)"),
          "helper function": (HelperFinish, _rebind(globals(), "finish", _FINISH),
                              "finish (a function"),
          "global": (GlobalScale, lambda v: CONFIG.__setitem__("scale", v), "CONFIG"),
          "helper's global": (HelperScale, lambda v: CONFIG.__setitem__("scale", v), "CONFIG"),
          "held helper's global": (lambda: HeldScale(scaled),
                                   lambda v: CONFIG.__setitem__("scale", v), "CONFIG"),
          "global in the loop": (Memory, lambda v: globals().__setitem__("STEP", 0.1 * v), "STEP"),
          "closure variable": (ClosureScale, _SET_CLOSURE_SCALE, "scale (a variable of"),
          "held helper's closure variable": (lambda: HeldScale(_HELD_FINISH), _SET_HELD_SCALE,
                                             "scale (a variable of")}


@pytest.fixture(autouse=True)
def _restore():
    yield
    ClassGain.GAIN, CONFIG["scale"] = 1.0, 1.0
    Rebound.close, Rebound.forward = _CLOSE, _FORWARD
    globals()["finish"] = _FINISH
    globals()["STEP"] = 0.1
    _SET_CLOSURE_SCALE(1.0)
    _SET_HELD_SCALE(1.0)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_changed_outside_value_runs_the_new_function(kind):
    make, change, name = LAYERS[kind]
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 20, D, requires_grad=True)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    change(3.0)
    got, want = conv(x), layer(x)
    assert rel_rms_error(got, want) <= 1e-5, kind
    gg = torch.autograd.grad(got.sum(), [x, *conv.parameters()])
    gw = torch.autograd.grad(want.sum(), [x, *layer.parameters()])
    assert all(rel_rms_error(a, b) <= 1e-5 for a, b in zip(gg, gw))
    runs = conv.ttt2la_report.layers[0].runs
    assert any(name in v and v.startswith("as written") for v in runs.values()), runs
    change(1.0)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_lossy_conversion_refuses_after_the_change(kind):
    make, change, name = LAYERS[kind]
    torch.manual_seed(0)
    conv = ttt2la.convert(make(), level=5, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 20, D)
    conv(x)
    change(3.0)
    with pytest.raises(ChangedAttributeError, match=name.split(" ")[0]):
        conv(x)


#: named like the attribute ``Memory.forward`` reads (``x.shape``) and ``close``'s ``o.shape``
shape = (2, 16, D)


class ShapeNamed(Memory):
    def close(self, o):
        return o * (o.shape[-1] / D)


def test_a_global_named_like_an_attribute_the_code_reads_is_not_watched():
    """``co_names`` holds attribute names too; only the names the code loads as globals are."""
    global shape
    torch.manual_seed(0)
    conv = ttt2la.convert(ShapeNamed(), level=5, example_inputs=(torch.randn(*shape),))
    x = torch.randn(2, 20, D)
    before = conv(x)
    shape = (4, 4)
    try:
        assert torch.equal(conv(x), before)
    finally:
        shape = (2, 16, D)


class Strict:
    """A global object of the user's without a ``__dict__``, whose ``__getattr__`` raises
    its own error for any name it does not hold."""

    __slots__ = ("scale",)

    def __init__(self):
        self.scale = 1.0

    def __getattr__(self, name):
        raise RuntimeError(f"no setting {name}")


STRICT = Strict()


class StrictScale(Memory):
    def close(self, o):
        return o * STRICT.scale


def test_a_global_whose_getattr_raises_its_own_error_converts():
    torch.manual_seed(0)
    layer = StrictScale()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 20, D)
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= 1e-5
