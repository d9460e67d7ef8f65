"""Feature graphs specialised to their inputs: same values, products token-major where the stream
lies so, intermediates reused only when no gradient is recorded, inputs never written."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ttt2la.lowering.specialize import (CACHE_SIZE, PLANNED_FROM_BYTES, SpecializedGraph,
                                        token_major_products)
from ttt2la.testing import rel_rms_error, tolerance

aten = torch.ops.aten


def swiglu_features(q_t, k, lr, w0, w2):
    """LaCT-like features: q read transposed ([b, d, L]), k token-major, a per-token rate."""
    phi_q = F.silu(torch.bmm(w0, q_t)) * torch.bmm(w2, q_t)                  # [b, dh, L]
    k_t = k.transpose(1, 2)
    phi_k = (F.silu(torch.bmm(w0, k_t)) * torch.bmm(w2, k_t)).transpose(1, 2) * lr   # [b, L, dh]
    return phi_q, phi_k


def _inputs(b, L, d, dh, transposed_q=True, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, L, d, generator=g)
    q_t = q.transpose(1, 2) if transposed_q else q.transpose(1, 2).contiguous()
    k = torch.randn(b, L, d, generator=g)
    lr = torch.rand(b, L, 1, generator=g)
    w0 = torch.randn(b, dh, d, generator=g) / d ** 0.5
    w2 = torch.randn(b, dh, d, generator=g) / d ** 0.5
    args = [q_t, k, lr, w0, w2]
    if requires_grad:
        args = [a.detach().requires_grad_() for a in args]
    return args


def _traced(args):
    return make_fx(swiglu_features)(*args)


def _products(gm):
    return [n for n in gm.graph.nodes if n.target in (aten.bmm.default, aten.mm.default)]


def _long_operands_row_major(gm, args) -> list[bool]:
    FakeTensorProp(gm).propagate(*args)
    return [n.args[0].meta["val"].stride(-1) == 1 and n.args[0].meta["val"].shape[-2] == args[1].shape[1]
            for n in _products(gm)]


def test_products_on_a_transposed_stream_run_token_major():
    args = _inputs(2, 16, 8, 4)
    assert _long_operands_row_major(_traced(args), args) == [False] * 4
    gm = token_major_products(_traced(args), args)
    # every product now reads the stream row-major as its first operand: [b, L, d] @ [b, d, dh]
    assert _long_operands_row_major(gm, args) == [True] * 4
    with torch.no_grad():
        phi_q, _ = gm(*args)
    # φ(Q) comes out as a transposed view of a token-major tensor, which the op reads as it lies
    assert phi_q.transpose(1, 2).is_contiguous()


def test_row_major_streams_are_left_alone():
    args = _inputs(2, 16, 8, 4, transposed_q=False)
    gm = token_major_products(_traced(args), args)
    # q_t is row-major [b, d, L] here: only the two products on k's transpose are reoriented
    assert len(_products(gm)) == 4
    assert sum(n.args[0].target == aten.transpose.int for n in _products(gm)) == 2


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), L=st.integers(1, 40), d=st.sampled_from([1, 4, 8]),
       dh=st.sampled_from([1, 3, 8]), transposed_q=st.booleans())
def test_specialised_values_equal_the_traced_graph(b, L, d, dh, transposed_q):
    args = _inputs(b, L, d, dh, transposed_q)
    spec = SpecializedGraph(_traced(args))
    with torch.no_grad():
        got = spec(*args)
    want = swiglu_features(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_rms_error(g, w) <= tolerance(torch.float32)


def test_inputs_are_never_written():
    args = _inputs(2, 24, 8, 8)
    saved = [a.clone() for a in args]
    spec = SpecializedGraph(_traced(args))
    with torch.no_grad():
        spec(*args)
    for a, s in zip(args, saved):
        assert torch.equal(a, s)


def test_intermediates_are_reused_in_place_without_gradients_and_planned_with_them():
    args = _inputs(2, 24, 8, 8)
    spec = SpecializedGraph(_traced(args))
    with torch.no_grad():
        inplace, _ = spec.for_inputs(args)
    assert any(str(n.target).endswith("_.Tensor") or str(n.target).endswith("_.default")
               for n in inplace.graph.nodes if n.op == "call_function")
    # recording a gradient, the graph runs as one autograd function (forward and backward
    # graphs of their own, see test_buffer_reuse.py), never as the re-inplaced graph
    grad_args = _inputs(2, 24, 8, 8, requires_grad=True)
    recorded, _ = spec.for_inputs(grad_args)
    assert not isinstance(recorded, torch.fx.GraphModule)
    saved = [a.detach().clone() for a in grad_args]
    out = spec.specialised_call(*grad_args)
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    for a, s in zip(grad_args, saved):
        assert torch.equal(a.detach(), s)


def test_gradients_through_the_specialised_graph():
    args = _inputs(2, 24, 8, 8, requires_grad=True)
    ref = [a.detach().clone().requires_grad_() for a in args]
    spec = SpecializedGraph(_traced(args))
    got, want = spec.specialised_call(*args), swiglu_features(*ref)
    seed = [torch.randn_like(w) for w in want]
    torch.autograd.backward(got, seed)
    torch.autograd.backward(want, seed)
    for a, r in zip(args, ref):
        assert rel_rms_error(a.grad, r.grad) <= tolerance(torch.float32)


def test_one_specialisation_per_signature_and_the_cache_is_bounded():
    """Without a gradient one copy serves every size of a layout (a new length does not plan
    again); with one, the buffers it reuses are sized, so every shape has its own."""
    spec = SpecializedGraph(_traced(_inputs(1, 8, 4, 4)))
    with torch.no_grad():
        first = spec.for_inputs(_inputs(1, 8, 4, 4))[0]
        assert spec.for_inputs(_inputs(1, 8, 4, 4, seed=1))[0] is first
        assert spec.for_inputs(_inputs(1, 37, 4, 4))[0] is first
        assert spec.for_inputs(_inputs(1, 9, 4, 4, transposed_q=False))[0] is not first
        batched = spec.for_inputs(_inputs(2, 9, 4, 4))[0]        # a size-1 axis broadcasts
        assert batched is not first and spec.for_inputs(_inputs(3, 12, 4, 4))[0] is batched
    assert len(spec._cache) == 3
    recorded = spec.for_inputs(_inputs(1, 8, 4, 4, requires_grad=True))[0]
    assert spec.for_inputs(_inputs(1, 9, 4, 4, requires_grad=True))[0] is not recorded
    for L in range(10, 10 + 2 * CACHE_SIZE):
        spec.for_inputs(_inputs(1, L, 4, 4, requires_grad=True))
    assert len(spec._cache) == CACHE_SIZE


@settings(max_examples=6, deadline=None)
@given(calls=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 40), st.booleans()),
                      min_size=2, max_size=6))
def test_one_copy_serves_every_size_of_its_layout(calls):
    """Calls of one specialised graph at any sequence of batches, lengths (size-1 axes included)
    and layouts compute what the traced graph computes, each reusing the copy of its layout."""
    spec = SpecializedGraph(_traced(_inputs(2, 16, 8, 8)))
    for b, L, transposed_q in calls:
        args = _inputs(b, L, 8, 8, transposed_q, seed=b * 100 + L)
        with torch.no_grad():
            got = spec(*args)
        for g, w in zip(got, swiglu_features(*args)):
            assert g.shape == w.shape
            assert rel_rms_error(g, w) <= tolerance(torch.float32)


def test_tensor_constants_are_read_never_written():
    """A graph's own tensor constants (``get_attr``, here a float64 map cast for use) run as
    inputs: the fake-tensor passes can read them and re-inplacing never writes into them."""
    constant = torch.randn(3, 4, dtype=torch.float64)

    def uses_a_constant(x):
        scaled = torch.ops.aten.mul.Tensor(constant.to(x.dtype), 2.0)    # dies here: in-place
        return torch.ops.aten.add.Tensor(torch.bmm(x, scaled.expand(x.shape[0], 3, 4)), 1.0)

    x = torch.randn(2, 5, 3)
    gm = make_fx(uses_a_constant)(x)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    saved = constant.clone()
    spec = SpecializedGraph(gm)
    with torch.no_grad():
        got = spec(x)
        again = spec(x)
    assert torch.equal(constant, saved)
    assert rel_rms_error(got, uses_a_constant(x)) <= tolerance(torch.float32)
    assert torch.equal(got, again)


def _half_streams(args):
    """``args`` with the streams (q, k, the rate) in bf16, as a caller's autocast leaves its
    projections, and the weights in fp32."""
    return [a.detach().to(torch.bfloat16).requires_grad_(a.requires_grad) if i < 3 else a
            for i, a in enumerate(args)]


def test_specialised_under_the_callers_autocast_computes_what_the_graph_does():
    """Traced in fp32, a weighted φ runs under the caller's autocast: its products autocast to
    bf16, fp32 weights times bf16 streams. The specialised copy is planned under the same
    autocast (without it, its fake tensors met a dtype clash), one copy per autocast state."""
    for requires_grad in (False, True):
        spec = SpecializedGraph(_traced(_inputs(2, 12, 4, 6)))
        results = []
        for fn in (spec.specialised_call, spec.graph):
            args = _half_streams(_inputs(2, 12, 4, 6, requires_grad=requires_grad))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fn(*args)
            assert all(o.dtype == torch.bfloat16 for o in out)
            if requires_grad:
                sum(o.float().square().sum() for o in out).backward()
                out = (*out, *(a.grad for a in args))
            results.append(out)
        for got, want in zip(*results):
            assert rel_rms_error(got, want) <= tolerance(torch.bfloat16)
    # the same signature with and without autocast: one copy each, computing in bf16 and fp32
    spec = SpecializedGraph(_traced(_inputs(2, 12, 4, 6)))
    args = _inputs(2, 12, 4, 6, requires_grad=True)
    for autocast in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            got, want = spec.specialised_call(*args), spec.graph(*args)
        assert [o.dtype for o in got] == [o.dtype for o in want]
        assert (torch.bfloat16 in [o.dtype for o in got]) == autocast
    assert len(spec._cache) == 2


def test_a_failing_specialisation_raises_without_logging_fake_tensor_tracebacks():
    """A specialisation that fails (bf16 streams and fp32 weights, without autocast) raises to
    the call, which runs the code as written naming the error; torch's fake tensors log nothing
    of it (they logged the failing op's traceback, some 300 lines on stderr, every call)."""
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.seen = []

        def emit(self, record):
            self.seen.append(record)

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    records = Records()
    logger.addHandler(records)
    spec = SpecializedGraph(_traced(_inputs(2, 12, 4, 6)))
    try:
        with torch.no_grad():
            spec(*_half_streams(_inputs(2, 12, 4, 6)))
    except RuntimeError as e:
        assert "dtype" in str(e) or "scalar type" in str(e)
    else:
        raise AssertionError("bf16 streams times fp32 weights ran without autocast")
    finally:
        logger.removeHandler(records)
    assert not records.seen, [r.getMessage() for r in records.seen]


def _large_inputs(requires_grad=True):
    """Streams of ``PLANNED_FROM_BYTES`` exactly (2 × 4096 × 64 fp32)."""
    return _inputs(2, PLANNED_FROM_BYTES // (2 * 64 * 4), 64, 16, requires_grad=requires_grad)


def test_a_recorded_graph_is_planned_only_at_large_shapes_called_again():
    """Planning a recorded graph costs more than the calls it speeds up at small shapes and on
    a shape called once (a length that changes call by call): it runs the graph's own autograd
    there, and plans a large shape on its second call. Gradients are the same either way."""
    small = _inputs(2, 24, 8, 8, requires_grad=True)
    spec = SpecializedGraph(_traced(small))
    for _ in range(3):
        got = spec(*small)
    assert not spec._cache
    large = _large_inputs()
    ref = [a.detach().clone().requires_grad_() for a in large]
    seed = None
    for call in range(2):
        args = [a.detach().clone().requires_grad_() for a in large]
        got = spec(*args)
        assert len(spec._cache) == call        # planned from the second call
        seed = seed or [torch.randn_like(g) for g in got]
        torch.autograd.backward(got, seed)
        want = swiglu_features(*ref)
        torch.autograd.backward(want, seed)
        for a, r in zip(args, ref):
            assert rel_rms_error(a.grad, r.grad) <= tolerance(torch.float32)
            r.grad = None


def test_activation_checkpointing_plans_at_the_first_call():
    """Recomputed in the backward, a checkpointed call must save what its forward saved: under
    saved-tensor hooks a large shape is planned at once, so forward and recomputation agree."""
    from torch.utils.checkpoint import checkpoint

    large = _large_inputs()
    spec = SpecializedGraph(_traced(large))
    ref = [a.detach().clone().requires_grad_() for a in large]
    out = checkpoint(lambda *a: spec(*a), *large, use_reentrant=False)
    assert len(spec._cache) == 1
    seed = [torch.randn_like(o) for o in out]
    torch.autograd.backward(out, seed)
    torch.autograd.backward(swiglu_features(*ref), seed)
    for a, r in zip(large, ref):
        assert rel_rms_error(a.grad, r.grad) <= tolerance(torch.float32)


def test_a_lifted_layer_differentiates_to_second_order_where_its_graphs_are_not_planned():
    """Below ``PLANNED_FROM_BYTES`` the feature graphs run the traced ops' own autograd, so a
    Hessian-vector product through a lifted layer (LaCT's operator on the block op) is the
    layer's as written; where a planned copy runs, ``create_graph=True`` is refused."""
    import ttt2la
    from ttt2la.zoo import LaCTPublishedLayer

    torch.manual_seed(0)
    layer = LaCTPublishedLayer(16, 2, 4, update_theta=False, weight_norm=False, muon=False).eval()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(1, 16, 16),))
    assert conv.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")
    x = torch.randn(2, 16, 16)

    def hvp(m):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        (h,) = torch.autograd.grad(g.square().sum(), xi)
        return g, h

    want = hvp(layer)
    for _ in range(2):              # the shape's second call too: these graphs are never planned
        for got, w in zip(hvp(conv), want):
            assert rel_rms_error(got, w) <= tolerance(torch.float32)
