"""Roll-up phase by phase, on tiny loops written here and traced with ``capture.trace``.

Each phase's result is checked directly against what the loop as written means: which inputs
are sliced per chunk and which are loop-invariant, which values are carried and where they
start, how the outputs leave the loop, what happens to the last chunk, and what the outer graph
calls. The outer graph with the rolled-up body run by a small interpreter of the calling
convention (written here from ``ttt2la.ir``'s description) must compute what the function does.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.errors import UnsupportedTTTError
from ttt2la.frontend.capture import trace
from ttt2la.frontend.loops import find_loops
from ttt2la.frontend.rollup import (ZERO, carried_states, chunk_output, classify_inputs,
                                    extract_body, order_and_tail, roll_up, split_buffer, unroll)
from ttt2la.ir import KIND, LOOP_MODULE, bind_loop_args, loop_interface
from ttt2la.testing import TOLERANCE, rel_rms_error

aten = torch.ops.aten
C = 2          # the chunk size every loop below slices with
B, D = 2, 3    # batch, feature size


# -- loops in the styles roll-up recognizes ----------------------------------------------------

def apply_then_update(W, q, k, v, lr):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        g = lr.exp()                                     # loop-invariant: hoisted
        outs.append(qi @ W)
        W = W + g * ki.transpose(1, 2) @ vi
    return torch.cat(outs, dim=1), W


def update_then_apply(W, q, k, v, lr):
    outs = []
    for s in range(0, q.shape[1], C):
        qi = q[:, s:s + C]
        ki = k[:, s:s + C]
        vi = v[:, s:s + C]
        W = W + lr * ki.transpose(1, 2) @ vi
        outs.append(qi @ W)
    return torch.cat(outs, dim=1), W


def per_token(W, q, k, v, lr):
    outs = []
    for t in range(q.shape[1]):
        qt, kt, vt = q[:, t], k[:, t], v[:, t]
        outs.append(torch.einsum("bd,bde->be", qt, W))
        W = W + lr * kt[:, :, None] * vt[:, None, :]
    return torch.stack(outs, dim=1), W


def into_buffer(W, q, k, v, lr):
    out = torch.zeros_like(q)
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        out[:, s:s + C] = qi @ W
        W = W + lr * ki.transpose(1, 2) @ vi
    return out, W


def per_token_into_buffer(W, q, k, v, lr):
    out = torch.empty_like(q)
    for t in range(q.shape[1]):
        W = W + lr * k[:, t, :, None] * v[:, t, None, :]
        out[:, t] = torch.einsum("bd,bde->be", q[:, t], W)
    return out, W


def buffer_read_in_loop(W, q, k, v, lr):
    out = torch.zeros_like(q)
    for t in range(q.shape[1]):
        out[:, t] = torch.einsum("bd,bde->be", q[:, t], W)
        W = W + lr * out[:, t, :, None] * v[:, t, None, :]
    return out, W


def last_chunk_after_loop(W, q, k, v, lr):
    L = q.shape[1]
    outs = []
    for s in range(0, L - C, C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ W)
        W = W + lr * ki.transpose(1, 2) @ vi
    outs.append(q[:, L - C:] @ W)
    return torch.cat(outs, dim=1), W


def last_update_skipped(W, q, k, v, lr):
    L = q.shape[1]
    outs = []
    for s in range(0, L, C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ W)
        if s + C < L:
            W = W + lr * ki.transpose(1, 2) @ vi
    return torch.cat(outs, dim=1), W


def starts_at_zero(W0, q, k, v, lr):
    W = None
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        kv = lr * ki.transpose(1, 2) @ vi
        W = kv if W is None else W + kv
        outs.append(qi @ W)
    return torch.cat(outs, dim=1), W


def initialised_in_loop(W0, q, k, v, lr):
    W = None
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        if W is None:
            W = W0 * 0.5
        outs.append(qi @ W)
        W = W + lr * ki.transpose(1, 2) @ vi
    return torch.cat(outs, dim=1), W


def constant_in_body(W, q, k, v, lr):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        weights = torch.tensor([1.0, 0.5])               # one per token of a chunk
        outs.append(qi @ W)
        W = W + lr * (ki * weights[:, None]).transpose(1, 2) @ vi
    return torch.cat(outs, dim=1), W


# -- loops roll-up refuses ---------------------------------------------------------------------

def squares_offsets(W, q, k, v, lr):
    outs = []
    for i in range(3):
        qi = q[:, i * i:i * i + 1]
        outs.append(qi @ W)
        W = W * lr
    return torch.cat(outs, dim=1), W


def chunks_in_reverse(W, q, k, v, lr):
    outs = []
    for i in reversed(range(4)):
        qi = q[:, 2 * i:2 * i + 2]
        outs.append(qi @ W)
        W = W * lr
    return torch.cat(outs, dim=1), W


def tokens_in_reverse(W, q, k, v, lr):
    outs = []
    for t in range(7, -1, -1):
        outs.append(q[:, t] @ W)
        W = W * lr
    return torch.stack(outs, dim=1), W


def a_rate_per_chunk_made_before_the_loop(W, q, k, v, lr):
    rates = lr.reshape(-1, 1).expand(-1, 4)          # one rate per chunk: [1, n]
    outs = []
    for i in range(4):
        qi = q[:, 2 * i:2 * i + 2]
        outs.append(qi @ W)
        W = W * rates[:, i]
    return torch.cat(outs, dim=1), W


def two_chunk_sizes(W, q, k, v, lr):
    outs = []
    for i in range(3):
        qi, ki = q[:, 2 * i:2 * i + 2], k[:, 3 * i:3 * i + 3]
        outs.append(qi @ W)
        W = W + lr * ki.transpose(1, 2) @ ki
    return torch.cat(outs, dim=1), W


def constant_changing_per_iteration(W, q, k, v, lr):
    outs = []
    for i, s in enumerate(range(0, q.shape[1], C)):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        step = torch.tensor([float(i)])
        outs.append(qi @ W)
        W = W + step * ki.transpose(1, 2) @ vi
    return torch.cat(outs, dim=1), W


# -- helpers -----------------------------------------------------------------------------------

def _inputs(L: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(B, D, D, generator=g)
    q, k, v = (torch.randn(B, L, D, generator=g) for _ in range(3))
    return W, q, k, v, torch.rand((), generator=g) * 0.5


def _traced(fn, L: int):
    """``fn`` traced at length ``L``, its placeholders, and its loop unrolled."""
    gm = trace(fn, *_inputs(L))
    (loop, depth), = [ld for ld in find_loops(gm) if ld[0].function == fn.__name__]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, placeholders, unroll(gm, loop, depth)


def _phases(fn, L: int):
    gm, ph, u = _traced(fn, L)
    inputs = classify_inputs(u)
    states = split_buffer(u, inputs, carried_states(u, inputs))
    out = chunk_output(u, states)
    return gm, ph, u, inputs, states, out, order_and_tail(u, inputs, states, out)


def _run_program(program, states, invariants):
    """The rolled-up loop, run as ``ttt2la.ir`` states its semantics: chunk j of every stream,
    the body on (states, streams, invariants), the states updated except after an apply-only
    last chunk, the chunk outputs joined along the output's axis (whole chunks only)."""
    spec = program.streams[0]
    L = invariants[spec.source].shape[spec.axis]
    step = 1 if spec.per_token else program.chunk_size
    assert L % step == 0
    n = L // step
    outs = []
    for j in range(n):
        streams = []
        for s in program.streams:
            src = invariants[s.source]
            streams.append(src.select(s.axis, j) if s.per_token
                           else src.narrow(s.axis, j * step, step))
        got = program.body(*states, *streams, *invariants)
        outs.append(got[len(states)])
        if j < n - 1 or program.last_chunk == "update":
            states = list(got[: len(states)])
    o = program.outputs[0]
    joined = torch.stack(outs, o.axis) if o.per_token else torch.cat(outs, o.axis)
    return (joined, *states)


