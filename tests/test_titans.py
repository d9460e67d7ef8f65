"""Titans-like neural memories (``ttt2la.zoo.titans``): the expected verdict at levels 0–2.

A linear memory trained on the MSE loss is a delta rule: it converts exactly (outputs, the
returned ``MemoryState`` and every parameter gradient within the fp32 tolerance of the layer as
written) for every batch size and every length from 1 to 5·C+7 (C the memory's window), with and
without weight decay, onto the log-depth matrix-affine scan; with momentum the joint state
(weights, surprise) is affine too and is scanned stacked, exactly. One memory is converted and
called with a ``store_mask`` (tokens not stored). The layer-normed MLP memory is refused, naming
the norm and its line. The memories read windows from ``torch.arange(...).tolist()``, take
per-chunk gradients by ``vmap(grad(loss))`` and return a named tuple: all three must trace.
"""
from __future__ import annotations

import inspect
import re

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo.titans import MemoryState, TitansLinearMemory, TitansMLPMemory, scan_gates

TOL = TOLERANCE[torch.float32]
pytestmark = pytest.mark.usefixtures("always_scan")

#: (dim, chunk_size, window_chunks, weight_decay, momentum, store_mask) of the linear memories
#: checked (one trace each: the sizes vary across them); a memory converted with a store mask
#: is called with one.
LINEAR = {
    "plain": (3, 2, 2, False, False, False),
    "decay": (5, 1, 4, True, False, True),
    "momentum": (4, 2, 2, True, True, False),
}


@module_scoped.cached
def converted(name: str, level: int):
    dim, chunk, window_chunks, decay, momentum, masked = LINEAR[name]
    torch.manual_seed(dim)
    layer = TitansLinearMemory(dim, chunk, window_chunks=window_chunks, weight_decay=decay,
                               momentum=momentum)
    with torch.no_grad():                 # larger gates than at initialisation: decay matters
        layer.to_decay.bias.fill_(-1.0)
    example = torch.randn(2, 2 * chunk * window_chunks + 1, dim)
    example = (example, torch.rand(example.shape[:2]) > 0.3) if masked else (example,)
    return layer, ttt2la.convert(layer, level=level, example_inputs=example)


def outputs_and_grads(model, x, *mask):
    """Retrieved values, the returned state and every parameter gradient of a fixed random
    functional of both."""
    model.zero_grad(set_to_none=True)
    y, state = model(x, *mask)
    assert isinstance(state, MemoryState) and state.seq_index == x.shape[1]
    parts = [y, state.weights] + ([] if state.momentum is None else [state.momentum])
    g = torch.Generator().manual_seed(3)
    sum((p * torch.randn(p.shape, generator=g)).sum() for p in parts).backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for n, p in model.named_parameters()}
    return [p.detach() for p in parts], grads


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(sorted(LINEAR)), level=st.integers(0, 2), batch=st.integers(1, 3),
       t_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_linear_memory_converts_exactly(name, level, batch, t_frac, seed):
    layer, fast = converted(name, level)
    dim, chunk, window_chunks, _, momentum, masked = LINEAR[name]
    report = fast.ttt2la_report
    assert report.exact, report
    plans = set(re.findall(r"torch\.vmap\([^)]*\)", str(report.to_dict())))
    scan = "matrix-affine scan: weights + surprise" if momentum else "matrix-affine scan: weights"
    assert plans == {f"torch.vmap(semi-parallel; {scan})"}, plans
    C = chunk * window_chunks
    T = 1 + round(t_frac * (5 * C + 6))                           # 1 .. 5·C + 7
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, dim, generator=g)
    mask = (torch.rand(batch, T, generator=g) > 0.3,) if masked else ()
    want, g_want = outputs_and_grads(layer, x, *mask)
    got, g_got = outputs_and_grads(fast, x, *mask)
    for a, b, what in zip(got, want, ("output", "weights", "momentum")):
        assert rel_rms_error(a, b) <= TOL, (what, T, rel_rms_error(a, b))
    for n, g in g_want.items():
        assert rel_rms_error(g_got[n], g) <= TOL, (n, T, rel_rms_error(g_got[n], g))


def _line_of(cls, text: str) -> int:
    lines, start = inspect.getsourcelines(cls)
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


def test_layer_normed_mlp_memory_is_refused_naming_the_norm():
    torch.manual_seed(0)
    layer = TitansMLPMemory(4, 2, window_chunks=2)
    with pytest.raises(ttt2la.NonReducibleError) as err:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 9, 4),))
    line = _line_of(TitansMLPMemory, "F.layer_norm(")
    message = str(err.value)
    assert "layer_norm" in message and f"titans.py:{line}" in message, message
    assert "layer norm" in message, message


@pytest.mark.parametrize("level", [1, 2])
def test_freezing_the_mlp_memory_s_first_layer_is_refused_naming_its_steps(level):
    """Each iteration is a window of chunks whose later chunks read ``w1`` stepped by the earlier
    ones (its steps scanned over the window): freezing the ``w1`` carried between windows
    would not freeze it, so ``freeze_theta`` refuses, naming a line of those steps."""
    torch.manual_seed(0)
    layer = TitansMLPMemory(6, 2, window_chunks=2)     # no size a window's
    with pytest.raises(ttt2la.UnsupportedTTTError) as err:
        ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 9, 6),))
    message = str(err.value)
    assert "stepped within an iteration" in message, message
    steps = [inspect.getsourcelines(f) for f in (scan_gates, TitansMLPMemory.store)]
    assert any(f"titans.py:{start + i}" in message
               for lines, start in steps for i in range(len(lines))), message


