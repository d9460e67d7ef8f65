"""The chunk-parallel executors against hand-written references: outputs, final states, gradients.

Every body is traced once per shape (the stream sources are unused placeholders, so the length
varies freely) and run by ``execute`` under the recurrent schedule and each schedule the checker
allows. The reference is not the project's own recurrent executor: every body's update is
written again below by hand (``REFERENCE``, its own literal constants) and run by a plain loop
over the raw sequences (no padding, no chunk axis), so it shares no code with ttt2la's
executors, chunking or runtime. It runs in float64; the executors run in fp32 and must be within
1e-5 of it (with Newton–Schulz, within the precision criterion of docs/testing.md). Bodies are
written in several styles: ``x@W`` and ``W@x``, hand-written gradients and ``torch.func.grad``,
per-chunk and per-token streams.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import module_scoped
import torch
from hypothesis import example, given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ttt2la.analysis import analyze
from ttt2la.errors import NonReducibleError, UnsupportedTTTError
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import chunk_streams, execute, lower, padding_problem
from ttt2la.testing import TOLERANCE, assert_no_worse_than_original, rel_rms_error
from references import ref_ns3

TOL = TOLERANCE[torch.float32]


# -- bodies ------------------------------------------------------------------------------------

def additive_xw(W, k, v, q, lr, inclusive):
    """W' = W + kᵀ(η⊙v); o = q·W (or q·W')."""
    W2 = W + k.transpose(-1, -2) @ (lr * v)
    return (W2,), (q @ (W2 if inclusive else W),)


def additive_wx(W, k, v, q, lr, inclusive):
    """The same rule with W stored transposed: W' = W + (η⊙v)ᵀk; o = q·Wᵀ."""
    W2 = W + (v * lr).transpose(1, 2) @ k
    return (W2,), (torch.matmul(q, (W2 if inclusive else W).transpose(1, 2)),)


def newton_schulz(G, steps=3):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(-1, -2)
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X


def momentum_muon(W, M, k, v, q, lr, beta, inclusive):
    """M' = β⊙M + kᵀ(η⊙v); W' = W + NS5(M') — momentum and Muon (β a loop invariant)."""
    M2 = beta * M + k.transpose(-1, -2) @ (lr * v)
    W2 = W + newton_schulz(M2)
    return (W2, M2), (q @ (W2 if inclusive else W),)


def momentum_chunk_gate(W, M, k, v, q, g, inclusive):
    """M' = mean_chunk(σ(g))·M + kᵀv — LaCT's per-chunk momentum gate."""
    alpha = torch.sigmoid(g).mean(dim=1, keepdim=True)
    M2 = alpha * M + k.transpose(-1, -2) @ v
    W2 = W + M2
    return (W2, M2), (q @ (W2 if inclusive else W),)


def weight_norm(W, k, v, q, n0, inclusive):
    """W' = Norm(W + kᵀv)·n₀: each column back to its initial norm (semi-parallel)."""
    U = W + k.transpose(-1, -2) @ v
    W2 = U / U.norm(dim=-2, keepdim=True) * n0
    return (W2,), (q @ (W2 if inclusive else W),)


def delta_rule(W, k, v, q, lr, inclusive):
    """A gradient step on an MSE binding loss (torch.func.grad): W' = W − kᵀ(η⊙(kW−v))."""
    def loss(W_):
        return 0.5 * (lr * (k @ W_ - v) ** 2).sum()
    W2 = W - torch.func.grad(loss)(W)
    return (W2,), (q @ (W2 if inclusive else W),)


def gated_per_token(W, k, v, q, g, inclusive):
    """Per-token gated linear attention: W' = σ(g_t)⊙W + k_tᵀv_t; o_t = q_t·W'."""
    W2 = torch.sigmoid(g)[:, None, None] * W + k.unsqueeze(-1) * v.unsqueeze(-2)
    return (W2,), ((q.unsqueeze(-2) @ (W2 if inclusive else W)).squeeze(-2),)


