"""Steps 1 and 2 (freeze_theta, drop_norm), their statuses, and the level driver ``run_level``."""
from __future__ import annotations

import inspect

import pytest
import module_scoped
import torch
import torch.nn.functional as F

from ttt2la.analysis import analyze
from ttt2la.errors import ConversionError, LevelNotImplementedError, UnsupportedTTTError
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import execute
from ttt2la.passes import (DropNorm, Pass, PassResult, PendingPass, drop_norm, freeze_theta,
                           get_pass, implemented_level, register, remedy_for, remove_dead_states,
                           run_level)
from ttt2la.testing import TOLERANCE, rel_rms_error
from references import ref_ns3

B, D, DH, C = 2, 3, 4, 4


def seq(L, *shape):
    return torch.randn(B, L, *shape)


def newton_schulz(G, steps=3):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return X


def swiglu(x, w0, w1, w2):
    return (F.silu(x @ w0) * (x @ w2)) @ w1


def lact_grad_body(w0, w1, w2, m0, m1, k, v, q, lr, beta, n1):
    """LaCT-like fast weights stored x@W, gradients from torch.func.grad, momentum on w0 and w1."""
    def loss(a, b, c):
        return -(lr * swiglu(k, a, b, c) * v).sum()
    g0, g1, g2 = torch.func.grad(loss, argnums=(0, 1, 2))(w0, w1, w2)
    m0n = beta * m0 - g0
    w0n = w0 + m0n                                                   # update of w0
    w2n = w2 - g2                                                    # update of w2
    m1n = beta * m1 - g1
    u = w1 + newton_schulz(m1n)
    w1n = u / u.norm(dim=-2, keepdim=True) * n1                      # weight norm of w1
    return (w0n, w1n, w2n, m0n, m1n), (swiglu(q, w0, w1, w2),)


def lact_program(last_chunk="apply_only", dtype=torch.float32):
    w1 = torch.randn(B, DH, D) * 0.3
    r = lambda *shape: torch.randn(*shape).to(dtype)  # noqa: E731
    return program_from_body(
        lact_grad_body,
        states=dict(w0=r(B, D, DH) * 0.3, w1=w1.to(dtype), w2=r(B, D, DH) * 0.3,
                    m0=torch.zeros(B, D, DH, dtype=dtype), m1=torch.zeros(B, DH, D, dtype=dtype)),
        streams=dict(k=r(B, 8, D), v=r(B, 8, D), q=r(B, 8, D), lr=r(B, 8, 1).abs()),
        invariants=dict(beta=torch.full((B, 1, 1), 0.9, dtype=dtype),
                        n1=w1.norm(dim=-2, keepdim=True).to(dtype)),
        chunk_size=C, last_chunk=last_chunk)


def line_of(marker: str) -> int:
    lines, start = inspect.getsourcelines(lact_grad_body)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def linear_attention(W, k, v, q):
    return (W + k.transpose(-1, -2) @ v,), (q @ W,)


def simple_program(body, invariants=None, **kw):
    return program_from_body(body, states=dict(W=torch.randn(B, D, D)),
                             streams=dict(k=seq(8, D), v=seq(8, D), q=seq(8, D)),
                             invariants=invariants, chunk_size=C, **kw)


