"""A decay per value channel (a column of the state) on the runtime ops, against their naive
references: outputs, final states and every input's gradient (the decays' included).

``block_linear_attention(value_decay=[B, N, H, Dv])``: ``W_j = W_{j-1} ⊙ γ_j[None, :] + Δ_j``
through momentum, Newton–Schulz and the weight norm, alone or after a decay per head.
``chunk_linear_attention(value_log_decay=[B, T, H, Dv])``: ``S_t = S_{t-1} ⊙ exp(g_t)[None, :] +
k_tᵀ v_t`` on each of its paths (the chunk factored, sub-chunks factored, sub-chunks exact).
float64 within 1e-10, fp32 within 1e-5 of the float64 reference.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ttt2la.errors import ConversionError, UnsupportedTTTError
from ttt2la.runtime import (block_linear_attention, chunk_linear_attention,
                            implementation_name, naive_block_linear_attention,
                            naive_chunk_linear_attention)
from ttt2la.testing import TOLERANCE, outputs_and_grads, rel_rms_error


def _assert_close(fast, reference, tensors, options, dtype, seed):
    """The fast op in ``dtype`` against the reference in float64: output, final state and
    every gradient within ``TOLERANCE[dtype]``."""
    got = outputs_and_grads(fast, [t.to(dtype) for t in tensors],
                            {k: v.to(dtype) if isinstance(v, torch.Tensor) else v
                             for k, v in options.items()},
                            output_final_state=True, seed=seed, cotangent_dtype=dtype)
    want = outputs_and_grads(reference, tensors, options, output_final_state=True, seed=seed,
                             cotangent_dtype=dtype)
    tol = TOLERANCE[dtype]
    assert rel_rms_error(got[0], want[0]) <= tol, "output"
    assert rel_rms_error(got[1], want[1]) <= tol, "final state"
    for name, (_, grad) in want[2].items():
        assert rel_rms_error(got[2][name][1], grad) <= tol, name


def _decays(shape, strong: bool, g: torch.Generator) -> torch.Tensor:
    """Factors in (0, 1]: mild (``e^-0.5`` at the least) or strong (down to ``e^-12``)."""
    low = 12.0 if strong else 0.5
    return torch.exp(-low * torch.rand(shape, generator=g, dtype=torch.float64))


def _block_case(B, T, H, Dk, Dv, C, order, strong, per_head, initial, seed, **extra):
    g = torch.Generator().manual_seed(seed)
    n = 1 if order == "full" else math.ceil(T / C)
    tensors = [torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (Dk, Dk, Dv)]
    options = dict(chunk_size=C, order=order, value_decay=_decays((B, n, H, Dv), strong, g))
    if per_head:
        options["decay"] = _decays((B, n, H), strong, g)
    if initial:
        options["initial_state"] = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    if extra.get("momentum"):
        options["momentum"] = torch.rand(B, n, H, generator=g, dtype=torch.float64)
    if extra.get("weight_norm"):
        options["weight_norm"] = 0.5 + torch.rand(B, H, Dv, generator=g, dtype=torch.float64)
    if extra.get("muon"):
        options["muon_steps"] = 2
    return tensors, options


def _torch_block(*tensors, **options):
    return block_linear_attention(*tensors, backend="torch", **options)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 19), H=st.integers(1, 2), Dk=st.integers(1, 6),
       Dv=st.integers(1, 6), C=st.integers(1, 7),
       order=st.sampled_from(("exclusive", "inclusive", "full")), strong=st.booleans(),
       per_head=st.booleans(), initial=st.booleans(), momentum=st.booleans(),
       muon=st.booleans(), weight_norm=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_block_op_decays_columns_float64(B, T, H, Dk, Dv, C, order, strong, per_head, initial,
                                         momentum, muon, weight_norm, seed):
    """Every option the block op takes beside the decay per column, ragged chunks included."""
    tensors, options = _block_case(B, T, H, Dk, Dv, C, order, strong, per_head, initial, seed,
                                   momentum=momentum, muon=muon, weight_norm=weight_norm)
    _assert_close(_torch_block, naive_block_linear_attention, tensors, options,
                  torch.float64, seed)


@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 40), Dk=st.integers(2, 9), Dv=st.integers(2, 9), C=st.integers(1, 8),
       order=st.sampled_from(("exclusive", "inclusive")), strong=st.booleans(),
       per_head=st.booleans(), initial=st.booleans(), momentum=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_block_op_decays_columns_fp32(T, Dk, Dv, C, order, strong, per_head, initial, momentum,
                                      seed):
    tensors, options = _block_case(2, T, 2, Dk, Dv, C, order, strong, per_head, initial, seed,
                                   momentum=momentum)
    _assert_close(_torch_block, naive_block_linear_attention, tensors, options,
                  torch.float32, seed)


def test_block_reference_decays_each_column_by_its_own_factor():
    """The reference against a loop written here: one chunk, then a state scaled per column."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 1, 3, generator=g, dtype=torch.float64) for _ in range(3))
    gamma = torch.rand(1, 2, 1, 3, generator=g, dtype=torch.float64)
    o, final = naive_block_linear_attention(q, k, v, chunk_size=3, order="inclusive",
                                            value_decay=gamma, output_final_state=True)
    W = torch.zeros(3, 3, dtype=torch.float64)
    outs = []
    for j in range(2):
        sl = slice(3 * j, 3 * j + 3)
        W = W * gamma[0, j, 0][None, :] + k[0, sl, 0].T @ v[0, sl, 0]
        outs.append(q[0, sl, 0] @ W)
    assert torch.allclose(o[0, :, 0], torch.cat(outs), atol=1e-12)
    assert torch.allclose(final[0, 0], W, atol=1e-12)