def make_program(kind: str, B: int, d: int, C: int, inclusive: bool, last_chunk: str):
    """``kind`` traced at batch ``B``, width ``d``, chunk ``C`` (the length is free)."""
    return dataclasses.replace(_traced(kind, B, d, C, inclusive), last_chunk=last_chunk)


@module_scoped.cached
def _traced(kind: str, B: int, d: int, C: int, inclusive: bool):
    last_chunk = "update"
    g = torch.Generator().manual_seed(B * 100 + d * 10 + C)
    r = lambda *s: torch.randn(*s, generator=g)
    L = 2 * C
    seq = dict(k=r(B, L, d), v=r(B, L, d), q=r(B, L, d))
    order = "inclusive" if inclusive else "exclusive"
    common = dict(chunk_size=C, order=order, last_chunk=last_chunk)
    W0 = r(B, d, d) * 0.1
    per_chunk_lr = dict(seq, lr=torch.rand(B, L, 1, generator=g))
    if kind == "additive_xw":
        body = lambda W, k, v, q, lr: additive_xw(W, k, v, q, lr, inclusive)
        return program_from_body(body, states=dict(W=W0), streams=per_chunk_lr, **common)
    if kind == "additive_wx":
        body = lambda W, k, v, q, lr: additive_wx(W, k, v, q, lr, inclusive)
        return program_from_body(body, states=dict(W=W0), streams=per_chunk_lr, **common)
    if kind == "momentum_muon":
        body = lambda W, M, k, v, q, lr, beta: momentum_muon(W, M, k, v, q, lr, beta, inclusive)
        return program_from_body(body, states=dict(W=W0, M=torch.zeros_like(W0)),
                                 streams=per_chunk_lr,
                                 invariants=dict(beta=torch.rand(B, 1, 1, generator=g)), **common)
    if kind == "momentum_chunk_gate":
        body = lambda W, M, k, v, q, g_: momentum_chunk_gate(W, M, k, v, q, g_, inclusive)
        return program_from_body(body, states=dict(W=W0, M=r(B, d, d) * 0.1),
                                 streams=dict(seq, g=r(B, L, 1)), **common)
    if kind == "weight_norm":
        body = lambda W, k, v, q, n0: weight_norm(W, k, v, q, n0, inclusive)
        return program_from_body(body, states=dict(W=W0), streams=seq,
                                 invariants=dict(n0=W0.norm(dim=-2, keepdim=True)), **common)
    if kind == "delta_rule":
        body = lambda W, k, v, q, lr: delta_rule(W, k, v, q, lr, inclusive)
        return program_from_body(body, states=dict(W=W0), streams=per_chunk_lr, **common)
    if kind == "gated_per_token":
        body = lambda W, k, v, q, g_: gated_per_token(W, k, v, q, g_, inclusive)
        streams = dict(k=r(B, L, d), v=r(B, L, d), q=r(B, L, d), g=r(B, L))
        return program_from_body(body, states=dict(W=W0), streams=streams, per_token=True,
                                 output_axes=[1], **common)
    raise KeyError(kind)


EXPECTED_SCHEDULE = {
    "additive_xw": "parallel", "additive_wx": "parallel", "momentum_muon": "parallel",
    "momentum_chunk_gate": "parallel", "weight_norm": "semi-parallel",
    "delta_rule": "semi-parallel", "gated_per_token": "parallel",
}


def inputs_for(program, L: int, seed: int):
    """Initial states and invariants at length ``L`` (stream sources resized), requiring grad."""
    g = torch.Generator().manual_seed(seed)
    states0 = [(torch.randn(s.shape, generator=g) * 0.3).requires_grad_() for s in program.states]
    sources = {s.source: s for s in program.streams}
    invariants = []
    for i, spec in enumerate(program.invariants):
        shape = list(spec.shape)
        if i in sources:
            shape[sources[i].axis] = L
        x = torch.randn(shape, generator=g)
        if spec.name in ("lr_seq", "beta"):
            x = x.abs() * 0.5
        if spec.name == "n0":
            x = x.abs() + 0.5
        invariants.append(x.requires_grad_())
    return states0, invariants