def random_inputs(program, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    states0 = [(torch.randn(s.shape, generator=g) * 0.3).requires_grad_() for s in program.states]
    sources = {s.source: s for s in program.streams}
    invariants = []
    for i, spec in enumerate(program.invariants):
        shape = list(spec.shape)
        if i in sources:
            shape[sources[i].axis] = L
        x = torch.randn(shape, generator=g)
        if spec.name in ("lr_seq", "beta", "n1"):
            x = x.abs() * 0.5 + 0.1
        invariants.append(x.requires_grad_())
    return states0, invariants


# -- the paper's steps on a LaCT-like body -------------------------------------------------------

def test_freeze_theta_then_drop_norm_gives_a_parallel_program():
    program = lact_program()
    assert analyze(program).schedule == "recurrent"

    level1, (r1,) = run_level(program, 1)
    assert (r1.name, r1.step, r1.status, r1.exact) == ("freeze_theta", 1, "applied", False)
    assert [s.name for s in level1.states] == ["w0", "w1", "w2", "m1"]   # m0 only fed w0
    assert f"test_passes.py:{line_of('# update of w0')}" in r1.reason
    assert f"test_passes.py:{line_of('# update of w2')}" in r1.reason
    assert "m0" in r1.reason
    assert analyze(level1).schedule == "semi-parallel"

    level2, (r1b, r2) = run_level(program, 2)
    assert r1b == r1
    assert (r2.name, r2.step, r2.status, r2.exact) == ("drop_norm", 2, "applied", False)
    assert "w1" in r2.reason and f"test_passes.py:{line_of('# weight norm of w1')}" in r2.reason
    analysis = analyze(level2)
    assert analysis.schedule == "parallel"
    assert analysis.rules["w1"] == "w1' = w1 + NS3(beta·m1 - φ(k)ᵀ·((-v)⊙η))"


# A hand-written reference for the reduced body: what steps 1 and 2 must leave of
# ``lact_grad_body`` (w0, w2 frozen; m0 gone; at level 2 no weight norm), with its own loop and
# its own literal constants, sharing no code with the passes, the executors or the runtime.

def _ref_silu(x):
    return x / (1 + torch.exp(-x))



def reduced_lact_reference(level, program, states0, invariants, L):
    """Outputs and final states of the level-``level`` body by a loop over chunks of ``C``
    tokens; the last chunk only reads (``apply_only``)."""
    named = {spec.name: x for spec, x in zip(program.invariants, invariants)}
    k, v, q, lr = (named[n] for n in ("k_seq", "v_seq", "q_seq", "lr_seq"))
    beta, n1 = named["beta"], named["n1"]
    w0, w1, w2, m1 = states0
    starts = list(range(0, L, C))
    ys = []
    for j, s in enumerate(starts):
        kc, vc, qc, lrc = (x[:, s:s + C] for x in (k, v, q, lr))
        ys.append((_ref_silu(qc @ w0) * (qc @ w2)) @ w1)
        if j == len(starts) - 1:
            break
        hidden = _ref_silu(kc @ w0) * (kc @ w2)                   # [B, c, DH]
        m1 = beta * m1 + hidden.transpose(-1, -2) @ (lrc * vc)    # -(dloss/dw1) is hᵀ(η⊙v)
        u = w1 + ref_ns3(m1)
        w1 = u / torch.sqrt((u * u).sum(dim=-2, keepdim=True)) * n1 if level == 1 else u
    return [torch.cat(ys, 1)], [w0, w1, w2, m1]


def _projected_grads(fn, states0, invariants):
    outs, finals = fn(states0, invariants)
    g = torch.Generator().manual_seed(11)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)).sum()
               for t in outs + finals)
    grads = torch.autograd.grad(loss, states0 + invariants, allow_unused=True)
    return outs + finals + [torch.zeros_like(x) if gr is None else gr
                            for gr, x in zip(grads, states0 + invariants)]


@module_scoped.cached
def _reduced(level, dtype):
    reduced, _ = run_level(lact_program(dtype=dtype), level)
    return reduced, analyze(reduced)


def _as64(xs):
    return [x.detach().double().requires_grad_() for x in xs]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("L", [8, 6, 3, 13])
def test_reduced_lact_equals_the_hand_written_variant(level, L):
    """Both schedules of the reduced program equal the variant written by hand — outputs, final
    states and every gradient: in float64 within 1e-10; in fp32 the chunk-parallel schedule
    within the precision criterion (Newton–Schulz): at most 2x the error of the body run as
    written (the recurrent schedule) against the float64 hand-written loop, plus 1e-6."""
    reduced, analysis = _reduced(level, torch.float64)
    assert [s.name for s in reduced.states] == ["w0", "w1", "w2", "m1"]
    states0, invariants = random_inputs(reduced, L)
    states0, invariants = _as64(states0), _as64(invariants)
    loop = lambda s, x: reduced_lact_reference(level, reduced, s, x, L)  # noqa: E731
    ref64 = _projected_grads(loop, states0, invariants)
    for schedule in ("recurrent", analysis.schedule):
        got = _projected_grads(
            lambda s, x: execute(reduced, analysis, s, x, schedule=schedule), states0, invariants)
        assert len(got) == len(ref64)
        for i, (a, b) in enumerate(zip(got, ref64)):
            assert rel_rms_error(a, b) <= TOLERANCE[torch.float64], (schedule, i)

    reduced, analysis = _reduced(level, torch.float32)
    states0, invariants = (
        [x.detach().float().requires_grad_() for x in xs] for xs in (states0, invariants))
    original, fast = (_projected_grads(
        lambda s, x: execute(reduced, analysis, s, x, schedule=schedule), states0, invariants)
        for schedule in ("recurrent", analysis.schedule))
    for i, (a, b, c) in enumerate(zip(fast, ref64, original)):
        bound = 2 * rel_rms_error(c, b) + 1e-6
        assert rel_rms_error(a, b) <= bound, (i, rel_rms_error(a, b), bound)


