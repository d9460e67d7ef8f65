"""The Triton kernels against the plain references: outputs and every gradient, fp32 and bf16, odd shapes.

On a machine with a GPU the kernels run there; elsewhere they run in Triton's CPU interpreter, which this
module switches on while it imports the kernels (``TRITON_INTERPRET=1`` while they are decorated). A
cheap subset runs by default; ``TTT2LA_FULL_KERNEL_TESTS=1`` runs the rest (``benchmarks/gpu_check.sh`` sets it).

References run in float64 on the same (rounded) inputs, and the random projection that turns outputs into a
loss is representable in the tested dtype, so both sides see the same upstream gradients: Newton–Schulz's
backward amplifies any difference there by up to ``3.4445^steps``.
"""
from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton", reason="triton is not installed")

from triton_interpreter import ON_GPU, import_kernels  # noqa: E402


import_kernels()

import ttt2la.runtime.triton as kernels  # noqa: E402
from ttt2la.errors import ConversionError, UnsupportedTTTError  # noqa: E402
from ttt2la.runtime import block_linear_attention as dispatched_block  # noqa: E402
from ttt2la.testing import TOLERANCE, outputs_and_grads, rel_rms_error  # noqa: E402
# hand-written references that share no code with the package
from test_runtime_block import NS_FORMS, hand_block  # noqa: E402
from test_runtime_chunk import hand_recurrence  # noqa: E402

if not ON_GPU and not kernels.interpreting():
    # loud, not a skip: a whole file of kernel tests silently skipped in CI would test nothing
    raise RuntimeError("the Triton kernels were imported (to compile) before this module could switch on the "
                       "CPU interpreter: a test module imported ttt2la.runtime.triton's kernels (or _common) "
                       "without tests/triton_interpreter.import_kernels first")

DEVICE = "cuda" if ON_GPU else "cpu"
FULL = os.environ.get("TTT2LA_FULL_KERNEL_TESTS") == "1"
full_only = pytest.mark.skipif(not FULL, reason="slow in the CPU interpreter; TTT2LA_FULL_KERNEL_TESTS=1 runs it")
ORDERS = ("exclusive", "inclusive", "full")
LR_KINDS = ("none", "token", "feature")


# ----------------------------------------------------------------------------- harness

def _rand(g, *shape, low=None, high=None):
    if low is None:
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    return low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64)


def run_with_grads(fn, tensors, options, output_final_state, seed, cotangent_dtype):
    """Outputs, final state and ``{name: (input, gradient)}`` for every tensor argument, w.r.t. a random
    projection of the outputs (representable in ``cotangent_dtype``)."""
    return outputs_and_grads(fn, tensors, options, output_final_state=output_final_state, seed=seed,
                             cotangent_dtype=cotangent_dtype)


def assert_matches(fn, reference, tensors, options, output_final_state, seed, low_references=()):
    """``fn`` on ``DEVICE`` against ``reference`` in float64 on CPU: output, final state, every gradient.

    Without ``low_references`` every error is held to the fixed tolerance of the dtype; with them (Newton–Schulz
    cases) to twice the largest error of those references run in the inputs' own precision, plus 1e-6.
    """
    dtype = tensors[0].dtype
    tol = TOLERANCE[dtype]
    on = lambda x, **kw: x.to(**kw) if isinstance(x, torch.Tensor) else x  # noqa: E731
    o, final, grads = run_with_grads(fn, [on(t, device=DEVICE) for t in tensors],
                                     {k: on(v, device=DEVICE) for k, v in options.items()},
                                     output_final_state, seed, dtype)
    o_ref, final_ref, grads_ref = run_with_grads(reference, [on(t, dtype=torch.float64) for t in tensors],
                                                 {k: on(v, dtype=torch.float64) for k, v in options.items()},
                                                 output_final_state, seed, dtype)
    assert o.dtype == dtype and o.shape == o_ref.shape and torch.isfinite(o).all()
    errors = {"output": rel_rms_error(o.cpu(), o_ref)}
    if output_final_state:
        assert final.dtype == (options["initial_state"].dtype if options.get("initial_state") is not None
                               else tensors[2].dtype)
        errors["final_state"] = rel_rms_error(final.cpu(), final_ref)
    for name, (x, gr) in grads.items():
        assert gr.dtype == x.dtype and gr.shape == x.shape, name
        errors[f"grad {name}"] = rel_rms_error(gr.cpu(), grads_ref[name][1])
    bounds = {k: tol for k in errors}
    for low_reference in low_references:
        o_low, final_low, grads_low = run_with_grads(low_reference, tensors, options, output_final_state, seed,
                                                     dtype)
        own = {"output": rel_rms_error(o_low, o_ref)}
        if output_final_state:
            own["final_state"] = rel_rms_error(final_low, final_ref)
        own.update({f"grad {name}": rel_rms_error(gr, grads_ref[name][1]) for name, (_, gr) in grads_low.items()})
        bounds = {k: (2 * own[k] + 1e-6 if low_reference is low_references[0] else max(bounds[k], 2 * own[k] + 1e-6))
                  for k in errors}
    bad = {k: (e, bounds[k]) for k, e in errors.items() if not e <= bounds[k]}
    assert not bad, f"relative RMS errors above their bounds: {bad}"