class _Interpreter(torch.nn.Module):
    def __init__(self, program):
        super().__init__()
        self.program = program

    def forward(self, *args):
        n = len(self.program.states)
        return _run_program(self.program, list(args[:n]), list(args[n:]))


# -- phase 0: the iterations -------------------------------------------------------------------

@pytest.mark.parametrize("L", [6, 7, 10])
def test_unroll_splits_one_iteration_per_chunk(L):
    _gm, _ph, u = _traced(update_then_apply, L)
    assert u.n_iter == math.ceil(L / C)
    assert all(u.to2[n].target == n.target for n in u.iters[1])
    assert set(u.to0.values()) <= set(u.iters[0])


def test_unroll_needs_three_iterations():
    with pytest.raises(UnsupportedTTTError, match="at least 3"):
        _traced(update_then_apply, 2 * C)


# -- phase 1: inputs ---------------------------------------------------------------------------

def test_streams_are_the_sliced_sequences_and_invariant_code_is_hoisted():
    _gm, ph, u = _traced(apply_then_update, 6)
    W, q, k, v, lr = ph
    inputs = classify_inputs(u)
    assert {s.source for s in inputs.streams.values()} == {q, k, v}
    assert all(s.axis == 1 and s.chunk == C and not s.per_token for s in inputs.streams.values())
    # lr.exp() reads only lr: computed once, read by every iteration
    assert [n.target for n in inputs.hoisted] == [aten.exp.default]
    assert next(iter(inputs.hoisted)).args[0] is lr
    assert not (set(inputs.body_nodes) & (inputs.hoisted | set(inputs.streams)))
    assert set(inputs.body_nodes) | inputs.hoisted | set(inputs.streams) == set(u.iters[1])


