"""Lossy levels keep the fast plans their layers have exactly, and a partial last chunk whose
padding is inert runs on the plan.

* The gated delta rule: from level 4 on, absorb_lr replaces the per-token ``β`` by its
  calibration mean per head, a constant of the body. The delta-rule op takes ``β`` per token,
  and a constant per head is one: levels 4–6 still run on ``delta_rule`` and equal the layer
  written with that constant (outputs and every gradient), for the bundled reference layer and
  for one written in fla's naive style (state stored value-first, ``clone`` everywhere).
* A fast-weight bias stepped by a sum of the chunk's values (``b += η Σ_t v_t``): zero padding
  adds nothing to the sum, so a partial last chunk runs on the plan, not the code as written,
  and equals it (outputs, final states and every gradient). A mean of the values, or a bias in
  an inner MSE loss (``f(0) = b`` on a padded token), is not inert and is still reported.
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
from equivalence import assert_same_function
from ttt2la.frontend.build import program_from_body
from ttt2la.lowering import chunk_streams, padding_problem
from ttt2la.zoo import FlaReferenceLayer
from ttt2la.zoo.fla_reference import gated_delta_recurrence

D, H = 32, 2


# -- the gated delta rule at the lossy levels -------------------------------------------------

class GatedDeltaNaive(nn.Module):
    """Gated DeltaNet per token as fla's naive reference writes it: the state stored ``[V, K]``,
    ``clone`` on every read, ``einsum`` reads. ``beta``: a per-head constant instead of the
    projected rate (the layer absorb_lr's fold describes)."""

    def __init__(self, d_model=D, num_heads=H, beta=None):
        super().__init__()
        self.H, self.beta = num_heads, beta
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.b_proj = nn.Linear(d_model, num_heads, bias=False)
        self.a_proj = nn.Linear(d_model, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.g_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H = self.H
        q = F.normalize(F.silu(self.q_proj(x)).view(B, T, H, -1), dim=-1).transpose(1, 2)
        k = F.normalize(F.silu(self.k_proj(x)).view(B, T, H, -1), dim=-1).transpose(1, 2)
        v = F.silu(self.v_proj(x)).view(B, T, H, -1).transpose(1, 2)
        beta = self.b_proj(x).sigmoid().transpose(1, 2)
        if self.beta is not None:
            beta = self.beta.reshape(1, H, 1).expand(B, H, T)
        g = (-self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)).transpose(1, 2)
        q = q * q.shape[-1] ** -0.5
        h = q.new_zeros(B, H, v.shape[-1], k.shape[-1])
        o = torch.zeros_like(v)
        for i in range(T):
            b_q, b_k, b_v = q[:, :, i], k[:, :, i], v[:, :, i].clone()
            h = h.clone() * g[:, :, i].exp()[..., None, None]
            b_v = b_v - torch.einsum("bhvk,bhk->bhv", h.clone(), b_k)
            b_v = b_v * beta[:, :, i, None]
            h = h.clone() + torch.einsum("bhv,bhk->bhvk", b_v, b_k)
            o[:, :, i] = torch.einsum("bhvk,bhk->bhv", h, b_q)
        o = o.transpose(1, 2)
        o = F.rms_norm(o, (o.shape[-1],)) * F.silu(self.g_proj(x).view(B, T, H, -1))
        return self.o_proj(o.reshape(B, T, -1))


class ReferenceWithConstantBeta(FlaReferenceLayer):
    """``FlaReferenceLayer(…, "gated_delta")`` with ``β`` a constant per head."""

    def __init__(self, layer: FlaReferenceLayer, beta: torch.Tensor):
        super().__init__(D, layer.num_heads, "gated_delta")
        self.load_state_dict(layer.state_dict())
        self.beta = beta

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.num_heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        q = q * q.shape[-1] ** -0.5
        _, a = self.gate(x).transpose(1, 2).chunk(2, 1)
        beta = self.beta.reshape(1, -1, 1).expand(B, -1, T)
        o = gated_delta_recurrence(q, F.normalize(k, dim=-1), v, beta, F.logsigmoid(a + 3))
        return self.out(o.transpose(1, 2).reshape(B, T, -1))


def _zoo():
    torch.manual_seed(0)
    return FlaReferenceLayer(D, H, "gated_delta").eval()


def _naive():
    torch.manual_seed(0)
    return GatedDeltaNaive().eval()


def _with_folded_beta(name, layer, beta):
    if name == "zoo":
        return ReferenceWithConstantBeta(layer, beta)
    hand = GatedDeltaNaive(beta=beta)
    hand.load_state_dict(layer.state_dict())
    return hand


LAYERS = {"zoo": _zoo, "naive": _naive}
_cache = module_scoped.cache()


def _lossy(name, level):
    """The layer converted at ``level``, and the layer written with absorb_lr's folded ``β``."""
    if (name, level) not in _cache:
        layer = LAYERS[name]()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 19, D),))
        report, = conv.ttt2la_report.layers
        (absorb,) = [p for p in report.passes if p.name == "absorb_lr"]
        assert absorb.status == "applied", absorb.reason
        (folded,) = absorb.folded.values()
        beta = torch.tensor(folded, dtype=torch.float32).flatten()
        assert beta.shape == (H,) and not torch.allclose(beta, beta[:1])    # one per head
        _cache[name, level] = conv, _with_folded_beta(name, layer, beta), report
    return _cache[name, level]