def test_calling_convention_survives_state_removal():
    reduced, _ = run_level(lact_program(), 1)
    placeholders = reduced.placeholders()
    assert len(placeholders) == len(reduced.states) + len(reduced.streams) + len(reduced.invariants)
    assert len(reduced.state_outputs()) == len(reduced.states)
    assert [p.meta["ttt2la_name"] for p in reduced.state_inputs()] == ["w0", "w1", "w2", "m1"]
    outs, ins = reduced.state_outputs(), reduced.state_inputs()
    assert outs[0] is ins[0] and outs[2] is ins[2]


def test_run_level_leaves_the_input_untouched():
    program = lact_program()
    code = program.body.code
    run_level(program, 2)
    assert program.body.code == code and len(program.states) == 5
    same, results = run_level(program, 0)
    assert results == [] and same is not program and same.body.code == code


def test_run_level_infers_roles_when_none_are_set():
    reduced, (result,) = run_level(lact_program(), 1)
    assert result.status == "applied"
    assert {s.name: s.role for s in reduced.states} == {
        "w0": "theta", "w1": "final", "w2": "theta", "m1": "momentum"}


# -- statuses --------------------------------------------------------------------------------------

def test_freeze_theta_statuses():
    frozen, _ = run_level(lact_program(), 1)
    again = freeze_theta(frozen)
    assert (again.status, again.exact) == ("already_satisfied", True)

    def frozen_kernel(W, k, v, q, w0):
        return (W + F.silu(k @ w0).transpose(-1, -2) @ v,), (F.silu(q @ w0) @ W,)
    program = simple_program(frozen_kernel, invariants=dict(w0=torch.randn(B, D, D)))
    result = freeze_theta(program)
    assert (result.status, result.exact) == ("already_satisfied", True)
    assert "parameter" in result.reason

    program = simple_program(linear_attention)      # φ = identity: nothing to freeze
    result = freeze_theta(program)
    assert (result.status, result.exact) == ("already_satisfied", True)
    assert "no weights Θ" in result.reason

    def no_read(W, k, v, q):                         # no final layer reads the state
        return (W + k.transpose(-1, -2) @ v,), (q * 2.0,)
    assert freeze_theta(simple_program(no_read)).status == "not_applicable"


def test_drop_norm_statuses():
    def layer_normed(W, k, v, q):
        U = W + k.transpose(-1, -2) @ v
        return (F.layer_norm(U, (D,)),), (q @ W,)
    program = simple_program(layer_normed)
    result = drop_norm(program)
    assert (result.status, result.exact) == ("applied", False) and "layer" in result.reason
    assert analyze(program).schedule == "parallel"

    result = drop_norm(simple_program(linear_attention))
    assert (result.status, result.exact) == ("already_satisfied", True)

    def never_updated(W, k, v, q):
        return (W,), (q @ W,)
    result = drop_norm(simple_program(never_updated))
    assert (result.status, result.exact) == ("not_applicable", True)


def test_rms_norm_of_state_is_dropped():
    def rms_normed(W, k, v, q, g):
        U = W + k.transpose(-1, -2) @ v
        return (U * torch.rsqrt(U.pow(2).mean(-1, keepdim=True) + 1e-6) * g,), (q @ W,)
    program = simple_program(rms_normed, invariants=dict(g=torch.ones(D)))
    assert drop_norm(program).status == "applied"
    assert analyze(program).rules["W"] == "W' = W + kᵀ·v"


