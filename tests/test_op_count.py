"""A converted layer does the same amount of work-dispatch at every length: no per-token or
per-chunk ops in the graph around the loop or in the plan.

Ops are counted with a ``TorchDispatchMode`` on a forward pass, split into the ops the runtime
linear-attention ops dispatch internally (any frame inside ``ttt2la/runtime/``) and all the
others: the user's code around the loop, the chunking and output assembly, the lifted feature
maps. The second part must not depend on the length at all. The runtime's scans over chunks
may grow by a log-depth term; on CPU they still run a Python loop over chunks, which the
full-layer tests below record as an expected failure that turns into a failure (strict) as
soon as the scan is log-depth, so that the marker is then removed.

The converted layers are also checked against the layers run as written (fp32, ≤ 1e-5 in
relative RMS error, outputs and every parameter gradient) at lengths that are not a multiple of
the chunk size, shorter than one chunk, and a single token.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTHeadsLayer, PerTokenTTTLayer

_RUNTIME_DIR = os.path.join(os.path.dirname(os.path.abspath(ttt2la.__file__)), "runtime") + os.sep


def _in_runtime() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_RUNTIME_DIR):
            return True
        frame = frame.f_back
    return False


class _OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched: ``layer`` outside the runtime ops, ``runtime`` inside."""

    def __init__(self):
        super().__init__()
        self.layer = 0
        self.runtime = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _in_runtime():
            self.runtime += 1
        else:
            self.layer += 1
        return func(*args, **(kwargs or {}))


def count_ops(module: torch.nn.Module, x: torch.Tensor) -> _OpCounter:
    module(x)                               # first call at this shape builds its graph
    with torch.no_grad(), _OpCounter() as counter:
        module(x)
    return counter