@pytest.mark.parametrize("level", [4, 5, 6])
@pytest.mark.parametrize("name", list(LAYERS))
def test_lossy_levels_of_the_gated_delta_rule_run_on_the_delta_rule_op(name, level):
    conv, hand, report = _lossy(name, level)
    assert report.runtime.startswith("delta_rule[torch](gated, "), report.runtime
    assert not report.exact
    assert_same_function(conv, hand, [torch.randn(2, 19, D), torch.randn(3, 70, D)])
    assert all(run.startswith("delta_rule[torch]") for run in report.runs.values()), report.runs


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(list(LAYERS)), batch=st.integers(1, 3), length=st.integers(1, 140))
def test_level4_gated_delta_rule_equals_the_folded_layer_at_any_shape(name, batch, length):
    conv, hand, report = _lossy(name, 4)
    assert_same_function(conv, hand, torch.randn(batch, length, D))
    assert all(run.startswith("delta_rule[torch]") for run in report.runs.values()), report.runs


def test_level4_drift_is_the_folded_layers_distance_from_the_source():
    """The plan changes nothing the level computes: its drift from the source is the folded
    layer's, whichever plan runs it."""
    conv, hand, _ = _lossy("zoo", 4)
    layer = _zoo()
    x = torch.randn(2, 64, D)
    with torch.no_grad():
        drift_converted = (conv(x) - layer(x)).norm() / layer(x).norm()
        drift_folded = (hand(x) - layer(x)).norm() / layer(x).norm()
    assert abs(float(drift_converted) - float(drift_folded)) <= 1e-5 * float(drift_folded)


# -- a partial last chunk whose padding is inert ----------------------------------------------

class BiasedFastWeight(nn.Module):
    """A fast weight with a bias, ``f(x) = x W + b``, both stepped per chunk; the bias by the
    chunk's values summed (``mode="sum"``) or averaged (``"mean"``). Returns the outputs and the
    final ``(W, b)``."""

    def __init__(self, mode="sum", d=16, heads=2, chunk=4):
        super().__init__()
        self.mode, self.H, self.dh, self.C = mode, heads, d // heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(heads, self.dh, self.dh) * 0.1)
        self.b0 = nn.Parameter(torch.randn(heads, 1, self.dh) * 0.1)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.dh).permute(2, 0, 3, 1, 4)
        k = k / self.dh ** 0.5
        W = self.W0.unsqueeze(0).repeat(B, 1, 1, 1)
        b = self.b0.unsqueeze(0).repeat(B, 1, 1, 1)
        ys = []
        for i in range(math.ceil(T / self.C)):
            s = i * self.C
            qc, kc, vc = q[:, :, s:s + self.C], k[:, :, s:s + self.C], v[:, :, s:s + self.C]
            ys.append(qc @ W + b)
            W = W + 0.1 * kc.transpose(-1, -2) @ vc
            step = vc.mean(2, keepdim=True) if self.mode == "mean" else vc.sum(2, keepdim=True)
            b = b + 0.1 * step
        y = torch.cat(ys, 2).transpose(1, 2).reshape(B, T, d)
        return y, (W, b)


