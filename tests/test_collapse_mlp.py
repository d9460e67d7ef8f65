"""Step 3 (collapse_mlp): the kernel φ becomes one fixed linear map ``x·M`` fitted on calibration
keys and queries; its statuses, its fold against an independent least-squares fit, replay, and
the converted layer against the variant written by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la
from ttt2la.calibration import LoopCalibration
from ttt2la.errors import UnsupportedTTTError
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import execute
from ttt2la.analysis import analyze
from ttt2la.passes import PassContext, collapse_mlp, run_level
from ttt2la.passes.collapse_mlp import MAP_ATTR
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTHeadsLayer
from references import ref_ns3
from test_passes import C, D, DH, lact_program, random_inputs


def _silu(x):
    return x / (1 + torch.exp(-x))


def _lstsq(x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """numpy's least squares in float64: the reference fit."""
    return np.linalg.lstsq(x.double().numpy(), y.double().numpy(), rcond=None)[0]


def calibration_for(program, L, seed=0) -> tuple[LoopCalibration, list, list]:
    """One calibration sample of length ``L`` for a float64 program, and its inputs."""
    states0, invariants = random_inputs(program, L, seed)
    states0 = [x.detach().double() for x in states0]
    invariants = [x.detach().double() for x in invariants]
    sample = {s.name: x for s, x in zip(program.states, states0)}
    sample.update({i.name: x for i, x in zip(program.invariants, invariants)})
    return LoopCalibration([sample]), states0, invariants


# -- the SwiGLU kernel of a LaCT-like body (fast weights x@W, gradients from torch.func.grad) --

