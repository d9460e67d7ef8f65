"""A forward that assigns attributes on its layer is refused: a converted layer would not write.

A layer that stores its final fast weights on ``self`` (a decoding cache it continues from) or
its inner loss (for logging) would, converted, keep the values from conversion: the continued
call would compute something else. ``convert`` refuses it with a ``SideEffectError`` naming the
attribute and the line (a global or class attribute it bumps, a call counter, by its name and
line); in a model whose other layers convert, it runs as written. A buffer
updated in place is no such write, nor a plain value written again unchanged.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]
D, C = 8, 4


class Memory(nn.Module):
    """A fast weight stepped per chunk; ``writes`` says what the forward also does on ``self``."""

    def __init__(self, writes: str = ""):
        super().__init__()
        self.writes = writes
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.register_buffer("calls", torch.zeros(()))
        self.use_cache, self.cache, self.scale = False, None, 0.5

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = self.cache if self.use_cache and self.cache is not None else x.new_zeros(
            x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], C):
            outs.append(q[:, i:i + C] @ W)
            W = W + self.scale * k[:, i:i + C].transpose(1, 2) @ v[:, i:i + C]
        if self.writes == "cache":
            self.cache = W.detach()
        elif self.writes == "buffer":
            self.calls += 1
        elif self.writes == "same value":
            self.scale = 0.5
        return torch.cat(outs, 1)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Memory(), Memory("cache")

    def forward(self, x):
        return self.second(x + self.first(x))


def test_a_forward_that_stores_its_state_is_refused_naming_the_line():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.SideEffectError, match=r"`self.cache`") as e:
        ttt2la.convert(Memory("cache"), level=0, example_inputs=(torch.randn(2, 8, D),))
    assert e.value.attribute == "cache"
    assert e.value.where.startswith("test_side_effects.py:") and "self.cache = W.detach()" \
        in e.value.where
    assert "Return the value from forward" in str(e.value)


CALLS = [0]


class Counted(Memory):
    """A call counter bumped by the forward: a global list changed in place, or a class
    attribute."""

    calls_seen = 0

    def __init__(self, counter: str):
        super().__init__()
        self.counter = counter

    def forward(self, x):
        if self.counter == "global":
            CALLS[0] += 1  # <- global
        else:
            Counted.calls_seen += 1  # <- class
        return super().forward(x)


@pytest.mark.parametrize("counter, named", [("global", "CALLS"), ("class", "Counted.calls_seen")])
def test_a_global_or_class_counter_the_forward_bumps_is_refused_naming_its_line(counter, named):
    """The write is seen as the value changing while conversion runs the layer: not a "lossy
    conversion traced with the old value", which converting again could not mend."""
    import inspect
    lines, start = inspect.getsourcelines(Counted.forward)
    line = start + next(i for i, text in enumerate(lines) if text.rstrip().endswith(counter))
    with pytest.raises(ttt2la.SideEffectError) as e:
        ttt2la.convert(Counted(counter), level=0, example_inputs=(torch.randn(2, 8, D),))
    assert e.value.attribute == named and str(e.value).startswith(named)
    assert e.value.where.startswith(f"test_side_effects.py:{line} ")
    assert "the forward writes it" in str(e.value) and "lossy" not in str(e.value)


def test_in_a_model_the_writing_layer_runs_as_written():
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 8, D)
    conv = ttt2la.convert(model, level=0, example_inputs=(x,))
    assert [r.module_path for r in conv.ttt2la_report.layers] == ["first"]
    assert any("second" in n and "self.cache" in n for n in conv.ttt2la_report.notes)
    model.second.cache = conv.second.cache = None
    with torch.no_grad():
        assert rel_rms_error(conv(x), model(x)) <= FP32
        model.second.use_cache = conv.second.use_cache = True
        assert rel_rms_error(conv(x), model(x)) <= FP32       # continues from its own cache


@pytest.mark.parametrize("writes", ["buffer", "same value"])
def test_a_buffer_updated_in_place_or_a_value_written_unchanged_converts(writes):
    torch.manual_seed(0)
    layer, x = Memory(writes), torch.randn(2, 8, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    with torch.no_grad():
        assert rel_rms_error(conv(x), layer(x)) <= FP32


def test_converting_and_inspecting_leave_the_buffers_as_they_were():
    """A conversion runs the forward many times (traces, probes, checks); a buffer the forward
    updates in place comes back as it was, in the model given and in the model returned."""
    torch.manual_seed(0)
    layer, x = Memory("buffer"), torch.randn(2, 8, D)
    layer.calls.fill_(3)
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert layer.calls.item() == conv.calls.item() == 3
    ttt2la.inspect(layer, (x,), show=False)
    assert layer.calls.item() == 3
    same = ttt2la.convert(layer, level=0, example_inputs=(x,), inplace=True)
    assert same is layer and layer.calls.item() == 3
    with torch.no_grad():
        conv(x)
    assert conv.calls.item() == 4               # the converted forward still counts its calls


class CacheParams:
    """A decoding cache the model owns and hands its layers (ttt-lm-pytorch's ``cache_params``)."""

    def __init__(self):
        self.params, self.seen = {}, 0


class SlotsCache:
    """The same with ``__slots__``, no ``__dict__``."""

    __slots__ = ("params", "seen")

    def __init__(self):
        self.params, self.seen = {}, 0


class ArgumentMemory(nn.Module):
    """A fast weight stepped per chunk that stores its final value, or a count, into what it is
    called with: ``into`` names where."""

    def __init__(self, into: str):
        super().__init__()
        self.into = into
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x, cache=None, log=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = x.new_zeros(x.shape[0], D, D), []
        for i in range(0, x.shape[1], C):
            outs.append(q[:, i:i + C] @ W)
            W = W + 0.5 * k[:, i:i + C].transpose(1, 2) @ v[:, i:i + C]
        if self.into in ("cache dict", "slots cache"):
            cache.params["W"] = W
        elif self.into == "cache count":
            cache.seen += x.shape[1]
        elif self.into == "list":
            log.append(W.norm())
        return torch.cat(outs, 1)


class WithCache(nn.Module):
    def __init__(self, into: str):
        super().__init__()
        self.cache = SlotsCache() if into == "slots cache" else CacheParams()
        self.layer, self.into = ArgumentMemory(into), into

    def forward(self, x):
        return self.layer(x, cache=self.cache, log=[] if self.into == "list" else None)


@pytest.mark.parametrize("into, named", [("cache dict", "`cache`.params"),
                                         ("slots cache", "`cache`.params"),
                                         ("cache count", "`cache`.seen"), ("list", "`log`")])
def test_a_forward_that_writes_into_its_arguments_is_refused_naming_them(into, named):
    """The write would be lost (the cache would stay as it was), and every later run of the
    conversion would start from what the first wrote: refused, naming what changed."""
    torch.manual_seed(0)
    with pytest.raises(ttt2la.SideEffectError, match="writes into the arguments") as e:
        ttt2la.convert(WithCache(into), level=0, example_inputs=(torch.randn(2, 8, D),))
    assert named in str(e.value) and "Return the value from forward" in str(e.value)


def test_arguments_read_and_left_as_they_were_convert():
    torch.manual_seed(0)
    model, x = WithCache("nothing"), torch.randn(2, 8, D)
    conv = ttt2la.convert(model, level=0, example_inputs=(x,))
    with torch.no_grad():
        assert rel_rms_error(conv(x), model(x)) <= FP32
