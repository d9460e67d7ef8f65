"""The dependence lattice, roles, the associativity checker and the rendered update rules."""
from __future__ import annotations

import inspect

import networkx as nx
import pytest
import module_scoped
import torch
import torch.nn.functional as F

from ttt2la.analysis import Dep, analyze, analyze_dependence, assign_roles, match_newton_schulz
from ttt2la.errors import ConversionError, NonReducibleError
from ttt2la.frontend.build import program_from_body

B, D, DH, L, C = 2, 3, 5, 8, 4


def seq(*shape):
    return torch.randn(B, L, *shape)


def newton_schulz5(G):
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = X @ X.transpose(-1, -2)
        X = a * X + (b * A + c * A @ A) @ X
    return X


def lact_body(w0, w1, w2, m1, k, v, q, lr, mom):
    """LaCT-like SwiGLU fast weights stored W@x, hand-written gradients, Θ = (w0, w2) updated."""
    pre = k @ w0.transpose(-1, -2)
    gate = F.silu(pre)
    hid = k @ w2.transpose(-1, -2)
    h = gate * hid
    dw1 = (v * lr).transpose(-1, -2) @ h
    dh = (v * lr) @ w1
    dgate, dhid = dh * hid, dh * gate
    dpre = dgate * torch.sigmoid(pre) * (1 + pre * (1 - torch.sigmoid(pre)))  # w0 nonlinear
    dw0 = dpre.transpose(-1, -2) @ k
    dw2 = dhid.transpose(-1, -2) @ k
    alpha = torch.sigmoid(mom).mean(dim=1, keepdim=True)
    m1n = alpha * m1 + dw1
    u = w1 + newton_schulz5(m1n)
    w1n = u / u.norm(dim=-1, keepdim=True) * w1.norm(dim=-1, keepdim=True)
    w0n = w0 + newton_schulz5(dw0)
    w2n = w2 + newton_schulz5(dw2)
    o = (F.silu(q @ w0.transpose(-1, -2)) * (q @ w2.transpose(-1, -2))) @ w1.transpose(-1, -2)
    return (w0n, w1n, w2n, m1n), (o,)


def lact_program():
    return _traced_lact().clone()


@module_scoped.cached
def _traced_lact():
    return program_from_body(
        lact_body, states=dict(w0=torch.randn(B, DH, D), w1=torch.randn(B, D, DH),
                               w2=torch.randn(B, DH, D), m1=torch.zeros(B, D, DH)),
        streams=dict(k=seq(D), v=seq(D), q=seq(D), lr=seq(1), mom=seq(1)), chunk_size=C)


def marked_line(marker: str) -> int:
    lines, start = inspect.getsourcelines(lact_body)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def single_state(body, *, d=D, order="exclusive", streams=None, invariants=None):
    streams = streams or dict(k=seq(d), v=seq(d), q=seq(d))
    return program_from_body(body, states=dict(W=torch.randn(B, d, d)), streams=streams,
                             invariants=invariants, chunk_size=C, order=order)


def self_class(program, state=0) -> Dep:
    return analyze_dependence(program).update(state, state).cls


# -- the lattice ---------------------------------------------------------------------------------

def test_additive_update_is_identity_and_parallel():
    def body(W, k, v, q):
        return (W + k.transpose(-1, -2) @ v,), (q @ W,)
    program = single_state(body)
    analysis = analyze(program)
    assert self_class(program) == Dep.IDENTITY
    assert analysis.schedule == "parallel" and analysis.reducible
    assert analysis.group_modes == ["prefix"]
    analysis.require_schedule("parallel")


def test_a_product_whose_added_term_alone_reads_the_state_is_additive():
    """``baddbmm(W, kᵀ, v)`` is ``W + kᵀv``; with ``beta`` it scales the state: a gate."""
    def fused(W, k, v, q):
        return (torch.baddbmm(W, k.transpose(-1, -2), v, alpha=0.5),), (q @ W,)

    def scaled(W, k, v, q):
        return (torch.baddbmm(W, k.transpose(-1, -2), v, beta=0.9),), (q @ W,)

    def through_the_state(W, k, v, q):
        return (torch.baddbmm(W, k.transpose(-1, -2), k @ W),), (q @ W,)
    assert self_class(single_state(fused)) == Dep.IDENTITY
    assert analyze(single_state(fused)).schedule == "parallel"
    assert self_class(single_state(scaled)) == Dep.SCALAR_AFFINE
    assert self_class(single_state(through_the_state)) == Dep.MATRIX_AFFINE