class InlinePerTokenTTT(torch.nn.Module):
    """A linear fast weight trained token by token, the loop written inline in ``forward``."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.v = torch.nn.Linear(d, d)
        self.lr = torch.nn.Linear(d, 1)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        eta = torch.sigmoid(self.lr(x))
        W = self.w0.expand(x.shape[0], -1, -1)
        outs = []
        for t in range(x.shape[1]):
            W = W + eta[:, t, :, None] * (k[:, t, :, None] * v[:, t, None, :])
            outs.append((q[:, t, None, :] @ W).squeeze(1))
        return torch.stack(outs, dim=1)


D_MODEL, HEADS, CHUNK = 32, 2, 8
_LAYERS = module_scoped.cache()


def _layer(name: str):
    """``(original, converted)``, built once per test session (conversion traces the layer)."""
    if name not in _LAYERS:
        torch.manual_seed(0)
        if name == "inline":
            layer, d = InlinePerTokenTTT(16), 16
        elif name == "per_token":
            layer, d = PerTokenTTTLayer(D_MODEL, HEADS), D_MODEL
        else:
            style, muon = name.split("-")
            cls = LaCTFoldedLayer if style == "folded" else LaCTHeadsLayer
            # two Newton–Schulz steps: their ops are as many per chunk as five's
            layer, d = cls(D_MODEL, HEADS, CHUNK, muon=muon == "muon", muon_steps=2), D_MODEL
        example = torch.randn(2, 8 * CHUNK, d)
        _LAYERS[name] = (layer, ttt2la.convert(layer, level=2, example_inputs=(example,)), d)
    return _LAYERS[name]


PER_TOKEN = ["inline", "per_token"]
CHUNKED = ["folded-muon", "folded-plain", "heads-muon", "heads-plain"]
# A log-depth scan adds a few ops (slice, pad, add, ...) per doubling of the number of chunks.
PER_TOKEN_OPS_PER_DOUBLING = 8


def _counts(name: str, lengths):
    _, converted, d = _layer(name)
    return [count_ops(converted, torch.randn(2, L, d)) for L in lengths]


@pytest.mark.parametrize("name", PER_TOKEN)
def test_per_token_layer_dispatches_the_same_ops_at_every_length(name):
    short, long = _counts(name, (256, 4096))
    assert short.layer == long.layer, (short.layer, long.layer)
    assert short.runtime > 0                 # the loop really runs on a runtime op


@pytest.mark.parametrize("name", CHUNKED)
def test_chunked_layer_dispatches_the_same_ops_at_16_and_256_chunks(name):
    few, many = _counts(name, (16 * CHUNK, 256 * CHUNK))
    assert few.layer == many.layer, (few.layer, many.layer)
    assert few.runtime > 0


@pytest.mark.parametrize("name", CHUNKED)
def test_a_partial_last_chunk_costs_no_ops_that_grow_with_length(name):
    few, many = _counts(name, (16 * CHUNK + 3, 256 * CHUNK + 3))
    assert few.layer == many.layer, (few.layer, many.layer)


@pytest.mark.parametrize("name", PER_TOKEN)
def test_whole_per_token_layer_grows_at_most_by_a_log_depth_scan(name):
    short, long = _counts(name, (256, 4096))
    doublings = math.log2(4096 // 256)
    grown = (long.layer + long.runtime) - (short.layer + short.runtime)
    assert grown <= PER_TOKEN_OPS_PER_DOUBLING * doublings, grown


@pytest.mark.parametrize("name", CHUNKED)
def test_whole_chunked_layer_grows_at_most_by_a_log_depth_scan(name):
    # a loop over chunks adds ops with every chunk; a log-depth (blocked) scan adds a level per
    # factor of its block size, so each further factor of 16 costs no more than the one before
    few, many, most = _counts(name, (16 * CHUNK, 256 * CHUNK, 4096 * CHUNK))
    total = [c.layer + c.runtime for c in (few, many, most)]
    first, second = total[1] - total[0], total[2] - total[1]
    assert first < 256 - 16, total
    assert second <= first, total


# -- the lean graph computes what the layer as written computes ------------------------------

def _outputs_and_grads(module, x, seed):
    module.zero_grad(set_to_none=True)
    y = module(x)
    gen = torch.Generator().manual_seed(seed)
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    return y.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


def _as_written(name):
    """The layer the converted one must equal: level 2 computes LaCT's variant 2 (Θ frozen,
    no weight norm), so a chunked layer is compared with that variant as written, holding the
    same weights; a per-token layer has neither and is its own reference."""
    original, _, _ = _layer(name)
    if name in PER_TOKEN:
        return original
    cls = type(original)
    variant2 = cls(D_MODEL, HEADS, CHUNK, muon=name.endswith("muon"), update_theta=False,
                   weight_norm=False)
    variant2.load_state_dict(original.state_dict())
    return variant2


def _check_equivalent(name, B, L, seed):
    _, converted, d = _layer(name)
    original = _as_written(name)
    x = torch.randn(B, L, d, generator=torch.Generator().manual_seed(seed))
    y_ref, g_ref = _outputs_and_grads(original, x, seed)
    y, g = _outputs_and_grads(converted, x, seed)
    tol = TOLERANCE[torch.float32]
    assert rel_rms_error(y, y_ref) <= tol
    assert set(g) == set(g_ref)
    for n in g_ref:
        assert rel_rms_error(g[n], g_ref[n]) <= tol, n


@settings(max_examples=6)
@given(name=st.sampled_from(PER_TOKEN), B=st.integers(1, 3), L=st.integers(1, 70),
       seed=st.integers(0, 2 ** 16))
def test_lean_per_token_layer_matches_the_loop_as_written(name, B, L, seed):
    _check_equivalent(name, B, L, seed)


@settings(max_examples=6)
@given(name=st.sampled_from(["folded-plain", "heads-plain"]), B=st.integers(1, 3),
       L=st.sampled_from([1, CHUNK - 3, CHUNK, 3 * CHUNK + 5, 7 * CHUNK]),
       seed=st.integers(0, 2 ** 16))
def test_lean_chunked_layer_matches_the_loop_as_written(name, B, L, seed):
    _check_equivalent(name, B, L, seed)