# -- hand-written references -------------------------------------------------------------------
# One chunk's update of each body, (states, chunk, invariants) -> new states, and its read
# q -> y; written from the bodies' docstrings, sharing no code with the bodies or with ttt2la.


def _outer(k, u):
    """Σ_t k_tᵀ u_t over the chunk's tokens, [B, C, d] x [B, C, e] -> [B, d, e], as a loop."""
    return sum(k[:, t, :, None] * u[:, t, None, :] for t in range(k.shape[1]))


def _ref_delta(W, k, v, lr):
    residual = torch.einsum("bcd,bde->bce", k, W) - v
    return W - _outer(k, lr * residual)


REFERENCE = {
    "additive_xw": (lambda W, k, v, q, lr: (W + _outer(k, lr * v),),
                    lambda W, q: q @ W),
    "additive_wx": (lambda W, k, v, q, lr: (W + _outer(lr * v, k),),
                    lambda W, q: q @ W.transpose(1, 2)),
    "momentum_muon": (lambda W, M, k, v, q, lr, beta: (
        W + ref_ns3(beta * M + _outer(k, lr * v)), beta * M + _outer(k, lr * v)),
        lambda W, q: q @ W),
    "momentum_chunk_gate": (lambda W, M, k, v, q, g: (
        W + torch.sigmoid(g).mean(dim=1, keepdim=True) * M + _outer(k, v),
        torch.sigmoid(g).mean(dim=1, keepdim=True) * M + _outer(k, v)),
        lambda W, q: q @ W),
    "weight_norm": (lambda W, k, v, q, n0: (
        (W + _outer(k, v)) / torch.sqrt(((W + _outer(k, v)) ** 2).sum(-2, keepdim=True)) * n0,),
        lambda W, q: q @ W),
    "delta_rule": (lambda W, k, v, q, lr: (_ref_delta(W, k, v, lr),),
                   lambda W, q: q @ W),
    "gated_per_token": (lambda W, k, v, q, g: (
        1 / (1 + torch.exp(-g))[:, None, None] * W + k[:, :, None] * v[:, None, :],),
        lambda W, q: torch.einsum("bd,bde->be", q, W)),
}


def reference_loop(kind, program, states0, invariants, *, C, inclusive, last_chunk):
    """``(outputs, finals)`` of ``kind`` by a plain loop over chunks of ``C`` raw tokens (per
    token for ``gated_per_token``); the last chunk's update is kept only when it is ``update``."""
    named = {spec.name: x for spec, x in zip(program.invariants, invariants)}
    seqs = {n[:-len("_seq")]: x for n, x in named.items() if n.endswith("_seq")}
    inv = {n: x for n, x in named.items() if not n.endswith("_seq")}
    per_token = kind == "gated_per_token"
    L = seqs["k"].shape[1]
    starts = list(range(0, L, 1 if per_token else C))
    step, read = REFERENCE[kind]
    states, ys = list(states0), []
    for j, s in enumerate(starts):
        chunk = {n: (x[:, s] if per_token else x[:, s:s + C]) for n, x in seqs.items()}
        new = step(*states, **chunk, **inv)
        ys.append(read(new[0] if inclusive else states[0], chunk["q"]))
        if j < len(starts) - 1 or last_chunk == "update":
            states = list(new)
    return [torch.stack(ys, 1) if per_token else torch.cat(ys, 1)], states


def outputs_finals_grads(fn, states0, invariants):
    """``fn(states0, invariants) -> (outputs, finals)`` and the gradients of every input
    w.r.t. a fixed random projection of outputs and finals (zeros where unused)."""
    outputs, finals = fn(states0, invariants)
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
               for t in outputs + finals]
    loss = sum((w * t).sum() for w, t in zip(weights, outputs + finals))
    grads = torch.autograd.grad(loss, states0 + invariants, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr
             for gr, x in zip(grads, states0 + invariants)]
    return outputs, finals, grads