def test_delta_rule_is_matrix_affine_and_semi_parallel():
    def body(W, k, v, q):
        return (W + k.transpose(-1, -2) @ (v - k @ W),), (q @ W,)
    program = single_state(body)
    analysis = analyze(program)
    assert self_class(program) == Dep.MATRIX_AFFINE
    assert analysis.schedule == "semi-parallel" and analysis.reducible
    analysis.require_reducible(level=0)
    with pytest.raises(NonReducibleError, match="delta rule"):
        analysis.require_schedule("parallel")


def test_weight_norm_is_local_and_semi_parallel():
    def body(W, k, v, q, n0):
        U = W + k.transpose(-1, -2) @ v
        return (U / U.norm(dim=-2, keepdim=True) * n0,), (q @ W,)
    program = single_state(body, invariants=dict(n0=torch.rand(B, 1, D)))
    analysis = analyze(program)
    assert self_class(program) == Dep.LOCAL
    assert analysis.schedule == "semi-parallel"
    assert analysis.rules["W"] == "W' = Norm(W + kᵀ·v)"
    culprit = analysis.states[0].culprit
    assert culprit is not None and "linalg_vector_norm" in str(culprit.target)
    with pytest.raises(NonReducibleError, match="drop_norm"):
        analysis.require_schedule("parallel")


def test_scalar_gate_from_a_stream_is_scalar_affine():
    def body(W, k, v, q, g):
        return (torch.sigmoid(g).mean(1, keepdim=True) * W + k.transpose(-1, -2) @ v,), (q @ W,)
    program = single_state(body, streams=dict(k=seq(D), v=seq(D), q=seq(D), g=seq(1)))
    assert self_class(program) == Dep.SCALAR_AFFINE
    assert analyze(program).group_modes == ["affine"]


def test_transpose_of_transpose_is_identity_again():
    def back(W, k, v, q):
        return ((W.transpose(1, 2) + v.transpose(1, 2) @ k).transpose(1, 2),), (q @ W,)

    def once(W, k, v, q):
        return (W.transpose(1, 2) + k.transpose(1, 2) @ v,), (q @ W,)
    assert self_class(single_state(back)) == Dep.IDENTITY
    assert self_class(single_state(once)) == Dep.MATRIX_AFFINE


def test_state_local_nonlinearity_versus_per_token_and_unknown_ops():
    def local(W, k, v, q):
        return (W + torch.tanh(W) * 0.1 + k.transpose(-1, -2) @ v,), (q @ W,)

    def per_token(W, k, v, q):
        return (W + k.transpose(-1, -2) @ torch.tanh(F.silu(k @ W)),), (q @ W,)

    def unknown(W, k, v, q):
        return (W + torch.special.bessel_j0(W),), (q @ W,)
    assert self_class(single_state(local)) == Dep.LOCAL
    dep = analyze_dependence(program := single_state(per_token)).update(0, 0)
    assert dep.cls == Dep.NONLINEAR and dep.token_mixed
    assert "silu" in str(dep.culprit.target)                 # the first nonlinear op, not tanh
    assert analyze(program).schedule == "recurrent"
    assert self_class(single_state(unknown)) == Dep.NONLINEAR


def test_state_recomputed_from_streams_is_independent():
    def body(W, k, v, q):
        return (k.transpose(-1, -2) @ v,), (q @ W,)
    program = single_state(body)
    assert self_class(program) == Dep.INDEPENDENT
    assert analyze(program).group_modes == ["independent"]


def test_nodes_record_streams_and_states():
    program = lact_program()
    dep = analyze_dependence(program)
    out = program.chunk_outputs()[0]
    assert dep.reads_streams(out)
    assert dep.states_of(out) == {0, 1, 2}
    assert dep.cls(out, 1) == Dep.MATRIX_AFFINE
    assert dep.cls(out, 0) == Dep.NONLINEAR


# -- roles ---------------------------------------------------------------------------------------

def test_lact_roles():
    program = lact_program()
    assert assign_roles(program) == {"w0": "theta", "w1": "final", "w2": "theta",
                                     "m1": "momentum"}
    assert {s.name: s.role for s in program.streams} == {
        "k": "k", "v": "v", "q": "q", "lr": "lr", "mom": "momentum"}


