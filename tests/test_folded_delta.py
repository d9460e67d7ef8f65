"""A gated DeltaNet with its heads folded into the batch, stepped by ``torch.bmm`` /
``torch.baddbmm`` on one-wide token slices (``zoo.FoldedDeltaLayer``), runs on the chunked
``delta_rule`` op.

A slice ``k[:, t:t + 1]`` is a chunk of one token: the loop is the per-token delta rule with a
unit token axis kept, and its outputs are joined by ``cat`` along that axis. At levels 0–2, with
and without the decay gate, read after or before the write, the converted layer equals the
layer's own loop (fp32, relative RMS ≤ 1e-5) in outputs and every gradient over batch, heads,
head size and length (1 included, and past the op's chunk of 64), carries that plan to every
batch size, and streams in pieces. A look-alike in the same style whose write key is not its
read key is matrix-affine but not the delta rule: it keeps the generic plan, exactly. A write
value computed in the loop by a batched product of the slice itself lifts too.
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
from ttt2la.zoo import FoldedDeltaLayer

C = DELTA_CHUNK_SIZE


@module_scoped.cached
def converted(heads: int, head_dim: int, decay: bool, read: str, level: int):
    """The zoo layer (seeded by its options) and its conversion at ``level``."""
    torch.manual_seed(heads * 100 + head_dim * 10 + decay)
    layer = FoldedDeltaLayer(heads * head_dim, heads, decay=decay, read=read)
    if decay:                          # gates well below 1, so that the decay matters
        with torch.no_grad():
            layer.gates.bias[:heads].fill_(-4.0)
    example = torch.randn(2, 12, heads * head_dim)
    return layer, ttt2la.convert(layer, level=level, example_inputs=(example,))


def _runtime(fast) -> str:
    return fast.ttt2la_report.to_dict()["layers"][0]["runtime"]


@settings(max_examples=16, deadline=None)
@given(heads=st.integers(1, 3), head_dim=st.integers(2, 5), decay=st.booleans(),
       read=st.sampled_from(["after", "before"]), level=st.integers(0, 2),
       batch=st.integers(1, 3), length=st.integers(1, 2 * C + 9),
       seed=st.integers(0, 2**31 - 1))
def test_folded_heads_convert_exactly_onto_the_delta_rule(heads, head_dim, decay, read, level,
                                                          batch, length, seed):
    layer, fast = converted(heads, head_dim, decay, read, level)
    runtime = _runtime(fast)
    assert runtime.startswith("delta_rule[torch]("), runtime
    assert ("gated" in runtime) == decay, runtime
    x = torch.randn(batch, length, heads * head_dim,
                    generator=torch.Generator().manual_seed(seed))
    assert_same_function(fast, layer, x)
    ran = fast.ttt2la_report.to_dict()["layers"][0]["runs"][f"batch {batch}"]
    assert ran == runtime, (batch, ran)          # the plan is carried to every batch size


def test_one_token_and_the_chunk_boundaries():
    """The lengths hypothesis may miss: 1, C − 1, C, C + 1 and 2C + 1, read after and before."""
    for read in ("after", "before"):
        layer, fast = converted(2, 4, True, read, 2)
        assert _runtime(fast).startswith("delta_rule[torch](gated"), _runtime(fast)
        xs = [torch.randn(2, n, 8, generator=torch.Generator().manual_seed(n))
              for n in (1, C - 1, C, C + 1, 2 * C + 1)]
        assert_same_function(fast, layer, xs)


def test_streamed_in_pieces_it_continues_the_state():
    """Fed in pieces, the converted layer gives the whole sequence's outputs, both read orders
    (read before the write: the last token of a piece stays open)."""
    for read in ("after", "before"):
        layer, fast = converted(2, 3, True, read, 0)
        x = torch.randn(2, C + 6, 6, generator=torch.Generator().manual_seed(3))
        assert_streams(fast, layer, x, cuts=(1, 2, 9, C, C + 1))


class InLoopValueLayer(nn.Module):
    """The folded ``bmm`` style with each token's value mixed in the loop by a matrix per head,
    ``bmm(v_t, M)``: a batched product of the one-wide slice itself, which takes the slice only
    with its unit token axis (``bmm`` is for three axes)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.b = nn.Linear(d, heads)
        self.mix = nn.Parameter(torch.randn(heads, d // heads, d // heads) * 0.5)

    def forward(self, x):
        B, L, d = x.shape
        fold = lambda t: t.view(B, L, self.heads, -1).transpose(1, 2).reshape(  # noqa: E731
            B * self.heads, L, -1)
        q, k, v = (fold(p) for p in self.proj(x).chunk(3, dim=-1))
        k, beta = F.normalize(k, dim=-1), fold(torch.sigmoid(self.b(x)))
        mix = self.mix.repeat(B, 1, 1)                                 # [B·H, D, D]
        S = x.new_zeros(B * self.heads, d // self.heads, d // self.heads)
        ys = []
        for t in range(L):
            k_t, v_t = k[:, t:t + 1], torch.bmm(v[:, t:t + 1], mix)
            u = beta[:, t:t + 1] * (v_t - torch.bmm(k_t, S))
            S = torch.baddbmm(S, k_t.transpose(1, 2), u)
            ys.append(torch.bmm(q[:, t:t + 1], S))
        return torch.cat(ys, dim=1).view(B, self.heads, L, -1).transpose(1, 2).reshape(B, L, d)


def test_a_value_computed_in_the_loop_from_the_slice():
    """The confirmation evaluates the loop's own code on a token laid out as the loop reads it
    (``bmm`` of the one-wide slice), so the rule is confirmed and lifted, exactly."""
    torch.manual_seed(1)
    layer = InLoopValueLayer(6, 2)
    fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 10, 6),))
    assert _runtime(fast).startswith("delta_rule[torch]("), _runtime(fast)
    xs = [torch.randn(b, n, 6, generator=torch.Generator().manual_seed(n)) for b, n in
          ((1, 1), (3, C + 5))]
    assert_same_function(fast, layer, xs)


