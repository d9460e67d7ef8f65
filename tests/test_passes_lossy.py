"""Steps 4–6 (absorb_lr, remove_momentum, remove_muon): their rewrites, statuses, folds measured
on calibration data against hand computations, replay, and ``convert`` at levels 4–6.

Step 3 (collapse_mlp) has its own tests; here it is stood in for by a pass that changes nothing
(``already_satisfied``), so steps 4–6 are seen alone on the SwiGLU kernel, and the registry is
restored afterwards.
References are hand-written loops with their own literal constants (``references.py``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.zoo import lact_layer
from ttt2la.analysis import analyze
from ttt2la.calibration import LoopCalibration
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import execute
from ttt2la.lowering.lift import lift
from ttt2la.passes import (Pass, PassContext, PassResult, absorb_lr, get_pass, register,
                           remove_momentum, remove_muon, run_level)
from ttt2la.testing import TOLERANCE, rel_rms_error
from references import ref_ns3
from test_passes import lact_program, linear_attention, simple_program

B, D, H, C = 2, 3, 2, 4
FP32 = TOLERANCE[torch.float32]


class StandInCollapse(Pass):
    """Step 3 as a pass that changes nothing: steps 4–6 seen alone."""

    name, step, exact = "collapse_mlp", 3, False

    def run(self, program, context) -> PassResult:
        return self.result("already_satisfied", "stand-in: φ kept as it is")


@pytest.fixture(scope="module", autouse=True)
def step3():
    previous = get_pass(3)
    register(StandInCollapse())
    try:
        yield
    finally:
        register(previous)


def calibration_for(program, L, seed=0):
    """A ``LoopCalibration`` of one random sample of ``program``'s loop inputs at length ``L``,
    and that sample (``{name: tensor}``)."""
    g = torch.Generator().manual_seed(seed)
    sources = {s.source: s for s in program.streams}
    sample = {s.name: torch.randn(s.shape, generator=g) * 0.3 for s in program.states}
    for i, spec in enumerate(program.invariants):
        shape = list(spec.shape)
        if i in sources:
            shape[sources[i].axis] = L
        x = torch.randn(shape, generator=g)
        if spec.name in ("lr_seq", "beta", "n1", "alpha_seq"):
            x = x.abs() * 0.5 + 0.1
        sample[spec.name] = x
    return LoopCalibration([sample]), sample


def run(program, sample):
    """Outputs and final states of ``program`` on ``sample``, run chunk by chunk."""
    states0 = [sample[s.name] for s in program.states]
    invariants = [sample[i.name] for i in program.invariants]
    outs, finals = execute(program, analyze(program), states0, invariants, schedule="recurrent")
    return outs, finals


def silu(x):
    return x / (1 + torch.exp(-x))


# -- absorb_lr -------------------------------------------------------------------------------------

@pytest.mark.parametrize("L, updating", [(13, 3), (12, 2)])
def test_absorb_lr_folds_the_calibration_mean_of_the_updating_chunks(L, updating):
    """13 tokens: three full chunks update (the partial fourth is only read); 12 tokens: the
    third, full, chunk is only read (apply_only), so two chunks count."""
    program, _ = run_level(lact_program(), 3)
    cal, sample = calibration_for(program, L)
    context = PassContext(cal)
    result = absorb_lr(program, context)
    assert (result.name, result.step, result.status, result.exact) == (
        "absorb_lr", 4, "applied", False)
    hand = sample["lr_seq"][:, : updating * C].double().mean().item()
    assert result.folded == pytest.approx({"lr": hand}, rel=1e-12)
    assert context.folds["absorb_lr"] == result.folded
    assert "lr" in result.reason and "test_passes.py:" in result.reason
    assert "all rows" in result.reason and "batch size" in result.reason
    assert not any(n.users for n in program.stream_inputs()
                   if n.meta["ttt2la_name"] == "lr")


def heads_lr_body(W, k, v, q, lr):
    """Heads on an axis of their own: [B, H, C, D] chunks, lr [B, H, C, 1]."""
    return (W + k.transpose(-1, -2) @ (lr * v),), (q @ W,)


def heads_lr_program(lr_body=heads_lr_body):
    r = torch.randn
    return program_from_body(
        lr_body, states=dict(W=r(B, H, D, D)),
        streams=dict(k=r(B, H, 8, D), v=r(B, H, 8, D), q=r(B, H, 8, D),
                     lr=r(B, H, 8, 1).abs()),
        stream_axes=dict(k=2, v=2, q=2, lr=2), output_axes=(2,), chunk_size=C)


def test_absorb_lr_keeps_a_heads_axis_and_equals_the_hand_written_constant_lr_loop():
    program = heads_lr_program()
    cal, sample = calibration_for(program, 14)
    result = absorb_lr(program, PassContext(cal))
    assert result.status == "applied"
    lr = sample["lr_seq"]
    hand = lr[:, :, :12].double().mean(dim=(0, 2))          # three full chunks update
    got = torch.tensor(result.folded["lr"], dtype=torch.float64)
    assert got.shape == (1, H, 1, 1)
    assert torch.allclose(got.flatten(), hand.flatten(), rtol=1e-12, atol=0)
    # the rewritten loop is the loop with that constant lr per head
    W = sample["W"]
    k, v, q = (sample[n] for n in ("k_seq", "v_seq", "q_seq"))
    eta = hand.float().reshape(1, H, 1, 1)
    ys = []
    for s in range(0, 14, C):
        ys.append(q[:, :, s:s + C] @ W)
        W = W + k[:, :, s:s + C].transpose(-1, -2) @ (eta * v[:, :, s:s + C])
    outs, finals = run(program, sample)
    assert rel_rms_error(outs[0], torch.cat(ys, 2)) <= FP32
    assert rel_rms_error(finals[0], W) <= FP32


def test_absorb_lr_replay_and_unfolded():
    program = heads_lr_program()
    cal, sample = calibration_for(program, 14)
    measured = program.clone()
    context = PassContext(cal)
    first = absorb_lr(measured, context)
    replayed = program.clone()
    again = absorb_lr(replayed, PassContext(None, dict(context.folds)))
    assert again.folded == first.folded and "replayed" in again.reason
    a, b = run(measured, sample), run(replayed, sample)
    assert torch.equal(a[0][0], b[0][0]) and torch.equal(a[1][0], b[1][0])

    unfolded = program.clone()
    result = absorb_lr(unfolded, PassContext(cal, fold=False))
    assert result.status == "applied" and result.folded is None and "unfolded" in result.reason
    one = program.clone()
    ones = dict(sample, lr_seq=torch.ones_like(sample["lr_seq"]))
    assert rel_rms_error(run(unfolded, sample)[0][0], run(one, ones)[0][0]) <= FP32


def test_absorb_lr_already_satisfied_by_a_constant_expression():
    """``lr * 0.0 + 1.0`` is the constant 1, folded from the graph: exact, nothing measured."""
    def constant_lr(W, k, v, q, lr):
        return (W + k.transpose(-1, -2) @ ((lr * 0.0 + 1.0) * v),), (q @ W,)
    program = heads_lr_program(constant_lr)
    cal, sample = calibration_for(program, 13)
    before = run(program, sample)
    context = PassContext(cal)
    result = absorb_lr(program, context)
    assert (result.status, result.exact, result.folded) == ("already_satisfied", True, None)
    assert "constant 1" in result.reason and "absorb_lr" not in context.folds
    after = run(program, sample)
    assert rel_rms_error(after[0][0], before[0][0]) <= FP32
    assert absorb_lr(program, context).status == "already_satisfied"


def test_absorb_lr_already_satisfied_by_a_rate_per_head():
    def per_head_lr(W, k, v, q, lr):          # lr [1, H, 1, 1], the same for every token
        return (W + k.transpose(-1, -2) @ (lr * v),), (q @ W,)
    r = torch.randn
    program = program_from_body(
        per_head_lr, states=dict(W=r(B, H, D, D)),
        streams=dict(k=r(B, H, 8, D), v=r(B, H, 8, D), q=r(B, H, 8, D)),
        invariants=dict(lr=r(1, H, 1, 1).abs()), stream_axes=dict(k=2, v=2, q=2),
        output_axes=(2,), chunk_size=C)
    result = absorb_lr(program)
    assert (result.status, result.exact) == ("already_satisfied", True)
    assert "lr" in result.reason


def test_absorb_lr_without_a_per_token_learning_rate():
    result = absorb_lr(simple_program(linear_attention))       # a constant rate: already 1
    assert (result.status, result.exact) == ("already_satisfied", True)

    def never_updated(W, k, v, q):
        return (W,), (q @ W,)
    assert absorb_lr(simple_program(never_updated)).status == "not_applicable"

    def output_gate(W, k, v, q, g):            # a per-token scalar on the read, not the update
        return (W + k.transpose(-1, -2) @ v,), ((q @ W) * g,)
    program = program_from_body(output_gate, states=dict(W=torch.randn(B, D, D)),
                                streams=dict(k=torch.randn(B, 8, D), v=torch.randn(B, 8, D),
                                             q=torch.randn(B, 8, D), g=torch.randn(B, 8, 1)),
                                chunk_size=C)
    assert absorb_lr(program).status == "already_satisfied"


def test_absorb_lr_keeps_a_rate_per_token_and_feature_and_says_so():
    """LaCT's operators take a rate per token and feature (``lr: [b, l, d]``): no per-token
    factor, so it is kept — and the report says so instead of finding no rate."""
    def per_channel_lr(W, k, v, q, lr1):
        return (W + k.transpose(-1, -2) @ (lr1 * v),), (q @ W,)
    program = program_from_body(per_channel_lr, states=dict(W=torch.randn(B, D, D)),
                                streams=dict(k=torch.randn(B, 8, D), v=torch.randn(B, 8, D),
                                             q=torch.randn(B, 8, D),
                                             lr1=torch.rand(B, 8, D)), chunk_size=C)
    result = absorb_lr(program)
    assert (result.status, result.exact) == ("not_applicable", True)
    assert "lr1, named as learning rates" in result.reason and "per token and feature" in \
        result.reason


def test_absorb_lr_folds_a_rate_laid_out_with_the_tokens_last():
    """Weights laid out ``W @ x`` (the flame variants' layout): the update reads the rate
    transposed with the values, ``(vᵀ ⊙ lrᵀ) @ k`` with ``lr`` of ``[B, C, 1]`` — a per-token
    factor still, folded like ``lr ⊙ v``; a rate per token and feature laid out so is not."""
    def transposed(W, k, v, q, lr):
        return (W + (v.transpose(-1, -2) * lr.transpose(-1, -2)) @ k,), \
            ((W @ q.transpose(-1, -2)).transpose(-1, -2),)

    def program(width):
        return program_from_body(transposed, states=dict(W=torch.randn(B, D, D)),
                                 streams=dict(k=torch.randn(B, 8, D), v=torch.randn(B, 8, D),
                                              q=torch.randn(B, 8, D),
                                              lr=torch.rand(B, 8, width)), chunk_size=C)
    per_token = program(1)
    cal, sample = calibration_for(per_token, 12)
    result = absorb_lr(per_token, PassContext(cal))
    assert result.status == "applied", result.reason
    eta = sample["lr_seq"].double().mean().item()    # the three chunks update (the last one too)
    assert result.folded["lr"] == pytest.approx(eta, rel=1e-12)
    W, (k, v, q) = sample["W"], (sample[n] for n in ("k_seq", "v_seq", "q_seq"))
    ys = []
    for s in range(0, 12, C):
        ys.append((W @ q[:, s:s + C].transpose(-1, -2)).transpose(-1, -2))
        W = W + eta * v[:, s:s + C].transpose(-1, -2) @ k[:, s:s + C]
    outs, finals = run(per_token, sample)
    assert rel_rms_error(outs[0], torch.cat(ys, 1)) <= FP32
    assert rel_rms_error(finals[0], W) <= FP32
    assert absorb_lr(program(D)).status == "not_applicable"


def per_token_body(W, k, v, q, eta):
    """Per-token TTT, update then read: ``W_t = W_{t-1} + η_t k_tᵀ v_t`` per head."""
    W = W + eta[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))
    return (W,), ((q.unsqueeze(-2) @ W).squeeze(-2),)


def test_absorb_lr_on_a_per_token_loop_lowers_onto_the_token_causal_op():
    r = torch.randn
    program = program_from_body(
        per_token_body, states=dict(W=r(B, H, D, D)),
        streams=dict(k=r(B, 6, H, D), v=r(B, 6, H, D), q=r(B, 6, H, D),
                     eta=r(B, 6, H).abs()),
        chunk_size=1, per_token=True, order="inclusive")
    cal, sample = calibration_for(program, 6)
    reduced, results = run_level(program, 6, PassContext(cal))
    assert [r.status for r in results] == ["already_satisfied", "already_satisfied",
                                           "already_satisfied", "applied",
                                           "already_satisfied", "already_satisfied"]
    hand = sample["eta_seq"].double().mean(dim=(0, 1))              # per head, over B and t
    got = torch.tensor(results[3].folded["eta"], dtype=torch.float64)
    assert got.shape == (1, H) and torch.allclose(got.flatten(), hand, rtol=1e-12, atol=0)
    lifted = lift(reduced)
    assert lifted is not None and lifted.kind == "chunk"
    W, (k, v, q) = sample["W"], (sample[n] for n in ("k_seq", "v_seq", "q_seq"))
    ys = []
    for t in range(6):
        W = W + hand.float().reshape(1, H, 1, 1) * (k[:, t, :, :, None] * v[:, t, :, None, :])
        ys.append((q[:, t, :, None, :] @ W)[:, :, 0])
    outs, _ = execute(reduced, analyze(reduced), [sample["W"]],
                      [sample[i.name] for i in reduced.invariants])
    assert rel_rms_error(outs[0], torch.stack(ys, 1)) <= FP32


# -- remove_momentum -------------------------------------------------------------------------------

def test_remove_momentum_folds_the_mean_accumulation_factor():
    program, _ = run_level(lact_program(), 4)
    L = 21                                              # five full chunks, four update
    cal, sample = calibration_for(program, L)
    context = PassContext(cal)
    result = remove_momentum(program, context)
    assert (result.status, result.exact) == ("applied", False)
    assert [s.name for s in program.states] == ["w0", "w1", "w2"]
    assert "m1" in result.reason and "test_passes.py:" in result.reason
    beta = sample["beta"].double().flatten()            # one coefficient per row, every chunk
    n = 5
    factors = [sum(b ** (j - i) for j in range(i, n)) for i in range(n) for b in beta.tolist()]
    assert result.folded == pytest.approx({"m1": sum(factors) / len(factors)}, rel=1e-12)
    assert remove_momentum(program, context).status == "already_satisfied"


def test_remove_momentum_with_a_constant_coefficient_counts_the_updating_chunks():
    """``m = 0.9 m + g`` reads no coefficient per chunk: the fold still averages the
    accumulation factor over the chunks that update (three of four here)."""
    torch.manual_seed(0)
    layer = ttt2la.zoo.MuonStepLayer(8, 2, 4, beta=0.9)
    conv = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, 16, 8),))
    step, = [p for p in conv.ttt2la_report.layers[0].passes if p.name == "remove_momentum"]
    assert step.status == "applied"
    factors = [sum(0.9 ** (j - i) for j in range(i, 3)) for i in range(3)]
    assert list(step.folded.values()) == pytest.approx([sum(factors) / 3], rel=1e-12)


@pytest.mark.parametrize("make", [
    lambda: ttt2la.zoo.MuonStepLayer(8, 2, 4, beta=0.9),
    lambda: ttt2la.zoo.ViTTTClosedFormBlock(8, 2, update_gate=False)])
def test_remove_muon_finds_the_transform_of_an_increment_subtracted(make):
    """``W − η·NS(m)`` (Muon's step) and ``w − g/(‖g‖+1)`` (ViTTT's clipped step): the
    transform of a subtracted increment is removed like an added one's, never called absent."""
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(2, 16 if isinstance(layer, ttt2la.zoo.MuonStepLayer) else 6, 8)
    conv = ttt2la.convert(layer, level=6, example_inputs=(x,))
    step, = [p for p in conv.ttt2la_report.layers[0].passes if p.name == "remove_muon"]
    assert step.status == "applied", step.reason
    rules = " ".join(s.update_rule for s in conv.ttt2la_report.layers[0].states)
    assert "NS" not in rules and "Norm" not in rules, rules


def momentum_program(alpha_expr):
    def body(W, M, k, v, q, alpha):
        a = alpha_expr(alpha.mean(dim=1, keepdim=True))
        M_new = a * M + k.transpose(-1, -2) @ v
        return (W + M_new, M_new), (q @ W,)
    r = torch.randn
    return program_from_body(
        body, states=dict(W=r(B, D, D), M=torch.zeros(B, D, D)),
        streams=dict(k=r(B, 8, D), v=r(B, 8, D), q=r(B, 8, D), alpha=r(B, 8, 1).sigmoid()),
        chunk_size=C, last_chunk="apply_only")


def test_remove_momentum_per_chunk_coefficients_against_a_hand_computation():
    program = momentum_program(lambda a: a)
    program.states[1].role = "momentum"
    cal, sample = calibration_for(program, 18)          # chunks 0..3 full, 4 partial: 4 update
    result = remove_momentum(program, PassContext(cal))
    a = sample["alpha_seq"].double()
    alphas = [a[:, 4 * j:4 * j + 4].mean(dim=1).flatten() for j in range(4)]
    total, count = 0.0, 0
    for row in range(B):
        for i in range(4):
            weight, prod = 0.0, 1.0
            for j in range(i, 4):
                if j > i:
                    prod *= alphas[j][row].item()
                weight += prod
            total, count = total + weight, count + 1
    assert result.folded["M"] == pytest.approx(total / count, rel=1e-6)   # fp32 chunk means
    W, (k, v, q) = sample["W"], (sample[n] for n in ("k_seq", "v_seq", "q_seq"))
    ys, c = [], result.folded["M"]
    for s in range(0, 18, C):
        ys.append(q[:, s:s + C] @ W)
        W = W + c * (k[:, s:s + C].transpose(-1, -2) @ v[:, s:s + C])
    assert rel_rms_error(run(program, sample)[0][0], torch.cat(ys, 1)) <= FP32


def test_remove_momentum_with_a_zero_coefficient_is_already_satisfied_and_exact():
    program = momentum_program(lambda a: 0.0 * a)
    program.states[1].role = "momentum"
    cal, sample = calibration_for(program, 13)
    before = run(program, sample)[0][0]
    result = remove_momentum(program, PassContext(cal))
    assert (result.status, result.exact, result.folded) == ("already_satisfied", True, None)
    assert [s.name for s in program.states] == ["W"]
    assert rel_rms_error(run(program, sample)[0][0], before) <= FP32
    assert remove_momentum(simple_program(linear_attention)).status == "already_satisfied"


# -- remove_muon -----------------------------------------------------------------------------------

def test_remove_muon_folds_the_least_squares_newton_schulz_scale_and_lifts_to_linear_attention():
    program = lact_program()
    L = 13
    cal, sample = calibration_for(program, L)
    context = PassContext(cal)
    reduced, results = run_level(program, 6, context)
    assert [r.status for r in results] == ["applied"] * 2 + ["already_satisfied"] + \
        ["applied"] * 3
    r6 = results[5]
    assert (r6.name, r6.step, r6.exact) == ("remove_muon", 6, False)
    assert "Newton–Schulz" in r6.reason and "test_passes.py:" in r6.reason
    assert set(context.folds) == {"absorb_lr", "remove_momentum", "remove_muon"}
    # the hand computation: the level-5 increment of every updating chunk, orthogonalised
    eta, c = results[3].folded["lr"], results[4].folded["m1"]
    w0, w2 = sample["w0"].double(), sample["w2"].double()
    k, v = sample["k_seq"].double(), sample["v_seq"].double()
    inner = square = 0.0
    for s in range(0, 12, C):                            # three full chunks update
        h = silu(k[:, s:s + C] @ w0) * (k[:, s:s + C] @ w2)
        G = c * eta * (h.transpose(-1, -2) @ v[:, s:s + C])
        inner += float((ref_ns3(G) * G).sum())
        square += float((G * G).sum())
    # the least-squares scale: the s minimising Σ‖NS(G) − s·G‖²
    assert r6.folded["w1"] == pytest.approx(inner / square, rel=1e-5)
    # equal to block-causal linear attention written from the folded constants
    scale = eta * c * r6.folded["w1"]
    w1, q = sample["w1"].double(), sample["q_seq"].double()
    ys = []
    for s in range(0, L, C):
        ys.append((silu(q[:, s:s + C] @ w0) * (q[:, s:s + C] @ w2)) @ w1)
        h = silu(k[:, s:s + C] @ w0) * (k[:, s:s + C] @ w2)
        w1 = w1 + scale * (h.transpose(-1, -2) @ v[:, s:s + C])
    outs, _ = run(reduced, sample)
    assert rel_rms_error(outs[0].double(), torch.cat(ys, 1)) <= FP32
    plan_outs, _ = execute(reduced, analyze(reduced),
                           [sample[s.name] for s in reduced.states],
                           [sample[i.name] for i in reduced.invariants])
    assert rel_rms_error(plan_outs[0].double(), torch.cat(ys, 1)) <= FP32


def lact_like_body(W, M, k, v, q, lr, alpha, w0):
    """A LaCT-like chunk update with a hand-written increment: a frozen kernel, per-token lr,
    momentum with per-chunk coefficients and Newton–Schulz."""
    G = F.silu(k @ w0).transpose(-1, -2) @ (lr * v)
    M_new = alpha.mean(dim=-2, keepdim=True) * M + G
    return (W + ref_ns3(M_new), M_new), (F.silu(q @ w0) @ W,)


def lact_like_program(b=B, h=H, d=D, c=C):
    r = torch.randn
    return program_from_body(
        lact_like_body, states=dict(W=r(b, h, d, d), M=torch.zeros(b, h, d, d)),
        streams=dict(k=r(b, h, 2 * c, d), v=r(b, h, 2 * c, d), q=r(b, h, 2 * c, d),
                     lr=r(b, h, 2 * c, 1).abs(), alpha=r(b, h, 2 * c, 1).sigmoid()),
        invariants=dict(w0=r(b, h, d, d)), stream_axes=dict(k=2, v=2, q=2, lr=2, alpha=2),
        output_axes=(2,), chunk_size=c, last_chunk="apply_only")


@settings(max_examples=8)
@given(b=st.integers(1, 3), h=st.integers(1, 3), d=st.integers(2, 4), c=st.integers(1, 5),
       extra=st.integers(0, 3), tail=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_folds_of_steps_4_to_6_against_hand_computations(b, h, d, c, extra, tail, seed):
    """Over shapes, chunk sizes and lengths (two to five full chunks and a tail): the three
    folds equal their definitions computed by hand on the calibration data, and the level-6
    program equals block linear attention written from them, on both schedules."""
    L = (2 + extra) * c + tail % c
    program = lact_like_program(b, h, d, c)
    cal, sample = calibration_for(program, L, seed)
    reduced, results = run_level(program, 6, PassContext(cal))
    n = L // c if L % c else L // c - 1                    # full chunks that update
    k, v, q, lr = (sample[x].double() for x in ("k_seq", "v_seq", "q_seq", "lr_seq"))
    alpha, w0 = sample["alpha_seq"].double(), sample["w0"].double()
    eta = lr[:, :, : n * c].mean(dim=(0, 2)).reshape(1, h, 1, 1)
    alphas = [alpha[:, :, j * c:(j + 1) * c].mean(dim=2) for j in range(n)]   # [b, h, 1]
    weights = []
    for i in range(n):
        total, prod = torch.ones_like(alphas[0]), torch.ones_like(alphas[0])
        for j in range(i + 1, n):
            prod = prod * alphas[j]
            total = total + prod
        weights.append(total)
    factor = torch.stack(weights).mean().item()
    inner = square = 0.0
    for j in range(n):
        kc, vc = k[:, :, j * c:(j + 1) * c], v[:, :, j * c:(j + 1) * c]
        G = factor * (silu(kc @ w0).transpose(-1, -2) @ (eta * vc))
        inner += float((ref_ns3(G) * G).sum())
        square += float((G * G).sum())
    scale = inner / square                               # least squares: min Σ‖NS(G) − s·G‖²
    got_eta = torch.tensor(results[3].folded["lr"], dtype=torch.float64).reshape(1, h, 1, 1)
    assert torch.allclose(got_eta, eta, rtol=1e-10, atol=0)
    assert results[4].folded["M"] == pytest.approx(factor, rel=1e-5)     # fp32 chunk means
    assert results[5].folded["W"] == pytest.approx(scale, rel=1e-4)      # fp32 Newton–Schulz
    W, ys = sample["W"].double(), []
    for s in range(0, L, c):
        ys.append(silu(q[:, :, s:s + c] @ w0) @ W)
        kc, vc = k[:, :, s:s + c], v[:, :, s:s + c]
        W = W + factor * scale * (silu(kc @ w0).transpose(-1, -2) @ (got_eta * vc))
    ref = torch.cat(ys, 2)
    states0 = [sample["W"]]
    invariants = [sample[i.name] for i in reduced.invariants]
    for schedule in ("recurrent", "parallel"):
        outs, _ = execute(reduced, analyze(reduced), states0, invariants, schedule=schedule)
        assert rel_rms_error(outs[0].double(), ref) <= FP32, schedule


def test_level6_lifts_onto_plain_block_linear_attention():
    """After steps 4–6 the update is ``W + s·φ(k)ᵀv``: the block op with no momentum and no
    Newton–Schulz, equal to block linear attention written from the folded constants."""
    program = lact_like_program()
    L = 18
    cal, sample = calibration_for(program, L)
    reduced, results = run_level(program, 6, PassContext(cal))
    assert [r.status for r in results] == ["already_satisfied"] * 3 + ["applied"] * 3
    assert [s.name for s in reduced.states] == ["W"]
    lifted = lift(reduced)
    assert lifted is not None and lifted.kind == "block"
    assert lifted.m is None and lifted.newton_schulz is None
    eta = torch.tensor(results[3].folded["lr"]).float()            # [1, H, 1, 1]
    scale = results[4].folded["M"] * results[5].folded["W"]
    W, w0 = sample["W"], sample["w0"]
    k, v, q = (sample[n] for n in ("k_seq", "v_seq", "q_seq"))
    ys = []
    for s in range(0, L, C):
        ys.append(silu(q[:, :, s:s + C] @ w0) @ W)
        W = W + scale * (silu(k[:, :, s:s + C] @ w0).transpose(-1, -2) @ (eta * v[:, :, s:s + C]))
    outs, _ = execute(reduced, analyze(reduced), [sample["W"]],
                      [sample[i.name] for i in reduced.invariants])
    assert rel_rms_error(outs[0], torch.cat(ys, 2)) <= FP32


def test_remove_muon_replay_unfolded_and_already_satisfied():
    program, _ = run_level(lact_program(), 5)
    cal, sample = calibration_for(program, 13)
    context = PassContext(cal)
    measured = program.clone()
    first = remove_muon(measured, context)
    replayed = program.clone()
    again = remove_muon(replayed, PassContext(None, dict(context.folds)))
    assert again.folded == first.folded and "replayed" in again.reason
    assert torch.equal(run(measured, sample)[0][0], run(replayed, sample)[0][0])
    unfolded = program.clone()
    result = remove_muon(unfolded, PassContext(cal, fold=False))
    assert result.folded is None and "unfolded" in result.reason
    # the increments do not read w1, so the folded update is the unfolded one times the scale
    w1 = sample["w1"]
    step_m = run(measured, sample)[1][1] - w1
    step_u = run(unfolded, sample)[1][1] - w1
    assert rel_rms_error(step_m, first.folded["w1"] * step_u) <= FP32
    again = remove_muon(measured, context)
    assert (again.status, again.exact) == ("already_satisfied", True)


def test_remove_muon_removes_a_gradient_normalisation():
    """ViTTT normalises each column of the gradient, ``g / (‖g‖ + 1)``, before the step."""
    def normalised(W, k, v, q):
        g = k.transpose(-1, -2) @ v
        return (W + g / (g.norm(dim=-2, keepdim=True) + 1),), (q @ W,)
    program = simple_program(normalised)
    cal, sample = calibration_for(program, 12)
    result = remove_muon(program, PassContext(cal))
    assert result.status == "applied" and "l2 normalisation" in result.reason
    k, v = sample["k_seq"], sample["v_seq"]
    inner = square = 0.0
    for s in range(0, 12, C):
        g = k[:, s:s + C].transpose(-1, -2).double() @ v[:, s:s + C].double()
        n = g / (torch.sqrt((g * g).sum(dim=-2, keepdim=True)) + 1)
        inner += float((n * g).sum())
        square += float((g * g).sum())
    assert result.folded["W"] == pytest.approx(inner / square, rel=1e-5)
    assert analyze(program).rules["W"].startswith("W' = W + ")
    assert "Norm" not in analyze(program).rules["W"]


# -- convert at levels 4–6 ----------------------------------------------------------------------

L_E2E = 17                               # four updating chunks of 4 tokens, one token read only


def _fold_heads(t, heads):
    b, n, _ = t.shape
    return t.reshape(b, n, heads, -1).transpose(1, 2).reshape(b * heads, n, -1)


def folded_level6_reference(layer, x, eta, c, s):
    """LaCT (folded style) reduced to level 6, by hand: w0, w2 frozen, no weight norm, and
    ``w1 += η·c·s · v φ(k)ᵀ`` per updating chunk — block-causal linear attention."""
    Bx, L, dm = x.shape
    Hx = layer.num_heads
    q, k, v = (layer.qkv(x)).chunk(3, dim=-1)
    q = _fold_heads(silu(q), Hx)
    k = _fold_heads(silu(k), Hx)
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    v = _fold_heads(v, Hx)
    w0, w1, w2 = (w.repeat(Bx, 1, 1) for w in (layer.w0, layer.w1, layer.w2))
    outs = []
    starts = list(range(0, L, layer.chunk_size))
    for j, a in enumerate(starts):
        e = a + layer.chunk_size
        qc, kc, vc = q[:, a:e].transpose(1, 2), k[:, a:e].transpose(1, 2), v[:, a:e].transpose(1, 2)
        outs.append(w1 @ (silu(w0 @ qc) * (w2 @ qc)))                 # [b, d, c]
        if j < len(starts) - 1:
            hk = silu(w0 @ kc) * (w2 @ kc)
            w1 = w1 + (eta * c * s) * (vc @ hk.transpose(1, 2))
    o = torch.cat(outs, dim=2).transpose(1, 2)                        # [b, L, d]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.o_norm_weight
    o = o.reshape(Bx, Hx, L, -1).transpose(1, 2).reshape(Bx, L, dm)
    return layer.o_proj(o)


@pytest.fixture(scope="module")
def level6():
    torch.manual_seed(3)
    layer = lact_layer("folded", d_model=8, num_heads=2, chunk_size=4,
                                  momentum=True, muon=True, base_lr=0.3)
    x = torch.randn(2, L_E2E, 8)
    calibration = torch.randn(3, L_E2E, 8)
    return layer, x, calibration, ttt2la.convert(layer, level=6, example_inputs=(x,),
                                                 calibration=(calibration,))


def test_convert_level6_is_block_linear_attention_from_the_folded_weights(level6):
    layer, x, _calibration, converted = level6
    report = converted.ttt2la_report.layers[0]
    assert [(p.name, p.status) for p in report.passes[3:]] == [
        ("absorb_lr", "applied"), ("remove_momentum", "applied"), ("remove_muon", "applied")]
    assert report.runtime.startswith("block_linear_attention")
    assert not report.exact
    folds = {p.name: p.folded for p in report.passes if p.folded}
    eta, c, s = folds["absorb_lr"]["lr1"], folds["remove_momentum"]["dw1"], \
        folds["remove_muon"]["w1"]
    for step in (4, 5, 6):
        drift = report.passes[step - 1].drift
        assert drift["inputs"] == "calibration"
        assert drift["rel_rms_error"] > 0 and drift["unfolded_rel_rms_error"] > 0
    x = x.clone().requires_grad_(True)
    got = converted(x)
    ref = folded_level6_reference(layer, x, eta, c, s)
    assert rel_rms_error(got, ref) <= FP32
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    params = [p for _, p in converted.named_parameters()]
    g_got = torch.autograd.grad((got * weight).sum(), [x, *params], allow_unused=True)
    g_ref = torch.autograd.grad((ref * weight).sum(), [x, *layer.parameters()],
                                allow_unused=True)
    for a, b in zip(g_got, g_ref):
        if a is None or b is None:
            assert (a is None or not a.any()) and (b is None or not b.any())
        else:
            assert rel_rms_error(a, b) <= FP32


def test_convert_level4_replays_recorded_folds_without_measuring(level6):
    layer, x, calibration, converted = level6
    report = converted.ttt2la_report.layers[0]
    recorded = {p.name: p.folded for p in report.passes if p.folded}
    other = torch.randn(2, L_E2E, 8)                                  # other calibration data
    replayed = ttt2la.convert(layer, level=4, example_inputs=(x,), calibration=(other,),
                              folds={report.module_path: recorded})
    (r4,) = [p for p in replayed.ttt2la_report.layers[0].passes if p.step == 4]
    assert r4.status == "applied" and "replayed" in r4.reason
    assert r4.folded == recorded["absorb_lr"]


def test_convert_level5_heads_without_momentum():
    """Heads on their own axis: one learning rate per head; no momentum to remove."""
    torch.manual_seed(4)
    layer = lact_layer("heads", d_model=8, num_heads=2, chunk_size=4,
                                  momentum=False, muon=False, base_lr=0.3)
    x = torch.randn(2, L_E2E, 8)
    converted = ttt2la.convert(layer, level=5, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    r4, r5 = report.passes[3:]
    assert (r4.status, r5.status, r5.exact) == ("applied", "already_satisfied", True)
    assert report.runtime.startswith("block_linear_attention")
    eta = torch.tensor(r4.folded["lr1"])
    assert eta.shape == (1, 2, 1, 1)
    # by hand: variant-2 LaCT (heads style) with the constant per-head lr
    Bx, L = x.shape[:2]
    q, k, v = layer.qkv(x).view(Bx, L, 3, 2, 4).permute(2, 0, 3, 1, 4)
    q = F.normalize(silu(q), dim=-1)
    k = F.normalize(silu(k), dim=-1)
    W0, W1, W2 = (w.mT.expand(Bx, 2, -1, -1) for w in (layer.w0, layer.w1, layer.w2))
    ys = []
    for j, a in enumerate(range(0, L, 4)):
        qc, kc, vc = q[:, :, a:a + 4], k[:, :, a:a + 4], v[:, :, a:a + 4]
        ys.append((silu(qc @ W0) * (qc @ W2)) @ W1)
        if a + 4 < L:
            W1 = W1 + (silu(kc @ W0) * (kc @ W2)).transpose(-1, -2) @ (eta.float() * vc)
    o = torch.cat(ys, dim=2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.o_norm_weight
    ref = layer.o_proj(o.transpose(1, 2).reshape(Bx, L, 8))
    assert rel_rms_error(converted(x), ref) <= FP32


def _ns5(G):
    X = G / (torch.sqrt((G * G).sum(dim=(1, 2), keepdim=True)) + 1e-7)
    for _ in range(5):
        A = X @ X.transpose(1, 2)
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


def variant4_operator(w, q, k, v, lr1, momentum, chunk_size):
    """A variant-4 operator (one linear fast weight, momentum, Muon) written the way the
    authors' variant code writes it: the learning rate is ``lr1 * 0.0 + 1.0``."""
    q, v = q.transpose(1, 2), v.transpose(1, 2)
    out = torch.zeros_like(v)
    m = torch.zeros_like(w)
    end = 0
    for start in range(0, k.shape[1] - chunk_size, chunk_size):
        end = start + chunk_size
        out[:, :, start:end] = torch.bmm(w, q[:, :, start:end])
        lr1c = lr1[:, start:end, :] * 0.0 + 1.0
        g = torch.bmm(v[:, :, start:end], k[:, start:end, :] * lr1c)
        g = g + m * momentum[:, start:end, :].mean(dim=1, keepdim=True)
        m = g
        w = w + _ns5(g)
    out[:, :, end:] = torch.bmm(w, q[:, :, end:])
    return out.transpose(1, 2)


class Variant4Layer(torch.nn.Module):
    def __init__(self, d_model, heads, chunk_size):
        super().__init__()
        self.heads, self.chunk_size = heads, chunk_size
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.lr_proj = torch.nn.Linear(d_model, heads, bias=False)
        self.momentum_proj = torch.nn.Linear(d_model, heads, bias=False)
        self.w = torch.nn.Parameter(torch.randn(heads, d_model // heads, d_model // heads) * 0.3)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (_fold_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        lr = _fold_heads(F.softplus(self.lr_proj(x)), self.heads)
        momentum = _fold_heads(torch.sigmoid(self.momentum_proj(x)), self.heads)
        o = variant4_operator(self.w.repeat(b, 1, 1), q, k, v, lr, momentum, self.chunk_size)
        return o.reshape(b, self.heads, n, -1).transpose(1, 2).reshape(b, n, d)


def test_variant4_layer_with_lr_times_zero_plus_one_converts_exactly_at_level4():
    torch.manual_seed(5)
    layer = Variant4Layer(8, 2, 4).double()
    x = torch.randn(2, L_E2E, 8, dtype=torch.float64)
    converted = ttt2la.convert(layer, level=4, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    r4 = report.passes[3]
    assert (r4.status, r4.exact, r4.folded) == ("already_satisfied", True, None)
    assert "constant 1" in r4.reason and report.exact
    x = x.clone().requires_grad_(True)
    got, ref = converted(x), layer(x)
    assert rel_rms_error(got, ref) <= TOLERANCE[torch.float64]
    weight = torch.randn(got.shape, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(1))
    for a, b in zip(torch.autograd.grad((got * weight).sum(), [x, *converted.parameters()],
                                        allow_unused=True),
                    torch.autograd.grad((ref * weight).sum(), [x, *layer.parameters()],
                                        allow_unused=True)):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        assert rel_rms_error(a, b) <= TOLERANCE[torch.float64]


def test_calibration_without_an_updating_chunk_is_refused():
    """One full chunk of an apply-then-update loop is only read: nothing to fold from."""
    program = lact_like_program()
    cal, _ = calibration_for(program, C)
    with pytest.raises(ttt2la.ConversionError, match="at least two chunks"):
        run_level(program, 4, PassContext(cal))
    run_level(program, 4, PassContext(cal, {"absorb_lr": {"lr": [[[[0.5]], [[0.25]]]]}}))
    with pytest.raises(ttt2la.ConversionError, match="no constant for lr"):
        run_level(program, 4, PassContext(None, {"absorb_lr": {"eta": 0.5}}))


class RateInTheLoss(torch.nn.Module):
    """Titans' style: a per-token rate weighting the inner loss, the step taken by
    ``torch.autograd.grad`` — the rate reaches the update through the loss's backward, beside
    the loss value the trace computes and leaves unread. ``rate`` fixes it to a constant."""

    def __init__(self, d: int = 16, chunk: int = 4, rate: float | None = None, loss: str = "sum"):
        super().__init__()
        self.C, self.rate, self.loss = chunk, rate, loss
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.lr = torch.nn.Linear(d, 1)
        self.W0 = torch.nn.Parameter(torch.randn(d, d) * d ** -0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        lr = torch.sigmoid(self.lr(x)).squeeze(-1) * 0.1
        if self.rate is not None:
            lr = torch.full_like(lr, self.rate)
        outs = []
        with torch.enable_grad():
            W = self.W0.expand(x.shape[0], -1, -1)
            for s in range(0, x.shape[1], self.C):
                kc, vc, lc = k[:, s:s + self.C], v[:, s:s + self.C], lr[:, s:s + self.C]
                if self.loss == "computed":       # the rate projected from the chunk, in the loop
                    lc = torch.sigmoid(self.lr(x[:, s:s + self.C])).squeeze(-1) * 0.1
                outs.append(q[:, s:s + self.C] @ W)
                W = W.requires_grad_()
                err = (kc @ W - vc) ** 2
                # a mean's backward divides the broadcast rate by the features' count; a rate
                # broadcast over the features first reaches the update through the backward's
                # ones times the rate
                if self.loss == "weighted":
                    loss = (lc[..., None] * err).sum()
                else:
                    loss = ((err.mean(-1) if self.loss == "mean" else err.sum(-1)) * lc).sum()
                (g,) = torch.autograd.grad(loss, W, create_graph=True)
                W = W - g
        return torch.cat(outs, 1)


@pytest.mark.parametrize("loss", ["sum", "mean", "weighted"])
def test_absorb_lr_folds_a_rate_that_weights_the_inner_loss(loss):
    torch.manual_seed(0)
    layer = RateInTheLoss(loss=loss)
    x = torch.randn(2, 16, 16)
    converted = ttt2la.convert(layer, level=4, example_inputs=(x,))
    (result,) = [p for p in converted.ttt2la_report.layers[0].passes if p.name == "absorb_lr"]
    assert result.status == "applied", result.reason
    hand = RateInTheLoss(rate=result.folded["lr"], loss=loss)
    hand.load_state_dict(layer.state_dict())
    x2 = torch.randn(3, 11, 16)
    with torch.no_grad():
        assert rel_rms_error(converted(x2), hand(x2)) <= FP32


def test_absorb_lr_says_it_leaves_a_rate_computed_in_the_loop():
    """A rate the body projects from its chunk is no stream: not folded, and the report says so
    (naming where it is read) instead of calling the step already satisfied."""
    torch.manual_seed(0)
    layer = RateInTheLoss(loss="computed")
    converted = ttt2la.convert(layer, level=4, example_inputs=(torch.randn(2, 16, 16),))
    (result,) = [p for p in converted.ttt2la_report.layers[0].passes if p.name == "absorb_lr"]
    assert result.status == "not_applicable", result.reason
    assert "computed in the loop body" in result.reason and "test_passes_lossy.py:" in result.reason


class DecayAndRate(torch.nn.Module):
    """A gated memory per token with a learning rate: ``S ← α_t S + η_t k_tᵀ v_t``. The decay
    ``α`` forgets; only ``η`` is a learning rate."""

    def __init__(self, d: int = 8, rate_on_the_key: bool = False):
        super().__init__()
        self.rate_on_the_key = rate_on_the_key
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.gates = torch.nn.Linear(d, 2)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        alpha, eta = torch.sigmoid(self.gates(x) + 2).unbind(-1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            if self.rate_on_the_key:        # (η k)ᵀ v: the rate scales the key's column first
                step = eta[:, t, None, None] * k[:, t, :, None] * v[:, t, None, :]
            else:
                step = eta[:, t, None, None] * (k[:, t, :, None] * v[:, t, None, :])
            S = alpha[:, t, None, None] * S + step
            outs.append((q[:, t, None, :] @ S)[:, 0])
        return torch.stack(outs, 1)


@pytest.mark.parametrize("rate_on_the_key", [False, True])
def test_absorb_lr_folds_the_rate_and_leaves_the_decay(rate_on_the_key):
    torch.manual_seed(0)
    converted = ttt2la.convert(DecayAndRate(rate_on_the_key=rate_on_the_key), level=4,
                               example_inputs=(torch.randn(2, 8, 8),))
    (result,) = [p for p in converted.ttt2la_report.layers[0].passes if p.name == "absorb_lr"]
    assert result.status == "applied" and set(result.folded) == {"eta"}, (result.status, result.folded)


class MomentumSpellings(torch.nn.Module):
    """One EMA momentum ``m' = 0.8 m + 0.2 g`` spelt four ways: a sum, ``lerp`` from the
    increment or from the momentum, and a scaled copy updated in place (``2 · 0.4 = 0.8``)."""

    def __init__(self, spelling: str, d: int = 8, chunk: int = 4):
        super().__init__()
        self.spelling, self.C = spelling, chunk
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        m = torch.zeros_like(W)
        outs = []
        for s in range(0, x.shape[1], self.C):
            outs.append(q[:, s:s + self.C] @ W)
            g = k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            if self.spelling == "sum":
                m = 0.8 * m + 0.2 * g
            elif self.spelling == "lerp_from_g":
                m = torch.lerp(g, m, 0.8)
            elif self.spelling == "lerp_from_m":
                m = torch.lerp(m, g, 0.2)
            else:                           # a scaled copy, then scaled again in place
                m = m * 2.0
                m.mul_(0.4).add_(0.2 * g)
            W = W + 0.1 * m
        return torch.cat(outs, 1)


@pytest.mark.parametrize("spelling", ["lerp_from_g", "lerp_from_m", "in_place"])
def test_remove_momentum_reads_every_spelling_of_one_momentum(spelling):
    """Each spelling is the sum's function, and level 5 removes its momentum as it removes the
    sum's: the same fold, the same converted layer."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8)
    base, other = MomentumSpellings("sum"), MomentumSpellings(spelling)
    other.load_state_dict(base.state_dict())
    with torch.no_grad():
        assert rel_rms_error(other(x), base(x)) <= FP32
    convs = [ttt2la.convert(m, level=5, example_inputs=(x,)) for m in (base, other)]
    results = [{p.name: p for p in c.ttt2la_report.layers[0].passes}["remove_momentum"]
               for c in convs]
    assert [r.status for r in results] == ["applied", "applied"], results[1].reason
    assert results[1].folded == pytest.approx(results[0].folded)
    x2 = torch.randn(3, 13, 8)
    with torch.no_grad():
        assert rel_rms_error(convs[1](x2), convs[0](x2)) <= FP32