def test_remove_dead_states():
    def body(W, Z, k, v, q):
        return (W + k.transpose(-1, -2) @ v, Z * 0.5 + v.mean()), (q @ W,)
    program = program_from_body(body, states=dict(W=torch.randn(B, D, D), Z=torch.randn(B)),
                                streams=dict(k=seq(8, D), v=seq(8, D), q=seq(8, D)),
                                chunk_size=C)
    assert remove_dead_states(program) == ["Z"]
    assert [s.name for s in program.states] == ["W"] and len(program.state_inputs()) == 1
    assert remove_dead_states(program) == []


# -- levels and the registry -----------------------------------------------------------------------

@pytest.fixture
def pending_step_3():
    """The registry with step 3 pending (as before its pass existed), restored afterwards."""
    written = get_pass(3)
    register(PendingPass(3, "collapse_mlp"))
    try:
        yield
    finally:
        register(written)


@pytest.mark.parametrize("level", [3, 4, 5, 6])
def test_a_level_with_a_pending_step_is_refused_naming_it(pending_step_3, level):
    with pytest.raises(LevelNotImplementedError, match="collapse_mlp") as info:
        run_level(lact_program(), level)
    assert isinstance(info.value, ConversionError)
    assert "level <= 2" in str(info.value)
    assert implemented_level() == 2


def test_remedies_come_from_the_registry():
    assert remedy_for("theta_update") == "apply freeze_theta (level >= 1)"
    assert remedy_for("state_norm") == "apply drop_norm (level >= 2)"
    assert remedy_for("no such blocker") is None
    written = get_pass(2)

    class Renamed(DropNorm):
        name = "renamed_norm_pass"
    try:
        register(Renamed())
        assert remedy_for("state_norm") == "apply renamed_norm_pass (level >= 2)"
        analysis = analyze(run_level(lact_program(), 1)[0])
        assert any("renamed_norm_pass (level >= 2)" in b.remedy for b in analysis.blockers)
    finally:
        register(written)


@pytest.mark.parametrize("level", [7, -1, 2.0, True, "1"])
def test_invalid_levels(level):
    with pytest.raises(ValueError):
        run_level(lact_program(), level)


def test_registry_order_and_registration():
    assert [get_pass(s).name for s in range(1, 7)] == [
        "freeze_theta", "drop_norm", "collapse_mlp", "absorb_lr", "remove_momentum", "remove_muon"]
    assert get_pass(1).implemented and get_pass(3).implemented

    class Identity(Pass):
        name, step, exact = "collapse_mlp", 3, False

        def run(self, program, context=None) -> PassResult:
            return self.result("already_satisfied", "nothing to collapse")
    written = get_pass(3)
    try:
        register(Identity())
        _, results = run_level(lact_program(), 3)
        assert [r.status for r in results] == ["applied", "applied", "already_satisfied"]
        assert results[2].exact
    finally:
        register(written)
    with pytest.raises(ValueError):
        register(type("Bad", (Pass,), {"step": 9})())