def _as64(xs):
    return [x.detach().double().requires_grad_() for x in xs]


#: Inputs the Newton–Schulz criterion takes medians over here: more than ``CRITERION_SAMPLES``,
#: because these bodies' chunks are often shorter than their features, and Newton–Schulz on a
#: rank-deficient update makes one input's error heavy-tailed. Measured on one such shape (d = 5,
#: C = 3) over 200 inputs: the parallel schedule's median error is 0.96x the fp32 loop's, yet one
#: window of 5 inputs in 40 put the median over the bound; no window of 9 in 22 did.
MUON_SAMPLES = 9


def assert_matches_reference(kind, program, L, seed=0, *, C, inclusive, last_chunk):
    """Both the recurrent and the chosen schedule equal the hand-written float64 loop: within
    1e-5 in fp32, or, with Newton–Schulz, within 2x the fp32 loop's own error plus 1e-6 — as
    medians over ``MUON_SAMPLES`` inputs, since one input's rounding error is a random draw
    (``assert_no_worse_than_original``). Returns the analysis and the float64 loop's results on
    the first input."""
    analysis = analyze(program)
    loop = functools.partial(reference_loop, kind, program, C=C, inclusive=inclusive,
                             last_chunk=last_chunk)
    schedules = tuple(dict.fromkeys(("recurrent", analysis.schedule)))

    def sample(i):
        """The float64 loop's results on input ``i``; each schedule's error against them, beside
        the fp32 loop's, per quantity."""
        states0, invariants = inputs_for(program, L, seed + i)
        ref64 = outputs_finals_grads(loop, _as64(states0), _as64(invariants))
        ref32 = outputs_finals_grads(loop, states0, invariants)
        errors = {}
        for schedule in schedules:
            got = outputs_finals_grads(
                lambda s, x: execute(program, analysis, s, x, schedule=schedule), states0,
                invariants)
            for what, got_l, r64_l, r32_l in zip(("outputs", "final states", "gradients"), got,
                                                 ref64, ref32):
                assert len(got_l) == len(r64_l)
                for j, (a, b, c) in enumerate(zip(got_l, r64_l, r32_l)):
                    assert a.shape == b.shape and a.dtype == torch.float32
                    errors[f"{schedule}: {what}[{j}]"] = (rel_rms_error(a, b), rel_rms_error(c, b))
        return ref64, errors

    first, errors = sample(0)
    if kind == "momentum_muon":
        assert_no_worse_than_original(lambda i: sample(i)[1] if i else errors,
                                      samples=MUON_SAMPLES)
    else:
        for name, (err, _) in errors.items():
            assert err <= TOL, f"{name} rel RMS error {err:.2e} > {TOL:.1e}"
    return analysis, first


def run_and_grad(program, analysis, states0, invariants, schedule):
    return outputs_finals_grads(
        lambda s, x: execute(program, analysis, s, x, schedule=schedule), states0, invariants)


def assert_matches_recurrent(program, L, seed=0):
    """The chosen schedule equals the recurrent executor (for bodies without a hand reference)."""
    analysis = analyze(program)
    states0, invariants = inputs_for(program, L, seed)
    ref = run_and_grad(program, analysis, states0, invariants, "recurrent")
    got = run_and_grad(program, analysis, states0, invariants, analysis.schedule)
    for name, got_list, ref_list in zip(("outputs", "final states", "gradients"), got, ref):
        assert len(got_list) == len(ref_list)
        for a, b in zip(got_list, ref_list):
            assert a.shape == b.shape
            err = rel_rms_error(a, b)
            assert err <= TOL, f"{name}: rel RMS error {err:.2e} > {TOL:.0e}"
    return analysis, ref


# -- hypothesis: every schedule == the hand-written loop --------------------------------------

