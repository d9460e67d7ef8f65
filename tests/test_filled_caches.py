"""A cache the layer's forward fills on itself neither stops conversion nor pins it to its code.

LaCT's language-model layer turns its fast queries and keys by a rotary embedding that keeps its
cos/sin table on itself, built for the longest length asked for so far. Traced from a table
filled at one length, traces at shorter and longer lengths held different ops (a constant table,
or one built), so the layer was refused or converted for some lengths only; an exact conversion
whose call filled the table longer ran the code as written from then on, and a lossy one refused
every call. The traces now start from the table as the constructor leaves it, where the layer
computes the same from there, so the converted graphs build it at any length; no trace leaves
its fake tensors on the layer, and checks against the code as written leave the table as found.
A value the first call fixes and later calls depend on is no cache: refused, saying what to do.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import ttt2la
from ttt2la.filled_caches import constructed_values
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTRotaryLayer

FP32 = TOLERANCE[torch.float32]
D, H, C, EXAMPLE = 64, 2, 16, 64
FOUND = {"fresh": None, "called at the example's length": EXAMPLE, "called longer": 300}


def _layers(found_at: int | None, **kw):
    """The layer (filled by a call at ``found_at`` tokens, if any) and variant 2 as written
    with its weights, whose function level 2 computes."""
    torch.manual_seed(0)
    layer = LaCTRotaryLayer(D, H, C, muon=False, **kw).eval()
    variant2 = LaCTRotaryLayer(D, H, C, muon=False, **{**kw, "update_theta": False,
                                                       "weight_norm": False}).eval()
    variant2.load_state_dict(layer.state_dict())
    if found_at is not None:
        with torch.no_grad():
            layer(torch.randn(1, found_at, D))
    return layer, variant2


def _table(layer) -> tuple:
    r = layer.rotary
    return r._seq_len_cached, r._cos_cached, r._sin_cached


@pytest.fixture(scope="module", params=list(FOUND))
def lossy(request):
    layer, variant2 = _layers(FOUND[request.param])
    found = _table(layer)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, EXAMPLE, D),))
    return layer, found, converted, variant2


def _ran_as_written(converted) -> list[str]:
    runs = converted.ttt2la_report.layers[0].runs
    return [f"{k}: {v}" for k, v in runs.items() if v.startswith("as written") or "changed" in k]


@settings(max_examples=10)
@given(length=st.integers(C, 320))
def test_level_2_runs_its_plan_at_any_length_however_the_table_was_found(lossy, length):
    layer, found, converted, variant2 = lossy
    torch.manual_seed(length)
    x = torch.randn(2, length, D)
    with torch.no_grad():
        out, want = converted(x), variant2(x)
    assert rel_rms_error(out, want) <= FP32
    assert not _ran_as_written(converted)
    assert _table(converted)[0] == found[0]       # the converted layer fills no table


def test_level_2_gradients_past_the_table(lossy):
    _, _, converted, variant2 = lossy
    x = torch.randn(2, 3 * EXAMPLE + 5, D)
    grads = []
    for m in (converted, variant2):
        m.zero_grad()
        m(x).square().sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[1]:
        assert rel_rms_error(grads[0][name], grads[1][name]) <= FP32, name


def test_no_trace_leaves_a_tensor_on_the_layer(lossy):
    layer, found, converted, _ = lossy
    assert _table(layer)[0] == found[0] and _table(layer)[1] is found[1]   # the user's, untouched
    length, cos, sin = _table(converted)
    assert length == found[0]
    for table, was in ((cos, found[1]), (sin, found[2])):
        if was is None:
            assert table is None
        else:
            assert type(table) is torch.Tensor and torch.equal(table, was)


def test_measuring_drift_leaves_the_layers_guards_as_recorded(lossy):
    """The drift of a lossy step is measured on a copy of the layer converted with the step's
    state; the final step's state is the converted layer's own, whose guards must stay the
    ones recorded from the converted layer, not from the copy."""
    from ttt2la.drift import layer_drift

    layer, _, converted, _ = lossy
    state = converted._ttt2la
    guards = (state.attributes, state.walk, state.input_layout, state.outside)
    x = torch.randn(2, EXAMPLE, D)
    with torch.no_grad():
        layer_drift(layer, state, (x,), {}, layer(x))
    assert all(a is b for a, b in zip(guards, (state.attributes, state.walk,
                                               state.input_layout, state.outside)))


@pytest.mark.parametrize("found_at", [None, 300])
def test_an_exact_conversion_keeps_its_plan_past_the_table(found_at):
    layer, _ = _layers(found_at, update_theta=False, weight_norm=False)
    reference = copy.deepcopy(layer)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, EXAMPLE, D),))
    assert converted.ttt2la_report.layers[0].exact
    for length in (128, 48, 400, EXAMPLE):
        x = torch.randn(2, length, D)
        with torch.no_grad():
            assert rel_rms_error(converted(x), reference(x)) <= FP32
    assert not _ran_as_written(converted)


@pytest.mark.parametrize("max_positions", [96, 512])
def test_a_table_built_for_a_fixed_number_of_positions(max_positions):
    """The release builds its table for ``max(L, max_position_embeddings)`` positions."""
    layer, _ = _layers(None, update_theta=False, weight_norm=False,
                       max_position_embeddings=max_positions)
    reference = copy.deepcopy(layer)
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, EXAMPLE, D),))
    for length in (EXAMPLE, 80, 200, 48):
        x = torch.randn(2, length, D)
        with torch.no_grad():
            assert rel_rms_error(converted(x), reference(x)) <= FP32
    # past the positions traced, the code as written runs that call (its table is longer than
    # the traced one), filling the table; the calls after it run the plan again
    assert [r for r in _ran_as_written(converted) if "length 200," not in r] == []
    assert all("length 200," not in r for r in _ran_as_written(converted)) == (max_positions > 200)


def _chunked_memory(qkv: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Linear attention over chunks of 8 tokens, each read with the memory of those before."""
    b, length, d = x.shape
    q, k, v = qkv(x).chunk(3, dim=-1)
    W = x.new_zeros(b, d, d)
    outs = []
    for s in range(0, length, 8):
        outs.append(q[:, s:s + 8] @ W)
        W = W + k[:, s:s + 8].transpose(1, 2) @ v[:, s:s + 8]
    return torch.cat(outs, 1)