def test_per_token_streams_select_one_token():
    _gm, ph, u = _traced(per_token, 5)
    inputs = classify_inputs(u)
    assert {s.source for s in inputs.streams.values()} == set(ph[1:4])
    assert all(s.per_token and s.chunk == 1 for s in inputs.streams.values())
    assert all(n.target is aten.select.int for n in inputs.streams)


def test_a_constant_built_in_the_body_is_loop_invariant():
    gm, _ph, u = _traced(constant_in_body, 6)
    inputs = classify_inputs(u)
    made = [n for n in inputs.hoisted if n.target is aten.lift_fresh_copy.default]
    assert len(made) == 1
    assert torch.equal(getattr(gm, made[0].args[0].target), torch.tensor([1.0, 0.5]))
    states = carried_states(u, inputs)
    assert len(states.carried) == 1
    assert any(a in inputs.hoisted for a in states.invariants)

    _gm, _ph, u, inputs, states, out, tail = _phases(constant_in_body, 6)
    program = extract_body(u, inputs, states, out, tail)
    # named after the variable it was built into, not after the update it is written in
    assert "weights" in [i.name for i in program.invariants]


def test_a_constant_that_changes_between_iterations_is_refused():
    _gm, _ph, u = _traced(constant_changing_per_iteration, 8)
    with pytest.raises(UnsupportedTTTError, match="changes between iterations"):
        classify_inputs(u)


def test_an_offset_that_does_not_move_by_a_chunk_is_refused():
    _gm, _ph, u = _traced(squares_offsets, 10)
    with pytest.raises(UnsupportedTTTError,
                       match=r"indexing `\[\.\.\.\]` at .*test_rollup_phases\.py:\d+ \(`.*`\) "
                             r"changes between iterations, and is neither the "
                             r"next chunk or token"):
        classify_inputs(u)


@pytest.mark.parametrize("fn,op", [(chunks_in_reverse, r"indexing `\[\.\.\.\]`"),
                                   (tokens_in_reverse, r"`torch\.select`")],
                         ids=["chunks_in_reverse", "tokens_in_reverse"])
def test_a_loop_in_reverse_is_refused_saying_how_to_run_it_forward(fn, op):
    _gm, _ph, u = _traced(fn, 8)
    with pytest.raises(UnsupportedTTTError,
                       match=rf"{op} at .*test_rollup_phases\.py:\d+ \(`.*`\) reads the sequence's "
                             r"chunks in reverse order .*x\.flip\(1\)") as info:
        classify_inputs(u)
    assert "%" not in str(info.value)             # no graph node's repr


def test_a_value_per_chunk_made_before_the_loop_is_refused_saying_where_to_make_it():
    _gm, _ph, u = _traced(a_rate_per_chunk_made_before_the_loop, 8)
    with pytest.raises(UnsupportedTTTError,
                       match=r"`torch\.select` at .*test_rollup_phases\.py:\d+ \(`.*`\) takes one "
                             r"row per iteration beside chunks "
                             r"of 2 tokens: .*Compute it inside the loop from the chunk"):
        classify_inputs(u)


def test_two_chunk_sizes_are_refused():
    _gm, _ph, u = _traced(two_chunk_sizes, 12)
    with pytest.raises(UnsupportedTTTError, match="chunk sizes 2 and 3"):
        classify_inputs(u)


# -- phase 2: carried states -------------------------------------------------------------------

@pytest.mark.parametrize("fn", [apply_then_update, update_then_apply])
def test_the_fast_weight_is_carried_from_its_argument(fn):
    _gm, ph, u = _traced(fn, 6)
    W, q, k, v, lr = ph
    inputs = classify_inputs(u)
    states = carried_states(u, inputs)
    (producer, out1), = states.carried.items()
    assert producer in u.iters[0] and out1 in u.iters[1]
    assert out1.target is aten.add.Tensor and u.to2[out1].args[0] is out1   # W = W + ...
    assert states.initial[producer] is W
    assert {q, k, v} <= set(states.invariants) and W not in states.invariants
    assert not states.init_nodes and not states.notes


