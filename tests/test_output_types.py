"""A layer that returns a ``torch.Size`` (``y, y.shape``) or a ``torch.return_types`` result
next to its output, or its output in a dataclass of its own: the converted layer returns values
of the same types as the code as written, at any shape, not the plain tuples the traced graph's
output holds."""
import dataclasses

import pytest
import module_scoped
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings, strategies as st

import ttt2la
from ttt2la.testing import rel_rms_error

from closing_memory import D, ClosingMemory as Memory


class WithShape(Memory):
    def close(self, o, x):
        return o, o.shape


class WithSizes(Memory):
    def close(self, o, x):
        return {"out": o, "sizes": [x.size(), o.shape[1:]], "max": o.max(-1)}


@dataclasses.dataclass
class Summary:
    mean: torch.Tensor
    steps: int = 4


@dataclasses.dataclass(frozen=True)
class Record:
    """What a layer may return in a dataclass of its own: tensors, a nested record, plain
    values and ``None``."""
    out: torch.Tensor
    summary: Summary
    state: torch.Tensor | None = None
    tag: str = "memory"


class WithRecord(Memory):
    def close(self, o, x):
        return Record(o, Summary(o.mean(1)))


class WithFlag(Memory):
    def close(self, o, x):
        return o, x.shape[1] % 4 == 0


LAYERS = {"shape": WithShape, "sizes": WithSizes, "record": WithRecord, "flag": WithFlag}
_CONVERTED = module_scoped.cache()


def _same(got, want) -> bool:
    """Equal values of the same types, leaf by leaf and node by node."""
    g, gs = pytree.tree_flatten(got)
    w, ws = pytree.tree_flatten(want)
    if gs != ws or len(g) != len(w):
        return False
    nodes = [(got, want)]
    while nodes:
        a, b = nodes.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, dict):
            nodes += [(a[k], b[k]) for k in b]
        elif dataclasses.is_dataclass(a):
            nodes += [(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
        elif isinstance(a, (list, tuple)):
            nodes += list(zip(a, b))
        elif isinstance(a, torch.Tensor):
            if a.shape != b.shape or rel_rms_error(a, b) > 1e-5:
                return False
        elif a != b:
            return False
    return True


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(sorted(LAYERS)), level=st.sampled_from([0, 1]),
       B=st.integers(1, 3), T=st.integers(1, 24))
def test_returned_values_keep_their_types(kind, level, B, T):
    if (kind, level) not in _CONVERTED:
        torch.manual_seed(0)
        layer = LAYERS[kind]()
        _CONVERTED[kind, level] = layer, ttt2la.convert(
            layer, level=level, example_inputs=(torch.randn(2, 16, D),))
    layer, conv = _CONVERTED[kind, level]
    x = torch.randn(B, T, D)
    got, want = conv(x), layer(x)
    assert _same(got, want), (got, want)


@pytest.mark.parametrize("level", [0, 1])
def test_a_dataclass_of_the_users_comes_back_as_itself(level):
    """Returned in a dataclass of the user's (nested, with ``None`` and plain fields), the
    output converts and comes back in that dataclass, its gradients the original's."""
    torch.manual_seed(0)
    layer = WithRecord()
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))
    for B, T in ((2, 16), (1, 7), (3, 21)):
        x = torch.randn(B, T, D, requires_grad=True)
        got, want = conv(x), layer(x)
        assert isinstance(got, Record) and _same(got, want), (got, want)
        g = torch.autograd.grad(got.out.sum() + got.summary.mean.sum(), [x, *conv.parameters()])
        w = torch.autograd.grad(want.out.sum() + want.summary.mean.sum(),
                                [x, *layer.parameters()])
        assert all(rel_rms_error(a, b) <= 1e-5 for a, b in zip(g, w))


@pytest.mark.parametrize("level", [0, 1])
def test_a_flag_of_the_length_it_returns_is_the_codes_at_every_length(level):
    """``return y, T % 4 == 0``, converted at a length of whole chunks (the probe traces, at
    lengths with a partial chunk, return ``False``): the example's own call returns ``True`` as
    the code does — the conversion's check compares every value returned, not only the first
    tensor — and so does every other length."""
    torch.manual_seed(0)
    layer = WithFlag()
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))
    for T in (16, 17, 20, 24, 13, 16):
        x = torch.randn(2, T, D)
        with torch.no_grad():
            got, want = conv(x), layer(x)
        assert got[1] is want[1] and rel_rms_error(got[0], want[0]) <= 1e-5, (T, got[1])
