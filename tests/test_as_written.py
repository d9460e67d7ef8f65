"""An exact conversion whose plan can lose to the user's own code (a loop over the chunks, the
block op) races the two on its first calls without gradients at each shape, and keeps the faster.

The clock is the test's: the user's forward and the plan each advance it by a drawn cost when they
run, so which side wins is known. Every call's output must be the source's, whichever side ran;
the user's forward must run exactly when the race's protocol says (plan first, then the code as
written, alternating, then the winner alone); plans on the token-causal and delta-rule ops
race only at lengths up to their op's chunk; calls with gradients, lossy conversions, forced
paths and the switch never race.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import example, given, settings, strategies as st

import ttt2la
import ttt2la.as_written as as_written
from ttt2la.as_written import CALLS_TO_DECIDE, PLAN, WRITTEN, AsWritten, race_as_written
from ttt2la.cli import ran_plans
import ttt2la.converted as converted_module
from ttt2la.converted import is_converted
from ttt2la.global_guard import GlobalGuard
from ttt2la.lowering.scan_choice import scanning
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import (DeltaMemoryLayer, DeltaProductLayer, GatedChunkMemory, LaCTFoldedLayer,
                        PerTokenTTTLayer)

#: 4 heads of 48 features at batch 1: 9,216 state elements, so the plan loops over the chunks.
LOOPING = dict(d_model=192, num_heads=4, chunk=8)
#: 4 heads of 4 features: the plan runs block_linear_attention.
ON_THE_OP = dict(d_model=16, num_heads=4, chunk=4)


class Costs:
    """A clock the two sides advance: ``plan`` and ``written`` seconds per call, counting the
    user's forward calls."""

    def __init__(self, monkeypatch, conv, plan: float, written: float | list[float],
                 cls=GatedChunkMemory):
        """``written`` may list the user's forward calls' costs in turn (the last repeats)."""
        self.now, self.written_calls = 0.0, 0
        # the instrument holds the test's patcher, so its counters read as no settings of the
        # layer's (a closure's plain values are guarded, ``global_guard``)
        self.patcher = monkeypatch
        monkeypatch.setattr(as_written, "_clock", lambda: self.now)
        forward = cls.forward
        costs = written if isinstance(written, list) else [written]

        def counted(module, *args, **kwargs):
            self.now += costs[min(self.written_calls, len(costs) - 1)]
            self.written_calls += 1
            return forward(module, *args, **kwargs)

        _forward_as_converted(monkeypatch, conv, cls, counted)
        state = conv._ttt2la
        for B in (1, 2):
            state.loop_for(B).register_forward_pre_hook(lambda *_: self._tick(plan))

    def _tick(self, seconds: float) -> None:
        self.now += seconds


def _forward_as_converted(monkeypatch, conv, cls, forward) -> None:
    """Set ``cls.forward`` to ``forward`` as if the layer had been converted with it: a forward
    rebound since conversion is otherwise a change the layer's guard sees (``global_guard``)
    and runs the code as written."""
    monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(conv._ttt2la, "outside", GlobalGuard.of(conv))


def _converted(kwargs, x):
    """The layer and its level-0 conversion, converted with racing on (as a user converts)."""
    torch.manual_seed(0)
    layer = GatedChunkMemory(**kwargs)
    with race_as_written(True):
        return layer, ttt2la.convert(layer, level=0, example_inputs=(x,))


def _expected_written_calls(calls: int, winner: str) -> int:
    """The user's forward calls in ``calls`` calls of a looping plan: every odd call while the
    race runs, then every call if the code as written won."""
    racing = min(calls, CALLS_TO_DECIDE)
    after = calls - racing
    return racing // 2 + (after if winner == WRITTEN else 0)


@settings(max_examples=8)
@example(plan_cost=1.0, written_cost=0.7, calls=3, batch=1)      # stopped while racing
@given(plan_cost=st.floats(0.5, 2.0), written_cost=st.floats(0.5, 2.0),
       calls=st.integers(1, CALLS_TO_DECIDE + 4), batch=st.sampled_from([1, 2]))
