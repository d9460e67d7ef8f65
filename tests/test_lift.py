"""Lifting onto ``block_linear_attention`` reads Newton–Schulz from the traced graph as data.

Each case is a small TTT layer written here by hand — a linear fast weight updated per chunk by
``NS(M)``, ``M`` a momentum over the chunk increments — with its own orthogonalisation: Muon's
constant triple, LaCT's five per-step triples (with and without its bf16 cast and
``torch.compile``), a schedule of the user's own, and look-alikes that are not Newton–Schulz
(row-wise normalisation, a cubic polynomial, a Gram matrix missing its transpose). The schedule
must be read and lifted exactly when the function is Newton–Schulz, and the converted layer must
equal the layer's own loop (float64, relative RMS ≤ 1e-10, outputs and every gradient) either
way; with the bf16 cast the converted layer is held to the precision criterion instead.
"""
from __future__ import annotations

import pytest
import module_scoped
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.lowering import LiftedPlan, Plan
from ttt2la.testing import rel_rms_error

C = 4
F64 = 1e-10

MUON = ((3.4445, -4.7750, 2.0315),) * 5
LACT = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
OWN = ((2.5, -2.0, 0.6), (2.0, -1.25, 0.3), (1.75, -0.9, 0.2))


def muon_classic(G):
    X = G
    if G.size(-2) > G.size(-1):
        X = X.transpose(-2, -1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = X @ X.transpose(-2, -1)
        B = -4.7750 * A + 2.0315 * A @ A
        X = 3.4445 * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.transpose(-2, -1)
    return X


def lact_schedule(G, cast=None):
    X = G if cast is None else G.to(cast)
    if G.size(1) > G.size(2):
        X = X.transpose(1, 2)
    X = X / (X.norm(dim=(1, 2), keepdim=True) + 1e-7)
    for a, b, c in [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                    (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                    (2.8366, -3.0525, 1.2012)]:
        A = X @ X.transpose(1, 2)
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(1) > G.size(2):
        X = X.transpose(1, 2)
    return X


@torch.compile(backend="eager")
def lact_bf16(G):
    return lact_schedule(G, cast=torch.bfloat16)


def own_schedule(G):
    X = G / (torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) + 1e-5)
    for a, b, c in ((2.5, -2.0, 0.6), (2.0, -1.25, 0.3), (1.75, -0.9, 0.2)):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    return X


def row_normalised(G):          # normalises each row, not the matrix
    X = G / (G.norm(dim=-1, keepdim=True) + 1e-7)
    for _ in range(3):
        A = X @ X.transpose(-2, -1)
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


def cubic(G):                   # b·A + c·A³: another polynomial
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(3):
        A = X @ X.transpose(-2, -1)
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A @ A) @ X
    return X


def gram_without_transpose(G):  # A = X·X (square updates): not X·Xᵀ
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(3):
        A = X @ X
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


class MuonLinearTTT(nn.Module):
    """Per chunk: read ``q W``, then ``M ← β_j M + kᵀ(η⊙v)``, ``W ← W + ns(M)``."""

    def __init__(self, ns, d=6, dv=6):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, dv, bias=False)
        self.lr = nn.Linear(d, 1, bias=False)
        self.beta = nn.Linear(d, 1, bias=False)
        self.w0 = nn.Parameter(torch.randn(d, dv) / d ** 0.5)
        self.ns = ns

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        lr = torch.sigmoid(self.lr(x))
        beta = torch.sigmoid(self.beta(x))
        W = self.w0.expand(B, -1, -1)
        M = torch.zeros_like(W)
        out = torch.zeros_like(v)
        e = 0
        for s in range(0, L - C, C):
            e = s + C
            out[:, s:e] = q[:, s:e] @ W
            M = beta[:, s:e].mean(dim=1, keepdim=True) * M \
                + k[:, s:e].transpose(1, 2) @ (v[:, s:e] * lr[:, s:e])
            W = W + self.ns(M)
        out[:, e:] = q[:, e:] @ W
        return out


_cache = module_scoped.cache()


def _converted(name, ns, dtype=torch.float64, dv=6):
    key = (name, dtype, dv)
    if key not in _cache:
        torch.manual_seed(0)
        layer = MuonLinearTTT(ns, dv=dv).to(dtype)
        x = torch.randn(2, 3 * C + 2, 6, dtype=dtype)
        _cache[key] = layer, ttt2la.convert(layer, level=2, example_inputs=(x,))
    return _cache[key]


def _plan(conv, B):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


