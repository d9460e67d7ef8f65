"""The chunked delta rule against a hand-written token-by-token recurrence (sharing no code with
the package): outputs, final state and the gradients of every input, fp32 within 1e-5 of the
float64 recurrence; and its dispatched op count, which grows only with the depth of the
log-depth scan over chunks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ttt2la.errors import ConversionError
from ttt2la.runtime import delta_rule, matrix_affine_scan, naive_delta_rule
from ttt2la.testing import TOLERANCE, CountOps, outputs_and_grads, rel_rms_error


def hand_delta_rule(q, k, v, beta, *, decay=None, chunk_size=None, initial_state=None,
                    output_final_state=False, order="inclusive"):
    """``W ← α W``, then one step ``W ← W − β kᵀ(k W − v)`` per token; read ``q W`` after the
    step (inclusive) or before the token (exclusive)."""
    B, T, H, Dk = k.shape
    W = (torch.zeros(B, H, Dk, v.shape[-1], dtype=v.dtype) if initial_state is None
         else initial_state)
    outs = []
    for t in range(T):
        read_before = (q[:, t].unsqueeze(-2) @ W).squeeze(-2)
        if decay is not None:
            W = W * decay[:, t][:, :, None, None]
        kt = k[:, t].unsqueeze(-2)  # [B, H, 1, Dk]
        residual = kt @ W - v[:, t].unsqueeze(-2)  # [B, H, 1, Dv]
        W = W - beta[:, t][:, :, None, None] * (kt.mT @ residual)
        read_after = (q[:, t].unsqueeze(-2) @ W).squeeze(-2)
        outs.append(read_before if order == "exclusive" else read_after)
    return torch.stack(outs, dim=1), (W if output_final_state else None)


OPTION_TENSORS = ("decay", "initial_state")


def make_case(seed, *, B, T, H, Dk, Dv, C, decay, initial_state, order, scan, dtype):
    """Keys of norm at most 1 and steps β in (0, 1): each token's map ``I − β kᵀk`` contracts,
    the regime the delta rule runs in (a larger step diverges in any form)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(rand(B, T, H, Dk), dim=-1)
    k = k * (0.3 + 0.7 * torch.rand(B, T, H, 1, generator=g, dtype=torch.float64))
    tensors = tuple(x.to(dtype) for x in (rand(B, T, H, Dk), k, rand(B, T, H, Dv),
                                          torch.sigmoid(rand(B, T, H))))
    options = dict(
        chunk_size=C, order=order, scan=scan,
        decay=torch.sigmoid(rand(B, T, H) + 2).to(dtype) if decay else None,  # ~0.3 .. 1
        initial_state=rand(B, H, Dk, Dv).to(dtype) if initial_state else None)
    return tensors, options


def run(fn, tensors, options, final, seed, cotangent_dtype):
    o, state, grads = outputs_and_grads(fn, tensors, options, output_final_state=final,
                                        seed=seed, cotangent_dtype=cotangent_dtype)
    names = ["q", "k", "v", "beta"] + [n for n in OPTION_TENSORS if options.get(n) is not None]
    return o, state, dict(zip(names, [gr for _, gr in grads.values()]))


def assert_matches_hand_loop(tensors, options, final, seed):
    dtype = tensors[0].dtype
    tol = TOLERANCE[dtype]
    o, state, grads = run(lambda *a, **kw: delta_rule(*a, backend="torch", **kw),
                          tensors, options, final, seed, dtype)
    as64 = lambda x: x.to(torch.float64) if isinstance(x, torch.Tensor) else x  # noqa: E731
    ref_options = {n: as64(x) for n, x in options.items() if n != "scan"}
    o_ref, state_ref, grads_ref = run(hand_delta_rule, [as64(t) for t in tensors], ref_options,
                                      final, seed, dtype)
    assert o.dtype == dtype and o.shape == o_ref.shape and torch.isfinite(o).all()
    assert rel_rms_error(o, o_ref) <= tol, ("output", rel_rms_error(o, o_ref))
    if final:
        assert state.dtype == dtype
        assert rel_rms_error(state, state_ref) <= tol, ("final", rel_rms_error(state, state_ref))
    assert grads.keys() == grads_ref.keys()
    for name, gr in grads.items():
        assert gr.dtype == dtype
        err = rel_rms_error(gr, grads_ref[name])
        assert err <= tol, (f"grad {name}", err)


case = st.fixed_dictionaries(dict(
    B=st.integers(1, 2), H=st.integers(1, 3), Dk=st.integers(1, 9), Dv=st.integers(1, 9),
    C=st.integers(1, 8), decay=st.booleans(), initial_state=st.booleans(), final=st.booleans(),
    order=st.sampled_from(["inclusive", "exclusive"]),
    scan=st.sampled_from(["pairwise", "sequential"]), seed=st.integers(0, 2**31 - 1),
    t_frac=st.floats(0.0, 1.0)))


def _draw(c, dtype):
    T = 1 + round(c["t_frac"] * (5 * c["C"] + 6))  # 1 .. 5·C + 7
    return make_case(c["seed"], B=c["B"], T=T, H=c["H"], Dk=c["Dk"], Dv=c["Dv"], C=c["C"],
                     decay=c["decay"], initial_state=c["initial_state"], order=c["order"],
                     scan=c["scan"], dtype=dtype)


@settings(max_examples=80, deadline=None)
@given(c=case)
def test_chunked_matches_the_token_loop_fp32(c):
    tensors, options = _draw(c, torch.float32)
    assert_matches_hand_loop(tensors, options, c["final"], c["seed"])