def test_every_call_is_the_sources_and_the_faster_side_is_kept(plan_cost, written_cost, calls,
                                                              batch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    layer, conv = _converted(LOOPING, x0)
    x = torch.randn(batch, 32, LOOPING["d_model"])
    with pytest.MonkeyPatch.context() as mp:
        with torch.no_grad():
            want = layer(x)
        costs = Costs(mp, conv, plan_cost, written_cost)
        with race_as_written(True), torch.no_grad():
            for _ in range(calls):
                assert rel_rms_error(conv(x), want) <= 1e-5
    race = conv._ttt2la.as_written.races[(batch, 32, torch.float32)]
    winner = WRITTEN if written_cost < plan_cost * (1 - as_written.MARGIN) else PLAN
    assert race.winner == (winner if calls >= CALLS_TO_DECIDE else None)
    timed = max(0, min(calls, CALLS_TO_DECIDE) - 2)      # the first call of each side is untimed
    assert (len(race.plan), len(race.written)) == ((timed + 1) // 2, timed // 2)
    assert costs.written_calls == _expected_written_calls(calls, winner)
    shape = AsWritten.shape(batch, 32)
    assert shape == f"batch {batch}, length 32, without gradients"
    runs = conv.ttt2la_report.layers[0].runs
    racing = race.winner is None and calls >= 2         # the user's forward has run
    assert (shape in runs) == (race.winner == WRITTEN or racing)
    assert (racing and runs[shape].startswith("racing: the plan and the user's own loop take "
                                               "turns")) == racing, runs
    said = f"- {shape}: as written: the user's own loop ran faster"
    assert (said in conv.ttt2la_report.to_markdown()) == (race.winner == WRITTEN)
    assert ("as written" in ran_plans(conv, batch)) == (race.winner == WRITTEN)


def test_each_shape_races_on_its_own(monkeypatch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    _layer, conv = _converted(LOOPING, x0)
    costs = Costs(monkeypatch, conv, plan=2.0, written=1.0)
    long, short = (torch.randn(1, L, LOOPING["d_model"]) for L in (32, 16))
    with race_as_written(True), torch.no_grad():
        for _ in range(CALLS_TO_DECIDE):
            conv(long)
        before = costs.written_calls
        conv(short)                  # a new shape: its race starts with the plan
        assert costs.written_calls == before
        conv(long)                   # the decided shape runs the code as written
        assert costs.written_calls == before + 1


def test_calls_with_gradients_never_race(monkeypatch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    _layer, conv = _converted(LOOPING, x0)
    costs = Costs(monkeypatch, conv, plan=2.0, written=1.0)
    x = torch.randn(1, 32, LOOPING["d_model"])
    with race_as_written(True):
        for _ in range(CALLS_TO_DECIDE + 2):
            conv(x).sum().backward()
    assert costs.written_calls == 0
    assert not conv._ttt2la.as_written.races


def test_a_plan_on_the_block_op_races_and_keeps_the_faster(monkeypatch):
    x0 = torch.randn(1, 16, ON_THE_OP["d_model"])
    layer, conv = _converted(ON_THE_OP, x0)
    x = torch.randn(1, 32, ON_THE_OP["d_model"])
    with torch.no_grad():
        want = layer(x)
    costs = Costs(monkeypatch, conv, plan=2.0, written=1.0)
    with race_as_written(True), torch.no_grad():
        for _ in range(CALLS_TO_DECIDE + 2):
            assert rel_rms_error(conv(x), want) <= 1e-5
    assert "block_linear_attention" in conv._ttt2la.loop_for(1).plan.implementation
    assert conv._ttt2la.as_written.races[(1, 32, torch.float32)].winner == WRITTEN
    assert costs.written_calls == _expected_written_calls(CALLS_TO_DECIDE + 2, WRITTEN)


#: Layers whose per-token loop runs on a token-causal or delta-rule op, with the longest length
#: at which they race: the op's chunk of 64 tokens (32 for two delta-rule steps a token).
PER_TOKEN = {"chunk_linear_attention": (lambda: PerTokenTTTLayer(16, 2), 64),
             "delta_rule": (lambda: DeltaMemoryLayer(16, 2), 64),
             "delta_rule, 2 steps a token": (lambda: DeltaProductLayer(16, 2, 2), 32)}


def _per_token(monkeypatch, op: str, plan: float, written: float):
    """The layer lowered onto ``op``, converted with racing on, and a clock on which its plan
    costs ``plan`` and its code as written ``written`` a call."""
    make, longest = PER_TOKEN[op]
    torch.manual_seed(0)
    layer = make()
    with race_as_written(True):
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(1, 16, 16),))
    assert op.split(",")[0] in conv._ttt2la.loop_for(1).plan.implementation
    return layer, conv, Costs(monkeypatch, conv, plan, written, cls=type(layer)), longest


@pytest.mark.parametrize("op", PER_TOKEN)
def test_a_per_token_plan_races_within_its_ops_chunk(monkeypatch, op):
    """A per-token loop lowered onto one call of an op replaces one step per token, but the op
    pads a short sequence to its chunk: up to that length the source can be the faster, so the
    plan races, and the report names the code as written where it won."""
    layer, conv, costs, longest = _per_token(monkeypatch, op, plan=2.0, written=1.0)
    for L in (8, longest):
        x = torch.randn(1, L, 16)
        with torch.no_grad():
            want = layer(x)
        costs.written_calls = 0
        with race_as_written(True), torch.no_grad():
            for _ in range(CALLS_TO_DECIDE + 2):
                assert rel_rms_error(conv(x), want) <= 1e-5
        assert conv._ttt2la.as_written.races[(1, L, torch.float32)].winner == WRITTEN
        assert costs.written_calls == _expected_written_calls(CALLS_TO_DECIDE + 2, WRITTEN)
        said = f"- {AsWritten.shape(1, L)}: as written: the user's own loop ran faster"
        assert said in conv.ttt2la_report.to_markdown()


@pytest.mark.parametrize("op", PER_TOKEN)
def test_a_per_token_plan_never_races_past_its_ops_chunk(monkeypatch, op):
    """Past the op's chunk the plan wins by a wide margin, and a race would only cost slow
    calls of the token loop at every new shape: the first call ends it."""
    _layer, conv, costs, longest = _per_token(monkeypatch, op, plan=2.0, written=1.0)
    for L in (longest + 1, 128):
        with race_as_written(True), torch.no_grad():
            for _ in range(CALLS_TO_DECIDE + 2):
                conv(torch.randn(1, L, 16))
        assert conv._ttt2la.as_written.races[(1, L, torch.float32)].winner == PLAN
    assert costs.written_calls == 0


@pytest.mark.parametrize("switch", ["race_as_written(False)", "scanning(False)"])
def test_the_switch_and_a_forced_path_run_the_plan_alone(monkeypatch, switch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    _layer, conv = _converted(LOOPING, x0)
    costs = Costs(monkeypatch, conv, plan=2.0, written=1.0)
    x = torch.randn(1, 32, LOOPING["d_model"])
    off = race_as_written(False) if switch.startswith("race") else scanning(False)
    with race_as_written(True), off, torch.no_grad():
        for _ in range(CALLS_TO_DECIDE + 2):
            conv(x)
    assert costs.written_calls == 0


def test_a_lossy_conversion_never_races():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, 4, momentum=False, muon=False, base_lr=0.3)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 12, 8),))
    assert conv.ttt2la_report.layers[0].exact is False
    state = next(m._ttt2la for m in conv.modules() if is_converted(m))
    assert state.as_written is None


