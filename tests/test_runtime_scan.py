"""Scans over the chunk axis against a plain float64 loop, including underflowing decay products."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ttt2la.runtime import affine_scan, prefix_sum
from ttt2la.runtime.scan import _TRIANGLES, blocked_scan
from ttt2la.testing import TOLERANCE, rel_rms_error

METHODS = ("auto", "blocked", "sequential", "doubling")


def loop_reference(a, f, initial, dim):
    """``S_j = a_j S_{j-1} + f_j`` written out with indexing, in float64."""
    a, f = torch.broadcast_tensors(a.double(), f.double())
    a, f = a.movedim(dim, 0), f.movedim(dim, 0)
    S = torch.zeros_like(f[0]) if initial is None else initial.double().expand_as(f[0])
    out = []
    for j in range(f.shape[0]):
        S = a[j] * S + f[j]
        out.append(S)
    return torch.stack(out).movedim(0, dim)


class _Ops(TorchDispatchMode):
    """The aten ops a block dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), a_kind=st.sampled_from(["scalar", "elementwise", "lower_rank"]),
       with_initial=st.booleans(), method=st.sampled_from(METHODS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**31 - 1))
def test_affine_scan_matches_loop_with_gradients(n, a_kind, with_initial, method, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, H, P, Q = 2, 3, 4, 5
    f = torch.randn(B, n, H, P, Q, generator=g).to(dtype)
    a = {"scalar": torch.rand(B, n, H, 1, 1, generator=g),   # one factor per batch, head, step
         "elementwise": torch.rand(B, n, H, P, Q, generator=g),
         "lower_rank": torch.rand(n, H, P, 1, generator=g)}[a_kind].to(dtype)  # left-padded
    initial = torch.randn(B, H, P, Q, generator=g).to(dtype) if with_initial else None
    leaves = [x.requires_grad_() for x in (a, f, initial) if x is not None]
    S = affine_scan(a, f, initial, dim=1, method=method)
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    a64, f64 = leaves64[:2]
    S_ref = loop_reference(a64, f64, leaves64[2] if with_initial else None, 1)
    tol = TOLERANCE[dtype]
    assert S.dtype == dtype and S.shape == f.shape
    assert rel_rms_error(S, S_ref) < tol
    w = torch.randn(S.shape, generator=g, dtype=torch.float64).to(dtype).double()
    grads = torch.autograd.grad((S.double() * w).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)]
    grads_ref = torch.autograd.grad((S_ref * w).sum(), leaves64)
    for gr, gr_ref in zip(grads, grads_ref):
        assert rel_rms_error(gr, gr_ref) < tol


@pytest.mark.parametrize("method", METHODS)
def test_affine_scan_products_underflow_harmlessly(method):
    """3000 steps of factor 0.5: Π a reaches 2^-3000, far below fp32 and float64; all finite."""
    n = 3000
    g = torch.Generator().manual_seed(0)
    a = torch.full((1, n, 2, 1), 0.5)
    f = torch.randn(1, n, 2, 3, generator=g)
    initial = torch.randn(1, 2, 3, generator=g)
    S = affine_scan(a, f, initial, dim=1, method=method)
    assert torch.isfinite(S).all()
    assert rel_rms_error(S, loop_reference(a, f, initial, 1)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("method", METHODS)
def test_affine_scan_zero_factors_reset_the_state(method):
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0]).view(1, 5, 1)
    f = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]).view(1, 5, 1)
    S = affine_scan(a, f, torch.tensor([[10.0]]), dim=1, method=method)
    assert S.flatten().tolist() == [11.0, 2.0, 7.0, 4.0, 17.0]


