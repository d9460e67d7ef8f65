"""Buffer reuse: results written into dead buffers compute the same values bit for bit, never
write an input the caller keeps or a value it receives; a feature graph recorded for a gradient
runs as one autograd function whose gradients match autograd's and which allocates fewer large
tensors."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

from ttt2la.errors import UnsupportedTTTError
from ttt2la.lowering.buffer_reuse import out_overload, reuse_buffers
from ttt2la.lowering.specialize import SpecializedGraph
from ttt2la.testing import rel_rms_error, tolerance

aten = torch.ops.aten


def chain(x, w, s):
    """Pointwise ops and products whose intermediates die one after another; ``s`` is also an
    output, read after the last use of everything else."""
    a = torch.sigmoid(x)
    b = a * x                            # a dies here: in place
    c = torch.bmm(b, w)                  # b dies: a product cannot write its own operand
    d = torch.tanh(c) + s                # into c
    e = torch.bmm(d.transpose(1, 2), x)  # into a buffer dead before it
    return d.sum(1), e, s * 2.0


def _args(b, n, m, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, m, generator=g, dtype=dtype),
            torch.randn(b, m, m, generator=g, dtype=dtype),
            torch.randn(b, n, m, generator=g, dtype=dtype))


def test_out_overloads_found_for_functional_ops_only():
    assert out_overload(aten.mul.Tensor)[1] == "out"
    assert out_overload(aten.silu_backward.default) == (aten.silu_backward.grad_input,
                                                        "grad_input")
    assert out_overload(aten.bmm.default)[0] is aten.bmm.out
    assert out_overload(aten.transpose.int) is None


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, 30), m=st.integers(1, 9))
def test_reused_buffers_give_the_same_values_bit_for_bit(b, n, m):
    args = _args(b, n, m)
    kept = [a.clone() for a in args]
    want = chain(*args)
    gm = reuse_buffers(make_fx(chain)(*args), args, min_bytes=0)
    rewritten = [n for n in gm.graph.nodes if n.op == "call_function"
                 and n.kwargs.get("out") is not None]
    assert rewritten            # something was placed in a dead buffer
    got = gm(*args)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for a, k in zip(args, kept):
        assert torch.equal(a, k)     # inputs are not the graph's to write


def test_owned_inputs_are_overwritten_only_after_their_last_read():
    def uses_input_late(x, y):
        t = torch.exp(y)                 # y is owned: it may be written ...
        u = torch.mm(t, x)
        return torch.tanh(u) * 2.0, y * 3.0        # ... only from here on, where it is last read

    x, y = torch.randn(5, 5), torch.randn(5, 5)
    want = uses_input_late(x, y)
    traced = make_fx(uses_input_late)(x, y)
    name = [n.name for n in traced.graph.nodes if n.op == "placeholder"][1]
    kept = y.clone()
    gm = reuse_buffers(make_fx(uses_input_late)(x, y), (x, y), min_bytes=0)
    assert all(torch.equal(g, w) for g, w in zip(gm(x, y), want))
    assert torch.equal(y, kept)          # not owned: never written
    gm = reuse_buffers(traced, (x, y), owned_inputs={name: "y"}, min_bytes=0)
    got = gm(x, y)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[1].data_ptr() == y.data_ptr()     # the last read of y wrote its result there


def _swiglu(q_t, k, lr, w0, w2):
    phi_q = F.silu(torch.bmm(w0, q_t)) * torch.bmm(w2, q_t)
    k_t = k.transpose(1, 2)
    return phi_q, (F.silu(torch.bmm(w0, k_t)) * torch.bmm(w2, k_t)).transpose(1, 2) * lr


def _reference_swiglu(q_t, k, lr, w0, w2):
    """The same features written with their own loops over the batch (no shared code)."""
    phi_q, phi_k = [], []
    for i in range(q_t.shape[0]):
        gate = w0[i] @ q_t[i]
        phi_q.append(gate * torch.sigmoid(gate) * (w2[i] @ q_t[i]))
        kg = w0[i] @ k[i].T
        phi_k.append(((kg * torch.sigmoid(kg)) * (w2[i] @ k[i].T)).T * lr[i])
    return torch.stack(phi_q), torch.stack(phi_k)


def _feature_inputs(b, L, d, dh, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_t = torch.randn(b, L, d, generator=g, dtype=dtype).transpose(1, 2)
    k = torch.randn(b, L, d, generator=g, dtype=dtype)
    lr = torch.rand(b, L, 1, generator=g, dtype=dtype)
    w0 = torch.randn(b, dh, d, generator=g, dtype=dtype) / d ** 0.5
    w2 = torch.randn(b, dh, d, generator=g, dtype=dtype) / d ** 0.5
    return [a.detach().requires_grad_() for a in (q_t, k, lr, w0, w2)]


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 3), L=st.integers(1, 300), d=st.sampled_from([1, 4, 16]),
       dh=st.sampled_from([1, 3, 16]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_recorded_gradients_match_autograd_of_a_reference(b, L, d, dh, dtype):
    args = _feature_inputs(b, L, d, dh, dtype)
    ref = [a.detach().clone().requires_grad_() for a in args]
    kept = [a.detach().clone() for a in args]
    spec = SpecializedGraph(make_fx(_swiglu)(*args))
    got, want = spec.specialised_call(*args), _reference_swiglu(*ref)
    seed = [torch.randn(w.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
            for w in want]
    torch.autograd.backward(got, seed)
    torch.autograd.backward(want, seed)
    for g, w in zip(got, want):
        assert rel_rms_error(g, w) <= tolerance(dtype)
    for a, r, k in zip(args, ref, kept):
        assert rel_rms_error(a.grad, r.grad) <= tolerance(dtype)
        assert torch.equal(a.detach(), k)


def test_recorded_graph_passes_gradcheck():
    args = _feature_inputs(2, 5, 3, 2, torch.float64)
    spec = SpecializedGraph(make_fx(_swiglu)(*args))
    assert torch.autograd.gradcheck(lambda *a: spec.specialised_call(*a), args)


def test_inputs_no_used_output_depends_on_get_no_gradient():
    """As autograd: φ(K) receives no gradient, so k and the rate get None, not zeros."""
    args = _feature_inputs(2, 40, 4, 3, torch.float64)
    phi_q, _ = SpecializedGraph(make_fx(_swiglu)(*args)).specialised_call(*args)
    phi_q.sum().backward()
    q_t, k, lr, w0, w2 = args
    assert k.grad is None and lr.grad is None
    assert q_t.grad is not None and w0.grad is not None and w2.grad is not None


def test_a_second_backward_through_overwritten_activations_is_refused():
    args = _feature_inputs(2, 4096, 64, 64, torch.float32)     # 2 MB intermediates
    spec = SpecializedGraph(make_fx(_swiglu)(*args))
    out = spec.specialised_call(*args)
    seed = [torch.ones_like(o) for o in out]
    torch.autograd.backward(out, seed, retain_graph=True)
    with pytest.raises(UnsupportedTTTError, match="retain_graph=True"):
        torch.autograd.backward(out, seed)


def test_a_backward_creating_a_graph_is_refused():
    args = _feature_inputs(2, 64, 8, 8, torch.float32)
    out = SpecializedGraph(make_fx(_swiglu)(*args)).specialised_call(*args)
    with pytest.raises(UnsupportedTTTError, match="create_graph=True"):
        torch.autograd.grad(sum(o.sum() for o in out), args[0], create_graph=True)


class _FreshLarge(TorchDispatchMode):
    """Counts large results an op allocated (not written into one of its arguments)."""

    def __init__(self, min_numel):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given_ptrs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.numel() >= self.min_numel \
                and out.untyped_storage().data_ptr() not in given_ptrs:
            self.count += 1
        return out


def _fresh_in_forward_and_backward(fn, args):
    out = fn(*args)           # warm: the first call prepares the recorded function
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    with _FreshLarge(args[1].numel()) as counter:
        out = fn(*args)
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    return counter.count


def test_recorded_graph_allocates_fewer_large_tensors():
    args = _feature_inputs(2, 4096, 64, 64, torch.float32)
    gm = make_fx(_swiglu)(*args)
    plain = _fresh_in_forward_and_backward(gm, args)
    spec = SpecializedGraph(gm)
    planned = _fresh_in_forward_and_backward(lambda *a: spec.specialised_call(*a), args)
    assert planned <= plain - 6, (planned, plain)