def test_the_user_code_failing_leaves_the_plan(monkeypatch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    layer, conv = _converted(LOOPING, x0)
    x = torch.randn(1, 32, LOOPING["d_model"])
    with torch.no_grad():
        want = layer(x)

    def broken(module, *args, **kwargs):
        raise RuntimeError("the user's code fails here")

    _forward_as_converted(monkeypatch, conv, GatedChunkMemory, broken)
    with race_as_written(True), torch.no_grad():
        for _ in range(3):
            assert rel_rms_error(conv(x), want) <= 1e-5
    assert conv._ttt2la.as_written.races[(1, 32, torch.float32)].winner == PLAN


def test_the_conversions_checks_and_a_copy_start_no_race(monkeypatch):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    _layer, conv = _converted(LOOPING, x0)
    assert conv._ttt2la.as_written is not None and not conv._ttt2la.as_written.races
    Costs(monkeypatch, conv, plan=2.0, written=1.0)
    x = torch.randn(1, 32, LOOPING["d_model"])
    with race_as_written(True), torch.no_grad():
        for _ in range(CALLS_TO_DECIDE):
            conv(x)
    assert conv._ttt2la.as_written.races[(1, 32, torch.float32)].winner == WRITTEN
    again = copy.deepcopy(conv)
    assert not again._ttt2la.as_written.races


class NormalisedLinearAttention(nn.Module):
    """Causal linear attention with a normaliser of its own keys ``u``, token by token: two
    memories (``S`` and ``z``, the sum of ``u``, not of the keys, so ``z`` is no column of
    ``S``): no runtime op takes it and the generic plan prefix-sums both."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 4 * d, bias=False)

    def forward(self, x):
        q, k, v, u = (F.elu(t) + 1 for t in self.qkv(x).chunk(4, -1))
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        z = x.new_zeros(x.shape[0], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = S + k[:, t, :, None] * v[:, t, None, :]
            z = z + u[:, t]
            outs.append((q[:, t, None] @ S)[:, 0] / ((q[:, t] * z).sum(-1, keepdim=True) + 1e-6))
        return torch.stack(outs, 1)


def test_a_generic_plan_that_scans_races_and_keeps_the_faster(monkeypatch):
    """A generic plan that does not loop (every token's memories prefix-summed at once) can
    lose to the user's loop by far: it races like a looping one."""
    torch.manual_seed(0)
    layer = NormalisedLinearAttention()
    with race_as_written(True):
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(1, 12, 8),))
    x = torch.randn(1, 32, 8)
    with torch.no_grad():
        want = layer(x)
    costs = Costs(monkeypatch, conv, plan=2.0, written=1.0, cls=NormalisedLinearAttention)
    with race_as_written(True), torch.no_grad():
        for _ in range(CALLS_TO_DECIDE + 2):
            assert rel_rms_error(conv(x), want) <= 1e-5
    plan = conv._ttt2la.loop_for(1).plan
    assert plan.implementation == "torch.vmap(parallel)" and not plan.loops_over_chunks
    assert conv._ttt2la.as_written.races[(1, 32, torch.float32)].winner == WRITTEN
    assert costs.written_calls == _expected_written_calls(CALLS_TO_DECIDE + 2, WRITTEN)


