"""A converted layer gives every parameter a gradient exactly where the layer as written does.

The layer as written records every op it runs: a momentum factor that multiplies a momentum
starting at zero, or feeds an update nothing reads, still gets a gradient — of zeros — and so
does the parameter it is computed from. A plan that skips that arithmetic must not leave the
parameter's ``.grad`` None: AdamW decays and moves a parameter with a zero gradient and skips one
with none, and DDP without ``find_unused_parameters`` waits for it. Where the layer skips the use
itself (``M if M is None else ...``) it gives None, and so must the converted layer. Conversion
compares the two on the example inputs and at short lengths, and runs calls that record gradients
as written where they differ.

Values are compared in float64, where rounding stays far below the bound and a gradient that
differs by more is a mistake, not the order of a sum.
"""
from __future__ import annotations

import copy

import pytest
import module_scoped
import torch
from hypothesis import given, settings, strategies as st

import ttt2la
from ttt2la.converted import LoopModule
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import TinyLaCTLM, lact_layer

D, H = 16, 2
F64 = torch.float64
LENGTHS = (1, 3, 4, 5, 7, 8, 9, 12, 16)   # one chunk, two (one partial), three, four


def _converted(style: str, level: int, chunk: int = 4, seed: int = 0):
    # two Newton–Schulz steps: which parameters get a gradient does not depend on how many
    torch.manual_seed(seed)
    layer = lact_layer(style, variant=2, d_model=D, num_heads=H, chunk_size=chunk,
                       muon_steps=2).double()
    return layer, ttt2la.convert(layer, level=level,
                                 example_inputs=(torch.randn(2, 4 * chunk, D, dtype=F64),))


_CACHE = module_scoped.cache()


def _cached(style: str, level: int, chunk: int):
    key = (style, level, chunk)
    if key not in _CACHE:
        _CACHE[key] = _converted(style, level, chunk)
    return _CACHE[key]


def _gradients(module: torch.nn.Module, x: torch.Tensor) -> dict:
    module.zero_grad(set_to_none=True)
    r = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    (module(x) * r).sum().backward()
    return {n: p.grad for n, p in module.named_parameters()}


def _assert_same_gradients(original, converted, x):
    want, got = _gradients(original, x), _gradients(converted, x)
    presence = {n: (want[n] is not None, got[n] is not None) for n in want
                if (want[n] is None) != (got[n] is None)}
    assert not presence, f"length {x.shape[1]}: (as written, converted) gradient present: {presence}"
    for n, w in want.items():
        if w is not None:
            assert rel_rms_error(got[n], w) <= TOLERANCE[F64], (x.shape[1], n)


@pytest.mark.parametrize("style", ["folded", "heads"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_parameter_has_a_gradient_where_the_layer_gives_one(style, level):
    original, converted = _cached(style, level, 4)
    for L in LENGTHS:
        _assert_same_gradients(original, converted, torch.randn(2, L, D, dtype=F64))


@pytest.mark.parametrize("style", ["folded", "heads"])
def test_the_plan_runs_calls_that_record_gradients(style):
    """Matching presence is the plan's own doing: conversion finds nothing to send to the code
    as written, and calls recording gradients at one, two and three chunks run the plan."""
    original, converted = _cached(style, 2, 4)
    layer = converted.ttt2la_report.layers[0]
    assert not [n for n in layer.notes if n.startswith("gradients:")], layer.notes
    for L in (3, 5, 8, 12):
        _gradients(converted, torch.randn(2, L, D, dtype=F64))
    assert not [k for k in layer.runs if "gradients" in k], layer.runs


def test_a_momentum_on_a_zero_start_gets_zeros_not_none():
    """The folded layer's momentum multiplies a zero state in its one update at two chunks:
    zeros as written, zeros converted."""
    original, converted = _cached("folded", 2, 4)
    for L in (5, 8):
        got = _gradients(converted, torch.randn(2, L, D, dtype=F64))["momentum_proj.weight"]
        assert got is not None and not got.any()


def _language_model():
    """A two-layer LaCT language model (two Newton–Schulz steps, as for the layers) and its
    conversion, converted once per module."""
    if "lm" not in _CACHE:
        torch.manual_seed(0)
        model = TinyLaCTLM(40, D, 2, H, 4, variant=2, muon_steps=2).double()
        _CACHE["lm"] = model, ttt2la.convert(
            model, level=2, example_inputs=(torch.randint(0, 40, (2, 16)),))
    return _CACHE["lm"]


def test_the_language_model_has_the_same_gradients_at_every_length():
    model, converted = _language_model()
    for L in (3, 5, 8, 12):
        _assert_same_gradients(model, converted, torch.randint(0, 40, (2, L)))


@settings(max_examples=10, deadline=None)
@given(style=st.sampled_from(["folded", "heads"]), chunk=st.sampled_from([2, 3, 4]),
       level=st.sampled_from([0, 2]), n=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_gradients_match_over_lengths_and_chunks(style, chunk, level, n, seed):
    original, converted = _cached(style, level, chunk)
    x = torch.randn(2, n, D, generator=torch.Generator().manual_seed(seed), dtype=F64)
    _assert_same_gradients(original, converted, x)


def _trained(model, lengths, tokens=None):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step, L in enumerate(lengths):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, tokens, (2, L), generator=g) if tokens else \
            torch.randn(2, L, D, generator=g, dtype=F64)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return dict(model.named_parameters())


def _assert_trained_alike(original, converted, lengths, tokens=None):
    start = dict(original.named_parameters())
    want, got = _trained(original, lengths, tokens), _trained(converted, lengths, tokens)
    for n, p0 in start.items():
        err = rel_rms_error(got[n] - p0, want[n] - p0)
        assert err <= TOLERANCE[torch.float32], (n, err)


def test_adamw_trains_the_converted_layer_like_the_original():
    original, converted = _cached("folded", 2, 4)
    _assert_trained_alike(original, converted, [16, 8, 5, 8, 3, 12])


def test_adamw_trains_the_converted_language_model_like_the_original():
    model, converted = _language_model()
    _assert_trained_alike(model, converted, [16, 8, 5, 8, 12, 7], tokens=40)


def test_a_presence_mismatch_at_conversion_runs_gradient_calls_as_written(monkeypatch):
    """Were the plan's outputs left as they come, conversion would find the parameter autograd
    no longer reaches, say so, and run calls that record gradients as written: never a None
    where the layer gives zeros."""
    monkeypatch.setattr(LoopModule, "_same_gradients_reached",
                        lambda self, plan, outputs, finals, *inputs: (outputs, finals))
    original, converted = _converted("folded", 2)
    notes = [n for layer in converted.ttt2la_report.layers for n in layer.notes]
    assert any("momentum_proj.weight (a gradient as written, none converted)" in n
               for n in notes), notes
    for L in (5, 8, 16):
        _assert_same_gradients(original, converted, torch.randn(2, L, D, dtype=F64))
    with torch.no_grad():
        converted(torch.randn(2, 8, D, dtype=F64))
    assert "block_linear_attention" in converted.ttt2la_report.layers[0].runs["batch 2"]
