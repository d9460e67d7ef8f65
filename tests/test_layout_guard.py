"""A branch on the memory layout of an input — ``x.is_contiguous()``, ``x.stride()``,
``x.storage_offset()``, and these methods under other names (``alias:``) — at a call whose
input is laid out otherwise than the example was: the converted layer computes the original's
branch (an exact conversion runs the code as written) or refuses naming the line (a lossy
one); a layer that reads no layout keeps no guard."""
import pytest
import module_scoped
import torch
from hypothesis import given, settings, strategies as st

import ttt2la
from ttt2la.errors import ChangedAttributeError
from ttt2la.testing import rel_rms_error

from closing_memory import D, ClosingMemory, converted_once



class Contiguous(ClosingMemory):
    def close(self, o, x):
        return o * 2 if x.is_contiguous() else o + 1


class Strided(ClosingMemory):
    def close(self, o, x):
        return o * 2 if x.stride(0) >= x.stride(1) else o + 1


class Offset(ClosingMemory):
    def close(self, o, x):
        return o * 2 if x.storage_offset() == 0 else o + 1


# The same reads under other names: the guard finds them by the method the name holds.
contiguous = torch.Tensor.is_contiguous


class ContiguousOfAGlobal(ClosingMemory):
    def close(self, o, x):
        return o * 2 if contiguous(x) else o + 1


class StridesHeld(ClosingMemory):
    """Reads the strides through a method it is given, which its code names by no global."""

    def __init__(self, strides):
        super().__init__()
        self.strides = strides

    def close(self, o, x):
        return o * 2 if self.strides(x, 0) >= self.strides(x, 1) else o + 1


class OffsetAsADefault(ClosingMemory):
    def close(self, o, x, offset=torch.Tensor.storage_offset):
        return o * 2 if offset(x) == 0 else o + 1


LAYERS = {"contiguity": Contiguous, "strides": Strided, "storage offset": Offset,
          "alias: contiguity of a global": ContiguousOfAGlobal,
          "alias: strides the layer holds": lambda: StridesHeld(torch.Tensor.stride),
          "alias: storage offset as a default": OffsetAsADefault}


def _laid_out(x: torch.Tensor, how: str) -> torch.Tensor:
    """``x`` with the same values in another memory layout."""
    if how == "batch-major transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if how == "sliced":
        return torch.cat([x[:1], x])[1:]
    if how == "strided":
        return torch.stack([x, x], -1)[..., 0]
    return x


_CONVERTED = module_scoped.cache()


def _converted(kind: str, level: int):
    return converted_once(_CONVERTED, LAYERS, kind, level)


@pytest.mark.parametrize("kind", sorted(LAYERS))
@settings(max_examples=6, deadline=None)
@given(how=st.sampled_from(["batch-major transposed", "sliced", "strided", "as given"]),
       B=st.integers(1, 3), T=st.integers(1, 24))
def test_the_converted_layer_follows_the_inputs_layout(kind, how, B, T):
    layer, conv = _converted(kind, 0)
    x = _laid_out(torch.randn(B, T, D), how)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5, (kind, how)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_lossy_conversion_refuses_another_layout_naming_the_line(kind):
    layer, conv = _converted(kind, 5)
    assert conv._ttt2la.as_written is None          # lossy
    x = torch.randn(2, 20, D)
    conv(x)
    how = "sliced" if "storage offset" in kind else "batch-major transposed"
    with pytest.raises(ChangedAttributeError, match=rf"{__file__}:\d+"):
        conv(_laid_out(x, how))


def test_a_layer_that_reads_no_layout_keeps_no_guard():
    class Plain(ClosingMemory):
        def close(self, o, x):
            return o * 2

    conv = ttt2la.convert(Plain(), level=0, example_inputs=(torch.randn(2, 16, D),))
    assert conv._ttt2la.input_layout is None
