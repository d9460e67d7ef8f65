"""A loop's chunk outputs joined straight into the memory order the code after the loop reads.

Whatever the shapes, the order, the axis and the chunks: the joined output equals ``torch.cat``
of the chunks cut to the length; without gradients and with whole chunks it is laid out in the
order already (``with_memory_order`` returns it as it is, no copy); with gradients it stays on
autograd and its gradients are ``cat``'s.
"""
from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings, strategies as st

from ttt2la.ir import OutputSpec, with_memory_order
from ttt2la.lowering.chunking import ChunkLayout, assemble_output

ORDERS = list(itertools.permutations(range(4)))


@settings(max_examples=40, deadline=None)
@given(shape=st.tuples(*[st.integers(1, 4)] * 4), order=st.sampled_from(ORDERS),
       axis=st.integers(0, 3), n=st.integers(1, 5), cut=st.integers(0, 3),
       grad=st.booleans(), seed=st.integers(0, 3))
def test_joined_chunks_equal_cat_laid_out_as_read(shape, order, axis, n, cut, grad, seed):
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(shape, generator=g).requires_grad_(grad) for _ in range(n)]
    C = shape[axis]
    length = max(n * C - cut, (n - 1) * C + 1)
    layout = ChunkLayout(length=length, chunk_size=C, n_chunks=n, per_token=False)
    spec = OutputSpec("o", axis=axis, memory_order=order)
    with torch.set_grad_enabled(grad):
        joined = assemble_output(chunks, spec, layout)
        expected = torch.cat(chunks, dim=axis).narrow(axis, 0, length)
    assert torch.equal(joined, expected)
    laid_out = with_memory_order(joined, order)
    if not grad and not layout.partial:
        assert laid_out.data_ptr() == joined.data_ptr() and laid_out.stride() == joined.stride()
    if grad:
        w = torch.randn(expected.shape, generator=g)
        got = torch.autograd.grad((joined * w).sum(), chunks)
        want = torch.autograd.grad((expected * w).sum(), chunks)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_chunks_of_another_dtype_are_joined_as_cat_joins_them():
    """Mixed dtypes (never a loop's, but not refused) promote as ``cat`` promotes."""
    chunks = [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)]
    layout = ChunkLayout(length=6, chunk_size=3, n_chunks=2, per_token=False)
    with torch.no_grad():
        joined = assemble_output(chunks, OutputSpec("o", axis=1, memory_order=(1, 0)), layout)
    assert joined.dtype == torch.float64 and torch.equal(joined, torch.ones(2, 6,
                                                                            dtype=torch.float64))