# ----------------------------------------------------------------------------- token-causal op

def chunk_case(seed, *, B, T, H, Dk, Dv, decay, scale, initial_state, dtype, strength=1.0):
    """``decay``: ``False``, ``True``/``"head"`` (one per head) or ``"channel"`` (one per key channel, GLA's
    gate); ``strength`` scales the log decays' spread and size (gates that shut for a token, then reopen)."""
    g = torch.Generator().manual_seed(seed)
    tensors = tuple(_rand(g, B, T, H, D).to(dtype) for D in (Dk, Dk, Dv))
    shape = (B, T, H, Dk) if decay == "channel" else (B, T, H)
    options = dict(
        scale=scale,
        log_decay=(strength * torch.nn.functional.logsigmoid(strength * _rand(g, *shape) + 2)).to(dtype)
        if decay else None,
        initial_state=_rand(g, B, H, Dk, Dv).to(dtype) if initial_state else None)
    return tensors, options


def check_chunk(seed, chunk_size, final, **case):
    tensors, options = chunk_case(seed, **case)
    fn = lambda *a, **k: kernels.chunk_linear_attention(*a, chunk_size=chunk_size, **k)  # noqa: E731
    assert_matches(fn, hand_recurrence, tensors, options, final, seed)


# B is 2 except where the interpreter's cost grows with it: every kernel's grid is B·H programs per tile,
# and the four-sub-chunk case runs the sub-chunk loops of the in-chunk attention (the only case where sub-chunks
# lie between the queries' and the keys'), so it keeps two heads and takes one batch row.
@pytest.mark.parametrize("T,Dk,Dv,chunk_size,decay,initial_state,final,dtype,B", [
    (37, 20, 24, 16, True, True, True, torch.float32, 2),      # ragged last chunk, D not a power of two
    (37, 20, 24, 32, "channel", True, True, torch.float32, 2),  # a decay per key channel, two sub-chunks
    (70, 18, 9, 64, "channel", False, True, torch.bfloat16, 1),  # four sub-chunks, the last chunk ragged
    (1, 16, 8, 64, True, True, True, torch.float32, 2),        # a single token
    (5, 7, 3, 64, False, False, True, torch.float32, 2),       # T < chunk, tiny features, no decay
    (70, 30, 17, 16, True, True, True, torch.bfloat16, 2),     # five chunks, the last ragged
    (21, 12, 12, 16, False, True, False, torch.bfloat16, 2),
])
def test_chunk_op_matches_reference(T, Dk, Dv, chunk_size, decay, initial_state, final, dtype, B):
    seed = zlib.crc32(repr((T, Dk, Dv, dtype)).encode())
    check_chunk(seed, chunk_size, final, B=B, T=T, H=2, Dk=Dk, Dv=Dv, decay=decay, scale=0.3,
                initial_state=initial_state, dtype=dtype)


chunk_shapes = st.fixed_dictionaries(dict(
    B=st.integers(1, 2), T=st.integers(1, 80), H=st.integers(1, 2), Dk=st.integers(1, 40), Dv=st.integers(1, 40),
    chunk_size=st.sampled_from([16, 32, 64]), decay=st.sampled_from([False, "head", "channel"]),
    initial_state=st.booleans(), final=st.booleans(), scale=st.sampled_from([None, 0.5]),
    seed=st.integers(0, 2**31 - 1)))


