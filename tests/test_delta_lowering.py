"""Per-token delta-rule loops lowered onto the chunked ``delta_rule`` op.

The DeltaNet-style memory of the zoo (one gradient step of ``½‖k S − v‖²`` per token, with and
without a decay gate, read after or before the step, the gradient by hand or by
``torch.func.grad``) converts exactly: outputs and every parameter gradient equal the layer's
own token loop (fp32, relative RMS ≤ 1e-5) for every length from 1 to 5·C+7, C the op's chunk
size; the report names ``delta_rule``; the converted layer's op count grows with the length only
as the op's log-depth scan over chunks. A look-alike whose update is matrix-affine but not the
delta rule (another key writes than reads) keeps the generic matrix-affine scan, exactly. And
the op itself on bf16 inputs is no further from a float64 evaluation than the token loop run in
bf16 (twice its error plus 1e-6). Two other ways of writing the rule — the row-sum form of
delta-rule libraries' reference code, and a ``[out, in]`` memory with a constant decay stepped
by ``torch.func.grad`` and read before the step — convert onto the op as well.
"""
from __future__ import annotations

import math

import pytest
import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from ttt2la.converted import SOME_CALLS
from ttt2la.runtime import delta_rule
from ttt2la.runtime.delta_rule import DELTA_CHUNK_SIZE
from ttt2la.testing import TOLERANCE, rel_rms_error, training_step_ops
from ttt2la.zoo import DeltaMemoryLayer

C = DELTA_CHUNK_SIZE
TOL = TOLERANCE[torch.float32]
pytestmark = pytest.mark.usefixtures("always_scan")

#: (decay, read, grad, heads) of the layers converted (one trace each); every option appears
#: with each of its values.
LAYERS = [
    (False, "after", "manual", 2),
    (True, "after", "func", 2),
    (True, "before", "manual", 2),
    (False, "before", "func", 3),
    (True, "after", "manual", 3),
    (True, "before", "manual", 1),     # one head: its view(B, L, 1, D) is no cut into chunks
]
HEAD_DIM = 4


@module_scoped.cached
def converted(which: int):
    decay, read, grad, heads = LAYERS[which]
    torch.manual_seed(which)
    layer = DeltaMemoryLayer(heads * HEAD_DIM, heads, decay=decay, read=read, grad=grad)
    if decay:                          # gates well below 1, so that the decay matters
        with torch.no_grad():
            layer.a_proj.bias.fill_(-2.0)
    example = torch.randn(2, 12, heads * HEAD_DIM)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(example,))


def outputs_and_grads(model, x, seed):
    model.zero_grad(set_to_none=True)
    y = model(x)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    (y * weights).sum().backward()
    return y.detach(), {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()}


@settings(max_examples=14, deadline=None)
@given(which=st.integers(0, len(LAYERS) - 1), batch=st.integers(1, 3),
       length=st.integers(1, 5 * C + 7), seed=st.integers(0, 2**31 - 1))
def test_delta_memory_converts_exactly_onto_the_delta_rule(which, batch, length, seed):
    layer, fast = converted(which)
    runtime = fast.ttt2la_report.to_dict()["layers"][0]["runtime"]
    assert runtime.startswith("delta_rule[torch]("), runtime
    assert ("gated" in runtime) == LAYERS[which][0], runtime
    d_model = LAYERS[which][3] * HEAD_DIM
    x = torch.randn(batch, length, d_model, generator=torch.Generator().manual_seed(seed))
    y_ref, g_ref = outputs_and_grads(layer, x, seed)
    y, g = outputs_and_grads(fast, x, seed)
    ran = fast.ttt2la_report.to_dict()["layers"][0]["runs"][f"batch {batch}"]
    assert ran == runtime, (batch, ran)          # the plan is carried to every batch size
    assert rel_rms_error(y, y_ref) <= TOL, rel_rms_error(y, y_ref)
    assert g.keys() == g_ref.keys()
    for name, grad in g_ref.items():
        assert rel_rms_error(g[name], grad) <= TOL, (name, rel_rms_error(g[name], grad))


@pytest.mark.parametrize("which", [2, 3, len(LAYERS) - 1],
                         ids=["two heads", "three heads", "one head"])