class FoldedTwoKeyLayer(nn.Module):
    """The folded ``bmm`` style with a *write* key other than the *read* key:
    ``S ← S + k_wᵀ β (v − k_r S)``, matrix-affine in ``S`` (``A = I − β k_wᵀ k_r``) but not the
    delta rule, whose map is symmetric."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.proj = nn.Linear(d, 4 * d, bias=False)
        self.b = nn.Linear(d, heads)

    def fold(self, x):
        B, L, _ = x.shape
        return x.view(B, L, self.heads, -1).transpose(1, 2).reshape(B * self.heads, L, -1)

    def forward(self, x):
        B, L, d = x.shape
        q, kr, kw, v = (self.fold(p) for p in self.proj(x).chunk(4, dim=-1))
        kr, kw = F.normalize(kr, dim=-1), F.normalize(kw, dim=-1)
        beta = self.fold(torch.sigmoid(self.b(x)))
        S = x.new_zeros(B * self.heads, d // self.heads, d // self.heads)
        ys = []
        for t in range(L):
            u = beta[:, t:t + 1] * (v[:, t:t + 1] - torch.bmm(kr[:, t:t + 1], S))
            S = torch.baddbmm(S, kw[:, t:t + 1].transpose(1, 2), u)
            ys.append(torch.bmm(q[:, t:t + 1], S))
        return torch.cat(ys, dim=1).view(B, self.heads, L, -1).transpose(1, 2).reshape(B, L, d)


def test_a_look_alike_keeps_the_generic_plan():
    torch.manual_seed(0)
    layer = FoldedTwoKeyLayer(8, 2)
    fast = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 10, 8),))
    assert "delta_rule" not in _runtime(fast), _runtime(fast)
    xs = [torch.randn(b, n, 8, generator=torch.Generator().manual_seed(n)) for b, n in
          ((1, 1), (3, 70))]
    assert_same_function(fast, layer, xs)
