"""``bidirectional_linear_attention``: one update over all key tokens, then every query reads it.

The torch path is checked against the token-loop reference and against the same math written
here by hand — a global state ``S0 + Σ_t k_tᵀ v_t`` read by every query and gated, and a local
one as a depthwise convolution (``F.unfold`` for the update, ``F.conv2d`` for the read) —
outputs, final state and every input's gradient, fp32 within 1e-5 relative RMS.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.runtime import bidirectional_linear_attention, naive_bidirectional_linear_attention
from ttt2la.runtime.naive import RuntimeInputError
from ttt2la.testing import TOLERANCE, rel_rms_error

FP32 = TOLERANCE[torch.float32]


def _inputs(B, T, H, Dk, Dv, rows, gen, dtype=torch.float32, Tq=None):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    Tq = T if Tq is None else Tq
    return dict(q=r(B, Tq, H, Dk), k=r(B, T, H, Dk), v=r(B, T, H, Dv), gate=r(B, Tq, H, Dv),
                initial_state=r(B, H, rows, Dv))


def _outputs_and_grads(fn, inputs, gen):
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items() if t is not None}
    o, S = fn(**{**inputs, **leaves})
    go = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    gS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    grads = torch.autograd.grad((o * go).sum() + (S * gS).sum(), list(leaves.values()))
    return {"o": o, "S": S, **{f"d{n}": g for n, g in zip(leaves, grads)}}


def _assert_close(got: dict, want: dict, tol: float):
    assert got.keys() == want.keys()
    for name in want:
        err = rel_rms_error(got[name], want[name])
        assert err <= tol, f"{name}: {err:.3g}"


@settings(max_examples=16, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Dk=st.integers(1, 5), Dv=st.integers(1, 5),
       grid=st.tuples(st.integers(1, 5), st.integers(1, 5)), size=st.sampled_from([None, 1, 3, 5]),
       gated=st.booleans(), initial=st.booleans(), queries=st.integers(1, 7),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_torch_path_equals_the_token_loop(B, H, Dk, Dv, grid, size, gated, initial, queries,
                                          dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    T = grid[0] * grid[1]
    window = None if size is None else (*grid, size)
    rows = Dk if size is None else size * size * Dk
    # a window reads the tokens it updates on; the global op may read other tokens
    inputs = _inputs(B, T, H, Dk, Dv, rows, gen, dtype, Tq=T if size else queries)
    inputs["gate"] = inputs["gate"] if gated else None
    inputs["initial_state"] = inputs["initial_state"] if initial else None

    def run(backend):
        return lambda **kw: bidirectional_linear_attention(**kw, window=window,
                                                           output_final_state=True,
                                                           backend=backend)
    got = _outputs_and_grads(run("torch"), inputs, torch.Generator().manual_seed(1))
    want = _outputs_and_grads(run("naive"), inputs, torch.Generator().manual_seed(1))
    _assert_close(got, want, TOLERANCE[dtype])


def gated_attention_by_hand(q, k, v, gate, initial_state):
    """Every head's state ``S0 + Σ_t k_tᵀ v_t``, read by every query, times the gate."""
    B, T, H, _ = k.shape
    out = torch.empty_like(gate)
    states = torch.empty_like(initial_state)
    for b in range(B):
        for h in range(H):
            S = initial_state[b, h].clone()
            for t in range(T):
                S = S + torch.outer(k[b, t, h], v[b, t, h])
            states[b, h] = S
            for s in range(q.shape[1]):
                out[b, s, h] = (q[b, s, h] @ S) * gate[b, s, h]
    return out, states


def conv_by_hand(q, k, v, initial_state, height, width):
    """A depthwise 3×3 convolution whose taps start at ``initial_state`` and gain every pixel's
    3×3 key patch times its value (``F.unfold``), then convolve the queries (``F.conv2d``)."""
    B, T, C, _ = q.shape
    image = lambda x: x[..., 0].transpose(1, 2).reshape(B, C, height, width)  # noqa: E731
    patches = F.unfold(image(k), 3, padding=1).view(B, C, 9, T)
    taps = initial_state[..., 0] + torch.einsum("bcjt,bct->bcj", patches, image(v).view(B, C, T))
    out = torch.cat([F.conv2d(image(q)[i:i + 1], taps[i].view(C, 1, 3, 3), padding=1, groups=C)
                     for i in range(B)])
    return out.view(B, C, T).transpose(1, 2).unsqueeze(-1), taps.unsqueeze(-1)


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 3), Dk=st.integers(1, 4), Dv=st.integers(1, 4),
       T=st.integers(1, 9), Tq=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_global_op_is_gated_linear_attention(B, H, Dk, Dv, T, Tq, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(B, T, H, Dk, Dv, Dk, gen, Tq=Tq)
    fast = lambda **kw: bidirectional_linear_attention(**kw, output_final_state=True)  # noqa
    got = _outputs_and_grads(fast, inputs, torch.Generator().manual_seed(2))
    want = _outputs_and_grads(gated_attention_by_hand, inputs, torch.Generator().manual_seed(2))
    _assert_close(got, want, FP32)


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 2), C=st.integers(1, 4), height=st.integers(1, 5),
       width=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_local_op_is_a_depthwise_convolution_with_fast_taps(B, C, height, width, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(B, height * width, C, 1, 1, 9, gen)
    del inputs["gate"]
    fast = lambda **kw: bidirectional_linear_attention(  # noqa: E731
        **kw, window=(height, width, 3), output_final_state=True)
    by_hand = lambda **kw: conv_by_hand(**kw, height=height, width=width)  # noqa: E731
    got = _outputs_and_grads(fast, inputs, torch.Generator().manual_seed(3))
    want = _outputs_and_grads(by_hand, inputs, torch.Generator().manual_seed(3))
    _assert_close(got, want, FP32)


def test_bf16_accumulates_in_fp32_and_returns_bf16():
    gen = torch.Generator().manual_seed(0)
    inputs = _inputs(2, 12, 2, 4, 3, 9 * 4, gen)
    low = {n: t.bfloat16() for n, t in inputs.items()}
    o, S = bidirectional_linear_attention(**low, window=(3, 4, 3), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.bfloat16
    want, _ = naive_bidirectional_linear_attention(
        **{n: t.float() for n, t in low.items()}, window=(3, 4, 3))
    assert rel_rms_error(o.float(), want) <= 1e-2


def test_contract_violations_and_backends_are_named():
    q = k = torch.randn(1, 6, 2, 3)
    v = torch.randn(1, 6, 2, 4)
    with pytest.raises(RuntimeInputError, match="q must be"):
        bidirectional_linear_attention(torch.randn(1, 6, 2, 2), k, v)
    with pytest.raises(RuntimeInputError, match="gate"):
        bidirectional_linear_attention(q, k, v, gate=torch.randn(1, 6, 2, 3))
    with pytest.raises(RuntimeInputError, match="odd size"):
        bidirectional_linear_attention(q, k, v, window=(2, 3, 2))
    with pytest.raises(RuntimeInputError, match="does not hold"):
        bidirectional_linear_attention(q, k, v, window=(2, 2, 3))
    with pytest.raises(RuntimeInputError, match=r"\[1, 2, 27, 4\]"):
        bidirectional_linear_attention(q, k, v, window=(2, 3, 3),
                                       initial_state=torch.zeros(1, 2, 3, 4))
    with pytest.raises(ttt2la.UnsupportedTTTError, match="no Triton kernel"):
        bidirectional_linear_attention(q, k, v, backend="triton")
    with pytest.raises(RuntimeInputError, match="backend"):
        bidirectional_linear_attention(q, k, v, backend="cuda")
