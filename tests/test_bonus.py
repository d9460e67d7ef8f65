"""A state read plus the token's own key-value product (RWKV's bonus, ``lowering/bonus.py``).

``o_t = r_t (S + c ⊙ k_tᵀ v_t)`` is the token-causal op's read of ``S`` plus one dot product per
token. Whatever the state's layout, whether it is read before or after the token's write, and
whether ``c`` is a constant, a number per head, a vector per key or per value channel, the
converted layer runs on the op, exact: fp32 within 1e-5 and float64 within 1e-10, outputs and
every parameter gradient. A term that is no outer product of one token keeps the generic plan.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function, assert_streams, converted_onto
from ttt2la.zoo import FlaReferenceLayer

WEIGHTS = ("key", "value", "head", "constant")


class BonusRead(nn.Module):
    """A gated memory read with the token's own product added, in the layouts and spellings
    RWKV-style code uses: ``weight`` says what ``c`` holds, ``own_values`` gives the term values
    of its own (not the written ones), ``term`` says how it is written (``"bonus"``, or
    ``"squared"``: ``(kᵀv)²``, no outer product; ``"matrix"``: a learnt matrix, no token's)."""

    def __init__(self, d=8, heads=2, layout="key_first", read="before", weight="key",
                 own_values=False, term="bonus", state_first=True):
        super().__init__()
        self.heads, self.layout, self.read, self.weight = heads, layout, read, weight
        self.own_values, self.term, self.state_first = own_values, term, state_first
        dh = d // heads
        self.proj = nn.Linear(d, 5 * d, bias=False)
        sizes = {"key": (heads, dh), "value": (heads, dh), "head": (heads,), "constant": ()}
        self.u = nn.Parameter(0.5 * torch.randn(sizes[weight])) if weight != "constant" else None
        self.matrix = nn.Parameter(0.1 * torch.randn(heads, dh, dh))

    def _c(self, key_first: bool):
        """The term's weight broadcast against a ``[B, H, rows, cols]`` state."""
        if self.weight == "constant":
            return 0.5
        if self.weight == "head":
            return self.u[None, :, None, None]
        along_rows = (self.weight == "key") == key_first
        return self.u[None, :, :, None] if along_rows else self.u[None, :, None, :]

    def _term(self, k, v, key_first):
        if self.term == "matrix":
            return self.matrix[None] if key_first else self.matrix[None].transpose(-1, -2)
        kv = k[..., :, None] * v[..., None, :] if key_first else v[..., :, None] * k[..., None, :]
        return self._c(key_first) * (kv * kv if self.term == "squared" else kv)

    def _read(self, S, q, term, key_first):
        total = S + term if self.state_first else term + S
        if key_first:
            return (total * q[..., :, None]).sum(-2)
        return (q[..., None, :] * total).sum(-1)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v, v2, g = (t.view(B, T, self.heads, -1).transpose(1, 2)
                          for t in self.proj(x).chunk(5, -1))
        g = torch.nn.functional.logsigmoid(g + 3)
        key_first = self.layout == "key_first"
        S = x.new_zeros(B, self.heads, k.shape[-1], v.shape[-1])
        o = torch.zeros_like(v)
        for i in range(T):
            ki, vi = k[:, :, i], v[:, :, i]
            term = self._term(ki, v2[:, :, i] if self.own_values else vi, key_first)
            if self.read == "before":
                o[:, :, i] = self._read(S, q[:, :, i], term, key_first)
            gate = g[:, :, i].exp()
            S = S * (gate[..., :, None] if key_first else gate[..., None, :])
            S = S + (ki[..., :, None] * vi[..., None, :] if key_first
                     else vi[..., :, None] * ki[..., None, :])
            if self.read == "after":
                o[:, :, i] = self._read(S, q[:, :, i], term, key_first)
        return o.transpose(1, 2).reshape(B, T, d)


def _runtime(layer, dtype=torch.float32):
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8, dtype=dtype),))
    report, = conv.ttt2la_report.layers
    return conv, report.runtime


def test_rwkv6_s_recurrence_runs_on_the_token_causal_op():
    """The zoo's RWKV-6 time mixing (flash-linear-attention's reference style): on the op, the
    report naming the term, exact at other batch sizes and lengths, the bonus's gradient too."""
    torch.manual_seed(0)
    layer = FlaReferenceLayer(16, 2, "rwkv6")
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 16),))
    report, = conv.ttt2la_report.layers
    assert report.runtime == "chunk_linear_attention[torch], plus each token's own term"
    assert_same_function(conv, layer, [torch.randn(1, 1, 16), torch.randn(3, 70, 16)])


def test_rwkv6_s_recurrence_streams():
    """Fed in pieces, the converted layer gives the whole sequence's outputs: the term belongs
    to each token, the state carries the rest."""
    torch.manual_seed(0)
    layer = FlaReferenceLayer(16, 2, "rwkv6")
    assert_streams(converted_onto(layer, "chunk_linear_attention"), layer, torch.randn(2, 29, 16))


@pytest.mark.parametrize("layout", ["key_first", "value_first"])
@pytest.mark.parametrize("weight", WEIGHTS)
def test_every_weight_of_the_term_in_either_layout_runs_on_the_op(layout, weight):
    torch.manual_seed(0)
    layer = BonusRead(layout=layout, weight=weight)
    conv, runtime = _runtime(layer)
    assert runtime.startswith("chunk_linear_attention") and runtime.endswith("own term"), runtime
    assert_same_function(conv, layer, [torch.randn(1, 1, 8), torch.randn(2, 33, 8)])