def with_enough_elements(dtype, case):
    """``case`` adjusted so a bf16 relative RMS error measures the kernels rather than one coincidence.

    The bf16 kernels round intermediate products (score gradients, states, ``dG``) to bf16 before their
    tensor-core matmuls, and a gradient element that is a near-cancelling sum of such terms keeps their
    rounding error. Two kinds of bf16 draws are therefore widened:

    * tensors of a single element show it undiluted (T = Dk = Dv = 1 did, at 3.7 %; a per-token ``lr`` with
      B = T = H = 1, at 3.1 %): at least 4 key and value features, and 4 tokens × heads × batch;
    * with Muon, a chunk's increment is normalised, so when every updating chunk holds one token a per-token
      ``lr`` only rescales what is normalised away: its exact gradient is zero (up to the 1e-7 of the
      normalisation), and any rounding is an infinite relative error: such draws get two tokens per chunk.

    T = 1, T < C and ragged chunks stay in the draws.
    """
    if dtype != torch.bfloat16:
        return case
    case = dict(case, Dk=max(case["Dk"], 4), Dv=max(case["Dv"], 4))
    if case.get("muon_steps", 0) > 0 and case.get("lr_kind") == "token":
        case.update(C=max(case["C"], 2), T=max(case["T"], 2))
    case["H"] = max(case["H"], math.ceil(4 / (case["B"] * case["T"])))
    return case


def _check_chunk_draw(c, bf16):
    c = dict(c)
    seed, chunk_size, final = c.pop("seed"), c.pop("chunk_size"), c.pop("final")
    dtype = torch.bfloat16 if bf16 else torch.float32
    check_chunk(seed, chunk_size, final, dtype=dtype, **with_enough_elements(dtype, c))


@settings(max_examples=3, deadline=None)
@given(c=chunk_shapes, bf16=st.booleans())
def test_chunk_op_random_shapes(c, bf16):
    _check_chunk_draw(c, bf16)


@full_only
@settings(max_examples=25, deadline=None)
@given(c=chunk_shapes, bf16=st.booleans())
def test_chunk_op_random_shapes_full(c, bf16):
    _check_chunk_draw(c, bf16)


def test_chunk_decay_gradient_has_no_long_range_cancellation():
    """Strong decay over a long sequence: ``d log_decay`` must not come from differences of large sums."""
    check_chunk(11, 16, True, B=1, T=128, H=1, Dk=16, Dv=16, decay=True, scale=1.0, initial_state=True,
                dtype=torch.bfloat16)


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("strength", [6.0, 15.0, 40.0])
def test_gates_that_shut_and_reopen_keep_every_digit(decay, strength):
    """Log decays down to about ``−6·strength²`` for single tokens, near 0 between them: the weights of the
    open spans after a shut gate are as exact as with mild decays (fp32, every gradient within 1e-5;
    exponents taken as differences of the chunk's cumulative sums lost 1e-4 here, per head and per channel)."""
    check_chunk(13, 32, True, B=1, T=70, H=2, Dk=16, Dv=16, decay=decay, scale=0.5, initial_state=True,
                dtype=torch.float32, strength=strength)


