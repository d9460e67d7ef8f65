"""A plan's call does no Python work that its first call could have done: it batches its
feature graphs over the chunks with ``flat_vmap`` (``torch.func.vmap``'s ops without its
pytree handling) and finds the body's inputs once, not by walking the body graph every call.
``flat_vmap`` dispatches what ``vmap`` dispatches: the same values, bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch._functorch.apis as functorch_apis
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.as_written import race_as_written
from ttt2la.ir import TTTProgram
from ttt2la.lowering.flat_vmap import flat_vmap
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import GatedChunkMemory, lact_layer


def _features(x, w, g):
    """Feature-graph-like work: a mean over a chunk, a product with a weight, an unbatched
    output passed through."""
    m = x.mean(-1, keepdim=True)
    y = (x * g) @ w
    return m.unsqueeze(-1), torch.sigmoid(y).transpose(-1, -2), w


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), b=st.integers(1, 3), d=st.integers(1, 6),
       batched=st.tuples(st.booleans(), st.booleans()), seed=st.integers(0, 2 ** 16))
def test_flat_vmap_is_vmap_bit_for_bit(n, b, d, batched, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, b, d, generator=gen)
    w = torch.randn(*((n,) if batched[0] else ()), d, d, generator=gen)
    g = torch.randn(*((n,) if batched[1] else ()), d, generator=gen)
    dims = (0, 0 if batched[0] else None, 0 if batched[1] else None)
    got = flat_vmap(_features, dims, (x, w, g))
    want = torch.func.vmap(_features, in_dims=dims)(x, w, g)
    assert len(got) == len(want)
    for a, e in zip(got, want):
        assert a.shape == e.shape and a.stride() == e.stride() and torch.equal(a, e)


def test_flat_vmap_refuses_batched_inputs_of_different_sizes():
    with pytest.raises(ValueError, match="share one size"):
        flat_vmap(_features, (0, None, 0), (torch.randn(3, 2, 4), torch.randn(4, 4),
                                            torch.randn(2, 4)))


def test_flat_vmap_refuses_a_function_returning_no_tensors():
    with pytest.raises(ValueError, match="tuple of tensors"):
        flat_vmap(lambda x: [x.sum(), 1.0], (0,), (torch.randn(3, 2),))


def _layers():
    torch.manual_seed(0)
    yield "gated", GatedChunkMemory(32, 2, 8), 0
    # two Newton–Schulz steps: what a call does in Python, not the iteration, is under test
    yield "lact", lact_layer("folded", variant=2, d_model=32, num_heads=2, chunk_size=8,
                             muon_steps=2), 2


@pytest.mark.parametrize("name,layer,level", list(_layers()), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_a_planned_call_neither_vmaps_through_pytrees_nor_walks_the_body(
        name, layer, level, monkeypatch):
    layer = layer.eval()
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 48, 32),))
    x = torch.randn(2, 64, 32)
    with torch.no_grad(), race_as_written(False):
        conv(x)                                     # builds this batch size's loop
        calls = {"vmap": 0, "placeholders": 0}
        vmap_impl, placeholders = functorch_apis.vmap_impl, TTTProgram.placeholders

        def counted_vmap(*a, **k):
            calls["vmap"] += 1
            return vmap_impl(*a, **k)

        def counted_placeholders(self):
            calls["placeholders"] += 1
            return placeholders(self)

        monkeypatch.setattr(functorch_apis, "vmap_impl", counted_vmap)
        monkeypatch.setattr(TTTProgram, "placeholders", counted_placeholders)
        y = conv(x)
        monkeypatch.undo()
        assert calls == {"vmap": 0, "placeholders": 0}, name
        assert rel_rms_error(y, layer(x)) <= TOLERANCE[torch.float32]