class SurpriseMemory(nn.Module):
    """A Titans-style linear memory with its gradient written by hand: surprise momentum and a
    weight decay gated by the chunk's last token, a per-token step size, the two states held as
    one tuple; the generic plan loops over the chunks (``sequential: W, S``)."""

    def __init__(self, d: int = 16, chunk: int = 8):
        super().__init__()
        self.wk, self.wv, self.wq = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gates = nn.Linear(d, 3)
        self.C = chunk

    def forward(self, x):
        B, _, d = x.shape
        k = F.normalize(self.wk(x), dim=-1)
        v, q = self.wv(x), self.wq(x)
        lr, mom, dec = torch.sigmoid(self.gates(x)).unbind(-1)
        state = (x.new_zeros(B, d, d), x.new_zeros(B, d, d))
        outs = []
        for kc, vc, qc, lc, mc, dc in zip(*(t.split(self.C, 1) for t in (k, v, q, lr, mom, dec))):
            W, S = state
            g = 2 * kc.transpose(1, 2) @ (lc.unsqueeze(-1) * (kc @ W - vc))
            S = mc[:, -1, None, None] * S - g
            W = (1 - 0.1 * dc[:, -1, None, None]) * W + S
            state = (W, S)
            outs.append(qc @ W)
        return torch.cat(outs, 1)