shapes = st.fixed_dictionaries(dict(
    B=st.sampled_from([1, 2]), d=st.sampled_from([2, 3, 5]), C=st.sampled_from([1, 2, 3, 4]),
    inclusive=st.booleans(), last_chunk=st.sampled_from(["update", "apply_only"]),
    n_len=st.integers(min_value=1, max_value=13), seed=st.integers(0, 3)))


@pytest.mark.parametrize("kind", ["additive_xw", "additive_wx", "momentum_muon", "weight_norm",
                                  "delta_rule"])
@settings(max_examples=10, deadline=None)
@given(shapes)
# one-token chunks: with Newton–Schulz, the recurrent schedule's error on one input was 1.1x twice
# the fp32 loop's own (a random draw of rounding; judged as medians over inputs since)
@example(s=dict(B=1, d=3, C=1, inclusive=False, last_chunk="update", n_len=5, seed=2))
# chunks shorter than the features: the parallel schedule's median over 5 inputs was 1.08x the bound
@example(s=dict(B=1, d=5, C=3, inclusive=True, last_chunk="apply_only", n_len=5, seed=0))
def test_chunked_schedule_matches_hand_written_loop(kind, s):
    program = make_program(kind, s["B"], s["d"], s["C"], s["inclusive"], s["last_chunk"])
    analysis, _ = assert_matches_reference(kind, program, s["n_len"], s["seed"], C=s["C"],
                                           inclusive=s["inclusive"], last_chunk=s["last_chunk"])
    assert analysis.schedule == EXPECTED_SCHEDULE[kind]


@settings(max_examples=10, deadline=None)
@given(shapes)
def test_per_token_gated_matches_hand_written_loop(s):
    program = make_program("gated_per_token", s["B"], s["d"], 1, s["inclusive"], s["last_chunk"])
    analysis, (outputs, finals, _) = assert_matches_reference(
        "gated_per_token", program, s["n_len"], s["seed"], C=1, inclusive=s["inclusive"],
        last_chunk=s["last_chunk"])
    assert analysis.schedule == "parallel"
    assert outputs[0].shape == (s["B"], s["n_len"], s["d"])


@settings(max_examples=8, deadline=None)
@given(shapes)
def test_chunk_mean_gate_is_exact_on_whole_chunks(s):
    """A momentum gate averaged over the chunk: exact when every chunk whose update is used
    (committed, or read by an inclusive output) is whole; otherwise the padding is refused."""
    program = make_program("momentum_chunk_gate", s["B"], s["d"], s["C"], s["inclusive"],
                           s["last_chunk"])
    C = s["C"]
    L = s["n_len"]
    update_read = s["last_chunk"] == "update" or s["inclusive"]
    if L % C != 0 and update_read:
        analysis = analyze(program)
        states0, invariants = inputs_for(program, L, s["seed"])
        for schedule in ("recurrent", analysis.schedule):
            with pytest.raises(UnsupportedTTTError, match="partial"):
                execute(program, analysis, states0, invariants, schedule=schedule)
    else:
        assert_matches_reference("momentum_chunk_gate", program, L, s["seed"], C=C,
                                 inclusive=s["inclusive"], last_chunk=s["last_chunk"])


# -- edge cases and reference values -----------------------------------------------------------

def test_recurrent_executor_follows_iteration_semantics():
    """The recurrent executor equals a hand-written loop over whole chunks (L = 3C)."""
    program = make_program("additive_xw", 1, 3, 2, False, "apply_only")
    states0, invariants = inputs_for(program, 6, 1)
    outputs, finals = execute(program, None, states0, invariants, schedule="recurrent")
    W = states0[0]
    k, v, q, lr = invariants
    ys = []
    for j in range(3):
        sl = slice(2 * j, 2 * j + 2)
        ys.append(q[:, sl] @ W)
        if j < 2:
            W = W + k[:, sl].transpose(-1, -2) @ (lr[:, sl] * v[:, sl])
    assert rel_rms_error(outputs[0], torch.cat(ys, 1)) <= TOL
    assert rel_rms_error(finals[0], W) <= TOL