@pytest.mark.parametrize("L", [8, 13, 16])
def test_the_fold_is_the_least_squares_map_of_the_swiglu_kernel(L):
    program = lact_program(dtype=torch.float64)
    calibration, states0, invariants = calibration_for(program, L)
    context = PassContext(calibration)
    level3, results = run_level(program, 3, context)
    r = results[2]
    assert (r.name, r.step, r.status, r.exact) == ("collapse_mlp", 3, "applied", False)
    assert [s.name for s in level3.states] == ["w1", "m1"]          # Θ = w0, w2 died
    assert "key path" in r.reason and "w0" in r.reason and "w2" in r.reason
    # φ by hand on every full chunk of the queries and keys; the rows (batch) have their own Θ,
    # so one map is shared by all rows
    named = {s.name: x.detach() for s, x in zip(program.states, states0)}
    named.update({s.name: x.detach() for s, x in zip(program.invariants, invariants)})
    n = (L // C) * C
    xs, ys = [], []
    for b in range(named["w0"].shape[0]):
        x = torch.cat([named["q_seq"][b, :n], named["k_seq"][b, :n]])
        xs.append(x)
        ys.append(_silu(x @ named["w0"][b]) * (x @ named["w2"][b]))
    X, Y = torch.cat(xs), torch.cat(ys)
    expected = _lstsq(X, Y)
    got = np.array(r.folded["M"])
    assert r.folded["shape"] == [1, D, DH] and r.folded["groups"] == 1 and got.shape == (1, D, DH)
    assert np.abs(got[0] - expected).max() <= 1e-9 * max(1.0, np.abs(expected).max())
    residual = float(np.linalg.norm(X.numpy() @ expected - Y.numpy()) / np.linalg.norm(Y.numpy()))
    assert r.folded["residual"] == pytest.approx(residual, rel=1e-9)
    assert r.folded["tokens"] == X.shape[0]
    assert context.folds["collapse_mlp"] is r.folded


def collapsed_reference(M, states0, invariants, names, L):
    """The level-3 body by hand: φ(x) = x·M, w1 updated through momentum and NS3, no norm;
    outputs and the final (w1, m1); the last chunk only reads."""
    named = dict(zip(names, invariants))
    k, v, q, lr, beta = (named[n] for n in ("k_seq", "v_seq", "q_seq", "lr_seq", "beta"))
    w1, m1 = states0
    starts = list(range(0, L, C))
    ys = []
    for j, s in enumerate(starts):
        kc, vc, qc, lrc = (x[:, s:s + C] for x in (k, v, q, lr))
        ys.append((qc @ M) @ w1)
        if j == len(starts) - 1:
            break
        m1 = beta * m1 + (kc @ M).transpose(-1, -2) @ (lrc * vc)
        w1 = w1 + ref_ns3(m1)
    return [torch.cat(ys, 1)], [w1, m1]


@pytest.mark.parametrize("L", [7, 12, 13])
def test_level3_runs_the_collapsed_variant_on_both_schedules(L):
    """The rewritten program is LaCT with φ(x) = x·M: every schedule equals the hand-written
    loop in float64 (outputs and final states)."""
    program = lact_program(dtype=torch.float64)
    calibration, _, _ = calibration_for(program, 16)
    level3, results = run_level(program, 3, PassContext(calibration))
    M = torch.tensor(results[2].folded["M"][0], dtype=torch.float64)
    analysis = analyze(level3)
    assert analysis.schedule == "parallel"
    states0, invariants = random_inputs(level3, L, seed=3)
    states0 = [x.detach().double() for x in states0]
    invariants = [x.detach().double() for x in invariants]
    ref_out, ref_finals = collapsed_reference(M, states0, invariants,
                                              [i.name for i in level3.invariants], L)
    for schedule in ("recurrent", "parallel"):
        out, finals = execute(level3, analysis, states0, invariants, schedule=schedule)
        assert rel_rms_error(out[0], ref_out[0]) <= TOLERANCE[torch.float64], schedule
        for got, ref in zip(finals, ref_finals):
            assert rel_rms_error(got, ref) <= TOLERANCE[torch.float64], schedule


def test_unfolded_and_uncalibrated_maps_are_the_identity_zero_padded():
    """fold=False (and no calibration data) write M = I: with d_k = 3 < d_h = 4 the kernel keeps
    x and pads a zero feature."""
    program = lact_program(dtype=torch.float64)
    for context, says in ((PassContext(fold=False), "unfolded"),
                          (PassContext(), "no calibration data")):
        level3, results = run_level(program, 3, context)
        r = results[2]
        assert r.status == "applied" and r.folded is None and says in r.reason
        assert "identity 3→4" in r.reason
        assert context.folds == {}
        buffer = getattr(level3.body, MAP_ATTR)
        assert torch.equal(buffer, torch.eye(D, DH, dtype=torch.float64).unsqueeze(0))


# -- heads folded into the batch: one map per head ----------------------------------------------

H = 2


def glu_body(w0, w2, W, k, v, q):
    """A linear-attention update read through a SwiGLU kernel with Θ = (w0, w2) kept frozen."""
    def phi(x):
        return F.silu(x @ w0) * (x @ w2)
    return (w0, w2, W + phi(k).transpose(-1, -2) @ v), (phi(q) @ W,)


def glu_program(batch, heads_w0, heads_w2, L=12):
    rows = batch * H
    g = torch.Generator().manual_seed(batch)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return program_from_body(
        glu_body,
        states=dict(w0=heads_w0.repeat(batch, 1, 1), w2=heads_w2.repeat(batch, 1, 1),
                    W=r(rows, DH, D) * 0.3),
        streams=dict(k=r(rows, L, D), v=r(rows, L, D), q=r(rows, L, D)),
        chunk_size=C, last_chunk="apply_only")


@pytest.fixture(scope="module")
def heads_theta():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(H, D, DH, generator=g, dtype=torch.float64),
            torch.randn(H, D, DH, generator=g, dtype=torch.float64))


def test_heads_folded_into_the_batch_get_one_map_each(heads_theta):
    w0, w2 = heads_theta
    program = glu_program(2, w0, w2)
    calibration, states0, invariants = calibration_for(program, 16)
    sample = calibration.samples[0]
    sample["w0"], sample["w2"] = w0.repeat(2, 1, 1), w2.repeat(2, 1, 1)    # Θ tiled, as LaCT does
    _, results = run_level(program, 3, PassContext(calibration))
    folded = results[2].folded
    assert folded["groups"] == H and folded["shape"] == [H, D, DH]
    assert "one per head (2)" in results[2].reason
    for h in range(H):
        rows = [h, h + H]                               # rows r and r + H share Θ
        x = torch.cat([sample[n][r, :16] for r in rows for n in ("q_seq", "k_seq")])
        y = F.silu(x @ w0[h]) * (x @ w2[h])
        assert np.abs(np.array(folded["M"][h]) - _lstsq(x, y)).max() <= 1e-9


