"""Recurrences written as flash-linear-attention's reference loops (``zoo.fla_reference``): states
read and corrected by broadcasting and summing, outputs written into a buffer, a decay per head,
per token, per key channel or per value channel.

Each converts exactly (outputs and every parameter gradient within the fp32 tolerance, ≤ 1e-10 in
float64) onto the op its recurrence is: retention, the scalar gate and the gates per key or value
channel onto the token-causal op with a log decay (per head, per key channel, or its
``value_log_decay``), the gated delta rule onto ``delta_rule``; a state multiplied on the right by
a whole matrix is no decay per column and keeps the generic plan. A decay that is not positive in
a call has no log: that call runs the generic plan and the report says so.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function, converted_onto
from ttt2la.converted import SOME_CALLS
from ttt2la.frontend.source_names import _sliced_names
from ttt2la.ir import SourceLoc
from ttt2la.lowering import LiftedPlan
from ttt2la.zoo import FlaReferenceLayer
from ttt2la.zoo.fla_reference import RULES

OPS = {"retention": "chunk_linear_attention", "scalar_gate": "chunk_linear_attention",
       "vector_gate": "chunk_linear_attention", "value_gate": "chunk_linear_attention",
       "gated_delta": "delta_rule",
       "ssd": "chunk_linear_attention", "normalised": "chunk_linear_attention",
       "rwkv6": "chunk_linear_attention"}


def _layer(rule, dtype=torch.float32, d=16, heads=2):
    torch.manual_seed(0)
    return FlaReferenceLayer(d, heads, rule).to(dtype)


def _converted(layer, d=16, dtype=torch.float32):
    return ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 19, d, dtype=dtype),))


@pytest.mark.parametrize("rule", RULES)
def test_each_recurrence_runs_on_its_op(rule):
    conv = _converted(_layer(rule))
    layer, = conv.ttt2la_report.layers
    assert layer.runtime.startswith(OPS[rule]), layer.runtime
    assert layer.exact


@settings(max_examples=6, deadline=None)
@given(rule=st.sampled_from(RULES), B=st.integers(1, 3), L=st.integers(1, 70),
       heads=st.sampled_from([1, 2, 4]))
def test_reference_loops_convert_exactly_fp32(rule, B, L, heads):
    layer = _layer(rule, heads=heads)
    conv = _converted(layer)
    assert_same_function(conv, layer, torch.randn(B, L, 16))


@pytest.mark.parametrize("rule", RULES)
def test_reference_loops_convert_exactly_float64(rule):
    layer = _layer(rule, torch.float64)
    conv = _converted(layer, dtype=torch.float64)
    assert_same_function(conv, layer, torch.randn(2, 45, 16, dtype=torch.float64), tol=1e-10)


class SignedGate(nn.Module):
    """A per-token decay ``tanh(·)``, negative for some tokens: it has no log decay."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.g = nn.Linear(d, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        g = torch.tanh(self.g(x))
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = g[:, t, :, None] * S + k[:, t, :, None] @ v[:, t, None, :]
            outs.append(q[:, t, None] @ S)
        return torch.cat(outs, 1)


def test_a_decay_without_a_log_runs_the_generic_plan_for_that_call():
    torch.manual_seed(0)
    layer = SignedGate()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    x = torch.randn(2, 30, 8)
    assert_same_function(conv, layer, x)
    assert "a decay <= 0 has no log decay" in report.runs["batch 2"]
    with torch.no_grad():                      # every gate positive: the op runs
        for m in (layer, conv):
            m.g.weight.zero_()
            m.g.bias.fill_(1.0)
    assert_same_function(conv, layer, x)
    ran = report.runs["batch 2"].split(SOME_CALLS)   # each path that ran, named once
    assert any(r.startswith("chunk_linear_attention") for r in ran), ran
    assert any("a decay <= 0 has no log decay" in r for r in ran), ran