@full_only
@pytest.mark.parametrize("decay", ["head", "channel"])
def test_chunk_op_at_kernel_tile_sizes(decay):
    """Features spanning two 64-wide tiles and 64-token chunks, as on a GPU."""
    check_chunk(12, 64, True, B=2, T=200, H=2, Dk=96, Dv=80, decay=decay, scale=0.1, initial_state=True,
                dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- block op

def block_case(seed, *, B, T, H, Dk, Dv, C, order, lr_kind, momentum, muon_steps, initial_state, dtype,
               decay=False, step=False):
    """``decay``: ``False``, ``True`` (one factor per chunk and head) or ``"row"`` (one per state row);
    ``step``: a ``step_scale`` per chunk and head."""
    g = torch.Generator().manual_seed(seed)
    n = 1 if order == "full" else math.ceil(T / C)
    tensors = tuple(_rand(g, B, T, H, D).to(dtype) for D in (Dk, Dk, Dv))
    options = dict(
        chunk_size=C, order=order, muon_steps=muon_steps,
        lr={"none": None, "token": _rand(g, B, T, H, low=0.1, high=1.0).to(dtype),
            "feature": _rand(g, B, T, H, Dv, low=0.1, high=1.0).to(dtype)}[lr_kind],
        momentum=_rand(g, B, n, H, low=0.3, high=0.9).to(dtype) if momentum else None,
        initial_state=_rand(g, B, H, Dk, Dv).to(dtype) if initial_state else None)
    if decay:
        options["decay"] = _rand(g, B, n, H, *((Dk,) if decay == "row" else ()), low=0.5, high=1.0).to(dtype)
    if step:
        options["step_scale"] = _rand(g, B, n, H, low=-1.2, high=1.2).to(dtype)
    return tensors, options


def check_block(seed, final, **case):
    tensors, options = block_case(seed, **case)
    lows = ()
    if options["muon_steps"]:
        lows = tuple((lambda form: lambda *a, **k: hand_block(*a, form=form, **k))(form) for form in NS_FORMS)
    assert_matches(kernels.block_linear_attention, hand_block, tensors, options, final, seed, lows)


@pytest.mark.parametrize("order,momentum,muon_steps,decay,step,dtype", [
    ("exclusive", True, 5, True, True, torch.float32),        # a gated memory stepped by Muon at a rate
    ("inclusive", False, 0, "row", False, torch.float32),     # GLA written chunk by chunk
    ("exclusive", True, 0, "row", True, torch.bfloat16),
    ("inclusive", False, 5, False, True, torch.bfloat16),
])
def test_block_op_with_a_decay_or_a_step_scale(order, momentum, muon_steps, decay, step, dtype):
    """The state's decay (per matrix or per state row) and the step's scale between chunks, against the plain
    loop: outputs, final state and every gradient, the factors' own included."""
    check_block(31, True, B=2, T=29, H=2, Dk=12, Dv=10, C=8, order=order, lr_kind="token", momentum=momentum,
                muon_steps=muon_steps, initial_state=True, dtype=dtype, decay=decay, step=step)


# Every order, lr kind and dtype; momentum, Muon and the initial state in most; chunks shorter than the
# features (rank-deficient increments, Newton–Schulz at its most sensitive) and ragged sequences.
BLOCK_CASES = [
    # order, lr, momentum, muon, h0, final, T, C, Dk, Dv, dtype
    ("exclusive", "token", True, 5, True, True, 37, 8, 20, 17, torch.float32),
    ("inclusive", "feature", True, 0, False, True, 37, 8, 20, 17, torch.float32),
    ("full", "none", False, 3, True, True, 23, 8, 9, 12, torch.float32),
    ("exclusive", "none", False, 0, False, True, 1, 4, 5, 3, torch.float32),
    ("exclusive", "feature", True, 5, True, True, 37, 8, 20, 17, torch.bfloat16),
    ("inclusive", "token", True, 5, False, False, 75, 32, 20, 17, torch.bfloat16),
    ("full", "token", True, 5, True, True, 30, 8, 16, 16, torch.bfloat16),
    ("inclusive", "none", False, 0, True, True, 3, 8, 6, 7, torch.bfloat16),
]


@pytest.mark.parametrize("order,lr_kind,momentum,muon_steps,initial_state,final,T,C,Dk,Dv,dtype", BLOCK_CASES)
def test_block_op_matches_reference(order, lr_kind, momentum, muon_steps, initial_state, final, T, C, Dk, Dv,
                                    dtype):
    seed = zlib.crc32(repr((order, lr_kind, momentum, muon_steps, T, dtype)).encode())
    check_block(seed, final, B=1 + (T % 2), T=T, H=2, Dk=Dk, Dv=Dv, C=C, order=order, lr_kind=lr_kind,
                momentum=momentum, muon_steps=muon_steps, initial_state=initial_state, dtype=dtype)


block_shapes = st.fixed_dictionaries(dict(
    B=st.integers(1, 2), H=st.integers(1, 2), Dk=st.integers(1, 24), Dv=st.integers(1, 24), C=st.integers(1, 20),
    order=st.sampled_from(ORDERS), lr_kind=st.sampled_from(LR_KINDS), momentum=st.booleans(),
    muon_steps=st.sampled_from([0, 1, 5]), initial_state=st.booleans(), final=st.booleans(),
    t_frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1)))


def _draw_block(c, dtype):
    c = dict(c)
    T = 1 + round(c.pop("t_frac") * (3 * c["C"] + 5))
    seed, final = c.pop("seed"), c.pop("final")
    return seed, final, with_enough_elements(dtype, dict(c, T=T, dtype=dtype))


@settings(max_examples=3, deadline=None)
@given(c=block_shapes, bf16=st.booleans())
def test_block_op_random_shapes(c, bf16):
    seed, final, case = _draw_block(c, torch.bfloat16 if bf16 else torch.float32)
    check_block(seed, final, **case)


