"""Gated DeltaProduct — ``n_h`` delta-rule steps a token (``zoo.DeltaProductLayer``) — runs on the
chunked ``delta_rule`` op over the expanded sequence of ``T·n_h`` tokens.

At levels 0–2, with and without the gate, for one to three steps a token, the converted layer
equals the layer's own loop (fp32, relative RMS ≤ 1e-5) in outputs and every parameter gradient
over batch, heads, head size and length (1 included, and past the op's chunk of 64 expanded
tokens), carries its plan to every batch size and streams in pieces. Look-alikes: a gate that
decays before every step is still the delta rule over the expanded sequence (a decay at every
expanded token) and lifts; a read after the first step, and a step whose write key is not its
read key, are not and keep the generic plan, exactly. Steps unrolled by hand in the
folded-heads ``bmm`` style lift too, read after the token's steps or before them.
"""
from __future__ import annotations


import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function, assert_streams
from ttt2la.runtime.delta_rule import DELTA_CHUNK_SIZE
from ttt2la.zoo import DeltaProductLayer

C = DELTA_CHUNK_SIZE


@module_scoped.cached
def converted(heads: int, head_dim: int, n: int, gate: bool, level: int, **options):
    """The zoo layer (seeded by its options) and its conversion at ``level``."""
    torch.manual_seed(heads * 100 + head_dim * 10 + n + gate)
    layer = DeltaProductLayer(heads * head_dim, heads, n, gate=gate, **options)
    if gate:                           # gates well below 1, so that the decay matters
        with torch.no_grad():
            layer.a_proj.bias.fill_(-4.0)
    example = torch.randn(2, 12, heads * head_dim)
    return layer, ttt2la.convert(layer, level=level, example_inputs=(example,))


def _runtime(fast) -> str:
    return fast.ttt2la_report.to_dict()["layers"][0]["runtime"]


def _assert_lifted(runtime: str, n: int, gated: bool) -> None:
    assert runtime.startswith("delta_rule[torch]("), runtime
    assert ("gated" in runtime) == gated, runtime
    assert (f"{n} steps a token" in runtime) == (n > 1), runtime


@settings(max_examples=10, deadline=None)
@given(heads=st.integers(1, 2), head_dim=st.integers(2, 5), n=st.integers(1, 3),
       gate=st.booleans(), level=st.integers(0, 2), batch=st.integers(1, 3),
       length=st.integers(1, C + 9), seed=st.integers(0, 2**31 - 1))
def test_delta_product_converts_exactly_onto_the_delta_rule(heads, head_dim, n, gate, level,
                                                            batch, length, seed):
    layer, fast = converted(heads, head_dim, n, gate, level)
    runtime = _runtime(fast)
    _assert_lifted(runtime, n, gate)
    x = torch.randn(batch, length, heads * head_dim,
                    generator=torch.Generator().manual_seed(seed))
    assert_same_function(fast, layer, x)
    ran = fast.ttt2la_report.to_dict()["layers"][0]["runs"][f"batch {batch}"]
    assert ran == runtime, (batch, ran)          # the plan is carried to every batch size