def test_a_decay_without_a_log_is_refused_by_an_explicit_triton_backend():
    """``backend="triton"`` runs no generic plan: the call says why instead of answering."""
    from ttt2la.lowering.lift import LiftedPlan, lift
    from ttt2la.conversion import _prepare, recognize

    torch.manual_seed(0)
    rl, = recognize(SignedGate(), (torch.randn(2, 12, 8),))[0]
    lifted = lift(_prepare(rl, 0).program)
    assert lifted is not None and lifted.kind == "chunk" and lifted.decayed
    plan = LiftedPlan(lifted, backend="triton")
    with pytest.raises(ttt2la.UnsupportedTTTError, match="factor <= 0"):
        plan._run_loop([], [])


@pytest.mark.parametrize("code,names", [
    ("y = (v[:, :, i] - p) * beta[:, :, i, None]", ["v", "beta"]),
    ("o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2)", ["q"]),
    ("S = S * decay[None, :, None, None] + k[:, :, i, :, None] * v[:, :, i, None, :]",
     ["k", "v"]),
    ("qi, ki = q[:, s:s + C], k[:, s:s + C]", ["q", "k"]),
])
def test_streams_are_named_in_the_order_the_line_reads_them(code, names):
    """Left to right as Python evaluates, not breadth first; a subscript written to and one that
    only reshapes (its index has no variable) slice no stream."""
    assert _sliced_names(SourceLoc("f.py", 1, "forward", code)) == names


def test_the_same_slice_taken_twice_is_one_stream():
    """``k[:, :, i, :, None]`` and ``k[:, :, i].unsqueeze(-1)`` are one value: the delta rule's
    key is read once, which is what lets its reading find ``kkᵀ``."""
    conv = _converted(_layer("gated_delta"))
    layer, = conv.ttt2la_report.layers
    names = [s.split(",")[0] for s in layer.streams]
    assert sorted(names) == sorted(set(names)) == ["beta", "g", "k", "q", "v"], layer.streams


class ChannelGate(nn.Module):
    """GLA's recurrence with its gate per key channel or per value channel, the state laid out
    key-first (``[K, V]``, as flash-linear-attention's reference) or value-first (``[V, K]``,
    as Mamba-2's), read before each token's write (the final memory returned too) or after;
    ``axis="matrix"``: the key-first state multiplied on the right by a learnt matrix instead,
    which mixes its columns (no decay per column); ``axis="both"``: decayed per row and per
    column by the same gate (an outer product, no decay along one axis)."""

    def __init__(self, d=8, heads=2, axis="key", layout="key_first", read="after"):
        super().__init__()
        self.heads, self.axis, self.layout, self.read = heads, axis, layout, read
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, d)
        self.mix = nn.Parameter(0.9 * torch.eye(d // heads) + 0.01) if axis == "matrix" else None

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        g = torch.nn.functional.logsigmoid(self.gate(x) + 2).view(B, T, self.heads, -1)
        g = g.transpose(1, 2)
        key_first = self.layout == "key_first"
        S = x.new_zeros(B, self.heads, k.shape[-1], v.shape[-1])
        if not key_first:
            S = S.transpose(-1, -2)
        o = torch.zeros_like(v)
        for i in range(T):
            if self.read == "before":
                o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2) if key_first else \
                    (S * q[:, :, i, None, :]).sum(-1)
            gate = g[:, :, i].exp()
            per_row = (self.axis == "key") == key_first
            if self.axis == "both":
                S = S * gate[..., None] * gate[..., None, :]
            else:
                S = S @ self.mix if self.mix is not None else \
                    S * (gate[..., None] if per_row else gate[..., None, :])
            S = S + (k[:, :, i, :, None] * v[:, :, i, None, :] if key_first
                     else v[:, :, i, :, None] * k[:, :, i, None, :])
            if self.read == "after":
                o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2) if key_first else \
                    (S * q[:, :, i, None, :]).sum(-1)
        y = o.transpose(1, 2).reshape(B, T, d)
        # read first, the memory after the last token is returned too: the last write is live
        return y if self.read == "after" else y + S.sum((1, 2, 3))[:, None, None]