@pytest.mark.parametrize("L", [1, 3, 4, 9])
def test_short_and_ragged_lengths(L):
    program = make_program("momentum_muon", 2, 3, 4, True, "update")
    _, (outputs, finals, _) = assert_matches_reference("momentum_muon", program, L, C=4,
                                                       inclusive=True, last_chunk="update")
    assert outputs[0].shape == (2, L, 3)


def test_one_chunk_runs_the_body_on_plain_tensors():
    """A call of one chunk (a single step over the whole sequence) runs the body's graphs on
    the chunk itself: ``vmap`` over an axis of one would only batch every op (and leave a
    select per stream in the backward)."""
    from torch._C._functorch import is_batchedtensor
    from ttt2la.lowering.executors import _call_batched
    seen = []

    def body(x, w):
        seen.append(is_batchedtensor(x))
        return (x * w, x.sum(-1))

    x, w = torch.randn(1, 3, 4), torch.randn(4)
    (y, s), fell_back = _call_batched(body, [(x, True), (w, False)], 1)
    assert seen == [False] and not fell_back
    assert torch.equal(y, x * w) and torch.equal(s, x.sum(-1))
    seen.clear()
    (y, _), _ = _call_batched(body, [(torch.randn(2, 3, 4), True), (w, False)], 2)
    assert seen == [True] and y.shape == (2, 3, 4)


@pytest.mark.parametrize("L", [4, 12])
def test_a_call_leaves_no_tensor_in_a_reference_cycle(L):
    """A plan's call frees its values when it returns: none is left for Python's cycle
    collector, which would keep each call's chunk-major values alive until it ran, so that
    every call faulted in fresh memory for its own."""
    import gc
    program = make_program("additive_xw", 2, 3, 4, True, "update")
    states0, invariants = inputs_for(program, L, 0)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        outputs, finals = execute(program, None, states0, invariants)
        outputs[0].sum().backward()
        del outputs, finals
        gc.collect()
        left = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not left, [tuple(t.shape) for t in left]


def test_exclusive_apply_only_reads_initial_state_in_first_chunk():
    program = make_program("weight_norm", 1, 2, 2, False, "apply_only")
    states0, invariants = inputs_for(program, 2, 3)
    outputs, finals = execute(program, None, states0, invariants)
    q = invariants[program.streams[2].source]
    assert rel_rms_error(outputs[0], q @ states0[0]) <= TOL
    assert rel_rms_error(finals[0], states0[0]) <= TOL


def test_plan_describes_schedule_and_sequential_states():
    plan = lower(make_program("weight_norm", 1, 2, 2, False, "update"), None)
    assert plan.schedule == "semi-parallel"
    assert "sequential: W" in plan.implementation
    plan = lower(make_program("additive_xw", 1, 2, 2, False, "update"), None)
    assert plan.implementation == "torch.vmap(parallel)"
    assert lower(plan.program, None, schedule="recurrent").implementation == "torch(recurrent loop)"


def test_more_parallel_schedule_than_allowed_raises():
    program = make_program("weight_norm", 1, 2, 2, False, "update")
    with pytest.raises(NonReducibleError, match="drop_norm"):
        lower(program, None, schedule="parallel")


def test_inputs_are_validated():
    program = make_program("additive_xw", 1, 2, 2, False, "update")
    states0, invariants = inputs_for(program, 4, 0)
    plan = lower(program, None)
    with pytest.raises(ValueError, match="initial states"):
        plan([], invariants)
    with pytest.raises(ValueError, match="invariants"):
        plan(states0, invariants[:-1])
    bad = list(invariants)
    bad[0] = bad[0][:, :3]
    with pytest.raises(UnsupportedTTTError, match="different lengths"):
        plan(states0, bad)