def test_a_preempted_call_does_not_decide_the_race(monkeypatch):
    """On a loaded machine a call preempted by another process gains a time slice (~4 ms) longer
    than the calls raced: the user's loop, faster on every call it ran alone, keeps its lead
    though two of its three timed calls were preempted (their median would be one of them), and
    the report's runs say the code as written runs."""
    torch.manual_seed(0)
    layer = SurpriseMemory()
    with race_as_written(True):
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 32, 16),))
    x = torch.randn(4, 64, 16)
    with torch.no_grad():
        want = layer(x)
    plan = conv._ttt2la.loop_for(4).plan
    # untimed, then timed: preempted, alone, preempted (the plan: 2 ms, every call)
    costs = Costs(monkeypatch, conv, plan=2e-3, written=[1.6e-3, 5.6e-3, 1.6e-3, 5.6e-3],
                  cls=SurpriseMemory)
    conv._ttt2la.loop_for(4).register_forward_pre_hook(lambda *_: costs._tick(2e-3))
    with race_as_written(True), torch.no_grad():
        for _ in range(CALLS_TO_DECIDE + 2):
            assert rel_rms_error(conv(x), want) <= 1e-5
    assert plan.implementation == "torch.vmap(semi-parallel; sequential: W, S)"
    # the plan it raced called its chunks' graph without the trace's views onto their own shape
    ran = list(plan._at_shapes.values())
    assert ran and not any(n.target in (torch.Tensor.expand, torch.ops.aten.expand.default)
                           for gm in ran for n in gm.graph.nodes), [gm.code for gm in ran]
    race = conv._ttt2la.as_written.races[(4, 64, torch.float32)]
    assert race.written == pytest.approx([5.6e-3, 1.6e-3, 5.6e-3]) and race.winner == WRITTEN
    runs = conv.ttt2la_report.layers[0].runs
    assert runs[AsWritten.shape(4, 64)].startswith(
        "as written: the user's own loop ran faster (1.6 ms against 2 ms for the plan, the "
        "fastest of 3 calls each"), runs
    assert costs.written_calls == _expected_written_calls(CALLS_TO_DECIDE + 2, WRITTEN)


class ChunkMeanGate(nn.Module):
    """A decay per chunk and head from the chunk's mean token: padding a partial last chunk with
    zeros would change its mean, so the plan cannot run such a length."""

    def __init__(self, d: int = 16, heads: int = 2, chunk: int = 4):
        super().__init__()
        self.H, self.D, self.C = heads, d // heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, heads)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.H, self.D).permute(2, 0, 3, 1, 4)
        W = x.new_zeros(B, self.H, self.D, self.D)
        outs = []
        for s in range(0, L, self.C):
            a = torch.sigmoid(self.gate(x[:, s:s + self.C].mean(1)))
            W = a[:, :, None, None] * W + k[:, :, s:s + self.C].transpose(-1, -2) @ v[:, :, s:s + self.C]
            outs.append(q[:, :, s:s + self.C] @ W)
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, d)


def test_a_partial_last_chunk_the_plan_cannot_pad_runs_as_written_when_exact():
    """Every length the layer as written takes, the exact conversion takes: a partial last chunk
    whose zero padding would change the chunk's mean runs the code as written (the report's runs
    say so), outputs and gradients equal; a lossy conversion, which has no code as written to
    run, raises ``PartialChunkError``."""
    from equivalence import assert_same_function

    torch.manual_seed(0)
    layer = ChunkMeanGate()
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 16),))
    ragged = torch.randn(3, 10, 16)
    assert_same_function(converted, layer, [ragged, torch.randn(3, 12, 16)])
    runs = converted.ttt2la_report.layers[0].runs
    assert runs["batch 3, length 10, partial last chunk"].startswith(
        "as written: the plan would pad the last chunk, and the padding changes"), runs
    assert not any("partial" in key for key in runs if "length 12" in key)
    lossy = copy.deepcopy(converted)
    lossy._ttt2la.as_written = None          # what a lossy conversion holds: nothing to run
    with pytest.raises(ttt2la.PartialChunkError, match="The last chunk is partial") as refused:
        lossy(ragged)
    assert "test_as_written.py:" in (refused.value.where or "") and refused.value.where in \
        str(refused.value)


