"""A delta-rule TTT layer (linear memory, MSE loss, ``torch.func.grad``) converts exactly onto the
log-depth matrix-affine scan: per-chunk and per-token loops, with and without weight decay, the
memory stored ``[in, out]`` (``k @ W``) or ``[out, in]`` (``k @ W.mT``). The converted
layer equals the layer's own loop (fp32, relative RMS ≤ 1e-5) in outputs and every parameter
gradient for every length from 1 to 5·C+7, and its op count grows with the chunks only as the
scan's depth."""
from __future__ import annotations

import math

import module_scoped
import torch
import torch.nn as nn
import torch.nn.functional as F
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from test_executors import inputs_for, make_program
from ttt2la.analysis import analyze
from ttt2la.lowering import lower
from ttt2la.lowering.lift_delta import DeltaScanPlan, lift_delta, scan_pays, scanning
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error, training_step_ops

D = 6


pytestmark = pytest.mark.usefixtures("always_scan")


class DeltaMemory(nn.Module):
    """One gradient step of ``lr·Σ‖f(k) − v‖²`` per chunk of ``chunk`` tokens on a linear memory
    ``f(k) = k W``, optionally after decaying it by ``1 − decay``; reads ``q W`` after the step."""

    def __init__(self, chunk: int, decay: float | None, transposed: bool, lr: float = 0.15):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.w0 = nn.Parameter(torch.randn(D, D) * 0.3)
        self.chunk, self.decay, self.transposed, self.lr = chunk, decay, transposed, lr

    def read(self, W, x):
        return x @ W.mT if self.transposed else x @ W

    def forward(self, x):
        q, v = self.wq(x), self.wv(x)
        k = F.normalize(self.wk(x), dim=-1)
        B, T, _ = x.shape
        W = self.w0.expand(B, D, D)

        def loss(W, k, v):
            return ((self.read(W, k) - v) ** 2).sum()

        outs = []
        for s in range(0, T, self.chunk):
            qi, ki, vi = q[:, s:s + self.chunk], k[:, s:s + self.chunk], v[:, s:s + self.chunk]
            if self.decay is not None:
                W = W * (1.0 - self.decay)
            W = W - self.lr * torch.func.grad(loss)(W, ki, vi)
            outs.append(self.read(W, qi))
        return torch.cat(outs, dim=1)


LAYERS = [(4, None, False), (3, 0.1, True), (1, 0.02, False)]


@module_scoped.cached
def converted(chunk, decay, transposed):
    torch.manual_seed(chunk)
    layer = DeltaMemory(chunk, decay, transposed)
    example = torch.randn(2, 6 * chunk, D)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(example,))


