"""Products summed over an axis read as the matmuls they are (``frontend.summed_products``): the
rewrite computes what ``(a * b).sum(dims)`` computes for every broadcast it takes, leaves alone
what is no product of matrices, and touches loop bodies only."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ttt2la.frontend.capture import trace
from ttt2la.frontend.summed_products import SummedProduct, summed_product

aten = torch.ops.aten


@st.composite
def broadcasts(draw):
    """Two operand shapes of one rank and the axes summed: every axis is shared, one operand's
    own (the other has 1 there) or, where summed, shared."""
    rank = draw(st.integers(2, 5))
    sa, sb, summed = [], [], []
    for i in range(rank):
        kind = draw(st.sampled_from(["batch", "a", "b", "sum"]))
        n = draw(st.integers(1, 4)) if kind in ("batch", "sum") else draw(st.integers(2, 4))
        sa.append(1 if kind == "b" else n)
        sb.append(1 if kind == "a" else n)
        if kind == "sum":
            summed.append(i)
    drop = draw(st.integers(0, rank - 1))           # fewer leading axes on one side
    if all(s == 1 for s in sa[:drop]):
        sa = sa[drop:]
    return sa, sb, summed, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(case=broadcasts())
def test_the_matmul_computes_the_summed_product(case):
    sa, sb, summed, keepdim = case
    a = torch.randn(sa, dtype=torch.float64)
    b = torch.randn(sb, dtype=torch.float64)
    if not summed:
        return
    want = (a * b).sum(summed, keepdim=keepdim)
    r = max(len(sa), len(sb))
    pa, pb = [1] * (r - len(sa)) + sa, [1] * (r - len(sb)) + sb
    a_own = tuple(i for i in range(r) if pa[i] > 1 and pb[i] == 1)
    b_own = tuple(i for i in range(r) if pb[i] > 1 and pa[i] == 1)
    batch = tuple(i for i in range(r) if i not in (*summed, *a_own, *b_own))
    got = SummedProduct(None, None, r, batch, a_own, b_own, tuple(summed), keepdim)(a, b)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _sums(fn, *args):
    gm = trace(fn, *args)
    return [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList], gm


def test_dot_products_sums_of_squares_and_one_sided_sums_are_not_products_of_matrices():
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)

    def f(x, y):
        return (x * y).sum(-1), (x * x).sum(-1), (x[..., None] * y[:, :, None]).sum(-1)

    sums, _ = _sums(f, x, y)
    assert len(sums) == 3 and all(summed_product(n) is None for n in sums)


def _reshapes(fn, *args):
    gm = trace(fn, *args)
    return [n for n in gm.graph.nodes if n.target in (aten.view.default, aten._unsafe_view.default)
            and n.args[0].target is aten.mul.Tensor]


def test_an_einsum_over_a_unit_axis_is_the_outer_product_it_computes():
    """``einsum`` contracting an axis of size one traces as a product reshaped without it: an
    outer product of a column and a row, unless which unit axis went is a guess (a batch of
    one has another)."""
    def f(v, k):
        return torch.einsum("bto,bti->boi", v, k)

    (node,) = _reshapes(f, torch.randn(2, 1, 3), torch.randn(2, 1, 4))
    found = summed_product(node)
    assert found is not None and found.a_own and found.b_own and not found.keepdim
    v, k = torch.randn(2, 1, 3, dtype=torch.float64), torch.randn(2, 1, 4, dtype=torch.float64)
    operands = {(2, 3, 1, 1): v.transpose(1, 2)[..., None], (2, 1, 4, 1): k[..., None]}
    got = found(*(operands[tuple(x.meta["val"].shape)] for x in (found.a, found.b)))
    torch.testing.assert_close(got, f(v, k), rtol=0, atol=0)
    (ambiguous,) = _reshapes(f, torch.randn(1, 1, 3), torch.randn(1, 1, 4))
    assert summed_product(ambiguous) is None


class Reads(nn.Module):
    """A state read by a broadcast product in a loop; the same pattern outside it."""

    def forward(self, q, S):
        before = (q[:, 0, :, None] * S).sum(-2)
        outs = []
        for t in range(q.shape[1]):
            outs.append((q[:, t, :, None] * S).sum(-2))
            S = S + 0.1
        return before, torch.stack(outs, 1)


def test_only_loop_bodies_are_rewritten():
    q, S = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    gm = trace(Reads(), q, S)
    sums = [n for n in gm.graph.nodes if n.target is aten.sum.dim_IntList]
    bmms = [n for n in gm.graph.nodes if n.target is aten.bmm.default]
    assert len(sums) == 1 and len(bmms) == 3          # the read before the loop stays as written
    for got, want in zip(gm(q, S), Reads()(q, S)):
        torch.testing.assert_close(got, want)


class HeadReads(nn.Module):
    """A read per token of a state per head: the product's batch is two axes, which its matmul
    merges with a view where the state's strides allow it and a copy where they do not."""

    def forward(self, q, S):
        outs = []
        for t in range(q.shape[1]):
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1)