@pytest.mark.parametrize("layout", ["key_first", "value_first"])
@pytest.mark.parametrize("read", ["after", "before"])
def test_a_gate_per_key_channel_runs_on_the_token_causal_op(layout, read):
    """Whichever way the state is laid out and whenever it is read, a decay along its key axis
    is the op's log decay per key channel: fp32 within 1e-5, float64 within 1e-10."""
    torch.manual_seed(0)
    layer = ChannelGate(layout=layout, read=read)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert_same_function(conv, layer, [torch.randn(1, 1, 8), torch.randn(3, 70, 8)])
    layer64 = ChannelGate(layout=layout, read=read).double()
    conv64 = ttt2la.convert(layer64, level=0,
                            example_inputs=(torch.randn(2, 12, 8, dtype=torch.float64),))
    assert_same_function(conv64, layer64, torch.randn(2, 41, 8, dtype=torch.float64), tol=1e-10)


@pytest.mark.parametrize("layout", ["key_first", "value_first"])
@pytest.mark.parametrize("read", ["after", "before"])
def test_a_gate_per_value_channel_runs_on_the_token_causal_op(layout, read):
    """A decay along the state's value axis, however it is laid out and read, is the op's
    ``value_log_decay``: fp32 within 1e-5, float64 within 1e-10."""
    torch.manual_seed(0)
    layer = ChannelGate(axis="value", layout=layout, read=read)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert _plan(conv).lifted.decays_values
    assert_same_function(conv, layer, [torch.randn(1, 1, 8), torch.randn(3, 70, 8)])
    layer64 = ChannelGate(axis="value", layout=layout, read=read).double()
    conv64 = ttt2la.convert(layer64, level=0,
                            example_inputs=(torch.randn(2, 12, 8, dtype=torch.float64),))
    assert_same_function(conv64, layer64, torch.randn(2, 41, 8, dtype=torch.float64), tol=1e-10)


def test_a_state_mixed_by_a_matrix_on_the_right_keeps_the_generic_plan():
    """``S @ M`` mixes the state's columns: no decay per value channel, exact on the generic
    plan."""
    torch.manual_seed(0)
    layer = ChannelGate(axis="matrix")
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert not report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert_same_function(conv, layer, torch.randn(2, 30, 8))


def test_an_explicit_triton_backend_is_refused_at_convert_time_for_value_channels():
    """No Triton kernel takes ``value_log_decay``: converting with ``backend="triton"`` says so."""
    with pytest.raises(ttt2la.UnsupportedTTTError, match="chunk_linear_attention.*triton"):
        ttt2la.convert(ChannelGate(axis="value"), level=0, backend="triton",
                       example_inputs=(torch.randn(2, 12, 8),))


def _plan(conv, B=2):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


def test_a_loop_kept_on_the_generic_plan_runs_the_code_s_own_products():
    """The products read as matmuls are for the matchers: a loop that lifts onto no op (a gate
    per key and per value channel at once) runs ``sum(a * b)`` as written, not a one-row
    ``bmm`` per token."""
    from ttt2la.converted import is_converted
    from ttt2la.ir import SUMMED_PRODUCT

    torch.manual_seed(0)
    conv = ttt2la.convert(ChannelGate(axis="both"), level=0,
                          example_inputs=(torch.randn(2, 12, 8),))
    assert not isinstance(_plan(conv), LiftedPlan)
    state = next(m._ttt2la for m in conv.modules() if is_converted(m))
    traced = state.program.body.graph
    assert any(SUMMED_PRODUCT in n.meta for n in traced.nodes)
    body = state.loop_for(2).plan.program.body.graph
    assert not any(n.target is torch.ops.aten.bmm.default for n in body.nodes)
    assert sum(n.target is torch.ops.aten.sum.dim_IntList for n in body.nodes) == 1


class RetrieveThenStore(nn.Module):
    """Per token: read the memory with the query, then decay it by a gate and store the token
    (``o_t = q_t S_{t-1}``, ``S_t = γ_t S_{t-1} + k_tᵀ v_t``); the memory after the last token
    is returned beside the outputs, so the last update is live."""

    def __init__(self, d=8, gated=True):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.g = nn.Linear(d, 1) if gated else None

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            outs.append(q[:, t, None] @ S)
            if self.g is not None:
                S = torch.sigmoid(self.g(x[:, t]))[:, :, None] * S
            S = S + k[:, t, :, None] * v[:, t, None, :]
        return torch.cat(outs, 1) + S.sum(1, keepdim=True)