def test_block_value_decay_contract():
    """Shape checked; exclusive with a decay per key channel; a backend whose ``supports`` does
    not name the option is never chosen by ``"auto"`` and refused when asked for."""
    q = torch.randn(1, 8, 2, 3)
    v = torch.randn(1, 8, 2, 4)
    with pytest.raises(ConversionError, match=r"value_decay must hold .* \[B, N, H, Dv\]"):
        block_linear_attention(q, q, v, chunk_size=4, value_decay=torch.rand(1, 2, 2, 3))
    with pytest.raises(ConversionError, match="per key channel"):
        block_linear_attention(q, q, v, chunk_size=4, value_decay=torch.rand(1, 2, 2, 4),
                               decay=torch.rand(1, 2, 2, 3))
    options = dict(chunk_size=4, value_decay=torch.rand(1, 2, 2, 4))
    assert implementation_name("block", q, q, v, **options) == "torch.block(parallel)"
    with pytest.raises(UnsupportedTTTError, match="backend='triton'"):
        block_linear_attention(q, q, v, backend="triton", **options)


@pytest.mark.parametrize("op,option,shape", [("block", "value_decay", (1, 2, 2, 4)),
                                             ("chunk", "value_log_decay", (1, 8, 2, 4))])
def test_the_triton_kernels_never_claim_a_decay_per_value_channel(monkeypatch, op, option,
                                                                  shape):
    """Where the kernels would take the call on every other count, the option alone makes
    ``supports`` answer False: ``"auto"`` runs torch and names it, ``"triton"`` is refused."""
    support = pytest.importorskip("ttt2la.runtime.triton.support")
    monkeypatch.setattr(support, "_devices_ok", lambda tensors: True)
    monkeypatch.setattr(support, "kernel_module", lambda name: None)
    q, v = torch.randn(1, 8, 2, 3), torch.randn(1, 8, 2, 4)
    assert support.supports(op, q, q, v, chunk_size=4)
    assert not support.supports(op, q, q, v, chunk_size=4, **{option: torch.rand(shape)})


#: Log decays per value channel and token (uniform in ``[-2·rate, 0]``) whose chunks take each
#: path of ``value_decay``: the chunk factored, sub-chunks factored, sub-chunks exact.
VALUE_STRENGTHS = {"mild": (0.01, set()), "medium": (0.3, {"_sub_chunked"}),
                   "strong": (3.0, {"_sub_chunked", "_exact"})}


def _chunk_case(B, T, H, Dk, Dv, rate, per_head, initial, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (Dk, Dk, Dv)]
    options = dict(value_log_decay=-2 * rate * torch.rand(B, T, H, Dv, generator=g,
                                                          dtype=torch.float64))
    if per_head:
        options["log_decay"] = -rate * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    if initial:
        options["initial_state"] = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    return tensors, options


