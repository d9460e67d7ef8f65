"""Loops that write each iteration's output into a tensor allocated before the loop.

``o = torch.empty_like(v)`` then ``o[:, t] = y`` per token, or ``o[:, :, s:e] = y`` per chunk,
is the same layer as collecting the outputs in a list and stacking them: the zoo layers written
that way (``outputs="buffer"``: the per-token layers inline and with a compiled step, the
delta-rule memory, LaCT head-major) convert exactly — outputs and every parameter gradient
equal the layer as written (fp32, relative RMS ≤ 1e-5) at any batch size and length — and the
buffer costs no per-token work: outside the runtime ops, the converted layer dispatches the
same ops at two lengths.
A buffer of another dtype than its outputs casts them, as the layer does. A buffer the loop
also reads, or one longer than the outputs written into it, is refused with a message that
names the line and says what to write instead. So is a loop that runs twice in one call (a helper
called per direction, each run's outputs stacked on their own), and the layout the message asks
for — one submodule per run — converts.
"""
from __future__ import annotations


import pytest
import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from test_op_count import count_ops
from ttt2la.errors import ConversionError
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import DeltaMemoryLayer, LaCTHeadsLayer, PerTokenInlineTTTLayer, PerTokenTTTLayer

FP32 = TOLERANCE[torch.float32]

#: name -> (constructor, d_model, level, schedule the report must name)
LAYERS = {
    "inline": (lambda **kw: PerTokenInlineTTTLayer(12, 3, **kw), 12, 0, "parallel"),
    "compiled-step": (lambda **kw: PerTokenTTTLayer(8, 2, **kw), 8, 0, "parallel"),
    "compiled-step-read-before": (lambda **kw: PerTokenTTTLayer(8, 2, read="before", **kw), 8, 0,
                                  "parallel"),
    "delta": (lambda **kw: DeltaMemoryLayer(8, 2, **kw), 8, 0, "semi-parallel"),
    "delta-gated-before": (lambda **kw: DeltaMemoryLayer(12, 3, decay=True, read="before",
                                                         grad="func", **kw),
                           12, 0, "semi-parallel"),
    "lact": (lambda **kw: LaCTHeadsLayer(16, 2, 4, update_theta=False, weight_norm=False,
                                         muon=False, **kw), 16, 2, "parallel"),
    "lact-weight-norm": (lambda **kw: LaCTHeadsLayer(16, 2, 4, update_theta=False, muon=False,
                                                     **kw), 16, 1, "semi-parallel"),
}


@module_scoped.cached
def converted(name: str):
    """``(layer as written, converted layer)``, one conversion per layer."""
    make, d, level, _ = LAYERS[name]
    torch.manual_seed(0)
    layer = make(outputs="buffer")
    return layer, ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 24, d),))