def test_replay_gives_the_same_map_at_another_batch_size(heads_theta):
    """Recorded constants replay without calibration data, bit for bit, and the per-head maps
    tile a batch of another size."""
    w0, w2 = heads_theta
    program = glu_program(2, w0, w2)
    calibration, _, _ = calibration_for(program, 16)
    calibration.samples[0]["w0"] = w0.repeat(2, 1, 1)
    calibration.samples[0]["w2"] = w2.repeat(2, 1, 1)
    context = PassContext(calibration)
    fitted, results = run_level(program, 3, context)
    recorded = dict(context.folds)
    again, results2 = run_level(program, 3, PassContext(folds=recorded))
    assert results2[2].folded == results[2].folded and "replayed" in results2[2].reason
    assert torch.equal(getattr(again.body, MAP_ATTR), getattr(fitted.body, MAP_ATTR))
    wider, _ = run_level(glu_program(3, w0, w2), 3, PassContext(folds=recorded))
    M = torch.tensor(recorded["collapse_mlp"]["M"], dtype=torch.float64)
    states0, invariants = random_inputs(wider, 10, seed=2)
    states0 = [x.detach().double() for x in states0]
    invariants = [x.detach().double() for x in invariants]
    (out,), _ = execute(wider, analyze(wider), states0, invariants, schedule="recurrent")
    named = {i.name: x for i, x in zip(wider.invariants, invariants)}
    k, v, q = named["k_seq"], named["v_seq"], named["q_seq"]
    maps = torch.stack([M[r % H] for r in range(3 * H)])           # rows r: head r mod H
    W, ys = states0[0], []
    for s in range(0, 10, C):
        ys.append((q[:, s:s + C] @ maps) @ W)
        W = W + (k[:, s:s + C] @ maps).transpose(-1, -2) @ v[:, s:s + C]
    assert rel_rms_error(out, torch.cat(ys, 1)) <= TOLERANCE[torch.float64]


# -- statuses -----------------------------------------------------------------------------------

def _simple(body, invariants=None):
    g = torch.Generator().manual_seed(0)
    return program_from_body(body, states=dict(W=torch.randn(2, D, D, generator=g)),
                             streams=dict(k=torch.randn(2, 8, D, generator=g),
                                          v=torch.randn(2, 8, D, generator=g),
                                          q=torch.randn(2, 8, D, generator=g)),
                             invariants=invariants, chunk_size=C)


def test_identity_and_fixed_linear_kernels_are_already_satisfied():
    def identity(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), (q @ W,)

    def projected(W, k, v, q, P):
        return (W + (k @ P).transpose(-1, -2) @ v,), ((q @ P) @ W,)

    for body, invariants, says in ((identity, None, "identity"),
                                   (projected, dict(P=torch.randn(D, D)), "fixed linear map")):
        program = _simple(body, invariants)
        before = program.body.code
        _, results = run_level(program, 3)
        r = results[2]
        assert (r.status, r.exact, r.folded) == ("already_satisfied", True, None), r.reason
        assert says in r.reason
        assert program.body.code == before


def test_no_final_product_is_not_applicable():
    def no_read(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), (q * 2.0,)
    _, results = run_level(_simple(no_read), 3)
    assert (results[2].status, results[2].exact) == ("not_applicable", True)


def test_a_key_path_written_another_way_is_refused():
    """When the key path computes φ in a form that does not match the query path, Θ would stay
    alive behind a rewritten query path: the pass raises instead."""
    def mismatched(w0, w2, W, k, v, q):
        phi_q = F.silu(q @ w0) * (q @ w2)
        phi_k = (F.silu(w0.transpose(-1, -2) @ k.transpose(-1, -2))
                 * (w2.transpose(-1, -2) @ k.transpose(-1, -2))).transpose(-1, -2)
        return (w0, w2, W + phi_k.transpose(-1, -2) @ v), (phi_q @ W,)
    g = torch.Generator().manual_seed(1)
    program = program_from_body(
        mismatched, states=dict(w0=torch.randn(2, D, DH, generator=g),
                                w2=torch.randn(2, D, DH, generator=g),
                                W=torch.randn(2, DH, D, generator=g)),
        streams=dict(k=torch.randn(2, 8, D, generator=g), v=torch.randn(2, 8, D, generator=g),
                     q=torch.randn(2, 8, D, generator=g)), chunk_size=C)
    with pytest.raises(UnsupportedTTTError, match="still read"):
        run_level(program, 3, PassContext(fold=False))