@settings(max_examples=6, deadline=None)
@given(layout=st.sampled_from(["key_first", "value_first"]),
       read=st.sampled_from(["before", "after"]), weight=st.sampled_from(WEIGHTS),
       own_values=st.booleans(), state_first=st.booleans(), B=st.integers(1, 3),
       L=st.integers(1, 40))
def test_a_state_read_plus_the_token_s_own_product_runs_on_the_op(layout, read, weight,
                                                                  own_values, state_first, B, L):
    """Read before or after the write, the term on either side of the sum, with values of its
    own: on the op, exact."""
    torch.manual_seed(0)
    layer = BonusRead(layout=layout, read=read, weight=weight, own_values=own_values,
                      state_first=state_first)
    conv, runtime = _runtime(layer)
    assert runtime.startswith("chunk_linear_attention") and runtime.endswith("own term"), runtime
    assert_same_function(conv, layer, torch.randn(B, L, 8))


@pytest.mark.parametrize("layout,weight", [("key_first", "key"), ("value_first", "value")])
def test_the_term_is_exact_in_float64(layout, weight):
    torch.manual_seed(0)
    layer = BonusRead(layout=layout, weight=weight).double()
    conv, runtime = _runtime(layer, torch.float64)
    assert runtime.endswith("own term"), runtime
    assert_same_function(conv, layer, torch.randn(2, 37, 8, dtype=torch.float64), tol=1e-10)


@pytest.mark.parametrize("term", ["squared", "matrix"])
def test_a_term_that_is_no_token_s_outer_product_keeps_the_generic_plan(term):
    """``(kᵀv)²`` per token, or a learnt matrix added to the state where it is read: no dot
    product per token computes them, so the loop stays on the generic plan, exact."""
    torch.manual_seed(0)
    layer = BonusRead(term=term)
    conv, runtime = _runtime(layer)
    assert "chunk_linear_attention" not in runtime, runtime
    assert_same_function(conv, layer, torch.randn(2, 20, 8))


class FixedDecayBonus(nn.Module):
    """RWKV-5's spelling: a decay per head and key channel from parameters alone, the query
    scaled inside the loop, the read's product and its sum in two statements."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.rkv = nn.Linear(d, 3 * d, bias=False)
        self.time_decay = nn.Parameter(torch.randn(heads, d // heads))
        self.time_first = nn.Parameter(torch.randn(heads, d // heads))

    def forward(self, x):
        B, T, d = x.shape
        r, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2)
                   for t in self.rkv(x).chunk(3, -1))
        w = torch.exp(-torch.exp(self.time_decay))
        h = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        o = torch.zeros_like(v)
        for i in range(T):
            q_i = r[:, :, i, :] * (d // self.heads) ** -0.5
            kv_i = k[:, :, i, :, None] * v[:, :, i, None, :]
            o_i = (h + self.time_first[None, ..., None] * kv_i) * q_i[..., None]
            o[:, :, i] = o_i.sum(-2)
            h = h * w[None, ..., None] + kv_i
        return o.transpose(1, 2).reshape(B, T, d)


def test_rwkv5_s_spelling_runs_on_the_op():
    """A fixed decay per key channel with the bonus, the read summed in its own statement: on
    the op, exact, the decay's and the bonus's gradients included."""
    torch.manual_seed(0)
    layer = FixedDecayBonus()
    conv = converted_onto(layer, "chunk_linear_attention[torch], plus each token's own term")
    assert_same_function(conv, layer, [torch.randn(1, 3, 16), torch.randn(3, 50, 16)])


class SpelledBonus(nn.Module):
    """The bonus written with ``einsum`` or with ``@`` (the token's product a ``bmm`` of a
    column and a row), the read of a list of outputs stacked after the loop."""

    def __init__(self, d=16, heads=2, spelling="einsum"):
        super().__init__()
        self.heads, self.spelling = heads, spelling
        self.proj = nn.Linear(d, 4 * d, bias=False)
        self.u = nn.Parameter(torch.randn(heads, d // heads))

    def forward(self, x):
        B, T, d = x.shape
        r, k, v, w = (t.view(B, T, self.heads, -1).transpose(1, 2)
                      for t in self.proj(x).chunk(4, -1))
        w = -torch.exp(w - 3)
        S = x.new_zeros(B, self.heads, d // self.heads, d // self.heads)
        outs = []
        for t in range(T):
            rt, kt, vt = r[:, :, t], k[:, :, t], v[:, :, t]
            if self.spelling == "einsum":
                kv = torch.einsum("bhk,bhv->bhkv", kt, vt)
                outs.append(torch.einsum("bhk,bhkv->bhv", rt, S + self.u[None, :, :, None] * kv))
            else:
                kv = kt.unsqueeze(-1) @ vt.unsqueeze(-2)
                outs.append((rt.unsqueeze(-2) @ (S + self.u.unsqueeze(-1) * kv)).squeeze(-2))
            S = torch.exp(w[:, :, t]).unsqueeze(-1) * S + kv
        return torch.stack(outs, 2).transpose(1, 2).reshape(B, T, d)


@pytest.mark.parametrize("spelling", ["einsum", "matmul"])
def test_the_term_written_with_einsum_or_matmul_runs_on_the_op(spelling):
    torch.manual_seed(0)
    layer = SpelledBonus(spelling=spelling)
    conv = converted_onto(layer, "chunk_linear_attention[torch], plus each token's own term")
    assert_same_function(conv, layer, torch.randn(2, 41, 16))
