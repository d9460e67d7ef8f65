"""Shape-only tensor values (index and mask code built from sizes) are evaluated for real while
a layer is traced with fake tensors; values read from data still fail the trace."""
from __future__ import annotations

import pytest
import torch

from ttt2la.frontend.capture import trace


def _shape_only_reads(x):
    """Every kind of read of tensors built from sizes only: ``tolist``, ``item``, ``int``,
    ``bool`` and iteration."""
    n = x.shape[1]
    total = x.new_zeros(())
    for i in torch.arange(0, n, 2):
        total = total + x[:, int(i.item()):int(i) + 1].sum()
    cut = torch.arange(n).tolist()[-2]
    if bool((torch.arange(n) < 3).any()):
        total = total * 2
    return total + x[:, :cut].mean()


def _reference(x):
    n = x.shape[1]
    total = sum(x[:, i:i + 1].sum() for i in range(0, n, 2))
    return 2 * total + x[:, :n - 2].mean()


@pytest.mark.parametrize("n", [3, 5, 8])
def test_shape_only_reads_trace_and_match_the_code(n):
    gm = trace(_shape_only_reads, torch.randn(2, n))
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(n))
    assert torch.allclose(gm(x), _reference(x), rtol=1e-6, atol=1e-6)


def _data_read(x):
    return x[:, :int(x.sum().item() > 0) + 1]


def test_reads_of_data_still_fail_the_trace():
    with pytest.raises(Exception) as info:
        trace(_data_read, torch.randn(2, 5))
    assert "data-dependent" in str(info.value) or "DataDependent" in type(info.value).__name__