def test_chunk_streams_pad_and_move_chunk_axis_first():
    program = make_program("additive_xw", 1, 2, 4, False, "update")
    _, invariants = inputs_for(program, 6, 0)
    streams, layout = chunk_streams(program, invariants)
    assert (layout.n_chunks, layout.tail, layout.partial) == (2, 2, True)
    k = invariants[program.streams[0].source]
    assert streams[0].shape == (2, 1, 4, 2)
    assert torch.equal(streams[0][1, :, :2], k[:, 4:6])
    assert torch.equal(streams[0][1, :, 2:], torch.zeros(1, 2, 2))


def test_analysis_of_another_program_is_rejected():
    a = make_program("additive_xw", 1, 2, 2, False, "update")
    b = make_program("additive_wx", 1, 2, 2, False, "update")
    with pytest.raises(ValueError, match="different program"):
        lower(a, analyze(b))


def test_multi_head_layout_with_token_axis_two():
    """Streams ``[B, H, L, d]`` sliced along axis 2, output joined along axis 2."""
    def body(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), (q @ W,)
    B, H, L, d, C = 2, 3, 6, 4, 4
    program = program_from_body(
        body, states=dict(W=torch.randn(B, H, d, d)),
        streams=dict(k=torch.randn(B, H, L, d), v=torch.randn(B, H, L, d),
                     q=torch.randn(B, H, L, d)),
        stream_axes=dict(k=2, v=2, q=2), output_axes=[2], chunk_size=C)
    _, (outputs, finals, _) = assert_matches_recurrent(program, 7)
    assert outputs[0].shape == (B, H, 7, d)
    states0, invariants = inputs_for(program, 7, 0)
    outputs, finals = execute(program, None, states0, invariants)
    k, v, q = invariants
    causal = torch.cat([q[:, :, :4] @ states0[0],
                        q[:, :, 4:] @ (states0[0] + k[:, :, :4].transpose(-1, -2) @ v[:, :, :4])],
                       dim=2)
    assert rel_rms_error(outputs[0], causal) <= TOL
    assert rel_rms_error(finals[0], states0[0] + k.transpose(-1, -2) @ v) <= TOL


def test_bfloat16_parallel_matches_recurrent():
    """bf16 states and streams through an affine scan (momentum) and a prefix sum."""
    program = make_program("momentum_chunk_gate", 2, 4, 4, True, "update")
    states0, invariants = inputs_for(program, 16, 0)
    states0 = [s.detach().bfloat16() for s in states0]
    invariants = [x.detach().bfloat16() for x in invariants]
    body = program_from_body(
        lambda W, M, k, v, q, g: momentum_chunk_gate(W, M, k, v, q, g, True),
        states=dict(W=states0[0], M=states0[1]),
        streams=dict(zip("kvqg", invariants)), chunk_size=4, order="inclusive")
    analysis = analyze(body)
    assert analysis.schedule == "parallel"
    ref = execute(body, analysis, states0, invariants, schedule="recurrent")
    got = execute(body, analysis, states0, invariants)
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        assert a.dtype == torch.bfloat16
        assert rel_rms_error(a, b) <= TOLERANCE[torch.bfloat16]


