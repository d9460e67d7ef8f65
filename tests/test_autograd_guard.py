"""A branch on whether an input records gradients — ``x.requires_grad``, ``x.is_leaf``,
``x.grad_fn``, and these under other names — at a call whose input records them (a leaf after
``requires_grad_()``, an earlier op's output): the trace saw its inputs detached, so the
converted layer computes the original's branch (an exact conversion runs the code as written)
or refuses naming the line (a lossy one); so does a call after a parameter's ``requires_grad``
changed; a layer that reads none of them keeps no guard."""
import pytest
import module_scoped
import torch
from hypothesis import given, settings, strategies as st

import ttt2la
from ttt2la.errors import ChangedAttributeError
from ttt2la.testing import rel_rms_error

from closing_memory import D, ClosingMemory, converted_once


class RequiresGrad(ClosingMemory):
    def close(self, o, x):
        return o + 1 if x.requires_grad else o * 2


class Leaf(ClosingMemory):
    def close(self, o, x):
        return o * 2 if x.is_leaf else o + 1


class MadeByAnOp(ClosingMemory):
    def close(self, o, x):
        return o * 2 if x.grad_fn is None else o + 1


# The same read under another name: the guard finds it by the descriptor the name holds.
records = torch.Tensor.requires_grad


class RequiresGradOfAGlobal(ClosingMemory):
    def close(self, o, x):
        return o + 1 if records.__get__(x) else o * 2


class FrozenProjection(ClosingMemory):
    """Reads its own weight's ``requires_grad``, converted with the weight frozen: unfreezing
    it after conversion takes the other branch."""

    def __init__(self):
        super().__init__()
        self.proj.weight.requires_grad_(False)

    def close(self, o, x):
        return o * 2 if self.proj.weight.requires_grad else o + 1


LAYERS = {"requires_grad": RequiresGrad, "is_leaf": Leaf, "grad_fn": MadeByAnOp,
          "alias: requires_grad of a global": RequiresGradOfAGlobal,
          "a parameter's requires_grad": FrozenProjection}


def _recording(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x``, the same values recording gradients as ``how`` says."""
    if how == "a leaf requiring grad":
        return x.clone().requires_grad_()
    if how == "an op's output":
        return x.clone().requires_grad_() * 1.0
    return x


_CONVERTED = module_scoped.cache()


def _converted(kind: str, level: int):
    return converted_once(_CONVERTED, LAYERS, kind, level)


@pytest.mark.parametrize("kind", sorted(k for k in LAYERS if "parameter" not in k))
@settings(max_examples=6, deadline=None)
@given(how=st.sampled_from(["a leaf requiring grad", "an op's output", "as given"]),
       grad=st.booleans(), B=st.integers(1, 3), T=st.integers(1, 24))
def test_the_converted_layer_follows_whether_its_input_records_gradients(kind, how, grad, B, T):
    layer, conv = _converted(kind, 0)
    x = _recording(torch.randn(B, T, D), how)
    with torch.set_grad_enabled(grad):
        assert rel_rms_error(conv(x), layer(x)) <= 1e-5, (kind, how, grad)


def test_a_parameter_unfrozen_after_conversion_takes_the_branch_the_code_takes():
    torch.manual_seed(0)
    layer = FrozenProjection()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    x = torch.randn(2, 20, D)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    for module in (conv, layer):
        module.proj.weight.requires_grad_(True)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_lossy_conversion_refuses_an_input_recording_gradients_naming_the_line(kind):
    layer, conv = _converted(kind, 5)
    assert conv._ttt2la.as_written is None          # lossy
    x = torch.randn(2, 20, D)
    with torch.no_grad():
        conv(x)
    if "parameter" in kind:
        conv.proj.weight.requires_grad_(True)
        calls = [x]
    else:
        calls = [_recording(x, "a leaf requiring grad"), _recording(x, "an op's output")]
    for xi in calls:
        with pytest.raises(ChangedAttributeError, match=rf"{__file__}:\d+"):
            conv(xi)


def test_a_layer_that_reads_none_of_them_keeps_no_guard_and_trains_on_its_plan():
    class Plain(ClosingMemory):
        def close(self, o, x):
            return o * 2

    torch.manual_seed(0)
    layer = Plain()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    assert conv._ttt2la.autograd is None
    x = torch.randn(2, 20, D, requires_grad=True)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5