def test_every_length_around_the_chunk_boundaries(which):
    """The lengths hypothesis may miss: 1, C − 1, C, C + 1, 2C and 5C + 7."""
    layer, fast = converted(which)
    assert fast.ttt2la_report.to_dict()["layers"][0]["runtime"].startswith("delta_rule[torch](")
    d_model = LAYERS[which][3] * HEAD_DIM
    for length in (1, C - 1, C, C + 1, 2 * C, 5 * C + 7):
        x = torch.randn(2, length, d_model, generator=torch.Generator().manual_seed(length))
        y_ref, g_ref = outputs_and_grads(layer, x, length)
        y, g = outputs_and_grads(fast, x, length)
        assert rel_rms_error(y, y_ref) <= TOL, (length, rel_rms_error(y, y_ref))
        for name, grad in g_ref.items():
            assert rel_rms_error(g[name], grad) <= TOL, (length, name)


def _count(fast, chunks: int, d_model: int) -> int:
    """Forward + backward ops at ``chunks`` chunks of the op, after one warm-up call."""
    x = torch.randn(1, chunks * C, d_model, generator=torch.Generator().manual_seed(0))
    return training_step_ops(fast, x)


def test_op_count_grows_only_with_the_scan_depth():
    """16 → 256 chunks adds log₂(256/16) = 4 levels of the op's pairwise scan, each costing
    what one level costs from 16 to 32 chunks; a per-token or per-chunk loop would not fit."""
    _, fast = converted(4)
    d_model = LAYERS[4][3] * HEAD_DIM
    c16, c32, c256 = (_count(fast, n, d_model) for n in (16, 32, 256))
    per_level = c32 - c16
    assert 0 < per_level < c16 / 2, (c16, c32)
    assert c256 <= c16 + (math.log2(256) - math.log2(16)) * per_level, (c16, c32, c256)


class RowSumMemory(nn.Module):
    """The delta rule as the reference recurrences of delta-rule libraries write it: heads-first
    ``[B, H, L, D]`` tensors, the prediction as a broadcast product summed over the key axis,
    the correction scaled by β before the write, the read by ``einsum``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.b = nn.Linear(d, heads)

    def forward(self, x):
        B, L, d = x.shape
        D = d // self.heads
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D).permute(2, 0, 3, 1, 4)
        q, k = q * D ** -0.5, F.normalize(k, dim=-1)
        beta = self.b(x).sigmoid().transpose(1, 2)                     # [B, H, L]
        S = x.new_zeros(B, self.heads, D, D)
        outs = []
        for i in range(L):
            k_i, v_i = k[:, :, i], v[:, :, i]
            correction = (v_i - (S * k_i[..., None]).sum(-2)) * beta[:, :, i, None]
            S = S + k_i[..., None] * correction[..., None, :]
            outs.append(torch.einsum("bhd,bhdm->bhm", q[:, :, i], S))
        return torch.stack(outs, dim=2).transpose(1, 2).reshape(B, L, d)


class OutInMemory(nn.Module):
    """A learned initial memory stored ``[out, in]`` (``k Wᵀ``), a constant decay and step on
    the unscaled loss ``‖k Wᵀ − v‖²`` by ``torch.func.grad``, read before the step; the final
    memory is returned too."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.w0 = nn.Parameter(torch.randn(d, d) * 0.2)

    def forward(self, x):
        q, v = self.q(x), self.v(x)
        k = F.normalize(self.k(x), dim=-1)

        def loss(W, k, v):
            return ((k[:, None, :] @ W.mT - v[:, None, :]) ** 2).sum()

        W = self.w0.expand(x.shape[0], -1, -1)
        ys = []
        for t in range(x.shape[1]):
            ys.append((q[:, t, None, :] @ W.mT)[:, 0])
            W = 0.95 * W - 0.2 * torch.func.grad(loss)(W, k[:, t], v[:, t])
        return torch.stack(ys, dim=1), W