def test_a_state_the_first_iteration_does_not_read_starts_at_zero():
    _gm, ph, u = _traced(starts_at_zero, 6)
    states = carried_states(u, classify_inputs(u))
    (producer,) = states.carried
    assert states.initial[producer] is ZERO
    assert "starts at zero" in states.notes[0]


def test_first_iteration_initialisation_is_kept_for_before_the_loop():
    _gm, ph, u = _traced(initialised_in_loop, 6)
    states = carried_states(u, classify_inputs(u))
    (producer,) = states.carried
    start = states.initial[producer]
    assert start in u.iters[0] and start.target is aten.mul.Tensor and start.args[0] is ph[0]
    assert start in states.init_nodes
    assert "initialises" in states.notes[0]


# -- phase 3: buffers and outputs --------------------------------------------------------------

def test_an_output_buffer_is_not_a_state():
    _gm, ph, u = _traced(into_buffer, 6)
    inputs = classify_inputs(u)
    before = carried_states(u, inputs)
    states = split_buffer(u, inputs, before)
    assert len(before.carried) == 2 and len(states.carried) == 1
    buf = states.buffer
    assert buf is not None and buf.axis == 1 and buf.producer not in states.carried
    assert not (buf.plumbing & set(states.body_nodes))
    out = chunk_output(u, states)
    assert out is buf.written and out.target is aten._unsafe_view.default   # qi @ W


def test_a_per_token_output_buffer_is_not_a_state():
    _gm, _ph, u = _traced(per_token_into_buffer, 5)
    inputs = classify_inputs(u)
    before = carried_states(u, inputs)
    states = split_buffer(u, inputs, before)
    assert len(before.carried) == 2 and len(states.carried) == 1
    buf = states.buffer
    assert buf is not None and buf.stacked and buf.axis == 1
    assert buf.write.target is aten.select_scatter.default
    assert not (buf.plumbing & set(states.body_nodes))
    out = chunk_output(u, states)
    assert out is buf.written and out in states.body_nodes
    assert list(out.meta["val"].shape) == [B, D]          # one token's output, no token axis


def test_a_buffer_the_loop_reads_is_refused_naming_the_line():
    _gm, _ph, u = _traced(buffer_read_in_loop, 5)
    inputs = classify_inputs(u)
    with pytest.raises(UnsupportedTTTError) as e:
        split_buffer(u, inputs, carried_states(u, inputs))
    line = buffer_read_in_loop.__code__.co_firstlineno + 4
    msg = str(e.value)
    assert f"test_rollup_phases.py:{line}" in msg and "`out`" in msg
    assert "read inside the loop" in msg and "torch.stack" in msg


def test_the_chunk_output_is_what_the_cat_reads():
    gm, _ph, u = _traced(apply_then_update, 6)
    inputs = classify_inputs(u)
    states = split_buffer(u, inputs, carried_states(u, inputs))
    assert states.buffer is None
    out = chunk_output(u, states)
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    assert out in cat.args[0] and out in u.iters[1]


# -- phase 4: order and the last chunk ---------------------------------------------------------

@pytest.mark.parametrize("fn, order", [(apply_then_update, "exclusive"),
                                       (update_then_apply, "inclusive"),
                                       (per_token, "exclusive"), (into_buffer, "exclusive")])
def test_order_is_whether_the_output_reads_the_update(fn, order):
    *_rest, tail = _phases(fn, 6)
    assert tail.order == order
    assert not tail.peeled and not tail.truncated and tail.last_chunk == "update"


def test_a_last_chunk_applied_after_the_loop_is_peeled():
    L = 8
    gm, _ph, u, _i, _s, _o, tail = _phases(last_chunk_after_loop, L)
    assert u.n_iter == L // C - 1
    assert tail.peeled and tail.last_chunk == "apply_only"
    assert tail.collector.target is aten.cat.default and tail.axis == 1
    assert tail.tail_nodes and all(n not in u.in_loop for n in tail.tail_nodes)
    assert any(n.target is aten.bmm.default for n in tail.tail_nodes)


def test_a_last_iteration_without_update_is_truncated():
    L = 8
    _gm, _ph, u, _i, _s, _o, tail = _phases(last_update_skipped, L)
    assert u.n_iter == L // C
    assert tail.truncated and not tail.peeled and tail.last_chunk == "apply_only"


@pytest.mark.parametrize("L", [7, 9])
def test_a_partial_last_chunk_still_updates(L):
    _gm, _ph, u, _i, _s, _o, tail = _phases(update_then_apply, L)
    assert u.n_iter == math.ceil(L / C)
    assert not tail.truncated and tail.last_chunk == "update"