@full_only
@pytest.mark.parametrize("order,lr_kind,momentum,muon_steps,initial_state,dtype", list(itertools.product(
    ORDERS, LR_KINDS, (False, True), (0, 5), (False, True), (torch.float32, torch.bfloat16))))
def test_block_op_every_option_combination(order, lr_kind, momentum, muon_steps, initial_state, dtype):
    seed = zlib.crc32(repr((order, lr_kind, momentum, muon_steps, initial_state, dtype)).encode())
    check_block(seed, True, B=2, T=29, H=2, Dk=13, Dv=9, C=8, order=order, lr_kind=lr_kind, momentum=momentum,
                muon_steps=muon_steps, initial_state=initial_state, dtype=dtype)


@full_only
@settings(max_examples=25, deadline=None)
@given(c=block_shapes, bf16=st.booleans())
def test_block_op_random_shapes_full(c, bf16):
    seed, final, case = _draw_block(c, torch.bfloat16 if bf16 else torch.float32)
    check_block(seed, final, **case)


@full_only
def test_block_op_at_kernel_tile_sizes():
    """Features and chunks spanning several 64-wide tiles, as on a GPU (two chunks plus a ragged one)."""
    check_block(5, True, B=1, T=300, H=2, Dk=130, Dv=96, C=128, order="exclusive", lr_kind="token", momentum=True,
                muon_steps=5, initial_state=True, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- every tuning candidate

def _tilings(options):
    """The distinct tile sides among a site's candidate configurations (warps and stages do not change what a
    kernel computes)."""
    seen = []
    for c in options:
        if c.tiles not in seen:
            seen.append(c.tiles)
    return seen


def _forcing_each_tiling(sites):
    """One ``forcing`` context per round: round ``i`` launches every site with its ``i``-th tiling (cycling), so
    a few runs cover every tiling of every site."""
    from ttt2la.runtime.triton import tile_tuning
    tilings = {site: _tilings(options) for site, options in sites.items()}
    rounds = max(len(t) for t in tilings.values())
    assert rounds > 1, "the test shape leaves a single tiling: it would test nothing but the default"
    for i in range(rounds):
        yield tile_tuning.forcing(**{site: tile_tuning.Config(t[i % len(t)], 4, 2) for site, t in tilings.items()})


def _gated_layer(kind):
    from ttt2la.zoo import FlaChunkReferenceLayer, FlaReferenceLayer, GatedChunkMemory
    torch.manual_seed(0)
    if kind == "gated memory":
        return GatedChunkMemory(16, 2, chunk=8), "block_linear_attention[triton]", 32
    if kind == "gla by chunks":
        return FlaChunkReferenceLayer(16, 2, "gla", chunk_size=8), "block_linear_attention[triton]", 32
    return FlaReferenceLayer(16, 2, kind), "chunk_linear_attention[triton]", 37


@pytest.mark.parametrize("kind", ["scalar_gate", "vector_gate", "gated memory", "gla by chunks"])
def test_a_converted_gated_layer_runs_its_decay_on_the_kernels(kind):
    """End to end: gated layers converted with ``backend="triton"`` run on the kernels and are the layer's
    function (outputs and every parameter gradient, fp32): flash-linear-attention's reference loops with a
    gate per head or per key channel (a ragged last chunk) on the token-causal op, a memory gated per chunk
    and GLA written chunk by chunk (a decay per state row) on the block op."""
    import ttt2la
    from equivalence import assert_same_function
    layer, op, length = _gated_layer(kind)
    layer = layer.to(DEVICE)
    # converted at batch 1 (the interpreter's time grows with the batch), checked at batch 2
    conv = ttt2la.convert(layer, level=2, backend="triton", example_inputs=(torch.randn(1, 16, 16, device=DEVICE),))
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith(op), report.runtime
    assert_same_function(conv, layer, torch.randn(2, length, 16, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_op_is_right_with_every_tuning_candidate(dtype):
    """Every tiling that tuning may pick for the chunk op's five kernels, on features that span two tiles."""
    from ttt2la.runtime.triton.chunk import feature_configs
    Dk, Dv = (36, 40) if dtype == torch.bfloat16 else (20, 24)
    sites = {"chunk.states": feature_configs(Dk, Dv, dtype), "chunk.output": feature_configs(Dk, Dv, dtype),
             "chunk.states_bwd": feature_configs(Dk, Dv, dtype), "chunk.dqk": feature_configs(Dk, Dv, dtype, 32),
             "chunk.dv": feature_configs(Dk, Dv, dtype)}
    for forced in _forcing_each_tiling(sites):
        with forced:
            check_chunk(21, 16, True, B=1, T=23, H=2, Dk=Dk, Dv=Dv, decay=True, scale=0.3, initial_state=True,
                        dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=full_only)])
def test_channel_decay_is_right_with_every_tuning_candidate(dtype):
    """Every tiling that tuning may pick for the kernels of a decay per key channel, on features that span
    two tiles, with two sub-chunks per chunk."""
    from ttt2la.runtime.triton.channel_decay import key_configs
    from ttt2la.runtime.triton.chunk import feature_configs
    Dk, Dv = (36, 40) if dtype == torch.bfloat16 else (20, 24)
    features = feature_configs(Dk, Dv, dtype)
    sites = {"chunk.states": features, "chunk.states_bwd": features, "channel.output": features,
             "channel.dv": features, "channel.dqkg": feature_configs(Dk, Dv, dtype, 32),
             "channel.scores_bwd": feature_configs(Dv, Dv, dtype), "channel.attention": key_configs(Dk, dtype),
             "channel.dqk_intra": key_configs(Dk, dtype)}
    for forced in _forcing_each_tiling(sites):
        with forced:
            check_chunk(24, 32, True, B=1, T=37, H=1, Dk=Dk, Dv=Dv, decay="channel", scale=0.3,
                        initial_state=True, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_op_is_right_with_every_tuning_candidate(dtype):
    """Every tiling that tuning may pick for the block op's increments and reads, forward and backward
    (per-token ``lr`` and momentum, so the scaled variants run too)."""
    from ttt2la.runtime.triton.block import _gemm_configs
    C, D = (80, 72) if dtype == torch.bfloat16 else (20, 24)
    sites = {"block.increments": _gemm_configs(dtype, "BT", BT=C, BX=D, BY=D),
             "block.read": _gemm_configs(dtype, "BX", BT=C, BX=D, BO=D)}
    for forced in _forcing_each_tiling(sites):
        with forced:
            check_block(22, True, B=1, T=2 * C + 9, H=1, Dk=D, Dv=D, C=C, order="exclusive", lr_kind="token",
                        momentum=True, muon_steps=0, initial_state=True, dtype=dtype)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the device timer is real; this replaces it to run anywhere")
def test_tuning_launches_every_candidate_and_the_op_stays_right(monkeypatch):
    """Tuning on, end to end: every candidate of every chunk-op site is launched into the same buffers
    (a site's launches must only write its own outputs), the fastest is kept (here the smallest tiles, by
    a stand-in timer), and the op's outputs and gradients are still right."""
    from ttt2la.runtime.triton import tile_tuning
    monkeypatch.setattr(tile_tuning, "INTERPRET", False)
    monkeypatch.setattr(tile_tuning, "CHOSEN", {})

    def smallest_tiles_fastest(launch):      # launch: the site's run bound to one configuration
        launch()
        return float(sum(side for _, side in launch.args[0].tiles))

    monkeypatch.setattr(tile_tuning, "_time", smallest_tiles_fastest)
    tile_tuning.tune_kernels(True)
    try:
        check_chunk(23, 16, True, B=1, T=21, H=1, Dk=20, Dv=24, decay=True, scale=0.3, initial_state=True,
                    dtype=torch.float32)
    finally:
        tile_tuning.tune_kernels(None)
    sites = {t.site for t in tile_tuning.CHOSEN.values()}
    assert sites == {"chunk.states", "chunk.output", "chunk.states_bwd", "chunk.dqk", "chunk.dv"}
    for tuned in tile_tuning.CHOSEN.values():
        assert len(tuned.times) > 1 and tuned.chosen == min(tuned.times, key=tuned.times.get)
        assert dict(tuned.chosen.tiles) == {"BK": 16, "BV": 16}, tuned      # not the default 32 × 32


# ----------------------------------------------------------------------------- fused SwiGLU features

def hand_swiglu(x, w0, w2):
    """``silu(x W0) ⊙ (x W2)`` per head, by matmuls on ``[B, H, T, D]``."""
    xh = x.transpose(1, 2)
    a, b = xh @ w0, xh @ w2
    return (a * torch.sigmoid(a) * b).transpose(1, 2)


def swiglu_reference(q, k, v, w0, w2, form="published", **options):
    return hand_block(hand_swiglu(q, w0, w2), hand_swiglu(k, w0, w2), v, form=form, **options)


def check_swiglu(seed, final, *, D, Dh, **case):
    (_, _, v), options = block_case(seed, Dk=Dh, **case)
    g = torch.Generator().manual_seed(seed + 7)
    B, T, H, dtype = case["B"], case["T"], case["H"], case["dtype"]
    q, k = (_rand(g, B, T, H, D).to(dtype) for _ in range(2))
    w0, w2 = ((_rand(g, H, D, Dh) / math.sqrt(D)).to(dtype) for _ in range(2))
    lows = ()
    if options["muon_steps"]:
        lows = tuple((lambda form: lambda *a, **k: swiglu_reference(*a, form=form, **k))(form) for form in NS_FORMS)
    assert_matches(kernels.fused_swiglu_block_linear_attention, swiglu_reference, (q, k, v, w0, w2), options,
                   final, seed, lows)


@pytest.mark.parametrize("order,lr_kind,momentum,muon_steps,T,C,dtype", [
    ("exclusive", "token", True, 5, 37, 8, torch.float32),
    ("full", "feature", False, 0, 21, 8, torch.bfloat16),
    ("inclusive", "feature", True, 5, 37, 8, torch.bfloat16),
])
def test_fused_swiglu_matches_reference(order, lr_kind, momentum, muon_steps, T, C, dtype):
    seed = zlib.crc32(repr((order, lr_kind, T, dtype)).encode())
    check_swiglu(seed, True, B=1, T=T, H=2, D=12, Dh=20, Dv=17, C=C, order=order, lr_kind=lr_kind,
                 momentum=momentum, muon_steps=muon_steps, initial_state=True, dtype=dtype)


@full_only
@pytest.mark.parametrize("order,lr_kind,momentum,muon_steps,dtype", list(itertools.product(
    ORDERS, LR_KINDS, (False, True), (0, 5), (torch.float32, torch.bfloat16))))
def test_fused_swiglu_every_option_combination(order, lr_kind, momentum, muon_steps, dtype):
    seed = zlib.crc32(repr((order, lr_kind, momentum, muon_steps, dtype)).encode())
    check_swiglu(seed, True, B=2, T=29, H=2, D=10, Dh=13, Dv=9, C=8, order=order, lr_kind=lr_kind,
                 momentum=momentum, muon_steps=muon_steps, initial_state=True, dtype=dtype)


@pytest.mark.parametrize("op", ["block", "chunk", "fused_swiglu"])
def test_a_backward_recording_a_graph_is_refused_not_silently_first_order(op):
    """The kernels' backward is not differentiable: a gradient penalty through them would miss
    its second-order terms, so it is refused, naming the torch backend that has them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g).to(DEVICE).requires_grad_(True)
               for _ in range(3))
    if op == "fused_swiglu":
        w0, w2 = (torch.randn(2, 4, 4, generator=g).to(DEVICE).requires_grad_(True)
                  for _ in range(2))
        o, _ = kernels.fused_swiglu_block_linear_attention(q, k, v, w0, w2, chunk_size=4)
    else:
        call = kernels.block_linear_attention if op == "block" else kernels.chunk_linear_attention
        o, _ = call(q, k, v, chunk_size=4)
    first = torch.autograd.grad(o.pow(2).sum(), q, retain_graph=True)[0]
    assert torch.isfinite(first).all()                  # a plain backward runs
    with pytest.raises(UnsupportedTTTError, match="create_graph=True.*backend='torch'"):
        torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)


def test_fused_swiglu_rejects_weights_of_the_wrong_shape():
    x = torch.randn(1, 4, 2, 6, device=DEVICE)
    with pytest.raises(ConversionError, match=r"\[H, D, Dh\]"):
        kernels.fused_swiglu_block_linear_attention(x, x, x, torch.randn(2, 5, 8, device=DEVICE),
                                                    torch.randn(2, 5, 8, device=DEVICE), chunk_size=2)


# ----------------------------------------------------------------------------- supports() and dispatch

def _block_args(dtype=torch.float32, device=DEVICE):
    x = torch.randn(1, 6, 2, 4, dtype=dtype, device=device)
    return (x, x, x), dict(chunk_size=4, order="inclusive")


def test_supports_accepts_what_the_kernels_implement():
    tensors, options = _block_args()
    assert kernels.supports("block", *tensors, **options)
    assert kernels.supports("block_linear_attention", *tensors, lr=torch.rand(1, 6, 2, device=DEVICE), **options)
    assert kernels.supports("chunk", *tensors, log_decay=-torch.rand(1, 6, 2, device=DEVICE))
    assert kernels.supports("chunk", *tensors, log_decay=-torch.rand(1, 6, 2, 4, device=DEVICE))
    w = torch.randn(2, 4, 5, device=DEVICE)
    assert kernels.supports("fused_swiglu", *tensors, w, w, **options)
    decay = torch.rand(1, 2, 2, device=DEVICE)      # the inclusive order's two chunks of 4
    assert kernels.supports("block", *tensors, decay=decay, step_scale=decay, **options)
    assert not kernels.supports("fused_swiglu", *tensors, w, w, decay=decay, **options)


@pytest.mark.parametrize("why,op,change", [
    ("weight norm is torch-only", "block", dict(weight_norm=torch.ones(1, 2, 4))),
    ("unknown option", "block", dict(not_an_option=1)),
    ("float64 inputs", "block", dict(dtype=torch.float64)),
    ("malformed chunk size", "block", dict(chunk_size=0)),
    ("malformed order", "block", dict(order="sideways")),
    ("unknown op", "attention", {}),
    ("block option on the token op", "chunk", dict(order="inclusive")),
    ("decay per key channel of the wrong width", "chunk", dict(log_decay=-torch.rand(1, 6, 2, 3))),
])
def test_supports_refuses_what_the_kernels_do_not_implement(why, op, change):
    change = dict(change)
    tensors, options = _block_args(dtype=change.pop("dtype", torch.float32))
    options.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    if op == "chunk":
        options.pop("chunk_size")
        if "order" not in change:
            options.pop("order")
    assert not kernels.supports(op, *tensors, **options), why


def test_weight_norm_called_directly_is_refused_with_a_reason():
    tensors, options = _block_args()
    with pytest.raises(UnsupportedTTTError, match="weight_norm"):
        kernels.block_linear_attention(*tensors, weight_norm=torch.ones(1, 2, 4, device=DEVICE), **options)


def test_dispatcher_runs_the_kernels_when_asked(monkeypatch):
    from ttt2la.runtime.triton import block as block_module
    launches = []
    increments = block_module.chunk_increments
    monkeypatch.setattr(block_module, "chunk_increments", lambda *a, **k: launches.append(1) or increments(*a, **k))
    tensors, options = _block_args()
    lr = torch.rand(1, 6, 2, device=DEVICE)
    o_triton, _ = dispatched_block(*tensors, backend="triton", lr=lr, **options)
    o_torch, _ = dispatched_block(*tensors, backend="torch", lr=lr, **options)
    assert launches, "backend='triton' did not reach the Triton kernels"
    assert rel_rms_error(o_triton.cpu(), o_torch.cpu()) < TOLERANCE[torch.float32]


def test_supports_is_false_on_cpu_without_the_interpreter(monkeypatch):
    from ttt2la.runtime.triton import support
    monkeypatch.setattr(support, "interpreting", lambda: False)
    x = torch.randn(1, 6, 2, 4)
    assert not kernels.supports("block", x, x, x, chunk_size=4)
    assert not kernels.supports("chunk", x, x, x)


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                        env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


def test_package_imports_and_declines_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, ttt2la.runtime.triton as k\n"
            "x = torch.randn(1, 6, 2, 4)\n"
            "print(k.triton_available(), k.supports('block', x, x, x, chunk_size=4))")
    assert _python(code) == "False False"


# ----------------------------------------------------------------------------- the compiled path

@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above run the compiled kernels themselves")
def test_kernels_compile_for_hopper():
    """The interpreter does not compile: build representative kernels for sm_90 and check they do not spill."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    code = ("from ttt2la.runtime.triton.ahead_of_time import check\n"
            "import torch\n"
            "names = None if {full} else {{'_dqk_bwd_kernel', '_swiglu_increments_kernel', '_dqk_intra_kernel'}}\n"
            "rows = check(dtypes=(torch.bfloat16,), kernels=names)\n"
            "print(len(rows), max(r.spill_bytes or 0 for r in rows))").format(full=FULL)
    count, spills = map(int, _python(code).split())
    assert count >= 2
    assert spills <= 64, f"{spills} bytes of register spills in a bf16 kernel on sm_90"