def _outputs_and_grads(module, x):
    x = x.clone().requires_grad_(True)
    out = module(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad((out * w).sum(), [x, *params], allow_unused=True)
    # a parameter unused at this length (no update when L <= C) has gradient zero on both sides
    return [out, *(torch.zeros_like(p) if g is None else g for p, g in zip([x, *params], grads))]


def _assert_matches(conv, layer, B, L):
    x = torch.randn(B, L, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(B * L))
    for got, ref in zip(_outputs_and_grads(conv, x), _outputs_and_grads(layer, x)):
        assert rel_rms_error(got, ref) <= F64


LIFTED = {"muon": (muon_classic, MUON, 1e-7, None), "lact": (lact_schedule, LACT, 1e-7, None),
          "own": (own_schedule, OWN, 1e-5, None)}


@pytest.mark.parametrize("name", list(LIFTED))
def test_schedule_is_read_and_lifted(name):
    ns, schedule, eps, dtype = LIFTED[name]
    layer, conv = _converted(name, ns)
    assert conv.ttt2la_report.layers[0].runtime == "block_linear_attention[torch]"
    for B in (1, 3):
        plan = _plan(conv, B)
        assert isinstance(plan, LiftedPlan)
        read = plan.lifted.newton_schulz
        assert read.coefficients == schedule          # the literals, read exactly
        assert read.eps == eps and read.dtype is dtype
        _assert_matches(conv, layer, B, 3 * C + 1)


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(list(LIFTED)), B=st.integers(1, 4), L=st.integers(1, 5 * C + 3))
def test_lifted_layers_equal_their_loop(name, B, L):
    layer, conv = _converted(name, LIFTED[name][0])
    _assert_matches(conv, layer, B, L)


@pytest.mark.parametrize("name, ns", [("rows", row_normalised), ("cubic", cubic),
                                      ("gram", gram_without_transpose)])
def test_look_alikes_are_not_lifted(name, ns):
    layer, conv = _converted(name, ns)
    assert conv.ttt2la_report.layers[0].runtime.startswith("torch.vmap(")
    for B in (1, 2, 3):
        assert isinstance(_plan(conv, B), Plan)
        _assert_matches(conv, layer, B, 3 * C + 1)


def test_wide_updates_keep_the_transpose_rule():
    # dk = 6 > dv = 4: the updates are tall, the iteration runs on their transpose
    layer, conv = _converted("muon", muon_classic, dv=4)
    assert isinstance(_plan(conv, 3), LiftedPlan)
    for B in (1, 3):
        x = torch.randn(B, 3 * C + 3, 6, dtype=torch.float64)
        assert rel_rms_error(conv(x), layer(x)) <= F64


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lact_bf16_cast_and_compiled_helper_lift_in_bf16(dtype):
    """The iteration stays in bf16 as the source casts; judged against the float64 function."""
    layer, conv = _converted("lact-bf16", lact_bf16, dtype)
    plan = _plan(conv, 3)
    assert isinstance(plan, LiftedPlan)
    assert plan.lifted.newton_schulz.dtype is torch.bfloat16
    assert plan.lifted.newton_schulz.coefficients == LACT
    exact = MuonLinearTTT(lact_schedule).double()           # the same function, no cast
    exact.load_state_dict(layer.state_dict())
    for B in (1, 3):
        x = torch.randn(B, 4 * C, 6, dtype=dtype, generator=torch.Generator().manual_seed(B))
        ref64 = exact(x.double())
        mine, theirs = rel_rms_error(conv(x), ref64), rel_rms_error(layer(x), ref64)
        assert theirs > 0
        assert mine <= 2 * theirs + 1e-6


class FlippedRead(nn.Module):
    """A per-token memory read through its transpose: ``einsum("bhkv,bhk->bhv", S, q)`` (the
    state written first) or ``S.mT @ q``, the state key-first or value-first, decayed per key
    channel, read after or before each write."""

    def __init__(self, d=16, heads=2, spelling="einsum", layout="key_first", read="after"):
        super().__init__()
        self.heads, self.spelling, self.layout, self.read = heads, spelling, layout, read
        self.proj = nn.Linear(d, 4 * d, bias=False)

    def _read(self, S, q):
        key_first = self.layout == "key_first"
        if self.spelling == "einsum":
            return torch.einsum("bhkv,bhk->bhv" if key_first else "bhvk,bhk->bhv", S, q)
        M = S.mT if key_first else S                     # [V, K] either way
        return (M @ q.unsqueeze(-1)).squeeze(-1) if key_first else \
            (q.unsqueeze(-2) @ M.mT).squeeze(-2)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v, g = (t.view(B, T, self.heads, -1).transpose(1, 2)
                      for t in self.proj(x).chunk(4, -1))
        a = torch.sigmoid(g + 3)
        key_first = self.layout == "key_first"
        S = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        outs = []
        for t in range(T):
            if self.read == "before":
                outs.append(self._read(S, q[:, :, t]))
            at, kt, vt = a[:, :, t], k[:, :, t], v[:, :, t]
            if key_first:
                S = S * at[..., :, None] + kt[..., :, None] * vt[..., None, :]
            else:
                S = S * at[..., None, :] + vt[..., :, None] * kt[..., None, :]
            if self.read == "after":
                outs.append(self._read(S, q[:, :, t]))
        return torch.stack(outs, 2).transpose(1, 2).reshape(B, T, d)