def test_affine_scan_other_axes_and_rejects_unknown_method():
    f = torch.randn(7, 3, 2)
    a = torch.rand(7, 1, 1)
    for dim, method in [(0, "doubling"), (-3, "sequential")]:
        assert rel_rms_error(affine_scan(a, f, dim=dim, method=method),
                             loop_reference(a, f, None, 0)) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="method"):
        affine_scan(a, f, dim=0, method="parallel")


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("with_initial", [False, True])
def test_prefix_sum(dtype, with_initial):
    g = torch.Generator().manual_seed(4)
    f = torch.randn(2, 6, 3, 4, 5, generator=g, dtype=torch.float64).to(dtype)
    initial = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64).to(dtype)
    initial = initial if with_initial else None
    S = prefix_sum(f, dim=1, initial=initial)
    expected = loop_reference(torch.ones(1, 6, 1, 1, 1, dtype=torch.float64), f, initial, 1)
    assert S.dtype == dtype
    assert rel_rms_error(S, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_initial", [False, True])
def test_prefix_sum_of_one_term_is_the_sum_itself(dtype, with_initial):
    """A single step's state after its one chunk: ``initial + f``, one add, no blocked scan's
    products to compute (a converted single-step layer calls this on every call)."""
    g = torch.Generator().manual_seed(5)
    f = torch.randn(3, 1, 4, 5, generator=g, dtype=torch.float64).to(dtype)
    initial = torch.randn(3, 4, 5, generator=g, dtype=torch.float64).to(dtype) \
        if with_initial else None
    with _Ops() as ops:
        S = prefix_sum(f, dim=1, initial=initial)
    expected = loop_reference(torch.ones(1, 1, 1, 1, dtype=torch.float64), f, initial, 1)
    assert S.dtype == dtype and S.shape == f.shape
    assert rel_rms_error(S, expected) < TOLERANCE[dtype]
    assert not {"bmm", "mm", "matmul", "cumsum"} & set(ops.names), ops.names
    assert len([n for n in ops.names if n not in ("unsqueeze", "_to_copy", "view")]) <= 1


@settings(max_examples=25, deadline=None)
@given(n=st.sampled_from([1, 2, 5, 63, 64, 65, 130]), with_initial=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_summed_scan_is_momentum_then_prefix_sum(n, with_initial, seed):
    """One matmul within a block, two blocked scans past it: both equal the two loops, with
    gradients, in fp32 against float64."""
    from ttt2la.runtime.scan import summed_scan
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(3, n, generator=g).requires_grad_()
    f = torch.randn(3, n, 6, generator=g).requires_grad_()
    initial = torch.randn(3, 6, generator=g).requires_grad_() if with_initial else None
    leaves = [x for x in (a, f, initial) if x is not None]
    leaves64 = [x.detach().double().requires_grad_() for x in leaves]
    a64, f64 = leaves64[:2]
    velocity = loop_reference(a64.unsqueeze(-1), f64, None, dim=1)
    want = loop_reference(torch.ones(()), velocity, leaves64[2] if with_initial else None, dim=1)
    got = summed_scan(a, f, initial)
    assert rel_rms_error(got, want) <= TOLERANCE[torch.float32]
    seed_grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got.backward(seed_grad.float())
    want.backward(seed_grad)
    for x, x64 in zip(leaves, leaves64):
        assert rel_rms_error(x.grad, x64.grad) <= TOLERANCE[torch.float32]


# ----------------------------------------------------------------------------- transfer masks

def test_transfer_masks_are_made_once_and_serve_every_mode():
    """The scan's triangular masks depend on the block's side alone: made once, a later call
    dispatches none of their ops; made under inference mode they still serve a call that
    records gradients, and a fake tensor's call (a compiler's tracing) gets masks of its own."""
    side = 7
    _TRIANGLES.pop((side, torch.device("cpu")), None)
    a, f, initial = torch.rand(3, side), torch.randn(3, side, 5), torch.randn(3, 5)
    with torch.inference_mode():
        blocked_scan(a, f, initial)                      # makes the masks
    with _Ops() as ops:
        blocked_scan(a, f, initial)
    assert "tril" not in ops.names and "ones" not in ops.names, ops.names
    leaves = [x.clone().requires_grad_() for x in (a, f, initial)]
    S = blocked_scan(*leaves)
    S.square().sum().backward()
    want = loop_reference(a.unsqueeze(-1), f, initial, 1)
    assert rel_rms_error(S.detach().double(), want) <= TOLERANCE[torch.float32]
    assert all(x.grad is not None for x in leaves)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in (a, f, initial)]
        assert blocked_scan(*fake).shape == (3, side, 5)
    assert all(type(m) is torch.Tensor for m in _TRIANGLES[(side, torch.device("cpu"))])