@pytest.mark.parametrize("gated", [False, True])
def test_a_read_before_the_update_runs_on_the_token_causal_op(gated):
    """The op reads after each update; a loop reading before it runs as the op on keys and
    values one token later, its last update applied after (the returned memory sees it)."""
    torch.manual_seed(0)
    layer = RetrieveThenStore(gated=gated)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert (report.order, report.last_chunk) == ("exclusive", "update")
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert_same_function(conv, layer, [torch.randn(1, 1, 8), torch.randn(3, 37, 8)])
    layer64 = RetrieveThenStore(gated=gated).double()
    conv64 = ttt2la.convert(layer64, level=0,
                            example_inputs=(torch.randn(2, 12, 8, dtype=torch.float64),))
    assert_same_function(conv64, layer64, torch.randn(2, 29, 8, dtype=torch.float64), tol=1e-10)


class NormalisedMemory(nn.Module):
    """Linear attention with its normaliser, ``o = q S / (q·z + ε)``, written per token with a
    second memory ``z`` of keys: decayed like ``S`` (``decay="shared"``), by its own gate
    (``"own"``) or not at all; laid out key-first or value-first; read after or before each
    token's write (the final memories then returned too); ``z`` written ``column`` times the
    key and read with the query (or, ``z_read="k"``, with the key)."""

    def __init__(self, d=8, decay="none", layout="key_first", read="after", column=1.0,
                 z_read="q"):
        super().__init__()
        self.decay, self.layout, self.read, self.column, self.z_read = \
            decay, layout, read, column, z_read
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, 2)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        gates = torch.sigmoid(self.gate(x) + 2)
        key_first = self.layout == "key_first"
        S, z = x.new_zeros(B, d, d), x.new_zeros(B, d)
        o = torch.zeros_like(v)
        for t in range(T):
            if self.read == "before":
                o[:, t] = self._read(S, z, q[:, t], k[:, t], key_first)
            if self.decay != "none":
                S = S * gates[:, t, 0, None, None]
                z = z * gates[:, t, 0 if self.decay == "shared" else 1, None]
            S = S + (k[:, t, :, None] * v[:, t, None, :] if key_first
                     else v[:, t, :, None] * k[:, t, None, :])
            z = z + self.column * k[:, t]
            if self.read == "after":
                o[:, t] = self._read(S, z, q[:, t], k[:, t], key_first)
        return o if self.read == "after" else o + S.sum((1, 2))[:, None, None] + z.sum(1)[:, None, None]

    def _read(self, S, z, q, k, key_first):
        num = (q[:, :, None] * S).sum(-2) if key_first else (S * q[:, None, :]).sum(-1)
        den = ((q if self.z_read == "q" else k) * z).sum(-1, keepdim=True)
        return num / (den + 1e-3)


@pytest.mark.parametrize("options", [
    dict(), dict(decay="shared"), dict(layout="value_first"), dict(read="before"),
    dict(read="before", decay="shared", layout="value_first"), dict(column=0.5)])
def test_a_normaliser_rides_the_token_causal_op_as_a_value_column(options):
    """The keys' running sum is one more column of the state with values 1 (or the constant it
    is written with): one op, exact in fp32 and float64, the report naming the column."""
    torch.manual_seed(0)
    layer = NormalisedMemory(**options)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert report.runtime.endswith("z as value columns"), report.runtime
    assert_same_function(conv, layer, [torch.randn(1, 1, 8), torch.randn(3, 50, 8)])
    layer64 = NormalisedMemory(**options).double()
    conv64 = ttt2la.convert(layer64, level=0,
                            example_inputs=(torch.randn(2, 12, 8, dtype=torch.float64),))
    assert_same_function(conv64, layer64, torch.randn(2, 33, 8, dtype=torch.float64), tol=1e-10)