class MeanLossStep(nn.Module):
    """A chunked TTT step on an inner loss averaged over the chunk (``F.mse_loss``'s default, a
    ``.mean()``, a sum divided by the token count, or a step size from the chunk's mean key
    norm): the gradient of a mean holds
    ``1 / (C·D)``, a number the traced body keeps as a constant, where the code as written
    divides a partial chunk of ``r`` tokens by ``r·D``."""

    def __init__(self, loss: str, d: int = 16, chunk: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(d, d) * d ** -0.5)
        self.C, self.loss = chunk, loss

    def step(self, W, k, v):
        if self.loss == "mse_loss":
            return torch.func.grad(lambda w: F.mse_loss(k @ w, v))(W)
        if self.loss == "mean":
            return torch.func.grad(lambda w: -((k @ w) * v).mean())(W)
        if self.loss == "sum over the count":
            return torch.func.grad(lambda w: ((k @ w - v) ** 2).sum() / k.shape[1])(W)
        rate = 1.0 / (1.0 + k.pow(2).sum(-1).mean(-1))          # a forward mean, not a gradient
        return -rate[:, None, None] * k.transpose(1, 2) @ v

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = F.normalize(k, dim=-1)
        W = self.W0.expand(x.shape[0], -1, -1)
        outs = []
        for s in range(0, x.shape[1], self.C):
            W = W - self.step(W, k[:, s:s + self.C], v[:, s:s + self.C])
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("loss", ["mse_loss", "mean", "sum over the count", "mean step size"])
def test_a_mean_over_the_chunk_is_never_padded(loss):
    """A number the code derives from the chunk's length (a mean's divisor, in its gradient or in
    the forward pass) makes zero padding change the partial last chunk: those lengths run as
    written, exactly, the report saying why and where; whole chunks run the plan. The reason
    names the whole chunk's number and no number for the partial one: the trace's partial chunk
    is the probe length's, not the call's (5 and 1 tokens here)."""
    import re

    from equivalence import assert_same_function

    torch.manual_seed(0)
    layer = MeanLossStep(loss)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 32, 16),))
    assert_same_function(converted, layer, [torch.randn(2, T, 16) for T in (32, 45, 5, 1)])
    runs = converted.ttt2la_report.layers[0].runs
    for T in (45, 5, 1):
        assert "the chunk's length" in runs[f"batch 2, length {T}, partial last chunk"], runs
        assert "test_as_written.py:" in runs[f"batch 2, length {T}, partial last chunk"], runs
        partial = re.search(r"in a whole chunk, (.*?) in a partial one",
                            runs[f"batch 2, length {T}, partial last chunk"])
        assert partial and not re.search(r"\d", partial.group(1)), runs
    assert not any("partial" in key for key in runs if "length 32" in key)