@settings(max_examples=25, deadline=None)
@given(c=case)
def test_chunked_matches_the_token_loop_float64(c):
    tensors, options = _draw(c, torch.float64)
    assert_matches_hand_loop(tensors, options, c["final"], c["seed"])


@settings(max_examples=25, deadline=None)
@given(c=case)
def test_naive_reference_matches_the_hand_written_loop(c):
    tensors, options = _draw(c, torch.float64)
    options.pop("scan")
    got = run(naive_delta_rule, tensors, options, True, c["seed"], torch.float64)
    exact = run(hand_delta_rule, tensors, options, True, c["seed"], torch.float64)
    assert rel_rms_error(got[0], exact[0]) <= TOLERANCE[torch.float64]
    assert rel_rms_error(got[1], exact[1]) <= TOLERANCE[torch.float64]
    for name, gr in got[2].items():
        assert rel_rms_error(gr, exact[2][name]) <= TOLERANCE[torch.float64], name


@pytest.mark.parametrize("T,C", [(1, 4), (4, 4), (5, 4), (8, 4), (3, 64), (27, 8), (27, 1)])
@pytest.mark.parametrize("decay", [False, True])
def test_edge_lengths(T, C, decay):
    """T < C, T = C, T = C + 1, T = 2C, ragged, one token per chunk; Dk ≠ Dv."""
    tensors, options = make_case(T * C + 1, B=2, T=T, H=2, Dk=6, Dv=5, C=C, decay=decay,
                                 initial_state=True, order="inclusive", scan="pairwise",
                                 dtype=torch.float32)
    assert_matches_hand_loop(tensors, options, True, T * C)


def test_a_realistic_chunk_in_fp32():
    """64-token chunks of 32 features, decay, two chunks and a ragged tail: the size at which
    the triangular solve and the decay masks meet fp32 rounding (measured ~2e-7, as the token
    loop in fp32)."""
    tensors, options = make_case(17, B=1, T=150, H=1, Dk=32, Dv=24, C=64, decay=True,
                                 initial_state=True, order="exclusive", scan="pairwise",
                                 dtype=torch.float32)
    assert_matches_hand_loop(tensors, options, True, 17)


def test_chunk_size_and_scan_do_not_change_the_result():
    tensors, options = make_case(3, B=1, T=50, H=2, Dk=4, Dv=3, C=4, decay=True,
                                 initial_state=True, order="inclusive", scan="pairwise",
                                 dtype=torch.float64)
    options.pop("chunk_size")
    options.pop("scan")
    results = [delta_rule(*tensors, chunk_size=C, scan=scan, output_final_state=True, **options)
               for C in (1, 7, 16, 64) for scan in ("pairwise", "sequential")]
    for o, state in results[1:]:
        assert rel_rms_error(o, results[0][0]) <= TOLERANCE[torch.float64]
        assert rel_rms_error(state, results[0][1]) <= TOLERANCE[torch.float64]


def test_matrix_affine_scan_against_a_loop():
    """Every length from 1 to 19 (odd lengths pad the pairwise levels), with a batch axis."""
    g = torch.Generator().manual_seed(5)
    for n in range(1, 20):
        A = torch.randn(3, n, 4, 4, generator=g, dtype=torch.float64) / 2
        B = torch.randn(3, n, 4, 2, generator=g, dtype=torch.float64)
        S0 = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
        S, expected = S0, []
        for j in range(n):
            S = torch.einsum("bij,bjv->biv", A[:, j], S) + B[:, j]
            expected.append(S)
        got = matrix_affine_scan(A, B, S0)
        assert rel_rms_error(got, torch.stack(expected, dim=1)) <= TOLERANCE[torch.float64], n


def _count(n_chunks, scan):
    C = 2
    tensors, options = make_case(0, B=1, T=n_chunks * C, H=1, Dk=3, Dv=2, C=C, decay=True,
                                 initial_state=True, order="inclusive", scan=scan,
                                 dtype=torch.float32)
    leaves = [t.requires_grad_() for t in tensors]
    options["decay"].requires_grad_()
    with CountOps() as counter:
        o, state = delta_rule(*leaves, output_final_state=True, **options)
        (o.sum() + state.sum()).backward()
    return counter.count


def test_op_count_grows_only_with_the_scan_depth():
    """Forward + backward: 16 → 256 chunks adds log₂(256/16) = 4 levels of the pairwise scan,
    each costing what one level costs from 16 to 32 chunks; a per-chunk loop would not fit."""
    c16, c32, c256 = (_count(n, "pairwise") for n in (16, 32, 256))
    per_level = c32 - c16
    assert 0 < per_level < c16 / 2
    assert c256 <= c16 + (math.log2(256) - math.log2(16)) * per_level, (c16, c32, c256)
    # the sequential scan's count grows with the number of chunks: the bound above would catch it
    s16, s256 = _count(16, "sequential"), _count(256, "sequential")
    assert s256 > s16 + 4 * per_level


def test_contract_errors_are_conversion_errors():
    q = torch.randn(1, 5, 2, 3)
    v = torch.randn(1, 5, 2, 4)
    beta = torch.rand(1, 5, 2)
    bad = [dict(beta=torch.rand(1, 5, 3)), dict(decay=torch.rand(1, 4, 2)),
           dict(initial_state=torch.randn(1, 2, 4, 3)), dict(order="full"), dict(chunk_size=0),
           dict(scan="doubling"), dict(backend="triton")]
    for change in bad:
        args = dict(beta=beta)
        args.update(change)
        b = args.pop("beta")
        with pytest.raises(ConversionError, match="delta_rule"):
            delta_rule(q, q, v, b, **args)