@pytest.mark.parametrize("options", [dict(decay="own"), dict(z_read="k")])
def test_a_second_memory_unlike_the_first_keeps_the_generic_plan(options):
    """A second memory decayed by its own gate, or read with another vector than the query,
    is not a column of the first: exact on the generic plan."""
    torch.manual_seed(0)
    layer = NormalisedMemory(**options)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    report, = conv.ttt2la_report.layers
    assert "chunk_linear_attention" not in report.runtime, report.runtime
    assert_same_function(conv, layer, torch.randn(2, 30, 8))


@pytest.mark.parametrize("layer", [lambda: FlaReferenceLayer(16, 2, "normalised"),
                                   lambda: NormalisedMemory(16, decay="shared")])
def test_a_value_column_memory_streams(layer):
    """Fed in pieces, the converted layer carries the companion memory with the first: the
    pieces give the whole sequence's outputs."""
    from equivalence import assert_streams

    torch.manual_seed(0)
    layer = layer()
    assert_streams(converted_onto(layer, "chunk_linear_attention"), layer, torch.randn(2, 29, 16))


def gla_reference(q, k, v, gk, initial_state=None, output_final_state=False):
    """GLA's recurrence as flash-linear-attention's reference functions take it: inputs cast to
    fp32, the query scaled inside the loop, an optional initial state added into the zero
    state, the final state returned on request."""
    dtype = q.dtype
    q, k, v, gk = (t.float() for t in (q, k, v, gk))
    B, H, T, K = q.shape
    scale = K ** -0.5
    h = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    if initial_state is not None:
        h += initial_state.float()
    o = torch.zeros_like(v)
    for i in range(T):
        kv = k[:, :, i][..., None] * v[:, :, i][..., None, :]
        h = h * gk[:, :, i].exp()[..., None] + kv
        o[:, :, i] = ((q[:, :, i] * scale)[..., None] * h).sum(-2)
    return o.to(dtype), (h if output_final_state else None)


class GLAWithState(nn.Module):
    """A GLA token mixer that takes and returns the recurrent state, as a decoding model does."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, 4 * d, bias=False)

    def forward(self, x, state):
        B, T, d = x.shape
        q, k, v, g = (t.view(B, T, self.heads, -1).transpose(1, 2)
                      for t in self.proj(x).chunk(4, -1))
        o, h = gla_reference(q, k, v, torch.nn.functional.logsigmoid(g) / 16,
                             initial_state=state, output_final_state=True)
        return o.transpose(1, 2).reshape(B, T, d), h


def test_a_gla_reference_with_an_initial_and_a_final_state_runs_on_the_token_causal_op():
    """The state passed in and returned: converted with both, on the op, exact at other batch
    sizes and lengths, outputs, the returned state and every gradient."""
    torch.manual_seed(0)
    layer = GLAWithState()
    conv = ttt2la.convert(layer, level=0,
                          example_inputs=(torch.randn(2, 12, 16), torch.randn(2, 2, 8, 8)))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    for B, L in ((1, 1), (3, 70)):
        x, s0 = torch.randn(B, L, 16), torch.randn(B, 2, 8, 8)
        grads = []
        for m in (conv, layer):
            inputs = [x.clone().requires_grad_(), s0.clone().requires_grad_()]
            o, h = m(*inputs)
            loss = (o * torch.sin(o.detach() * 0 + 1.3)).sum() + (h * 0.7).sum()
            grads.append([o, h, *torch.autograd.grad(loss, [*inputs, *m.parameters()])])
        for a, b in zip(*grads):
            assert float((a - b).norm() / b.norm()) < 1e-5


class FixedChannelDecay(nn.Module):
    """RetNet's fixed decay made one per key channel: a parameter, the same at every token."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.decay_logit = nn.Parameter(torch.randn(heads, d // heads) + 3)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        decay = torch.sigmoid(self.decay_logit)
        S = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        o = torch.zeros_like(v)
        for i in range(T):
            S = S * decay[None, :, :, None] + k[:, :, i, :, None] * v[:, :, i, None, :]
            o[:, :, i] = (q[:, :, i, :, None] * S).sum(-2)
        return o.transpose(1, 2).reshape(B, T, d)