def test_stacked_per_token_outputs():
    *_rest, tail = _phases(per_token, 5)
    assert tail.stacked and tail.collector.target is aten.stack.default and tail.axis == 1


def test_per_token_outputs_written_into_a_buffer_are_stacked():
    *_rest, tail = _phases(per_token_into_buffer, 5)
    assert tail.stacked and tail.collector.target is aten.select_scatter.default
    assert tail.axis == 1 and tail.order == "inclusive" and tail.last_chunk == "update"


# -- the body and the outer graph --------------------------------------------------------------

_STYLES = [apply_then_update, update_then_apply, per_token, into_buffer, per_token_into_buffer,
           last_chunk_after_loop,
           last_update_skipped, starts_at_zero, initialised_in_loop, constant_in_body]


@pytest.mark.parametrize("fn", _STYLES)
def test_the_outer_graph_calls_the_loop_once_with_states_then_invariants(fn):
    gm = trace(fn, *_inputs(9 if fn is update_then_apply else 8))
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    rolled = roll_up(gm, *[ld for ld in find_loops(gm) if ld[0].function == fn.__name__][0])
    program = rolled.program
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [c.target for c in calls] == [LOOP_MODULE]
    (call,) = calls
    n_states = len(program.states)
    assert n_states == 1 and len(call.args) == n_states + len(program.invariants)
    start = call.args[0]
    if fn is starts_at_zero:
        assert start.target is aten.zeros.default
    elif fn is initialised_in_loop:
        assert start.target is aten.mul.Tensor and start.args[0] is ph[0]
    else:
        assert start is ph[0]
    assert set(ph[1:4]) <= set(call.args[n_states:])
    by_name = bind_loop_args(loop_interface(program), call.args)
    assert by_name[program.states[0].name] is start
    assert [by_name[i.name] for i in program.invariants] == list(call.args[n_states:])
    # nothing of the loop's iterations is left around the call
    assert not any(n.target in (aten.bmm.default, aten.slice.Tensor, aten.select.int)
                   for n in gm.graph.nodes if n.op == "call_function")
    # the body's placeholders follow the convention: states, streams, invariants
    kinds = [n.meta[KIND] for n in program.body.graph.nodes if n.op == "placeholder"]
    assert kinds == sorted(kinds, key=["state", "stream", "invariant"].index)


@pytest.mark.parametrize("fn", _STYLES)
@pytest.mark.parametrize("L", [4 * C, 5 * C])
def test_outer_graph_and_body_compute_the_loop(fn, L):
    """(The body is traced on whole chunks: its shapes are the traced ones, so the lengths
    here are whole chunks; partial chunks are lowering's business.)"""
    gm = trace(fn, *_inputs(L))
    rolled = roll_up(gm, *[ld for ld in find_loops(gm) if ld[0].function == fn.__name__][0])
    setattr(gm, LOOP_MODULE, _Interpreter(rolled.program))
    gm.recompile()
    args = _inputs(L, seed=1)
    got, want = gm(*args), fn(*args)
    for g, w in zip(got, want):
        assert rel_rms_error(g, w) <= TOLERANCE[torch.float32]


# -- a constant of Python numbers in a layer's loop converts -----------------------------------

class TokenWeightedLayer(torch.nn.Module):
    """Apply-then-update over chunks of 4, each key weighted by its place in the chunk with a
    ``torch.tensor`` of Python numbers built inside the loop."""

    def __init__(self, d: int):
        super().__init__()
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d)
        self.proj = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W = self.w0.expand(x.shape[0], -1, -1)
        outs = []
        for s in range(0, x.shape[1], 4):
            qi, ki, vi = q[:, s:s + 4], k[:, s:s + 4], v[:, s:s + 4]
            outs.append(qi @ W)
            weights = torch.tensor([0.125, 0.25, 0.5, 1.0])
            W = W + (ki * weights[:, None]).transpose(1, 2) @ vi
        return torch.cat(outs, dim=1)


@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 3), chunks=st.integers(3, 6), d=st.sampled_from([4, 8]),
       seed=st.integers(0, 2**16))
def test_a_constant_built_in_the_loop_converts_exactly(batch, chunks, d, seed):
    torch.manual_seed(seed)
    layer = TokenWeightedLayer(d)
    x = torch.randn(batch, 4 * chunks, d)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    others = [torch.randn(batch + 1, 4 * (chunks + 2), d), torch.randn(batch, 4 * chunks, d)]
    assert_same_function(converted, layer, others)