def _torch_chunk(chunk_size):
    return lambda *t, **o: chunk_linear_attention(*t, chunk_size=chunk_size, backend="torch",
                                                  **o)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 70), H=st.integers(1, 2), Dk=st.integers(1, 6),
       Dv=st.integers(1, 6), C=st.sampled_from((1, 5, 16, 32, 64)),
       strength=st.sampled_from(list(VALUE_STRENGTHS)), per_head=st.booleans(),
       initial=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_chunk_op_decays_columns_float64(B, T, H, Dk, Dv, C, strength, per_head, initial,
                                         seed):
    tensors, options = _chunk_case(B, T, H, Dk, Dv, VALUE_STRENGTHS[strength][0], per_head,
                                   initial, seed)
    _assert_close(_torch_chunk(C), naive_chunk_linear_attention, tensors, options,
                  torch.float64, seed)


@pytest.mark.parametrize("strength", list(VALUE_STRENGTHS))
@pytest.mark.parametrize("T,C", [(64, 64), (150, 64), (97, 32), (13, 64)])
def test_chunk_op_takes_each_path_exactly_fp32(T, C, strength, monkeypatch):
    """Every path against the token-by-token reference (fp32 within 1e-5 of float64, every
    gradient included); a spy confirms the path taken."""
    import ttt2la.runtime.value_decay as value_decay
    rate, path = VALUE_STRENGTHS[strength]
    called = []
    for name in ("_sub_chunked", "_exact"):
        fn = getattr(value_decay, name)
        monkeypatch.setattr(value_decay, name,
                            lambda *a, _fn=fn, _name=name: called.append(_name) or _fn(*a))
    tensors, options = _chunk_case(2, T, 2, 6, 5, rate, False, True, T)
    _assert_close(_torch_chunk(C), naive_chunk_linear_attention, tensors, options,
                  torch.float32, T)
    if T >= 32 or strength == "mild":
        assert set(called) == path, called


def test_chunk_op_stays_finite_and_exact_under_strong_decays_over_a_long_sequence():
    """Log decays per value channel from -0.001 to -40 a token over 2048 tokens, fp32."""
    B, T, H, D = 1, 2048, 2, 5
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    log_decay = -torch.logspace(-3, 1.6, D) * torch.rand(B, T, H, D, generator=g)
    o, final = chunk_linear_attention(q, k, v, value_log_decay=log_decay,
                                      output_final_state=True)
    o_ref, final_ref = naive_chunk_linear_attention(
        q.double(), k.double(), v.double(), value_log_decay=log_decay.double(),
        output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms_error(o, o_ref) <= TOLERANCE[torch.float32]
    assert rel_rms_error(final, final_ref) <= TOLERANCE[torch.float32]


def test_chunk_reference_decays_each_column_by_its_own_factor():
    """The reference against a loop written here."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 5, 1, 2, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 5, 1, 3, generator=g, dtype=torch.float64)
    gv = -torch.rand(1, 5, 1, 3, generator=g, dtype=torch.float64)
    o, final = naive_chunk_linear_attention(q, k, v, value_log_decay=gv,
                                            output_final_state=True)
    S = torch.zeros(2, 3, dtype=torch.float64)
    for t in range(5):
        S = S * gv[0, t, 0].exp()[None, :] + torch.outer(k[0, t, 0], v[0, t, 0])
        assert torch.allclose(o[0, t, 0], q[0, t, 0] @ S, atol=1e-12)
    assert torch.allclose(final[0, 0], S, atol=1e-12)


def test_chunk_value_decay_contract():
    q, v = torch.randn(1, 8, 2, 3), torch.randn(1, 8, 2, 4)
    with pytest.raises(ConversionError, match=r"value_log_decay must be \[B, T, H, Dv\]"):
        chunk_linear_attention(q, q, v, value_log_decay=-torch.rand(1, 8, 2, 3))
    with pytest.raises(ConversionError, match="per key channel"):
        chunk_linear_attention(q, q, v, value_log_decay=-torch.rand(1, 8, 2, 4),
                               log_decay=-torch.rand(1, 8, 2, 3))
    options = dict(value_log_decay=-torch.rand(1, 8, 2, 4))
    assert implementation_name("chunk", q, q, v, **options) == "torch.chunk"
    with pytest.raises(UnsupportedTTTError, match="backend='triton'"):
        chunk_linear_attention(q, q, v, backend="triton", **options)