class _Ops(TorchDispatchMode):
    """The aten ops a block of code dispatches, counted by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@settings(max_examples=6, deadline=None)
@given(batch=st.sampled_from([1, 2]), length=st.sampled_from([16, 32]))
def test_a_shape_kept_as_written_runs_the_users_code_and_the_guards_alone(batch, length):
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    layer, conv = _converted(LOOPING, x0)
    x = torch.randn(batch, length, LOOPING["d_model"])
    state = conv._ttt2la
    with pytest.MonkeyPatch.context() as mp:
        Costs(mp, conv, plan=2.0, written=1.0)
        with race_as_written(True), torch.no_grad():
            for _ in range(CALLS_TO_DECIDE):
                conv(x)
    assert state.as_written.races[(batch, length, torch.float32)].winner == WRITTEN
    fetched = []
    with pytest.MonkeyPatch.context() as mp:
        outer_for = type(state).outer_for
        mp.setattr(type(state), "outer_for",
                   lambda self, B, L: fetched.append((B, L)) or outer_for(self, B, L))
        with race_as_written(True), torch.no_grad():
            with _Ops() as original:
                want = layer(x)
            with _Ops() as converted:
                got = conv(x)
    assert rel_rms_error(got, want) <= 1e-5
    assert converted.ops == original.ops
    assert fetched == []            # nothing of the plan, its graph included, is touched
    with pytest.MonkeyPatch.context() as mp:
        costs = Costs(mp, conv, plan=2.0, written=1.0)
        with race_as_written(True):
            conv(x).sum().backward()        # with gradients: the plan, as before the race
        assert costs.written_calls == 0
        hooked = []
        conv.q.register_forward_hook(lambda *_: hooked.append(1))
        with race_as_written(True), torch.no_grad():
            assert rel_rms_error(conv(x), want) <= 1e-5
        assert hooked == [1]            # the code as written ran, and with it the hook


def _kept(conv, x) -> None:
    """Race ``conv`` at ``x``'s shape until the code as written is kept there, and call it
    there once more (which makes its input shapes known)."""
    with pytest.MonkeyPatch.context() as mp:
        Costs(mp, conv, plan=2.0, written=1.0)
        with race_as_written(True), torch.no_grad():
            for _ in range(CALLS_TO_DECIDE + 1):
                conv(x)
    assert conv._ttt2la.as_written.races[(*x.shape[:2], x.dtype)].winner == WRITTEN


@settings(max_examples=4, deadline=None)
@given(batch=st.sampled_from([1, 2]), length=st.sampled_from([16, 32]),
       keyword=st.booleans())
def test_a_kept_shape_asks_no_guard_and_reads_what_changed_itself(batch, length, keyword):
    """A call at a kept shape runs the code as written before the layer's guards are asked:
    that code reads the layer's hooks, attributes and weights itself, so a call after they
    changed is the changed layer's as written, positional or by keyword, and the walk of the
    modules, the hooks' and attributes' guards are not run; given as the example was, it is
    known by its shapes before it is spelled (``kept_as_given``)."""
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    layer, conv = _converted(LOOPING, x0)
    x = torch.randn(batch, length, LOOPING["d_model"])
    _kept(conv, x)
    call = (lambda m: m(x=x)) if keyword else (lambda m: m(x))
    asked, spelled = [], []
    with pytest.MonkeyPatch.context() as mp:
        walk, layout = conv._ttt2la.walk, conv._ttt2la.layout
        mp.setattr(type(walk), "quiet", lambda self, module: asked.append("walk"))
        mp.setattr(converted_module, "hooked", lambda module: asked.append("hooks"))
        spell = type(layout).spelled
        mp.setattr(type(layout), "spelled",
                   lambda self, *a: spelled.append(1) or spell(self, *a))
        with race_as_written(True), torch.no_grad():
            for m in (layer, conv):
                m.chunk = LOOPING["chunk"] * 2                  # an attribute the loop reads
                m.q.weight.data.mul_(1.5)                       # weights changed in place
            assert rel_rms_error(call(conv), call(layer)) <= 1e-5
            assert rel_rms_error(call(conv), call(layer)) <= 1e-5
    assert asked == []
    # given as the example was, positionally, the call is known by its shapes before spelling
    assert bool(spelled) == keyword


def test_a_kept_shape_compiles_whole():
    """A shape whose race kept the code as written is not asked for under a compiler (no race
    runs there): the converted layer compiled with ``fullgraph=True`` at that shape traces its
    plan, and gives the layer's outputs."""
    from ttt2la.zoo import PerTokenTTTLayer

    torch.manual_seed(0)
    layer = PerTokenTTTLayer(8, 2)
    with race_as_written(True):
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    x = torch.randn(2, 16, 8)
    with pytest.MonkeyPatch.context() as mp:
        Costs(mp, conv, plan=2.0, written=1.0, cls=PerTokenTTTLayer)
        with race_as_written(True), torch.no_grad():
            for _ in range(CALLS_TO_DECIDE + 1):
                conv(x)
    assert conv._ttt2la.as_written.given
    with race_as_written(True), torch.no_grad(), torch.compiler.set_stance("default"), \
            torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        y = torch.compile(conv, fullgraph=True, backend="eager")(x)
        torch._dynamo.reset()
    assert rel_rms_error(y, layer(x)) <= 1e-5


def test_a_kept_shape_runs_a_forward_rebound_since(monkeypatch):
    """A call at a kept shape runs the class's ``forward`` as it is at the call: one rebound
    since conversion (a wrapper that patches the class) runs, not the one first kept."""
    x0 = torch.randn(1, 16, LOOPING["d_model"])
    layer, conv = _converted(LOOPING, x0)
    x = torch.randn(1, 32, LOOPING["d_model"])
    _kept(conv, x)
    forward = GatedChunkMemory.forward
    monkeypatch.setattr(GatedChunkMemory, "forward",
                        lambda module, *a, **k: forward(module, *a, **k) * 2.0)
    with race_as_written(True), torch.no_grad():
        want = layer(x)
        assert rel_rms_error(conv(x), want) <= 1e-5
        assert rel_rms_error(conv(x), want) <= 1e-5