class BetaKeyMemory(nn.Module):
    """The gated delta rule with β on the key of the write, ``S ← α S``, then
    ``S ← S + (β k)ᵀ (v − k S)``: the update reads ``β k``, not ``β``, so the coefficients are
    products of scalars the frontier is made from."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.ab = nn.Linear(d, 2 * heads)

    def forward(self, x):
        B, L, d = x.shape
        D = d // self.heads
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D).permute(2, 0, 3, 1, 4)
        k = F.normalize(k, dim=-1)
        a, b = self.ab(x).chunk(2, dim=-1)
        alpha, beta = torch.sigmoid(a + 2).transpose(1, 2), torch.sigmoid(b).transpose(1, 2)
        S = x.new_zeros(B, self.heads, D, D)
        outs = []
        for t in range(L):
            k_t, v_t = k[:, :, t], v[:, :, t]
            S = S * alpha[:, :, t, None, None]
            error = v_t - (k_t.unsqueeze(-2) @ S).squeeze(-2)
            S = S + (beta[:, :, t, None] * k_t).unsqueeze(-1) * error.unsqueeze(-2)
            outs.append((q[:, :, t].unsqueeze(-2) @ S).squeeze(-2))
        return torch.stack(outs, dim=2).transpose(1, 2).reshape(B, L, d)


STYLES = {"row-sum": (lambda: RowSumMemory(8, 2), 8), "out-in": (lambda: OutInMemory(5), 5),
          "beta-key": (lambda: BetaKeyMemory(8, 2), 8)}


@module_scoped.cached
def converted_style(name: str):
    torch.manual_seed(7)
    make, d = STYLES[name]
    layer = make()
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, d),)), d


def _flat_outputs_and_grads(model, x, seed):
    model.zero_grad(set_to_none=True)
    ys = model(x)
    ys = ys if isinstance(ys, tuple) else (ys,)
    g = torch.Generator().manual_seed(seed)
    sum((y * torch.randn(y.shape, generator=g)).sum() for y in ys).backward()
    return [y.detach() for y in ys], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(STYLES))
@settings(max_examples=3, deadline=None)
@given(batch=st.integers(1, 3),
       length=st.integers(1, 5 * C + 7), seed=st.integers(0, 2**31 - 1))
def test_other_ways_of_writing_it_convert_exactly(name, batch, length, seed):
    """Outputs (and the returned memory), every parameter gradient (the initial memory's too)."""
    layer, fast, d = converted_style(name)
    runtime = fast.ttt2la_report.to_dict()["layers"][0]["runtime"]
    assert runtime.startswith("delta_rule[torch]("), runtime
    x = torch.randn(batch, length, d, generator=torch.Generator().manual_seed(seed))
    want, g_want = _flat_outputs_and_grads(layer, x, seed)
    got, g_got = _flat_outputs_and_grads(fast, x, seed)
    ran = fast.ttt2la_report.layers[0].runs[f"batch {batch}"]
    assert ran == runtime, ran                  # the call ran on the op, not a fallback
    for a, b in zip(got, want):
        assert rel_rms_error(a, b) <= TOL, rel_rms_error(a, b)
    for n, grad in g_want.items():
        assert rel_rms_error(g_got[n], grad) <= TOL, (n, rel_rms_error(g_got[n], grad))


class TwoKeyMemory(nn.Module):
    """A look-alike: ``S ← S − β k_wᵀ (k_r S − v)`` with a *write* key ``k_w`` other than the
    *read* key ``k_r``. Matrix-affine in ``S`` (``A = I − β k_wᵀ k_r``) but not the delta rule,
    whose map is symmetric."""

    def __init__(self, d: int):
        super().__init__()
        self.q, self.kr, self.kw, self.v = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.b = nn.Linear(d, 1)

    def forward(self, x):
        q, v = self.q(x), self.v(x)
        kr, kw = F.normalize(self.kr(x), dim=-1), F.normalize(self.kw(x), dim=-1)
        beta = torch.sigmoid(self.b(x))
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        ys = []
        for t in range(x.shape[1]):
            error = (kr[:, t, None, :] @ S) - v[:, t, None, :]          # [B, 1, d]
            S = S - beta[:, t, :, None] * (kw[:, t, :, None] @ error)
            ys.append((q[:, t, None, :] @ S)[:, 0])
        return torch.stack(ys, dim=1)


def test_a_look_alike_keeps_the_generic_scan():
    torch.manual_seed(0)
    layer = TwoKeyMemory(5)
    fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 10, 5),))
    runtime = fast.ttt2la_report.to_dict()["layers"][0]["runtime"]
    assert "delta_rule" not in runtime and "matrix-affine scan" in runtime, runtime
    x = torch.randn(3, 70, 5, generator=torch.Generator().manual_seed(1))
    y_ref, g_ref = outputs_and_grads(layer, x, 1)
    y, g = outputs_and_grads(fast, x, 1)
    assert rel_rms_error(y, y_ref) <= TOL
    for name, grad in g_ref.items():
        assert rel_rms_error(g[name], grad) <= TOL, name