def outputs_and_grads(module, x, seed):
    x = x.clone().requires_grad_(True)
    y = module(x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    names, leaves = zip(("x", x), *module.named_parameters())
    grads = torch.autograd.grad((y * w).sum(), leaves, allow_unused=True)
    return y, {n: torch.zeros_like(t) if g is None else g     # unread: a zero gradient
               for n, t, g in zip(names, leaves, grads)}


@pytest.mark.parametrize("name", list(LAYERS))
def test_the_buffer_layer_converts_to_the_schedule_of_its_list_form(name):
    _, conv = converted(name)
    report = conv.ttt2la_report.layers[0]
    assert report.exact and report.schedule == LAYERS[name][3]
    assert ("delta_rule" in report.runtime) == name.startswith("delta")


@settings(max_examples=12, deadline=None)
@example(name="inline", batch=1, length=1, seed=0)
@example(name="lact", batch=2, length=4 * 5 + 3, seed=1)
@example(name="delta", batch=1, length=64 + 1, seed=2)
@given(name=st.sampled_from(list(LAYERS)), batch=st.integers(1, 3), length=st.integers(1, 70),
       seed=st.integers(0, 2**16))
def test_converted_buffer_layer_equals_the_layer_as_written(name, batch, length, seed):
    layer, conv = converted(name)
    x = torch.randn(batch, length, LAYERS[name][1], generator=torch.Generator().manual_seed(seed))
    y_ref, g_ref = outputs_and_grads(layer, x, seed)
    y, g = outputs_and_grads(conv, x, seed)
    assert rel_rms_error(y, y_ref) <= FP32
    assert g.keys() == g_ref.keys()
    for n, ref in g_ref.items():
        assert rel_rms_error(g[n], ref) <= FP32, n


@pytest.mark.parametrize("name, lengths", [("inline", (256, 4096)), ("delta", (64 * 4, 64 * 32)),
                                           ("lact", (4 * 16 + 3, 4 * 256 + 3)),
                                           ("compiled-step-read-before", (256, 4096))])
def test_the_buffer_adds_no_ops_that_grow_with_length(name, lengths):
    """Outside the runtime ops the converted layer dispatches the same ops at both lengths."""
    _, conv = converted(name)
    d = LAYERS[name][1]
    short, long = (count_ops(conv, torch.randn(1, L, d)) for L in lengths)
    assert short.layer == long.layer, (short.layer, long.layer)
    assert short.runtime > 0


# -- refused buffers ---------------------------------------------------------------------------

class BufferLayer(nn.Module):
    """A linear fast weight per token (or per chunk of 4) writing into a buffer ``o``; ``how``
    picks what else the code does with ``o``."""

    def __init__(self, how: str, d: int = 8):
        super().__init__()
        self.how = how
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.q(x), F.normalize(self.k(x), dim=-1), self.v(x)
        W = x.new_zeros(B, d, d)
        o = x.new_zeros(B, L + (self.how == "too long"), d)
        if self.how == "float32":
            o = torch.zeros(B, L, d, dtype=torch.float32)
        if self.how == "chunks read":
            for s in range(0, L, 4):
                o[:, s:s + 4] = q[:, s:s + 4] @ W
                W = W + k[:, s:s + 4].mT @ o[:, s:s + 4]
            return o
        for t in range(L):
            W = W + k[:, t, :, None] * v[:, t, None, :]
            o[:, t] = (q[:, t, None, :] @ W)[:, 0]
            if self.how == "tokens read":
                W = W - 0.1 * o[:, t, :, None] * k[:, t, None, :]
        return o


_FORWARD = BufferLayer.forward.__code__.co_firstlineno


def test_a_float32_buffer_casts_float64_outputs_as_the_layer_does():
    torch.manual_seed(1)
    layer = BufferLayer("float32").double()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    for other in (x, torch.randn(3, 21, 8, dtype=torch.float64)):
        y, y_ref = conv(other), layer(other)
        assert y.dtype == y_ref.dtype == torch.float32
        assert rel_rms_error(y, y_ref) <= FP32


@pytest.mark.parametrize("how, line, says", [
    ("tokens read", _FORWARD + 16, "is also read inside the loop"),
    ("chunks read", _FORWARD + 10, "is also read inside the loop"),
    ("too long", _FORWARD + 14, "allocate the buffer with the outputs' shape"),
])
def test_a_buffer_that_is_not_only_the_outputs_is_refused_naming_the_line(how, line, says):
    with pytest.raises(ConversionError) as e:
        ttt2la.convert(BufferLayer(how), level=0, example_inputs=(torch.randn(2, 16, 8),))
    msg = str(e.value)
    assert f"test_loop_outputs.py:{line}" in msg, msg
    assert "`o`" in msg and says in msg and "torch.stack" in msg, msg


class Scan(nn.Module):
    """A per-token memory over the tokens it is given."""

    def forward(self, q, k, v):
        return scan(q, k, v)


def scan(q, k, v):
    S = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        S = S + k[:, t, :, None] * v[:, t, None, :]
        outs.append(torch.einsum("bk,bkv->bv", q[:, t], S))
    return torch.stack(outs, 1)                             # <- each run's own stack


class BothWays(nn.Module):
    """The memory run left to right and right to left in one call: by one helper called twice,
    or (``modules=True``) by one submodule per direction."""

    def __init__(self, modules: bool, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(2 * d, d, bias=False)
        self.ways = nn.ModuleList([Scan(), Scan()]) if modules else None

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        right, left = self.ways or (scan, scan)
        forth = right(q, k, v)
        back = left(q.flip(1), k.flip(1), v.flip(1)).flip(1)
        return self.o(torch.cat([forth, back], -1))


def test_a_loop_run_twice_in_one_call_is_refused_with_what_to_do():
    torch.manual_seed(0)
    with pytest.raises(ConversionError) as refused:
        ttt2la.convert(BothWays(False), level=0, example_inputs=(torch.randn(2, 12, 8),))
    text = str(refused.value)
    assert "ran 2 times in one call" in text and "its own submodule" in text
    assert "each run's own stack" in text                   # the line of each run's stack


def test_one_submodule_per_run_converts_exactly():
    torch.manual_seed(0)
    layer = BothWays(True)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    assert [r.module_path for r in conv.ttt2la_report.layers] == ["ways.0", "ways.1"]
    assert all(r.runtime.startswith("chunk_linear_attention") for r in conv.ttt2la_report.layers)
    x = torch.randn(3, 17, 8)
    assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]


class StoredStates(nn.Module):
    """Every token's state kept in a list and read after the loop, stacked: no output per
    iteration."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        states = []
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            states.append(S)
        return torch.einsum("btk,btkv->btv", q, torch.stack(states, 1))


def test_states_stored_and_read_after_the_loop_are_refused_saying_to_read_them_inside():
    with pytest.raises(ConversionError, match=r"every iteration's state `S` .*test_loop_outputs\.py"
                                              r":\d+.* compute each chunk's output there"):
        ttt2la.convert(StoredStates(), level=0, example_inputs=(torch.randn(2, 6, 8),))
