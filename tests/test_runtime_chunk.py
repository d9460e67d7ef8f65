"""The token-causal chunked op against a hand-written token-by-token recurrence: outputs, final
state and gradients (the reference shares no code with the package), fp32 within 1e-5 of the
float64 recurrence, bf16 within 2e-2."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ttt2la.errors import ConversionError

from ttt2la.runtime import (chunk_linear_attention, implementation_name,
                            naive_chunk_linear_attention)
from ttt2la.testing import TOLERANCE, CountOps, outputs_and_grads, rel_rms_error


def hand_recurrence(q, k, v, *, chunk_size=None, log_decay=None, scale=None, initial_state=None,
                    output_final_state=False):
    """``S_t = exp(g_t) S_{t-1} + k_tᵀ v_t``, ``o_t = scale · q_t S_t``, token by token."""
    B, T, H, Dk = k.shape
    S = (torch.zeros(B, H, Dk, v.shape[-1], dtype=v.dtype) if initial_state is None
         else initial_state)
    outs = []
    for t in range(T):
        if log_decay is not None:   # one factor per head, or per key channel (a row of S)
            S = S * log_decay[:, t].exp().reshape(B, H, -1, 1)
        S = S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    o = torch.stack(outs, dim=1)
    return (o if scale is None else scale * o), (S if output_final_state else None)

TENSOR_OPTIONS = ("log_decay", "initial_state")
DECAY_SHAPE = {True: lambda B, T, H, Dk: (B, T, H), "head": lambda B, T, H, Dk: (B, T, H),
               "channel": lambda B, T, H, Dk: (B, T, H, Dk)}


def make_case(seed, *, B, T, H, Dk, Dv, C, decay, scale, initial_state, dtype):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    tensors = tuple(x.to(dtype) for x in (rand(B, T, H, Dk), rand(B, T, H, Dk), rand(B, T, H, Dv)))
    options = dict(
        chunk_size=C, scale=scale,
        # log-sigmoid of a normal: decays between ~0.05 and ~1, as gated linear attention uses;
        # per head, or per key channel (GLA)
        log_decay=(torch.nn.functional.logsigmoid(rand(*DECAY_SHAPE[decay](B, T, H, Dk)) + 2)
                   .to(dtype) if decay else None),
        initial_state=rand(B, H, Dk, Dv).to(dtype) if initial_state else None,
    )
    return tensors, options


def run_with_grads(fn, tensors, options, output_final_state, seed, cotangent_dtype):
    """Outputs, final state and gradients of every tensor input w.r.t. a random projection."""
    o, final, grads = outputs_and_grads(fn, tensors, options, output_final_state=output_final_state,
                                        seed=seed, cotangent_dtype=cotangent_dtype)
    return o, final, [gr for _, gr in grads.values()]


def assert_matches_reference(tensors, options, output_final_state, seed):
    dtype = tensors[0].dtype
    tol = TOLERANCE[dtype]
    as64 = lambda x: x.to(torch.float64) if isinstance(x, torch.Tensor) else x  # noqa: E731
    o, final, grads = run_with_grads(
        lambda *a, **k: chunk_linear_attention(*a, backend="torch", **k),
        tensors, options, output_final_state, seed, dtype)
    o_ref, final_ref, grads_ref = run_with_grads(
        hand_recurrence, [as64(t) for t in tensors],
        {k: as64(v) for k, v in options.items()}, output_final_state, seed, dtype)
    assert o.dtype == dtype and o.shape == o_ref.shape and torch.isfinite(o).all()
    assert rel_rms_error(o, o_ref) < tol, ("output", rel_rms_error(o, o_ref))
    if output_final_state:
        assert final.dtype == dtype
        err = rel_rms_error(final, final_ref)
        assert err < tol, ("final_state", err)
    names = ["q", "k", "v"] + [k for k in TENSOR_OPTIONS if options[k] is not None]
    for name, gr, gr_ref in zip(names, grads, grads_ref):
        assert gr.dtype == dtype
        assert rel_rms_error(gr, gr_ref) < tol, (f"grad {name}", rel_rms_error(gr, gr_ref))


case = st.fixed_dictionaries(dict(
    B=st.integers(1, 2), H=st.integers(1, 3), Dk=st.integers(1, 9), Dv=st.integers(1, 9),
    C=st.integers(1, 8), decay=st.sampled_from([False, "head", "channel"]),
    scale=st.sampled_from([None, 0.37]),
    initial_state=st.booleans(), final=st.booleans(), seed=st.integers(0, 2**31 - 1),
    t_frac=st.floats(0.0, 1.0)))


def _draw(c, dtype):
    T = 1 + round(c["t_frac"] * (5 * c["C"] + 6))  # 1 .. 5·C + 7
    return make_case(c["seed"], B=c["B"], T=T, H=c["H"], Dk=c["Dk"], Dv=c["Dv"], C=c["C"],
                     decay=c["decay"], scale=c["scale"], initial_state=c["initial_state"],
                     dtype=dtype)


@settings(max_examples=100, deadline=None)
@given(c=case)
def test_random_shapes_and_options_fp32(c):
    tensors, options = _draw(c, torch.float32)
    assert_matches_reference(tensors, options, c["final"], c["seed"])


@settings(max_examples=50, deadline=None)
@given(c=case)
def test_random_shapes_and_options_bf16(c):
    tensors, options = _draw(c, torch.bfloat16)
    assert_matches_reference(tensors, options, c["final"], c["seed"])


@settings(max_examples=40, deadline=None)
@given(c=case)
def test_naive_reference_matches_the_hand_written_recurrence(c):
    tensors, options = _draw(c, torch.float64)
    got = outputs_and_grads(naive_chunk_linear_attention, tensors, options,
                            output_final_state=True, seed=c["seed"], cotangent_dtype=torch.float64)
    exact = outputs_and_grads(hand_recurrence, tensors, options, output_final_state=True,
                              seed=c["seed"], cotangent_dtype=torch.float64)
    assert rel_rms_error(got[0], exact[0]) <= TOLERANCE[torch.float64]
    assert rel_rms_error(got[1], exact[1]) <= TOLERANCE[torch.float64]
    for name, (_, gr) in got[2].items():
        assert rel_rms_error(gr, exact[2][name][1]) <= TOLERANCE[torch.float64], name


@pytest.mark.parametrize("T,C", [(1, 4), (4, 4), (5, 4), (8, 4), (3, 64), (37, 8)])
@pytest.mark.parametrize("decay", [False, "head", "channel"])
def test_edge_lengths_against_reference(T, C, decay):
    """T < C, T = C, T = C + 1, T = 2C, ragged, with a non-power-of-two feature size."""
    tensors, options = make_case(T * C, B=2, T=T, H=2, Dk=6, Dv=5, C=C, decay=decay, scale=0.5,
                                 initial_state=True, dtype=torch.float32)
    assert_matches_reference(tensors, options, True, T * C)


def test_strong_decay_over_a_long_sequence():
    """Decay products far below float64's range, within and across chunks, stay exact and finite.

    Over 4096 tokens with log-decays around -1.5, the product over the sequence is ~e^-6000
    and within one 64-token chunk ~e^-96 (below fp32's smallest number): a form that divides
    cumulative products, or exponentiates positive cumulative log-decays, breaks here.
    """
    B, T, H, D, C = 1, 4096, 2, 4, 64
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    log_decay = -1.0 - torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, D, D, generator=g)
    o, final = chunk_linear_attention(q, k, v, chunk_size=C, log_decay=log_decay,
                                      initial_state=s0, output_final_state=True)
    o_ref, final_ref = hand_recurrence(
        q.double(), k.double(), v.double(), log_decay=log_decay.double(), initial_state=s0.double(),
        output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms_error(o, o_ref) < TOLERANCE[torch.float32]
    assert rel_rms_error(final, final_ref) < TOLERANCE[torch.float32]


#: Log decays per key channel whose chunks take each path of ``channel_decay``: mild (factored
#: over the chunk), medium (sub-chunks, each factored), strong (sub-chunks, exact inside).
CHANNEL_STRENGTHS = {"mild": (0.01, []), "medium": (0.3, ["_sub_chunked", "_factored"]),
                     "steep": (0.8, ["_sub_chunked", "_factored"]),
                     "strong": (3.0, ["_sub_chunked", "_exact"])}


@pytest.mark.parametrize("rate,tiles,short", [
    (0.01, (64, 16), (10, 10)), (0.3, (64, 16), (10, 10)), (0.7, (32, 8), (10, 10)),
    (0.9, (32, 8), (16, 8)), (1.5, (32, 4), (12, 4)), (3.0, (32, 4), (12, 4))])
def test_sub_chunks_shrink_until_their_decay_factors(rate, tiles, short):
    """The largest sub-chunk over which no channel decays by more than e^-8 (16, 8 or 4
    tokens), chunks of 32 tokens when shorter than 16; exact sub-chunks of 4 beyond. Ten
    tokens are one sub-chunk where that is mild, else shrink the same way."""
    from ttt2la.runtime.channel_decay import tiles as chosen
    g = torch.full((1, 256, 2, 3), -rate)
    assert chosen(g, 64) == tiles
    assert chosen(g[:, :10], 64) == short


@pytest.mark.parametrize("strength", list(CHANNEL_STRENGTHS))
@pytest.mark.parametrize("T,C", [(64, 64), (150, 64), (97, 32), (40, 20), (13, 64)])
def test_decay_per_channel_takes_each_path_exactly(T, C, strength, monkeypatch):
    """Every path of the per-channel algorithm against the token-by-token recurrence (fp32
    within 1e-5 of float64, gradients included); a spy confirms the path taken."""
    import ttt2la.runtime.channel_decay as channel_decay
    rate, path = CHANNEL_STRENGTHS[strength]
    called = []
    for name in ("_factored", "_sub_chunked", "_exact"):
        fn = getattr(channel_decay, name)
        monkeypatch.setattr(channel_decay, name,
                            lambda *a, _fn=fn, _name=name: called.append(_name) or _fn(*a))
    tensors, options = make_case(T + C, B=2, T=T, H=2, Dk=6, Dv=5, C=C, decay=False, scale=None,
                                 initial_state=True, dtype=torch.float32)
    g = torch.Generator().manual_seed(T)
    options["log_decay"] = -rate * torch.rand(2, T, 2, 6, generator=g) * 2
    assert_matches_reference(tensors, options, True, T)
    if T >= 32 or strength == "mild":
        assert sorted(set(called)) == sorted(path), called


def test_strong_decay_per_channel_over_a_long_sequence():
    """As the per-head test below: log decays per channel from -0.001 to -40 (one channel nearly
    constant, one forgetting at once) stay exact and finite over 2048 tokens."""
    B, T, H, D = 1, 2048, 2, 5
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    log_decay = -torch.logspace(-3, 1.6, D) * torch.rand(B, T, H, D, generator=g)
    o, final = chunk_linear_attention(q, k, v, log_decay=log_decay, output_final_state=True)
    o_ref, final_ref = hand_recurrence(q.double(), k.double(), v.double(),
                                       log_decay=log_decay.double(), output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    assert rel_rms_error(o, o_ref) < TOLERANCE[torch.float32]
    assert rel_rms_error(final, final_ref) < TOLERANCE[torch.float32]


def test_chunk_size_does_not_change_the_result():
    tensors, options = make_case(5, B=1, T=50, H=2, Dk=3, Dv=7, C=1, decay=True, scale=None,
                                 initial_state=True, dtype=torch.float64)
    per_channel = options["log_decay"].unsqueeze(-1).expand(1, 50, 2, 3) * torch.rand(3)
    for decay in (options["log_decay"], per_channel):
        outs = [chunk_linear_attention(*tensors, **(options | dict(chunk_size=C, log_decay=decay)),
                                       output_final_state=True) for C in (1, 7, 16, 50, 64)]
        for o, final in outs[1:]:
            assert rel_rms_error(o, outs[0][0]) < TOLERANCE[torch.float64]
            assert rel_rms_error(final, outs[0][1]) < TOLERANCE[torch.float64]


def test_scale_defaults_to_one():
    tensors, options = make_case(2, B=1, T=9, H=1, Dk=4, Dv=4, C=4, decay=False, scale=None,
                                 initial_state=False, dtype=torch.float64)
    o_default, _ = chunk_linear_attention(*tensors, **options)
    o_one, _ = chunk_linear_attention(*tensors, **(options | dict(scale=1.0)))
    q, k, v = tensors
    expected = torch.stack([torch.einsum("bhk,bshk,bshv->bhv", q[:, t], k[:, :t + 1], v[:, :t + 1])
                            for t in range(q.shape[1])], dim=1)
    torch.testing.assert_close(o_default, o_one)
    torch.testing.assert_close(o_default, expected)


def test_named_for_the_report():
    tensors, options = make_case(3, B=1, T=4, H=1, Dk=2, Dv=2, C=2, decay=True, scale=None,
                                 initial_state=False, dtype=torch.float32)
    assert implementation_name("chunk", *tensors, **options) == "torch.chunk"
    assert implementation_name("chunk", *tensors, backend="naive",
                               **options) == "naive.chunk(recurrent)"


@pytest.mark.parametrize("bad", [
    dict(chunk_size=0),
    dict(log_decay=torch.zeros(1, 6, 2)),
    dict(log_decay=torch.zeros(1, 6, 1, 3)),
    dict(initial_state=torch.zeros(1, 1, 3, 2)),
])
def test_malformed_arguments_raise_conversion_errors(bad):
    x = torch.randn(1, 6, 1, 2)
    with pytest.raises(ConversionError):
        chunk_linear_attention(x, x, x, **bad)





def ops_for(chunks, decay):
    B, H, D, C = 1, 2, 3, 2
    T = chunks * C
    x = [torch.randn(B, T, H, D, requires_grad=True) for _ in range(3)]
    shape = (B, T, H, D) if decay == "channel" else (B, T, H)
    g = (torch.nn.functional.logsigmoid(torch.randn(shape)).requires_grad_() if decay
         else None)
    with CountOps() as counter:
        o, final = chunk_linear_attention(x[0], x[1], x[2], chunk_size=C, log_decay=g,
                                          output_final_state=True, backend="torch")
        (o.sum() + final.sum()).backward()
    return counter.count


@pytest.mark.parametrize("decay", [False, "head", "channel"])
def test_dispatched_ops_grow_at_most_logarithmically_with_chunks(decay):
    """16 → 256 → 4096 chunks: one more level of the log-depth state scan per 16×, nothing more
    (a loop over chunks would add at least 240, then 3840 ops)."""
    c16, c256, c4096 = (ops_for(n, decay) for n in (16, 256, 4096))
    assert c256 - c16 < 240, (c16, c256)
    assert c4096 - c256 <= c256 - c16 + 8, (c16, c256, c4096)