def _traced_chain(f, shape):
    """The call nodes of ``f`` traced on a tensor of ``shape``, in order."""
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(f, pre_dispatch=False)(torch.randn(*shape))
    return [n for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("f, neutral", [
    (lambda x: torch.ops.aten.t_copy(torch.ops.aten.t_copy(x)), True),
    (lambda x: torch.ops.aten.t_copy(x), False),
    (lambda x: x.transpose(0, 1).transpose(1, 0).detach(), True),
    (lambda x: x.transpose(0, 1).reshape(2, 3), False),
    (lambda x: x.squeeze(0).clone(), True),
    (lambda x: x.unsqueeze(0).view(3, 2), False),
])
def test_neutral_views_of_an_increment(f, neutral):
    """Copies, same-shape reshapes and an even number of two-axis swaps leave an increment as
    it is; one swap or a reshape to another shape does not."""
    from ttt2la.passes.remove_muon import _neutral
    assert _neutral(_traced_chain(f, (3, 2))) is neutral


@pytest.mark.parametrize("f, replayed", [
    (lambda x: x.detach(), [True]), (lambda x: x.to(torch.float64), [True]),
    (lambda x: x.transpose(0, 1), [True]), (lambda x: x.view(6), [True]),
    (lambda x: x.expand_as(torch.ones(4, 3, 2)), [True]),
])
def test_views_replayed_by_collapse_mlp(f, replayed):
    """A view between a product and the kernel's value is replayed (never dropped) when its
    other arguments are constants."""
    from ttt2la.passes.collapse_mlp import _replayed
    assert [_replayed(n) for n in _traced_chain(f, (3, 2))][-len(replayed):] == replayed


def test_a_view_shaped_by_another_value_is_not_replayed():
    from ttt2la.passes.collapse_mlp import _replayed
    gm = torch.fx.symbolic_trace(lambda x, y: torch.ops.aten.expand_as(x, y))
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not _replayed(node)


def test_a_view_sized_by_the_body_is_replayed_at_each_chunk_s_size():
    """A body generic in the length computes the sizes of its views: collapse_mlp builds the
    view's metadata at the traced size and replays it on a calibration chunk at that chunk's."""
    import operator
    from ttt2la.passes.collapse_mlp import Site, _call, _in_product_layout, _replayed
    g = torch.fx.Graph()
    product = g.placeholder("product")
    product.meta["val"] = torch.empty(4, 6)
    size = g.call_function(operator.mul, (3, 2))
    size.meta["val"] = 6                        # the traced length
    core = _call(g, torch.ops.aten.view.default, [product, [2, 2, size]])
    assert _replayed(core) and core.meta["val"].shape == (2, 2, 6)
    value = torch.randn(2, 2, 5)                # a chunk of 5 tokens
    site = Site(core, product, product, [core, product])
    laid_out = _in_product_layout(site, value, (4, 5), {size: 5})
    assert torch.equal(laid_out, value.reshape(4, 5).double())


def test_a_pass_that_breaks_its_promise_raises_a_conversion_error(monkeypatch):
    """A postcondition that fails is ttt2la's bug: said as a ``ConversionError`` naming the
    pass and the level to fall back to, never a bare ``AssertionError``."""
    import ttt2la
    from ttt2la.passes.freeze_theta import FreezeTheta
    from ttt2la.zoo import LaCTFoldedLayer

    def broken(self, program):
        raise AssertionError("a Θ update left behind")

    monkeypatch.setattr(FreezeTheta, "ensures", broken)
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, 4, muon=False)
    with pytest.raises(ConversionError, match="freeze_theta.*a Θ update left behind.*"
                                                     "level <= 0"):
        ttt2la.convert(layer, level=1, example_inputs=(torch.randn(2, 16, 8),))


class _TwoChunksPerIteration(torch.nn.Module):
    """An MLP memory whose loop takes two chunks per iteration, stepping its kernel weights Θ
    and its final layer after each: the second chunk reads Θ stepped by the first."""

    def __init__(self, d=6, h=10, C=4):
        super().__init__()
        self.C = C
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.theta = torch.nn.Parameter(torch.randn(d, h) / d ** 0.5)
        self.w = torch.nn.Parameter(torch.randn(h, d) / h ** 0.5)

    def _step(self, theta, w, k, v):
        phi = torch.nn.functional.silu(k @ theta)
        return theta + 0.05 * k.mT @ phi, w + 0.1 * phi.mT @ v

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        B, C, outs = x.shape[0], self.C, []
        theta, w = self.theta.expand(B, -1, -1), self.w.expand(B, -1, -1)
        for s in range(0, x.shape[1], 2 * C):
            qs, ks, vs = (t[:, s:s + 2 * C].reshape(B, 2, C, -1) for t in (q, k, v))
            ya = torch.nn.functional.silu(qs[:, 0] @ theta) @ w
            theta, w = self._step(theta, w, ks[:, 0], vs[:, 0])
            yb = torch.nn.functional.silu(qs[:, 1] @ theta) @ w
            theta, w = self._step(theta, w, ks[:, 1], vs[:, 1])
            outs.append(torch.cat([ya, yb], dim=1))
        return torch.cat(outs, dim=1)


def test_kernel_weights_stepped_within_an_iteration_are_not_called_frozen():
    """Freezing the Θ the loop carries would leave the Θ stepped by the first chunk read by the
    second: level 1 refuses, naming where, instead of reporting Θ frozen."""
    import ttt2la
    torch.manual_seed(0)
    layer, x = _TwoChunksPerIteration(), torch.randn(2, 16, 6)
    with pytest.raises(UnsupportedTTTError, match=r"stepped within an iteration.*test_passes.py"):
        ttt2la.convert(layer, level=1, example_inputs=(x,))
    exact = ttt2la.convert(layer, level=0, example_inputs=(x,), strict=False)
    assert exact.ttt2la_report.exact