def test_one_token_and_the_chunk_boundaries():
    """The lengths hypothesis may miss: 1 and those whose expanded sequence ends just before,
    at and after a chunk of the op (``C/n`` tokens of ``n`` steps), two and three steps."""
    for n in (2, 3):
        layer, fast = converted(2, 4, n, True, 2)
        _assert_lifted(_runtime(fast), n, True)
        lengths = (1, C // n - 1, C // n, C // n + 1, 2 * C // n + 1)
        xs = [torch.randn(2, L, 8, generator=torch.Generator().manual_seed(L)) for L in lengths]
        assert_same_function(fast, layer, xs)


def test_streamed_in_pieces_it_continues_the_state():
    """Fed in pieces, the converted layer gives the whole sequence's outputs."""
    for n, gate in ((2, True), (3, False)):
        layer, fast = converted(2, 3, n, gate, 0)
        x = torch.randn(2, C + 6, 6, generator=torch.Generator().manual_seed(3))
        assert_streams(fast, layer, x, cuts=(1, 2, 9, C // n, C))


def test_a_gate_before_every_step_lifts_with_a_decay_at_every_expanded_token():
    layer, fast = converted(2, 4, 3, True, 1, gate_every_step=True)
    _assert_lifted(_runtime(fast), 3, True)
    xs = [torch.randn(b, L, 8, generator=torch.Generator().manual_seed(L)) for b, L in
          ((1, 1), (3, 29), (2, C // 3 + 2))]
    assert_same_function(fast, layer, xs)


def test_a_read_between_the_steps_keeps_the_generic_plan_exactly():
    """Read after the first of two or three steps: not the expanded rule's read, not lifted."""
    for n in (2, 3):
        layer, fast = converted(2, 4, n, True, 2, read_after=1)
        assert not _runtime(fast).startswith("delta_rule"), _runtime(fast)
        xs = [torch.randn(b, L, 8, generator=torch.Generator().manual_seed(L)) for b, L in
              ((1, 1), (2, 23))]
        assert_same_function(fast, layer, xs)


class FoldedProductLayer(nn.Module):
    """Two delta-rule steps a token unrolled by hand, heads folded into the batch, one-wide token
    slices through ``torch.bmm`` / ``torch.baddbmm``; read after the steps or before them.
    ``write_key=True`` writes the second step with a key of its own (``S ← S + k_wᵀ β (v − k S)``):
    matrix-affine, but not a delta-rule step."""

    def __init__(self, d: int, heads: int, *, read: str = "after", write_key: bool = False):
        super().__init__()
        self.heads, self.read, self.write_key = heads, read, write_key
        self.proj = nn.Linear(d, 6 * d, bias=False)
        self.gates = nn.Linear(d, 3 * heads)

    def fold(self, x):
        B, L, _ = x.shape
        return x.view(B, L, self.heads, -1).transpose(1, 2).reshape(B * self.heads, L, -1)

    def forward(self, x):
        B, L, d = x.shape
        q, k1, v1, k2, v2, kw = (self.fold(p) for p in self.proj(x).chunk(6, dim=-1))
        k1, k2, kw = (F.normalize(k, dim=-1) for k in (k1, k2, kw))
        a, b1, b2 = (self.fold(g) for g in self.gates(x).chunk(3, dim=-1))
        alpha, b1, b2 = F.logsigmoid(a - 2.0).exp(), torch.sigmoid(b1), torch.sigmoid(b2)
        S = x.new_zeros(B * self.heads, d // self.heads, d // self.heads)
        ys = []
        for t in range(L):
            s = slice(t, t + 1)
            if self.read == "before":
                ys.append(torch.bmm(q[:, s], S))
            S = S * alpha[:, s]
            S = torch.baddbmm(S, k1[:, s].transpose(1, 2), b1[:, s] * (v1[:, s] - k1[:, s] @ S))
            write = kw if self.write_key else k2
            S = torch.baddbmm(S, write[:, s].transpose(1, 2),
                              b2[:, s] * (v2[:, s] - torch.bmm(k2[:, s], S)))
            if self.read == "after":
                ys.append(torch.bmm(q[:, s], S))
        return torch.cat(ys, dim=1).view(B, self.heads, L, -1).transpose(1, 2).reshape(B, L, d)


def test_steps_unrolled_in_the_folded_style_read_after_or_before():
    for read in ("after", "before"):
        torch.manual_seed(2)
        layer = FoldedProductLayer(6, 2, read=read)
        fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 10, 6),))
        _assert_lifted(_runtime(fast), 2, True)
        xs = [torch.randn(b, L, 6, generator=torch.Generator().manual_seed(L)) for b, L in
              ((1, 1), (3, C // 2 + 3), (2, 2 * C + 1))]
        assert_same_function(fast, layer, xs)
        assert_streams(fast, layer, torch.randn(2, 41, 6), cuts=(1, 5, 32))


def test_a_step_with_a_write_key_of_its_own_keeps_the_generic_plan_exactly():
    torch.manual_seed(3)
    layer = FoldedProductLayer(6, 2, write_key=True)
    fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 10, 6),))
    assert not _runtime(fast).startswith("delta_rule"), _runtime(fast)
    xs = [torch.randn(b, L, 6, generator=torch.Generator().manual_seed(L)) for b, L in
          ((1, 1), (2, 37))]
    assert_same_function(fast, layer, xs)