@settings(max_examples=15, deadline=None)
@given(which=st.integers(0, len(LAYERS) - 1), batch=st.integers(1, 3),
       t_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_delta_rule_layer_converts_exactly(which, batch, t_frac, seed):
    chunk, decay, transposed = LAYERS[which]
    layer, fast = converted(chunk, decay, transposed)
    runtime = fast.ttt2la_report.to_dict()["layers"][0]["runtime"]
    # one-token slices s:s+1 are the per-token delta rule: its chunked op, not the generic scan
    op = "delta_rule[torch](" if chunk == 1 else "matrix-affine scan"
    assert op in runtime, runtime
    T = 1 + round(t_frac * (5 * chunk + 6))  # 1 .. 5·C + 7
    x = torch.randn(batch, T, D, generator=torch.Generator().manual_seed(seed))
    assert_same_function(fast, layer, x, conditioned=True)


def _count(fast, chunks):
    """Forward + backward ops at ``chunks`` chunks, after one warm-up call (which builds the
    plan at this batch size)."""
    x = torch.randn(1, chunks * 4, D, generator=torch.Generator().manual_seed(0))
    return training_step_ops(fast, x)


def test_op_count_grows_only_with_the_scan_depth():
    _, fast = converted(4, None, False)
    c16, c32, c256 = (_count(fast, n) for n in (16, 32, 256))
    per_level = c32 - c16
    assert 0 < per_level < c16 / 2, (c16, c32)
    assert c256 <= c16 + (math.log2(256) - math.log2(16)) * per_level, (c16, c32, c256)


shapes = st.fixed_dictionaries(dict(
    B=st.sampled_from([1, 2]), d=st.sampled_from([2, 3, 5]), C=st.sampled_from([1, 2, 3, 4]),
    inclusive=st.booleans(), last_chunk=st.sampled_from(["update", "apply_only"]),
    n_len=st.integers(min_value=1, max_value=27), seed=st.integers(0, 3)))


def _assert_scan_equals_the_loop(program, plan, n_len: int, seed: int,
                                 op: str = "matrix-affine scan: W"):
    """``plan`` scans ``W`` (its implementation names ``op``) and equals the recurrent loop at
    length ``n_len``: outputs, final states and the gradients of states and invariants."""
    assert isinstance(plan, DeltaScanPlan)
    results = []
    for run in (plan, lower(program, None, schedule="recurrent")):
        states0, invariants = inputs_for(program, n_len, seed)
        outputs, finals = run(states0, invariants)
        leaves = [*states0, *invariants]
        loss = sum((o * torch.cos(torch.arange(o.numel()).view(o.shape))).sum()
                   for o in [*outputs, *finals])
        results.append([*outputs, *finals, *torch.autograd.grad(loss, leaves, allow_unused=True)])
    assert op in plan.implementation, plan.implementation
    for got, want in zip(*results):
        if want is None:
            assert got is None or not got.abs().any()
            continue
        assert rel_rms_error(got, want) <= TOLERANCE[torch.float32], rel_rms_error(got, want)


@settings(max_examples=15, deadline=None)
@given(shapes)
def test_scan_plan_matches_the_recurrent_loop_on_hand_built_programs(s):
    """The delta-rule body of the executor tests (per-token learning rates, both read orders,
    a last chunk that updates or is only read): the scan plan equals the loop, outputs, final
    states and gradients of states and invariants."""
    program = make_program("delta_rule", s["B"], s["d"], s["C"], s["inclusive"], s["last_chunk"])
    analysis = analyze(program)
    plan = lift_delta(program, analysis, analysis.schedule)
    # chunks of one token are tokens: the per-token delta rule's chunked op runs them, in every
    # order it takes (not an update-then-read loop whose last update is dead)
    on_the_op = s["C"] == 1 and not (s["inclusive"] and s["last_chunk"] == "apply_only")
    op = "delta_rule[torch](W" if on_the_op else "matrix-affine scan: W"
    _assert_scan_equals_the_loop(program, plan, s["n_len"], s["seed"], op)


def test_a_map_on_neither_side_runs_the_sequential_pass():
    """``W' = W − 0.1·(Wᵀ + kᵀk W)``: matrix-affine in ``W``, but not ``A·W`` or ``W·A``; the
    plan must notice and keep the sequential pass, exactly."""
    from ttt2la.frontend.build import program_from_body

    def body(W, k, q):
        W2 = W - 0.1 * (W.transpose(-1, -2) + k.transpose(-1, -2) @ k @ W)
        return (W2,), (q @ W2,)

    g = torch.Generator().manual_seed(0)
    program = program_from_body(body, states=dict(W=torch.randn(2, 3, 3, generator=g)),
                                streams=dict(k=torch.randn(2, 4, 3, generator=g),
                                             q=torch.randn(2, 4, 3, generator=g)),
                                chunk_size=2, order="inclusive", last_chunk="update")
    analysis = analyze(program)
    plan = lift_delta(program, analysis, analysis.schedule)
    assert plan is not None
    states0, invariants = inputs_for(program, 9, 0)
    got = plan(states0, invariants)
    want = lower(program, None, schedule="recurrent")(states0, invariants)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert rel_rms_error(a, b) <= TOLERANCE[torch.float32]
    assert "sequential: W" in plan.implementation
    assert "matrix-affine scan" not in plan.implementation


def _rectangular_program(dk: int, dv: int, transposed: bool, chunk: int):
    """A delta rule on a ``[dk, dv]`` memory (``[dv, dk]`` stored transposed: ``S·A``), so that
    reading ``A`` takes ``ceil(dk / dv)`` derivatives, each covering ``dv`` of its columns."""
    from ttt2la.frontend.build import program_from_body

    def body(W, k, v, q):
        read = (lambda x: x @ W.mT) if transposed else (lambda x: x @ W)
        err = (read(k) - v) * 0.3
        grad = err.transpose(-1, -2) @ k if transposed else k.transpose(-1, -2) @ err
        W2 = W - grad
        return (W2,), (read(q),)

    g = torch.Generator().manual_seed(dk * 10 + dv)
    shape = (2, dv, dk) if transposed else (2, dk, dv)
    return program_from_body(body, states=dict(W=torch.randn(shape, generator=g) * 0.3),
                             streams=dict(k=torch.randn(2, chunk, dk, generator=g) * 0.5,
                                          v=torch.randn(2, chunk, dv, generator=g),
                                          q=torch.randn(2, chunk, dk, generator=g)),
                             chunk_size=chunk, order="exclusive", last_chunk="update")


@settings(max_examples=12, deadline=None)
@given(dk=st.integers(1, 7), dv=st.integers(1, 7), transposed=st.booleans(),
       chunk=st.integers(1, 4), n_len=st.integers(1, 23))
def test_the_scan_reads_rectangular_maps_exactly(dk, dv, transposed, chunk, n_len):
    """Memories wider than tall and taller than wide, stored either way: the maps read off by
    derivatives along identity blocks give the loop's outputs, final state and gradients."""
    program = _rectangular_program(dk, dv, transposed, chunk)
    analysis = analyze(program)
    plan = lift_delta(program, analysis, analysis.schedule)
    # chunks of one token are the per-token delta rule, on its op (a key of one feature is a
    # scalar decay, no delta rule)
    op = "delta_rule[torch](W" if chunk == 1 and dk > 1 else "matrix-affine scan: W"
    _assert_scan_equals_the_loop(program, plan, n_len, 0, op)


def test_on_a_cpu_the_scan_runs_only_where_it_beats_the_loop():
    """The scan redoes every chunk's update and composes ``[r, r]`` maps: on a CPU it pays for
    small memories over many chunks and loses for large ones over few; on CUDA it always runs."""
    small, large = torch.zeros(16, 8, 8), torch.zeros(16, 64, 64)
    with scanning(None):                 # the rule as it stands, not the module's forced scan
        assert scan_pays([small], n=512, tokens=4)
        assert not scan_pays([large], n=32, tokens=64)
        assert not scan_pays([large], n=512, tokens=4)
        assert not scan_pays([small], n=2, tokens=4)       # the scan's fixed cost, two steps
        assert scan_pays([torch.zeros(16, 64, 64, device="meta")], n=32, tokens=64) is False
        # a memory with its momentum, stacked: the stacked rows count
        assert scan_pays([torch.zeros(4, 6, 6), torch.zeros(4, 6, 6)], n=256, tokens=4)
        with scanning(False):            # forced either way, then restored
            assert not scan_pays([small], n=512, tokens=4)
        assert scan_pays([small], n=512, tokens=4)


def test_a_large_memory_on_a_cpu_runs_the_loop_exactly_and_says_so():
    """A ``[48, 48]`` memory over three chunks: the plan loops (cheaper here), names it, and
    equals the recurrent loop."""
    program = _rectangular_program(48, 48, False, 32)
    analysis = analyze(program)
    plan = lift_delta(program, analysis, analysis.schedule)
    states0, invariants = inputs_for(program, 96, 0)
    with scanning(None):                 # the rule as it stands, not the module's forced scan
        got = plan(states0, invariants)
    assert "sequential: W" in plan.implementation and "scan" not in plan.implementation, \
        plan.implementation
    want = lower(program, None, schedule="recurrent")(states0, invariants)
    for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert rel_rms_error(a, b) <= TOLERANCE[torch.float32]