def test_each_layout_of_a_product_is_traced_once():
    """The loop's three reads are one product on one layout: its matmul is traced once and
    copied in three times. A state with its batch and head axes swapped in memory is another
    layout (its reshape copies): traced apart, and both compute their products."""
    from ttt2la.frontend.summed_products import _traced

    q = torch.randn(2, 3, 4, 5)
    S = torch.randn(2, 4, 5, 6)
    S_swapped = torch.randn(4, 2, 5, 6).transpose(0, 1)
    _traced.cache_clear()
    gm = trace(HeadReads(), q, S)
    assert (_traced.cache_info().misses, _traced.cache_info().hits) == (1, 2)
    gm_swapped = trace(HeadReads(), q, S_swapped)
    assert _traced.cache_info().misses == 2
    for g, state in ((gm, S), (gm_swapped, S_swapped)):
        assert any(n.target is aten.bmm.default for n in g.graph.nodes)
        torch.testing.assert_close(g(q, state), HeadReads()(q, state))


def test_a_matrix_times_a_vector_reads_the_matrix_as_stored_on_either_side():
    """``q[..., None] * S`` and ``S * q[..., None]`` are one product: the matrix goes to the side
    of the ``bmm`` that reads it as it lies (``[summed, own]`` on the right, ``[own, summed]``
    on the left), so the state's read has one form for the analysis, with no relayout copy."""
    q, S, P = torch.randn(2, 4), torch.randn(2, 4, 5), torch.randn(2, 5, 4)

    def f(q, S, P):
        return ((q[..., None] * S).sum(-2), (S * q[..., None]).sum(-2),
                (P * q[:, None, :]).sum(-1), (q[:, None, :] * P).sum(-1))

    sums, gm = _sums(f, q, S, P)
    _, s_in, p_in = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = [summed_product(n) for n in sums]
    key_first, key_first_swapped, value_first, value_first_swapped = found
    for prod in (key_first, key_first_swapped):       # S [4, 5], summed over its rows
        assert prod.b is s_in and prod.a_own == () and prod.b_own == (2,)
    for prod in (value_first, value_first_swapped):   # P [5, 4], summed over its columns
        assert prod.a is p_in and prod.a_own == (1,) and prod.b_own == ()
    run = torch.fx.Interpreter(gm, garbage_collect_values=False)
    run.run(q, S, P)
    for prod, n in zip(found, sums):
        torch.testing.assert_close(prod(run.env[prod.a], run.env[prod.b]), run.env[n])


class StateFirstRead(nn.Module):
    """A linear-attention loop that writes the state first in its read, ``(S * q).sum``."""

    def __init__(self, d=8, state_first=True):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.state_first = state_first

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            qt = q[:, t, :, None]
            outs.append((S * qt).sum(-2) if self.state_first else (qt * S).sum(-2))
        return torch.stack(outs, 1)


def test_a_read_lifts_whichever_operand_is_written_first():
    import ttt2la
    from equivalence import assert_same_function

    for state_first in (True, False):
        torch.manual_seed(0)
        layer = StateFirstRead(state_first=state_first)
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
        report, = conv.ttt2la_report.layers
        assert report.runtime.startswith("chunk_linear_attention"), (state_first, report.runtime)
        assert_same_function(conv, layer, torch.randn(3, 40, 8))