def test_a_fixed_decay_per_key_channel_runs_on_the_token_causal_op():
    """A decay from parameters alone (no token stream) is the op's log decay per key channel at
    every token, its gradient reaching the parameter."""
    torch.manual_seed(0)
    layer = FixedChannelDecay()
    assert_same_function(converted_onto(layer, "chunk_linear_attention"), layer,
                         [torch.randn(1, 2, 16), torch.randn(3, 70, 16)])


class ForgetGateKeys(nn.Module):
    """HGRN2's recurrence: a forget gate per channel decays the state, and its complement is the
    key, ``h' = diag(f) h + (1 − f)ᵀ v``."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, d = x.shape
        q, g, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.proj(x).chunk(3, -1))
        g = torch.nn.functional.logsigmoid(g + 3)
        k = 1 - g.exp()
        h = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        o = torch.zeros_like(v)
        for t in range(T):
            h = g[:, :, t].exp()[..., None] * h + k[:, :, t, :, None] * v[:, :, t, None, :]
            o[:, :, t] = (q[:, :, t, :, None] * h).sum(-2)
        return o.transpose(1, 2).reshape(B, T, d)


def test_keys_made_from_the_forget_gate_run_on_the_token_causal_op():
    """The key a function of the gate that decays the state: still the op with a log decay per
    key channel, exact, the gate's gradient through both."""
    torch.manual_seed(0)
    layer = ForgetGateKeys()
    assert_same_function(converted_onto(layer, "chunk_linear_attention"), layer,
                         [torch.randn(1, 2, 16), torch.randn(3, 50, 16)])


class ChunkedNormalisedAttention(nn.Module):
    """Causal linear attention with its normaliser, written chunk by chunk: the state read before
    each chunk plus the chunk's masked attention, over the normaliser ``z`` read as ``q·z`` in the
    denominator, ``z`` then given the chunk's summed keys (ELU + 1 features)."""

    def __init__(self, d: int = 16, chunk: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.C = chunk

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        S, z = x.new_zeros(B, D, D), x.new_zeros(B, D)
        outs = []
        for i in range(0, T, self.C):
            qc, kc, vc = q[:, i:i + self.C], k[:, i:i + self.C], v[:, i:i + self.C]
            n = qc.shape[1]
            A = (qc @ kc.transpose(1, 2)).tril()[:, :n, :n]
            outs.append((qc @ S + A @ vc) / (qc @ z[:, :, None] + A.sum(-1, keepdim=True)))
            S = S + kc.transpose(1, 2) @ vc
            z = z + kc.sum(1)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_chunked_normaliser_is_a_memory_not_a_kernel_weight(level):
    """The normaliser read in the denominator is a memory beside the state (a final fast weight),
    never a kernel weight Θ that ``freeze_theta`` would freeze: every level is exact, outputs and
    every gradient, at a length with a partial last chunk too."""
    torch.manual_seed(0)
    layer = ChunkedNormalisedAttention()
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 32, 16),))
    report, = conv.ttt2la_report.layers
    roles = {s.name: s.role for s in report.states}
    assert roles == {"S": "final", "z": "final"}, roles
    assert report.exact
    assert_same_function(conv, layer, [torch.randn(2, 32, 16), torch.randn(1, 29, 16)])


def test_a_layer_whose_padding_is_not_inert_streams_in_whole_chunks():
    """The streaming probe runs the plan at whole chunks where it cannot pad a partial one (the
    chunked normaliser divides 0 by 0 on a padded query): pieces of whole chunks, carried from
    call to call, give the whole sequence's outputs."""
    torch.manual_seed(0)
    layer = ChunkedNormalisedAttention()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 32, 16),))
    x = torch.randn(2, 32, 16)
    with torch.no_grad():
        state, pieces = None, []
        for s in range(0, 32, 8):
            y, state = conv(x[:, s:s + 8], ttt_state=state, return_ttt_state=True)
            pieces.append(y)
        whole = layer(x)
    assert torch.allclose(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-6)