class Flat(nn.Module):
    """The outputs and the final states as one tensor, so every one is compared and
    differentiated."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y, (W, b) = self.inner(x)
        return torch.cat([y.flatten(1), W.flatten(1), b.flatten(1)], 1)


_biased = module_scoped.cache()


def _biased_converted(mode="sum"):
    if mode not in _biased:
        torch.manual_seed(0)
        layer = Flat(BiasedFastWeight(mode))
        conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 32, 16),))
        _biased[mode] = layer, conv
    return _biased[mode]


def test_a_bias_stepped_by_a_sum_runs_a_partial_last_chunk_on_the_plan():
    layer, conv = _biased_converted()
    assert_same_function(conv, layer, [torch.randn(2, 255, 16), torch.randn(3, 10, 16)])
    runs = conv.ttt2la_report.layers[0].runs
    assert runs and all(v == "torch.vmap(parallel)" for v in runs.values()), runs


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 41))
def test_a_bias_stepped_by_a_sum_equals_the_source_at_any_length(batch, length):
    layer, conv = _biased_converted()
    assert_same_function(conv, layer, torch.randn(batch, length, 16))
    assert not any(v.startswith("as written") for v in conv.ttt2la_report.layers[0].runs.values())


def test_a_bias_stepped_by_a_mean_still_runs_a_partial_last_chunk_as_written():
    layer, conv = _biased_converted("mean")
    assert_same_function(conv, layer, torch.randn(2, 10, 16))
    runs = conv.ttt2la_report.layers[0].runs
    assert any(k.endswith("partial last chunk") and v.startswith("as written")
               for k, v in runs.items()), runs


def _probe(body, states, L=6, C=4, d=3):
    r = torch.randn
    program = program_from_body(body, states=states,
                                streams=dict(k=r(1, 8, d), v=r(1, 8, d), q=r(1, 8, d)),
                                chunk_size=C)
    g = torch.Generator().manual_seed(0)
    states0 = [torch.randn(s.shape, generator=g) for s in program.states]
    sources = {s.source: s for s in program.streams}
    invariants = []
    for i, spec in enumerate(program.invariants):
        shape = list(spec.shape)
        if i in sources:
            shape[sources[i].axis] = L
        invariants.append(torch.randn(shape, generator=g))
    _, layout = chunk_streams(program, invariants)
    assert layout.partial
    return padding_problem(program, states0, invariants, layout)


def test_the_padding_probe_takes_a_sum_of_a_stream_as_inert_and_nothing_else():
    W0, b0 = torch.randn(1, 3, 3), torch.randn(1, 1, 3)

    def summed(W, b, k, v, q):
        return (W + 0.1 * k.transpose(-1, -2) @ v, b + 0.1 * v.sum(1, keepdim=True)), \
            (q @ W + b,)

    def averaged(W, b, k, v, q):            # the mean's divisor counts the padding
        return (W + 0.1 * k.transpose(-1, -2) @ v, b + 0.1 * v.mean(1, keepdim=True)), \
            (q @ W + b,)

    def mse_with_bias(W, b, k, v, q):       # a padded token predicts b: its error is b, not 0
        err = k @ W + b - v
        return (W - 0.1 * k.transpose(-1, -2) @ err, b - 0.1 * err.sum(1, keepdim=True)), \
            (q @ W + b,)

    def gated_by_the_chunk(W, b, k, v, q):  # a padded key's sigmoid is 1/2, not 0
        gate = torch.exp(-torch.sigmoid(k).sum(1, keepdim=True))
        return (W, gate * b + v.sum(1, keepdim=True)), (q @ W + b,)

    states = dict(W=W0, b=b0)
    assert _probe(summed, states) is None
    assert _probe(averaged, states) == "the update of state b"
    assert _probe(mse_with_bias, states) == "the update of state W"
    assert _probe(gated_by_the_chunk, states) == "the update of state b"