@pytest.mark.parametrize("spelling,layout,read", [
    ("einsum", "key_first", "after"), ("einsum", "value_first", "before"),
    ("matmul", "key_first", "before"), ("matmul", "value_first", "after")])
def test_a_read_through_the_state_s_transpose_runs_on_the_token_causal_op(spelling, layout,
                                                                          read):
    """The read's operand is the state's transpose: the query and the read take the other
    layout's form, the state, its decay per key channel and its updates keep their own: on the
    op, exact."""
    from equivalence import assert_same_function, converted_onto

    torch.manual_seed(0)
    layer = FlippedRead(spelling=spelling, layout=layout, read=read)
    assert_same_function(converted_onto(layer, "chunk_linear_attention"), layer, [torch.randn(1, 1, 16), torch.randn(3, 37, 16)])


class FlippedBlockRead(nn.Module):
    """Chunked linear attention (apply, then update) whose chunk reads the state through its
    transpose: ``(S.mT @ q.mT).mT`` key-first, ``q @ S.mT`` value-first."""

    def __init__(self, d=16, heads=2, chunk=8, layout="key_first"):
        super().__init__()
        self.heads, self.chunk, self.layout = heads, chunk, layout
        self.proj = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.proj(x).chunk(3, -1))
        S = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        outs = []
        for s in range(0, T, self.chunk):
            qc, kc, vc = (t[:, :, s:s + self.chunk] for t in (q, k, v))
            if self.layout == "key_first":
                outs.append((S.mT @ qc.mT).mT)
                S = S + kc.mT @ vc
            else:
                outs.append(qc @ S.mT)
                S = S + vc.mT @ kc
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, T, d)


@pytest.mark.parametrize("layout", ["key_first", "value_first"])
def test_a_chunk_read_through_the_state_s_transpose_runs_on_the_block_op(layout):
    from equivalence import assert_same_function, converted_onto

    torch.manual_seed(0)
    layer = FlippedBlockRead(layout=layout)
    assert_same_function(converted_onto(layer, "block_linear_attention", (2, 32, 16)), layer, [torch.randn(1, 8, 16), torch.randn(3, 40, 16)])


class OneTokenSlices(nn.Module):
    """A fast weight stored as ``nn.Linear`` stores its weight (``[out, in]``) and stepped token
    by token over slices of one token (``q[:, t:t + 1]``), decayed by a gate per token; read
    before or after each update; with ``momentum``, a momentum buffer between them. The
    update's outer product is a ``matmul`` or an ``einsum`` contracting the unit token axis."""

    def __init__(self, d=16, read="before", momentum=False, product="matmul"):
        super().__init__()
        self.read, self.momentum, self.product = read, momentum, product
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, 1)
        self.W0 = nn.Parameter(0.1 * torch.randn(d, d))

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        a = torch.sigmoid(self.gate(x) + 3)
        W, M = self.W0.expand(B, d, d), x.new_zeros(B, d, d)
        outs = []
        for t in range(T):
            qt, kt, vt, at = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1]
            if self.read == "before":
                outs.append(qt @ W.transpose(1, 2))
            step = vt.transpose(1, 2) @ kt if self.product == "matmul" else \
                torch.einsum("bto,bti->boi", vt, kt)
            if self.momentum:
                M = 0.5 * M + step
                step = M
            W = at * W + 0.1 * step
            if self.read == "after":
                outs.append(qt @ W.transpose(1, 2))
        return torch.cat(outs, 1)


@pytest.mark.parametrize("read, product", [("before", "matmul"), ("after", "matmul"),
                                           ("before", "einsum"), ("after", "einsum")])
def test_a_loop_over_slices_of_one_token_runs_on_the_token_causal_op(read, product):
    """Slices of one token are a per-token loop: on ``chunk_linear_attention`` (its decay as
    the log decay), not the block op at chunks of one, exact — the outer product written as a
    matmul or as an einsum over the unit token axis (traced as a broadcast product reshaped)."""
    from equivalence import assert_same_function, converted_onto

    torch.manual_seed(0)
    layer = OneTokenSlices(read=read, product=product)
    assert_same_function(converted_onto(layer, "chunk_linear_attention"), layer, [torch.randn(1, 1, 16), torch.randn(3, 37, 16)])


def test_slices_of_one_token_with_momentum_keep_the_block_op():
    """Momentum has no token-causal form: the block op at chunks of one token, exact."""
    from equivalence import assert_same_function, converted_onto

    torch.manual_seed(0)
    layer = OneTokenSlices(momentum=True)
    assert_same_function(converted_onto(layer, "block_linear_attention"), layer, torch.randn(2, 30, 16))