def _token_loop(q, k, v, beta, decay):
    """The gated delta rule one token at a time, in the inputs' dtype: decay, then one step of
    ``½β‖k S − v‖²``, read after the step."""
    B, T, H, Dk = k.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=v.dtype)
    outs = []
    for t in range(T):
        S = decay[:, t, :, None, None] * S
        residual = (k[:, t].unsqueeze(-2) @ S).squeeze(-2) - v[:, t]
        S = S - beta[:, t, :, None, None] * (k[:, t].unsqueeze(-1) * residual.unsqueeze(-2))
        outs.append((q[:, t].unsqueeze(-2) @ S).squeeze(-2))
    return torch.stack(outs, dim=1)


def _out_and_grads(fn, inputs, weights):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = fn(*leaves)
    grads = torch.autograd.grad((o.double() * weights).sum(), leaves)
    return [o.detach().double(), *(gr.double() for gr in grads)]


def test_bf16_inputs_are_no_worse_than_the_token_loop_in_bf16():
    """Outputs and the gradients of q, k, v, β and the decay: the op on bf16 inputs against a
    float64 evaluation, within twice the bf16 token loop's own error plus 1e-6."""
    g = torch.Generator().manual_seed(4)
    B, T, H, D = 1, 2 * C + 9, 2, 16
    q, v = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    k = F.normalize(torch.randn(B, T, H, D, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    decay = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=torch.float64) + 3)
    inputs = [x.to(torch.bfloat16) for x in (q, k, v, beta, decay)]
    weights = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    exact = _out_and_grads(_token_loop, [x.double() for x in inputs], weights)
    loop = _out_and_grads(_token_loop, inputs, weights)
    op = _out_and_grads(lambda q, k, v, b, a: delta_rule(q, k, v, b, decay=a)[0], inputs, weights)
    for name, want, theirs, mine in zip(("o", "q", "k", "v", "beta", "decay"), exact, loop, op):
        bound = 2 * rel_rms_error(theirs, want) + 1e-6
        assert rel_rms_error(mine, want) <= bound, (name, rel_rms_error(mine, want), bound)


def _zero_gate_case(kind: str):
    """A converted gated layer and an input one of whose gates underflows to zero (a token a
    thousand times larger than the others), checked to do so."""
    if kind == "delta memory":
        layer, fast = converted(2)
        gate = lambda x: torch.sigmoid(layer.a_proj(x) + 3.0)  # noqa: E731
    else:
        from ttt2la.zoo import DeltaProductLayer
        torch.manual_seed(0)
        layer = DeltaProductLayer(8, 2)
        fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
        gate = lambda x: F.logsigmoid(layer.a_proj(x) + 3).exp()  # noqa: E731
    x = torch.randn(2, 11, layer.a_proj.in_features, generator=torch.Generator().manual_seed(3))
    x[:, 6] *= 1e3
    with torch.no_grad():
        assert bool((gate(x) == 0).any()) and bool((gate(x[:, :6]) > 0).all())
    return layer, fast, x


@pytest.mark.parametrize("kind", ["delta memory", "delta product"])
def test_a_gate_that_underflows_to_zero_runs_the_generic_plan_exactly(kind):
    """The op takes the decay's logarithm: a call where a gate is zero runs the generic plan of
    the same program (outputs and every gradient equal the layer's), named in the report; the
    next call whose gates are positive is back on the op."""
    layer, fast, x = _zero_gate_case(kind)
    y_ref, g_ref = outputs_and_grads(layer, x, 0)
    y, g = outputs_and_grads(fast, x, 0)
    assert rel_rms_error(y, y_ref) <= TOL, rel_rms_error(y, y_ref)
    for name, grad in g_ref.items():
        assert rel_rms_error(g[name], grad) <= TOL, name
    ran = fast.ttt2la_report.layers[0].runs["batch 2"].split(SOME_CALLS)
    assert "not delta_rule: a decay <= 0" in ran[-1] and not ran[-1].startswith("as written"), \
        ran
    outputs_and_grads(fast, x[:, :6], 0)         # back on the op; the earlier call still named
    ran = fast.ttt2la_report.layers[0].runs["batch 2"].split(SOME_CALLS)
    assert any(r.startswith("delta_rule[torch]") for r in ran), ran
    assert any("not delta_rule: a decay <= 0" in r for r in ran), ran
