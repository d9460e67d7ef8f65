"""A loop over the chunks computes its state-sized, state-free increments itself, per chunk.

The bodies' updates add an outer product ``kᵀv`` (the state's size, larger than ``k`` and ``v``)
to a decayed state. Looped, the plan must equal the recurrent executor (outputs, final states,
every gradient) and never hold all chunks' increments at once; scanned, it computes the same
increments batched, as before; an output that reads the increment itself gets it too.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ttt2la.analysis import analyze
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import lower
from ttt2la.lowering import loop_expansions
from ttt2la.lowering.loop_expansions import expansions
from ttt2la.lowering.scan_choice import scanning
from ttt2la.testing import TOLERANCE, rel_rms_error
from test_executors import _ShapesMade, inputs_for, outputs_finals_grads

TOL = TOLERANCE[torch.float32]


SIDES = pytest.mark.parametrize("where", ["moved", "batched"])


def size_rule(where: str):
    """Either side of the size rule: the expansions computed in the loop (none is too small)
    or read batched before it (none is large enough)."""
    return mock.patch.object(loop_expansions, "EXPANSION_MIN_ELEMENTS",
                             0 if where == "moved" else 10**12)


def decayed(W, k, v, q, g, lr):
    """W' = mean(σ(g))·W + lr·kᵀv; o = q·W."""
    decay = torch.sigmoid(g).mean(dim=1, keepdim=True)
    return (decay * W + lr * (k.transpose(-1, -2) @ v),), (q @ W,)


def decayed_reading_the_increment(W, k, v, q, g, lr):
    """The same update; the output also reads the increment."""
    U = k.transpose(-1, -2) @ v
    decay = torch.sigmoid(g).mean(dim=1, keepdim=True)
    return (decay * W + lr * U,), (q @ W + q @ U,)


def scaled(W, u, q, lr):
    """W' = W·0.9 + lr·u, with u a stream already the state's size: nothing to expand."""
    return (0.9 * W + lr * u,), (q @ W,)


def program_of(body, B, d, e, C, L=None):
    L = L or 2 * C
    r = torch.randn
    streams = dict(k=r(B, L, d), v=r(B, L, e), q=r(B, L, d), g=r(B, L, 1))
    if body is scaled:
        streams = dict(u=r(B, L, d, e), q=r(B, L, d))
    return program_from_body(body, states=dict(W=r(B, d, e) * 0.1), streams=streams,
                             invariants=dict(lr=torch.tensor(0.3)), chunk_size=C)


def run(program, states0, invariants, always):
    plan = lower(program, analyze(program))
    with scanning(always):
        return outputs_finals_grads(plan, states0, invariants), plan


def assert_equal(got, ref):
    for what, got_l, ref_l in zip(("outputs", "final states", "gradients"), got, ref):
        for a, b in zip(got_l, ref_l):
            assert rel_rms_error(a, b) <= TOL, f"{what}: {rel_rms_error(a, b):.2e}"


@SIDES
@settings(max_examples=12, deadline=None)
@given(B=st.sampled_from([1, 3]), d=st.sampled_from([2, 5]), e=st.sampled_from([3, 6]),
       C=st.sampled_from([1, 2, 4]), n=st.integers(3, 9), seed=st.integers(0, 3),
       body=st.sampled_from([decayed, decayed_reading_the_increment]))
def test_looped_and_scanned_equal_the_recurrent_loop(where, B, d, e, C, n, seed, body):
    program = program_of(body, B, d, e, C)
    states0, invariants = inputs_for(program, n * C, seed)
    recurrent = lower(program, analyze(program), schedule="recurrent")
    ref = outputs_finals_grads(recurrent, states0, invariants)
    for always in (False, True):
        with size_rule(where):
            got, _ = run(program, states0, invariants, always)
        assert_equal(got, ref)


@SIDES
@settings(max_examples=8, deadline=None)
@given(B=st.sampled_from([1, 2]), d=st.sampled_from([4, 8]), C=st.sampled_from([1, 2]),
       n=st.integers(4, 12))
def test_a_loop_never_holds_every_chunks_increment(where, B, d, C, n):
    """Looped with its expansions moved, no op makes a tensor of ``n - 1`` or more state-sized
    values (each chunk's ``kᵀv``, or each chunk's state); batched, or scanned, the batched
    increments are made. (Chunks shorter than ``d (d + 1) / (2d + 1)`` tokens: ``kᵀv`` is
    larger than ``k`` and ``v``.)"""
    program = program_of(decayed, B, d, d + 1, C)
    states0, invariants = inputs_for(program, n * C, 0)
    state = (B, d, d + 1)
    for always in (False, True):
        made = _ShapesMade()
        with made, torch.no_grad(), scanning(always), size_rule(where):
            lower(program, analyze(program))(states0, invariants)
        batched = {s for s in made.shapes if len(s) > 3 and s[1:] == state and s[0] >= n - 1}
        assert bool(batched) == (always or where == "batched"), made.shapes


def test_only_an_expansion_moves_into_the_loop():
    """An outer product, larger than its factors, is computed in the loop; a value the state's
    size computed from a stream of the same size stays batched before it."""
    moved = {}
    for body in (decayed, scaled):
        plan = lower(program_of(body, 2, 8, 8, 2), None)
        (step,) = plan._steps
        loop = step.as_loop or step                 # scanned or looped at each call, or looped
        moved[body.__name__] = loop.moved, plan._deferred
    assert all(moved["decayed"]) and not any(moved["scaled"])
    outer = program_of(decayed, 2, 8, 8, 4)         # kᵀv no larger than k and v: stays
    assert not lower(outer, None)._steps[0].as_loop.moved


def test_the_size_rule_scales_the_trace_by_the_call():
    """Traced at batch 1, a call at batch ``B`` has ``B`` times the elements: the rule reads
    the call's state, not the trace's."""
    plan = lower(program_of(decayed, 1, 8, 8, 2), None)
    loop = plan._steps[0].as_loop
    traced = plan.program.state_inputs()[0].meta["val"].numel()          # 64 elements
    at = lambda B: torch.zeros(B, 8, 8)                                   # noqa: E731
    limit = loop_expansions.EXPANSION_MIN_ELEMENTS
    assert not loop_expansions.expansions_pay(loop.moved, at(limit // 64 - 1), traced)
    assert loop_expansions.expansions_pay(loop.moved, at(limit // 64), traced)


def test_expansions_reads_sizes_off_the_trace():
    """Directly: ``a·b`` of two vectors' outer product moves; adding a bias of its size does
    not (it reads as much as it makes)."""
    graph = torch.fx.Graph()
    a, b, bias = (graph.placeholder(n) for n in ("a", "b", "bias"))
    outer = graph.call_function(torch.mul, (a, b))
    shifted = graph.call_function(torch.add, (outer, bias))
    for node, shape in ((a, (8, 1)), (b, (1, 8)), (bias, (8, 8)), (outer, (8, 8)),
                        (shifted, (8, 8))):
        node.meta["val"] = torch.empty(shape)
    assert expansions([outer], {outer, shifted}) == {outer}
    assert expansions([shifted], {outer, shifted}) == set()
    assert expansions([outer], set()) == set()        # not movable: a state's or a constant's


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