def test_strict_false_keeps_the_mlp_memory_as_written_or_refuses_to_freeze_it():
    """``strict=False`` at level 0 leaves the MLP memory as written (same outputs and state); at
    level 2 ``freeze_theta`` refuses: each iteration is a window of chunks whose later chunks
    read ``w1`` stepped by the earlier ones, so freezing the ``w1`` carried between windows
    would not freeze it."""
    torch.manual_seed(0)
    layer = TitansMLPMemory(6, 2, window_chunks=2)     # no size a window's
    x = torch.randn(2, 9, 6)
    kept = ttt2la.convert(layer, level=0, example_inputs=(x,), strict=False)
    y, state = kept(x)
    y_ref, state_ref = layer(x)
    assert torch.equal(y, y_ref)
    assert isinstance(state, MemoryState) and set(state.weights) == {"w1", "w2"}
    for k in state.weights:
        assert torch.equal(state.weights[k], state_ref.weights[k])
    with pytest.raises(ttt2la.UnsupportedTTTError, match="stepped within an iteration.*titans.py"):
        ttt2la.convert(layer, level=2, example_inputs=(x,), strict=False)


def test_coupled_affine_states_are_scanned_stacked():
    """A memory and its momentum, ``M' = 0.9 M − kᵀ(k W − v)`` and ``W' = W + 0.1 M'``: one
    affine map of ``[W; M]``; the stacked scan equals the loop run chunk by chunk, outputs,
    final states and the gradients of the initial states."""
    from test_executors import inputs_for
    from ttt2la.analysis import analyze
    from ttt2la.frontend.build import program_from_body
    from ttt2la.lowering import lower
    from ttt2la.lowering.lift_delta import lift_delta

    def body(W, M, k, v, q):
        M2 = 0.9 * M - k.transpose(-1, -2) @ (k @ W - v)
        W2 = W + 0.1 * M2
        return (W2, M2), (q @ W2,)

    g = torch.Generator().manual_seed(0)
    program = program_from_body(
        body, states=dict(W=torch.randn(2, 3, 4, generator=g), M=torch.zeros(2, 3, 4)),
        streams=dict(k=torch.randn(2, 2, 3, generator=g) * 0.3,
                     v=torch.randn(2, 2, 4, generator=g), q=torch.randn(2, 2, 3, generator=g)),
        chunk_size=2, order="inclusive", last_chunk="update")
    analysis = analyze(program)
    plan = lift_delta(program, analysis, analysis.schedule)
    assert plan is not None
    results = []
    for run in (plan, lower(program, None, schedule="recurrent")):
        states0, invariants = inputs_for(program, 9, 0)
        outputs, finals = run(states0, invariants)
        loss = sum((o * torch.cos(torch.arange(o.numel()).view(o.shape))).sum()
                   for o in [*outputs, *finals])
        results.append([*outputs, *finals, *torch.autograd.grad(loss, states0)])
    assert "matrix-affine scan: W + M" in plan.implementation, plan.implementation
    for got, want in zip(*results):
        assert rel_rms_error(got, want) <= TOL, rel_rms_error(got, want)


@pytest.mark.parametrize("momentum", [False, True])
def test_a_large_memory_loops_over_chunks_with_every_batched_value_vmapped(momentum):
    """At dim 64 and batch 4 the cost rule loops over the chunks; the values around the loop
    (the windows' features, the outputs) still run as one ``vmap`` over the chunks, not a loop
    fallback (a view of a chunk of a stream refused for its strides once forced one), exact."""
    from ttt2la.lowering.lift_delta import scanning

    torch.manual_seed(0)
    layer = TitansLinearMemory(64, 16, momentum=momentum)
    fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(1, 64, 64),))
    x = torch.randn(4, 256, 64)
    with torch.no_grad(), scanning(None):
        got, want = fast(x), layer(x)
    ran = fast.ttt2la_report.layers[0].runs["batch 4"]
    assert "sequential: weights" in ran and "fallback" not in ran, ran
    for a, b in ((got[0], want[0]), (got[1].weights, want[1].weights)):
        assert rel_rms_error(a, b) <= TOL


def test_the_lossy_steps_say_what_they_leave_in_a_memory_with_momentum():
    """At level 6 nothing in the memory has the forms steps 1, 4 and 5 rewrite, and each says
    what it found: no Θ (the weights are the final layer); a rate of one value per token that
    reaches the update through the weighted loss; and the surprise, a momentum scanned token by
    token, named at its line rather than called absent. The layer stays exact."""
    layer, conv = converted("momentum", 6)
    report, = conv.ttt2la_report.layers
    steps = {p.name: p for p in report.passes}
    assert steps["freeze_theta"].status == "already_satisfied"
    assert "(weights) are the final layer" in steps["freeze_theta"].reason
    lr = steps["absorb_lr"]
    assert lr.status == "not_applicable" and "hold one value per token" in lr.reason, lr.reason
    assert "per token and feature" not in lr.reason
    momentum = steps["remove_momentum"]
    assert momentum.status == "not_applicable", momentum.reason
    line = _line_of(TitansLinearMemory.__mro__[1], "surprise = {**surprise")
    assert f"surprise (`torch.select` at zoo/titans.py:{line})" in momentum.reason, momentum.reason
    assert "enters the update of weights" in momentum.reason, momentum.reason
    assert report.exact