def test_coupled_states_run_as_one_sequential_group():
    def body(S, T, k, v, q, P):
        return (S + T @ P + k.transpose(-1, -2) @ v, 0.5 * T + S @ P), (q @ S + q @ T,)
    B, d, C = 2, 3, 2
    program = program_from_body(
        body, states=dict(S=torch.randn(B, d, d), T=torch.randn(B, d, d)),
        streams=dict(k=torch.randn(B, 5, d), v=torch.randn(B, 5, d), q=torch.randn(B, 5, d)),
        invariants=dict(P=torch.randn(B, d, d) * 0.2), chunk_size=C, last_chunk="apply_only")
    analysis, _ = assert_matches_recurrent(program, 5)
    assert analysis.groups == [[0, 1]] and analysis.group_modes == ["sequential"]
    states0, invariants = inputs_for(program, 5, 0)
    (y,), finals = execute(program, analysis, states0, invariants)
    named = {spec.name: x for spec, x in zip(program.invariants, invariants)}
    k, v, q, P = (named[n] for n in ("k_seq", "v_seq", "q_seq", "P"))
    S, T, ys = states0[0], states0[1], []
    for j, s in enumerate(range(0, 5, 2)):
        ys.append(q[:, s:s + 2] @ S + q[:, s:s + 2] @ T)
        if j < 2:                                   # apply_only: the last chunk only reads
            S, T = S + T @ P + k[:, s:s + 2].transpose(-1, -2) @ v[:, s:s + 2], 0.5 * T + S @ P
    assert rel_rms_error(y, torch.cat(ys, 1)) <= TOL
    assert rel_rms_error(finals[0], S) <= TOL and rel_rms_error(finals[1], T) <= TOL
    assert "sequential: S, T" in lower(program, analysis).implementation


class _ShapesMade(TorchDispatchMode):
    """The shapes of every tensor the ops dispatched within the block return."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("last_chunk", ["update", "apply_only"])
def test_the_last_sequential_group_reads_the_outputs_inside_its_loop(last_chunk):
    """Outputs that read a sequential state before and after each chunk's update, and a
    parallel state's sequence, are read inside the sequential state's chunk loop: equal to the
    recurrent loop (outputs, finals, gradients), and no tensor holds every chunk's state."""
    def body(A, S, k, v, u, q):
        S_next = S - k.transpose(-1, -2) @ (k @ S - v) * 0.1
        return (A + k.transpose(-1, -2) @ u, S_next), (q @ S + q @ S_next + (q @ A).sum(-1, True),)
    B, d, e, C, L = 2, 3, 4, 2, 9
    program = program_from_body(
        body, states=dict(A=torch.randn(B, d, e), S=torch.randn(B, d, d)),
        streams=dict(k=torch.randn(B, L, d), v=torch.randn(B, L, d), u=torch.randn(B, L, e),
                     q=torch.randn(B, L, d)), chunk_size=C, last_chunk=last_chunk)
    analysis, _ = assert_matches_recurrent(program, L)
    assert analysis.group_modes[-1] == "sequential" and len(analysis.groups) == 2
    states0, invariants = inputs_for(program, L, 0)
    made = _ShapesMade()
    with made:
        execute(program, analysis, states0, invariants)
    n = -(-L // C)
    assert (n, B, d, e) in made.shapes                # the parallel state's sequence
    assert not any(s[1:] == (B, d, d) and s[0] >= n - 1 for s in made.shapes), made.shapes


def test_unknown_backend_is_refused():
    program = make_program("additive_xw", 1, 2, 2, False, "update")
    with pytest.raises(UnsupportedTTTError, match="backend"):
        lower(program, None, backend="triton")


def test_padding_probe_names_what_the_padding_changes():
    inert = make_program("additive_xw", 1, 3, 4, True, "update")
    gated = make_program("momentum_chunk_gate", 1, 3, 4, False, "update")
    for program, expected in ((inert, None), (gated, "the update of state W")):
        states0, invariants = inputs_for(program, 6, 0)
        _, layout = chunk_streams(program, invariants)
        assert layout.tail == 2
        assert padding_problem(program, states0, invariants, layout) == expected

    def in_chunk_attention(W, k, v, q):
        scores = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return (W,), (q @ W + scores @ v,)
    program = program_from_body(
        in_chunk_attention, states=dict(W=torch.randn(1, 3, 3)),
        streams=dict(k=torch.randn(1, 8, 3), v=torch.randn(1, 8, 3), q=torch.randn(1, 8, 3)),
        chunk_size=4)
    states0, invariants = inputs_for(program, 6, 0)
    with pytest.raises(UnsupportedTTTError, match="chunk output y0"):
        execute(program, None, states0, invariants)