class FirstLength(nn.Module):
    """A memory whose outputs are scaled by the length of its first call: filled once, and no
    cache — later calls of other lengths depend on it."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.first_length = None

    def forward(self, x):
        if self.first_length is None:
            self.first_length = x.shape[1]
        return _chunked_memory(self.qkv, x) / self.first_length


def test_a_value_the_first_call_fixes_is_refused_saying_what_to_do():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.SideEffectError, match="at its first call") as e:
        ttt2la.convert(FirstLength().eval(), level=0, example_inputs=(torch.randn(2, 64, 32),))
    assert "`self.first_length`" in str(e.value)
    assert "Call the layer once" in str(e.value)


def test_a_value_the_first_call_fixed_converts_for_it():
    torch.manual_seed(0)
    layer = FirstLength().eval()
    with torch.no_grad():
        layer(torch.randn(1, 100, 32))
    reference = copy.deepcopy(layer)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 64, 32),))
    for length in (64, 32, 128):
        x = torch.randn(2, length, 32)
        with torch.no_grad():
            assert rel_rms_error(converted(x), reference(x)) <= FP32


class _Filled(nn.Module):
    def __init__(self):
        super().__init__()
        self.length, self.table, self.built = 0, None, torch.zeros(2)
        self.step = 3                       # constant, and never assigned again

    def forward(self, x):
        self.length, self.table, self.built = x.shape[1], x, x
        return x


class _FilledLater(_Filled):
    def __init__(self):
        super().__init__()
        self.length = 5                     # the subclass's constant comes first


def test_constructed_values_are_the_constructors_constants_of_what_the_forward_fills():
    m = _Filled()
    assert constructed_values(m) == {}      # as constructed: nothing to set
    m(torch.ones(1, 4))
    assert constructed_values(m) == {"length": 0, "table": None}
    assert constructed_values(_FilledLater()) == {} and \
        constructed_values(_FilledLater(), {"length": 0}) == {"length": 5}


class Limited(nn.Module):
    """A memory whose outputs are halved past a length set by a method the forward never calls
    (``None`` as constructed): a setting, traced as found."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96, bias=False)
        self.limit = None

    def set_limit(self, n: int) -> None:
        self.limit = n

    def forward(self, x):
        y = _chunked_memory(self.qkv, x)
        if self.limit is not None and x.shape[1] > self.limit:
            y = y * 0.5
        return y


def test_an_attribute_set_outside_the_forward_is_traced_as_found():
    torch.manual_seed(0)
    layer = Limited().eval()
    layer.set_limit(1000)       # past the example's length and twice it
    reference = copy.deepcopy(layer)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 64, 32),))
    for length in (64, 1024):
        x = torch.randn(1, length, 32)
        with torch.no_grad():
            assert rel_rms_error(converted(x), reference(x)) <= FP32, length


@pytest.mark.parametrize("found_at", [None, EXAMPLE, 300])
def test_where_the_traces_start(found_at):
    """The rotary table starts as constructed however it was found; a setting made by a method
    the forward never calls starts as found."""
    from ttt2la.as_found import as_found, traced_as_found
    from ttt2la.filled_caches import settle_start

    layer, _ = _layers(found_at)
    limited = Limited().eval()
    limited.set_limit(1000)
    for m, length in ((layer, D), (limited, 32)):
        calls = [((torch.randn(2, n, length),), {}) for n in (EXAMPLE, 2 * EXAMPLE)]
        with as_found(m):
            refused, _, caches = settle_start(m, *calls)
            with traced_as_found(m):
                started = dict(vars(getattr(m, "rotary", m)))
        assert not refused
        if m is layer:
            assert started["_seq_len_cached"] == 0 and started["_cos_cached"] is None
            assert set(caches) == {"rotary._seq_len_cached", "rotary._cos_cached",
                                   "rotary._sin_cached"}
        else:
            assert started["limit"] == 1000 and caches == ()
