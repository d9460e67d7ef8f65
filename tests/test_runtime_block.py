"""The block (LaCT-style) runtime op against its recurrent reference: outputs and gradients."""
from __future__ import annotations

import itertools
import math
import types
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ttt2la.errors import ConversionError, UnsupportedTTTError
from ttt2la.runtime import (block_linear_attention, dispatch, implementation_name,
                            naive_block_linear_attention, newton_schulz)
from ttt2la.runtime.naive import naive_newton_schulz, ns_schedule
from ttt2la.testing import TOLERANCE, outputs_and_grads, rel_rms_error

ORDERS = ("exclusive", "inclusive", "full")
LR_KINDS = ("none", "token", "feature")
TENSOR_OPTIONS = ("lr", "momentum", "weight_norm", "initial_state")


def make_case(seed, *, B, T, H, Dk, Dv, C, order, lr_kind, momentum, muon_steps, weight_norm,
              initial_state, dtype):
    """Random inputs for one call: the positional tensors and the keyword options."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, low=None, high=None):
        x = (torch.randn(*shape, generator=g, dtype=torch.float64) if low is None else
             low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64))
        return x.to(dtype)

    n = 1 if order == "full" else math.ceil(T / C)
    tensors = (rand(B, T, H, Dk), rand(B, T, H, Dk), rand(B, T, H, Dv))
    options = dict(
        chunk_size=C, order=order, muon_steps=muon_steps,
        lr={"none": None, "token": rand(B, T, H, low=0.1, high=1.0),
            "feature": rand(B, T, H, Dv, low=0.1, high=1.0)}[lr_kind],
        momentum=rand(B, n, H, low=0.3, high=0.9) if momentum else None,
        weight_norm=rand(B, H, Dv, low=0.5, high=1.5) if weight_norm else None,
        initial_state=rand(B, H, Dk, Dv) if initial_state else None,
    )
    return tensors, options


def run_with_grads(fn, tensors, options, output_final_state, seed, cotangent_dtype):
    """Outputs, final state and gradients of every tensor input w.r.t. a random projection."""
    o, final, grads = outputs_and_grads(fn, tensors, options, output_final_state=output_final_state,
                                        seed=seed, cotangent_dtype=cotangent_dtype)
    return o, final, [gr for _, gr in grads.values()]


def assert_matches_reference(tensors, options, output_final_state, seed, backend="torch"):
    dtype = tensors[0].dtype
    tol = TOLERANCE[dtype]
    as64 = lambda x: x.to(torch.float64) if isinstance(x, torch.Tensor) else x  # noqa: E731
    o, final, grads = run_with_grads(
        lambda *a, **k: block_linear_attention(*a, backend=backend, **k),
        tensors, options, output_final_state, seed, dtype)
    o_ref, final_ref, grads_ref = run_with_grads(
        naive_block_linear_attention, [as64(t) for t in tensors],
        {k: as64(v) for k, v in options.items()}, output_final_state, seed, dtype)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert torch.isfinite(o).all()
    assert rel_rms_error(o, o_ref) < tol, ("output", rel_rms_error(o, o_ref))
    if output_final_state:
        assert final.dtype == dtype
        err = rel_rms_error(final, final_ref)
        assert err < tol, ("final_state", err)
    names = ["phi_q", "phi_k", "v"] + [k for k in TENSOR_OPTIONS if options[k] is not None]
    for name, gr, gr_ref in zip(names, grads, grads_ref):
        assert gr.dtype == dtype
        err = rel_rms_error(gr, gr_ref)
        assert err < tol, (f"grad {name}", err)


# Every option combination once, on a ragged sequence (two full chunks and a partial one).
@pytest.mark.parametrize("order,lr_kind,momentum,muon_steps,weight_norm,initial_state,final",
                         list(itertools.product(ORDERS, LR_KINDS, (False, True), (0, 5),
                                                (False, True), (False, True), (False, True))))
def test_every_option_combination_fp32(order, lr_kind, momentum, muon_steps, weight_norm,
                                       initial_state, final):
    options = (order, lr_kind, momentum, muon_steps, weight_norm, initial_state)
    seed = zlib.crc32(repr(options).encode())
    tensors, options = make_case(seed, B=2, T=11, H=2, Dk=5, Dv=3, C=4, order=order,
                                 lr_kind=lr_kind, momentum=momentum, muon_steps=muon_steps,
                                 weight_norm=weight_norm, initial_state=initial_state,
                                 dtype=torch.float32)
    assert_matches_reference(tensors, options, final, seed)


case = st.fixed_dictionaries(dict(
    B=st.integers(1, 2), H=st.integers(1, 2), Dk=st.integers(1, 9), Dv=st.integers(1, 9),
    C=st.integers(1, 6), order=st.sampled_from(ORDERS), lr_kind=st.sampled_from(LR_KINDS),
    momentum=st.booleans(), muon_steps=st.sampled_from([0, 1, 5]), weight_norm=st.booleans(),
    initial_state=st.booleans(), final=st.booleans(), seed=st.integers(0, 2**31 - 1),
    t_frac=st.floats(0.0, 1.0)))


def _draw(c, dtype):
    # Muon and the weight norm are blind to the length of what they normalise, so an input that
    # only sets a length (a one-feature key or value, a chunk's lone token, the rank-one first
    # update of a zero state) has a gradient that is exactly 0 or of the order of the norm's
    # epsilon; its relative error is rounding noise over ~0 in any implementation. Such cases are
    # drawn with at least two features, two tokens per chunk and (weight norm) an initial state,
    # as LaCT runs them; the exhaustive test above covers the options on a fixed shape.
    normalised = c["muon_steps"] > 0 or c["weight_norm"]
    least = 2 if normalised else 1
    C = max(c["C"], least)
    T = max(1 + round(c["t_frac"] * (5 * C + 6)), least)  # 1 .. 5·C + 7
    return make_case(c["seed"], B=c["B"], T=T, H=c["H"], Dk=max(c["Dk"], least),
                     Dv=max(c["Dv"], least), C=C, order=c["order"], lr_kind=c["lr_kind"],
                     momentum=c["momentum"], muon_steps=c["muon_steps"],
                     weight_norm=c["weight_norm"],
                     initial_state=c["initial_state"] or c["weight_norm"], dtype=dtype)


# Derandomized: about one fp32 draw in 3500 has a weight-norm gradient that is a near-cancelling
# sum (measured: the fp32 reference itself is then 2e-5..6e-5 off); a fixed example set keeps
# the suite deterministic without loosening the tolerance.
@settings(max_examples=120, deadline=None, derandomize=True)
@given(c=case)
def test_random_shapes_and_options_fp32(c):
    tensors, options = _draw(c, torch.float32)
    assert_matches_reference(tensors, options, c["final"], c["seed"])


@settings(max_examples=60, deadline=None)
@given(c=case)
def test_random_shapes_and_options_bf16(c):
    tensors, options = _draw(c, torch.bfloat16)
    assert_matches_reference(tensors, options, c["final"], c["seed"])


@pytest.mark.parametrize("T", [1, 4, 5, 8, 13])
def test_edge_lengths_against_reference(T):
    """T < C, T = C, T = C + 1, T = 2C, ragged — with everything switched on."""
    tensors, options = make_case(T, B=1, T=T, H=3, Dk=6, Dv=7, C=4, order="exclusive",
                                 lr_kind="feature", momentum=True, muon_steps=5,
                                 weight_norm=True, initial_state=True, dtype=torch.float32)
    assert_matches_reference(tensors, options, True, T)


def test_exclusive_single_chunk_returns_initial_state():
    """With one chunk, exclusive order only applies: the state is left untouched."""
    tensors, options = make_case(0, B=1, T=3, H=1, Dk=4, Dv=4, C=8, order="exclusive",
                                 lr_kind="none", momentum=False, muon_steps=0,
                                 weight_norm=False, initial_state=True, dtype=torch.float32)
    o, final = block_linear_attention(*tensors, output_final_state=True, **options)
    torch.testing.assert_close(final, options["initial_state"], rtol=0, atol=0)
    torch.testing.assert_close(o, torch.einsum("bthk,bhkv->bthv", tensors[0],
                                               options["initial_state"]))


def test_long_sequence_momentum_does_not_underflow():
    """2^20 tokens, 512 chunks, momentum ≈ 0.5: Π α underflows fp32, the scan must not care."""
    B, T, H, D, C = 1, 1 << 20, 1, 4, 2048
    g = torch.Generator().manual_seed(7)
    phi_q, phi_k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    lr = torch.rand(B, T, H, generator=g)
    momentum = 0.45 + 0.1 * torch.rand(B, T // C, H, generator=g)
    assert torch.prod(momentum.double()).item() < 1e-100  # a cumulative product would underflow
    for order, muon_steps, weight_norm in [("exclusive", 0, None), ("inclusive", 5, None),
                                           ("exclusive", 5, torch.full((B, H, D), 2.0))]:
        options = dict(chunk_size=C, order=order, lr=lr, momentum=momentum,
                       muon_steps=muon_steps, weight_norm=weight_norm, output_final_state=True)
        o, final = block_linear_attention(phi_q, phi_k, v, backend="torch", **options)
        as64 = {k: (x.double() if isinstance(x, torch.Tensor) else x) for k, x in options.items()}
        o_ref, final_ref = naive_block_linear_attention(phi_q.double(), phi_k.double(),
                                                        v.double(), **as64)
        assert torch.isfinite(o).all() and torch.isfinite(final).all()
        assert rel_rms_error(o, o_ref) < TOLERANCE[torch.float32], (order, muon_steps)
        assert rel_rms_error(final, final_ref) < TOLERANCE[torch.float32], (order, muon_steps)


# ----------------------------------------------------------------------------- Newton–Schulz

@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 9), steps=st.integers(0, 6),
       seed=st.integers(0, 2**31 - 1))
def test_newton_schulz_matches_reference(m, n, steps, seed):
    G = torch.randn(3, 2, m, n, generator=torch.Generator().manual_seed(seed))
    expected = naive_newton_schulz(G.double(), ns_schedule(steps))
    assert rel_rms_error(newton_schulz(G, steps), expected) < TOLERANCE[torch.float32]
    assert rel_rms_error(newton_schulz(G.mT, steps).mT, expected) < TOLERANCE[torch.float32]
    G16 = G.bfloat16()
    assert rel_rms_error(newton_schulz(G16, steps),
                         naive_newton_schulz(G16.double(), ns_schedule(steps))) < TOLERANCE[torch.bfloat16]


def test_newton_schulz_orthogonalises():
    """Five quintic steps push every singular value of a well-conditioned matrix near 1."""
    G = torch.randn(16, 24, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(G, 5))
    assert s.min() > 0.6 and s.max() < 1.25


# ----------------------------------------------------------------------------- dispatch

def test_backends_agree_and_are_named():
    tensors, options = make_case(1, B=1, T=9, H=2, Dk=3, Dv=5, C=4, order="inclusive",
                                 lr_kind="token", momentum=True, muon_steps=2, weight_norm=True,
                                 initial_state=True, dtype=torch.float32)
    o_auto, _ = block_linear_attention(*tensors, **options)
    o_naive, _ = block_linear_attention(*tensors, backend="naive", **options)
    assert rel_rms_error(o_auto, o_naive) < TOLERANCE[torch.float32]
    assert implementation_name("block", *tensors, **options) == "torch.block(semi-parallel)"
    options["weight_norm"] = None
    assert implementation_name("block", *tensors, **options) == "torch.block(parallel)"
    assert implementation_name("block", *tensors, backend="naive",
                               **options) == "naive.block(recurrent)"


def _small_case():
    return make_case(1, B=1, T=4, H=1, Dk=2, Dv=2, C=2, order="inclusive", lr_kind="none",
                     momentum=False, muon_steps=0, weight_norm=False, initial_state=False,
                     dtype=torch.float32)


def test_triton_requested_without_a_kernel_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setattr(dispatch, "_triton_module", lambda: None)
    tensors, options = _small_case()
    assert implementation_name("block", *tensors, **options) == "torch.block(parallel)"
    with pytest.raises(UnsupportedTTTError, match="backend='triton'"):
        block_linear_attention(*tensors, backend="triton", **options)


def test_triton_package_is_used_when_it_supports_the_call(monkeypatch):
    """An explicit request goes to the Triton package; ``auto`` only takes it for CUDA tensors."""
    calls = []
    fake = types.SimpleNamespace(
        supports=lambda op, *tensors, **options: op == "block",
        block_linear_attention=lambda *a, **k: calls.append(k["order"]) or ("triton", None))
    monkeypatch.setattr(dispatch, "_triton_module", lambda: fake)
    tensors, options = _small_case()
    assert block_linear_attention(*tensors, backend="triton", **options)[0] == "triton"
    assert calls == ["inclusive"]
    assert implementation_name("block", *tensors, backend="triton",
                               **options) == "triton.block(parallel)"
    assert implementation_name("block", *tensors, **options) == "torch.block(parallel)"


@pytest.mark.parametrize("bad", [
    dict(order="sideways"),
    dict(chunk_size=0),
    dict(momentum=torch.rand(1, 7, 1)),
    dict(lr=torch.rand(1, 6, 1, 2, 2)),
    dict(weight_norm=torch.rand(1, 1, 3)),
    dict(initial_state=torch.rand(1, 1, 2, 3)),
    dict(backend="cuda"),
])
def test_malformed_arguments_raise_conversion_errors(bad):
    phi = torch.randn(1, 6, 1, 2)
    kwargs = dict(chunk_size=2, order="exclusive") | bad
    with pytest.raises(ConversionError):
        block_linear_attention(phi, phi, phi, **kwargs)