def test_roles_in_x_at_w_style_with_torch_func_grad():
    def fast(x, w0, w1):
        return F.silu(x @ w0) @ w1

    def body(w0, w1, k, v, q):
        g0, g1 = torch.func.grad(lambda a, b: -(fast(k, a, b) * v).sum(), argnums=(0, 1))(w0, w1)
        return (w0 - g0, w1 - g1), (fast(q, w0, w1),)
    program = program_from_body(body, states=dict(w0=torch.randn(B, D, DH),
                                                  w1=torch.randn(B, DH, D)),
                                streams=dict(k=seq(D), v=seq(D), q=seq(D)), chunk_size=C)
    assert assign_roles(program) == {"w0": "theta", "w1": "final"}
    assert {s.name: s.role for s in program.streams} == {"k": "k", "v": "v", "q": "q"}


# -- the checker and its error -------------------------------------------------------------------

def test_lact_with_theta_updated_is_not_reducible_and_names_the_op():
    program = lact_program()
    assign_roles(program)
    analysis = analyze(program)
    assert analysis.schedule == "recurrent" and not analysis.reducible
    assert analysis.groups == [[0, 1, 2, 3]]
    with pytest.raises(NonReducibleError) as info:
        analysis.require_reducible(level=0)
    err = info.value
    line = marked_line("# w0 nonlinear")
    assert isinstance(err, ConversionError)
    assert err.state == "w0"
    assert "the kernel-weight Θ state w0" in str(err)
    assert err.op == "`torch.sigmoid`" and err.where == f"tests/test_analysis.py:{line}"
    assert f"test_analysis.py:{line}" in str(err)
    assert "freeze_theta (level >= 1)" in str(err) and "freeze_theta" in err.remedy


def test_state_graph_and_topological_order():
    def body(W, M, k, v, q, g):
        alpha = torch.sigmoid(g).mean(dim=1, keepdim=True)
        M2 = alpha * M + k.transpose(-1, -2) @ v
        return (W + newton_schulz5(M2), M2), (q @ W,)
    program = program_from_body(body, states=dict(W=torch.randn(B, D, D), M=torch.zeros(B, D, D)),
                                streams=dict(k=seq(D), v=seq(D), q=seq(D), g=seq(1)),
                                chunk_size=C)
    assign_roles(program)
    analysis = analyze(program)
    assert [s.role for s in program.states] == ["final", "momentum"]
    assert set(analysis.graph.edges) == {(1, 0)}
    assert isinstance(analysis.graph, nx.DiGraph)
    assert analysis.topological_order == ["M", "W"]
    assert analysis.schedule == "parallel"
    assert analysis.states[0].depends_on == {"M": Dep.LOCAL}
    assert analysis.states[1].self_dependence == Dep.SCALAR_AFFINE
    assert analysis.rules == {"W": "W' = W + NS5(α·M + kᵀ·v)", "M": "M' = α·M + kᵀ·v"}
    ns = match_newton_schulz(program.state_outputs()[0].args[1])
    assert ns is not None and ns.steps == 5


def test_coupled_states_form_one_component():
    def linear(S, T, k, v, q, P):
        return (S + T @ P + k.transpose(-1, -2) @ v, T + S @ P), (q @ S,)

    def nonlinear(S, T, k, v, q, P):
        return (S + torch.tanh(k @ T).transpose(-1, -2) @ v, T + S @ P), (q @ S,)
    states = dict(S=torch.randn(B, D, D), T=torch.randn(B, D, D))
    streams = dict(k=seq(D), v=seq(D), q=seq(D))
    inv = dict(P=torch.randn(B, D, D))
    a = analyze(program_from_body(linear, states=states, streams=streams, invariants=inv,
                                  chunk_size=C))
    assert a.groups == [[0, 1]] and a.schedule == "semi-parallel"
    b = analyze(program_from_body(nonlinear, states=states, streams=streams, invariants=inv,
                                  chunk_size=C))
    assert b.schedule == "recurrent"
    with pytest.raises(NonReducibleError, match="tanh"):
        b.require_reducible()


def test_rules_render_lact_update():
    program = lact_program()
    assign_roles(program)
    rules = analyze(program).rules
    assert rules["m1"] == "m1' = α·m1 + (v⊙η)ᵀ·φ(k)"
    assert rules["w1"] == "w1' = Norm(w1 + NS5(α·m1 + (v⊙η)ᵀ·φ(k)))"
    assert rules["w0"].startswith("w0' = w0 + NS5(")


def test_rules_fall_back_to_generic_functions():
    def body(W, k, v, q):
        return (W + torch.special.bessel_j0(k).transpose(-1, -2) @ v,), (q @ W,)
    rule = analyze(single_state(body)).rules["W"]
    assert rule.startswith("W' = W + ") and "f(k)" in rule.replace("φ(k)", "f(k)")
