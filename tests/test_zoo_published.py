"""The LaCT layer written like its published operator (compiled, heads folded into the batch by the
caller, bf16 Newton–Schulz): it matches a reference written here with autograd, and it converts.

Level 0 refuses it (Θ is updated); level k equals the same layer built as variant k and run by its
own loop. Precision is judged as the project judges it: without Muon in fp32 to 1e-5; with Muon in
float64 (Newton–Schulz switched to float64) to 1e-10; and with the published bf16 Newton–Schulz in
fp32 against a float64 evaluation of the same function, where the converted layer may err at most
twice as much as the variant run as written, plus 1e-6 — outputs and every gradient, as medians
over several inputs (``ttt2la.testing.assert_no_worse_than_original``).
"""
from __future__ import annotations

import inspect
import math

import pytest
import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, assert_no_worse_than_original, drawn_after, rel_rms_error
from ttt2la.zoo import LaCTPublishedLayer, lact_layer
from ttt2la.zoo import lact_published

VARIANT = {1: dict(update_theta=False), 2: dict(update_theta=False, weight_norm=False)}
H, D = 2, 4
CHUNK = {"fp32": 5, "fp64": 8, "bf16-ns": 8}          # Muon wants full-rank chunk updates (C > D)


def _build(mode: str, momentum: bool, seed: int, **variant) -> LaCTPublishedLayer:
    """The layer in a precision mode: fp32 without Muon, float64 with float64 Newton–Schulz, or
    fp32 with the published bf16 Newton–Schulz."""
    torch.manual_seed(seed)
    muon = mode != "fp32"
    ns_dtype = torch.float64 if mode == "fp64" else torch.bfloat16
    layer = LaCTPublishedLayer(H * D, H, CHUNK[mode], momentum=momentum, muon=muon, base_lr=0.3,
                               ns_dtype=ns_dtype, **variant)
    with torch.no_grad():
        layer.ttt_norm.weight.uniform_(0.5, 1.5)
    return layer.to(torch.float64 if mode == "fp64" else torch.float32)


_converted = module_scoped.cache()


def _layers(mode: str, momentum: bool, level: int):
    """(variant-`level` layer, converted full layer, float64 evaluation of the variant), cached:
    a conversion traces the layer; the full layer's traces are shared between the levels."""
    key = (mode, momentum, level)
    if key not in _converted:
        seed = 17 + 2 * level + momentum
        full = _build(mode, momentum, seed)
        variant = _build(mode, momentum, seed, **VARIANT[level])
        variant.load_state_dict(full.state_dict())
        exact = None
        if mode == "bf16-ns":
            exact = _build("fp64", momentum, seed, **VARIANT[level])
            exact.load_state_dict(full.state_dict())
            exact = exact.to(torch.float64)
        dtype = next(full.parameters()).dtype
        x = torch.randn(2, 3 * CHUNK[mode] + 5, H * D, dtype=dtype)
        conv = ttt2la.convert(full, level=level, example_inputs=(x,))
        _converted[key] = (variant, conv, exact)
    return _converted[key]


def _outputs_and_grads(module, x, seed=3):
    """Output and the gradients of a fixed random projection of it w.r.t. x and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    names = ["x", *(n for n, _ in module.named_parameters())]
    grads = torch.autograd.grad((y.double() * w).sum(), [x, *module.parameters()],
                                allow_unused=True)
    return {"output": y, **dict(zip(names, grads))}


def _zero(t) -> bool:
    """An unused (None) or exactly zero gradient."""
    return t is None or float(t.detach().abs().max()) == 0.0


def _compare(got: dict, ref: dict, bound):
    """Every entry of ``got`` within ``bound(name, error)`` of ``ref``. A gradient that is unused
    (None) or exactly zero on one side must be so on the other, and is not judged further: e.g.
    momentum's, when a sequence has one chunk update only and the momentum it scales is still
    zero (one side may compute the zeros, the other leave the parameter unused)."""
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        g = got[name]
        if _zero(r) or _zero(g):
            assert _zero(r) and _zero(g), name
            continue
        bound(name, rel_rms_error(g, r))


configs = st.tuples(st.sampled_from(["fp32", "fp64", "bf16-ns"]), st.booleans())
HEAVY = settings(max_examples=5, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _check_level(level: int, mode: str, momentum: bool, B: int, L: int):
    variant, conv, exact = _layers(mode, momentum, level)
    assert conv.ttt2la_report.layers[0].schedule == ("parallel" if level == 2 else "semi-parallel")
    dtype = next(variant.parameters()).dtype
    x = torch.randn(B, L, H * D, dtype=torch.float64)
    if mode != "bf16-ns":
        tol = TOLERANCE[dtype]

        def within_tolerance(name, err):
            assert err <= tol, f"{name}: {err:.3g} > {tol:g}"
        _compare(_outputs_and_grads(conv, x.to(dtype)), _outputs_and_grads(variant, x.to(dtype)),
                 within_tolerance)
        return
    # rounding in bf16 Newton–Schulz is a random draw per input: judge medians over inputs
    inputs = drawn_after(x, torch.Generator().manual_seed(B * 1000 + L))

    def errors_on(i):
        ref = _outputs_and_grads(exact, inputs(i))
        errors = {"converted": {}, "original": {}}
        for side, module in (("converted", conv), ("original", variant)):
            _compare(_outputs_and_grads(module, inputs(i).to(dtype)), ref,
                     lambda name, err, side=side: errors[side].__setitem__(name, err))
        assert errors["converted"].keys() == errors["original"].keys()
        return {name: (err, errors["original"][name]) for name, err in errors["converted"].items()}

    assert_no_worse_than_original(errors_on)


def _length(mode: str, n: int) -> int:
    """A length in 1 .. 5C+7 for the mode's chunk size C."""
    return 1 + (n - 1) % (5 * CHUNK[mode] + 7)


@HEAVY
@example(cfg=("bf16-ns", True), B=3, n=29)
@example(cfg=("fp64", False), B=1, n=17)
@example(cfg=("fp32", True), B=1, n=9)      # one chunk update: momentum still zero
@given(cfg=configs, B=st.integers(1, 4), n=st.integers(1, 47))
def test_level2_equals_variant2_run_by_its_own_loop(cfg, B, n):
    mode, momentum = cfg
    _check_level(2, mode, momentum, B, _length(mode, n))


@HEAVY
@example(cfg=("bf16-ns", True), B=2, n=15)   # one chunk update: momentum's gradient exactly zero
@example(cfg=("bf16-ns", False), B=2, n=40)
@example(cfg=("fp64", True), B=4, n=20)
@example(cfg=("fp32", False), B=1, n=3)     # shorter than a chunk: only read
@given(cfg=configs, B=st.integers(1, 4), n=st.integers(1, 47))
def test_level1_equals_variant1_run_by_its_own_loop(cfg, B, n):
    mode, momentum = cfg
    _check_level(1, mode, momentum, B, _length(mode, n))


def _lines_assigning(name: str) -> list[int]:
    """Source lines of the operator that assign ``name`` (its update, its weight norm)."""
    lines, start = inspect.getsourcelines(lact_published.block_causal_swiglu_ttt)
    return [start + i for i, line in enumerate(lines) if line.strip().startswith(f"{name} = ")]


def test_level0_refuses_and_names_the_theta_update_with_its_line():
    layer = _build("bf16-ns", True, 0)
    with pytest.raises(ttt2la.NonReducibleError) as info:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 29, H * D),))
    err = info.value
    assert err.state in ("w0", "w2")
    assert "Θ" in str(err) and "freeze_theta" in str(err)
    assert any(f"lact_published.py:{line} " in str(err) for line in _lines_assigning(err.state))
    assert err.where and "lact_published.py:" in err.where


def test_the_operator_submodule_gets_heads_folded_by_the_caller():
    layer = _build("fp32", True, 0)
    seen = {}
    layer.ttt.register_forward_pre_hook(lambda m, args: seen.update(q=args[0].shape))
    layer(torch.randn(3, 7, H * D))
    assert seen["q"] == (3 * H, 7, D)
    assert lact_published.orthogonalize(torch.randn(2, 3, 5)).dtype == torch.bfloat16
    assert lact_layer("published", d_model=8, num_heads=2, chunk_size=4).ttt.ns_dtype == torch.bfloat16


# -- the layer itself, against a reference written with autograd --------------------------------

def _reference(layer: LaCTPublishedLayer, x: torch.Tensor) -> torch.Tensor:
    """The published layer's math, head by head and chunk by chunk, with the fast-weight gradient
    of its inner loss (the binding score, or the squared error) taken by autograd and
    Newton–Schulz written from its five literal triples (float64)."""
    ttt = layer.ttt
    Bsz, L, _ = x.shape
    C = ttt.chunk_size
    steps = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))

    def ns(G):
        X = G.mT if G.shape[0] > G.shape[1] else G
        X = X / (torch.linalg.matrix_norm(X) + 1e-7)
        for a, b, c in steps[:ttt.muon_steps]:
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
        return X.mT if G.shape[0] > G.shape[1] else X

    def mlp(W, xs):                      # rows xs [n, d] -> [n, d]
        w0, w1, w2 = W
        return (F.silu(xs @ w0.mT) * (xs @ w2.mT)) @ w1.mT

    qkv = layer.qkv(x)
    q, k, v = (F.silu(t) for t in qkv.view(Bsz, L, 3, H, D).unbind(2))
    q = q / (q.norm(dim=-1, keepdim=True) + 1e-5)
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-5)
    lr = F.softplus(layer.lr_proj(x) + math.log(math.expm1(0.3))).view(Bsz, L, H, 3)
    mom = layer.momentum_proj(x) if layer.use_momentum else None
    out = torch.zeros(Bsz, L, H, D, dtype=x.dtype)
    for b in range(Bsz):
        for h in range(H):
            W = [ttt.w0[h], ttt.w1[h], ttt.w2[h]]
            norms = [w.norm(dim=1, keepdim=True) for w in W]
            M = [torch.zeros_like(w) for w in W]
            n_updates = max(0, math.ceil(L / C) - 1)
            for j in range(n_updates + 1):
                s, e = j * C, min(L, (j + 1) * C)
                out[b, s:e, h] = mlp(W, q[b, s:e, h])
                if j == n_updates:
                    break
                Wd = [w.detach().requires_grad_(True) for w in W]
                grads = []
                for i in range(3):       # each matrix's lr weights its own binding score
                    fk, vs = mlp(Wd, k[b, s:e, h]), v[b, s:e, h]
                    # ascend <f(k), v>, or descend 0.5 ||f(k) - v||^2
                    fit = fk * vs if ttt.inner_loss == "dot" else -0.5 * (fk - vs).square()
                    score = (fit * lr[b, s:e, h, i:i + 1]).sum()
                    grads.append(torch.autograd.grad(score, Wd[i], create_graph=False)[0])
                for i in range(3):
                    if i != 1 and not ttt.update_theta:
                        continue
                    g = grads[i]
                    if mom is not None:
                        g = g + M[i] * mom[b, s:e, h].mean()
                        M[i] = g
                    if ttt.use_muon:
                        g = ns(g)
                    W[i] = W[i] + g
                    if ttt.weight_norm:
                        W[i] = W[i] / (W[i].norm(dim=1, keepdim=True) + 1e-5) * norms[i]
    o = F.rms_norm(out, (D,), layer.ttt_norm.weight, eps=1e-6)
    return layer.o_proj(o.reshape(Bsz, L, H * D))


@settings(max_examples=12, deadline=None)
@given(switches=st.fixed_dictionaries({**{k: st.booleans() for k in
                                          ("update_theta", "weight_norm", "momentum", "muon")},
                                       "inner_loss": st.sampled_from(["dot", "mse"])}),
       B=st.integers(1, 2), C=st.integers(2, 5), data=st.data())
def test_layer_matches_a_reference_written_with_autograd(switches, B, C, data):
    L = data.draw(st.integers(1, 4 * C + 3), label="L")
    torch.manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    layer = LaCTPublishedLayer(H * D, H, C, base_lr=0.3, ns_dtype=torch.float64,
                               **switches).double()
    x = torch.randn(B, L, H * D, dtype=torch.float64)
    assert rel_rms_error(layer(x), _reference(layer, x)) <= TOLERANCE[torch.float64]


@pytest.mark.parametrize("dtype,ns_dtype", [(torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16),
                                            (torch.float32, torch.float32)])
def test_newton_schulz_iterates_in_the_dtype_the_code_iterates_in(monkeypatch, dtype, ns_dtype):
    """Precision follows the source: in a bf16 model whose orthogonalisation casts to bf16 (a no-op
    on bf16 values, so the trace holds no cast) the converted layer iterates in bf16, not in the
    op's fp32 accumulation dtype; an fp32 model's cast to bf16 is kept, and fp32 stays fp32."""
    from ttt2la.runtime import block as torch_block
    torch.manual_seed(0)
    layer = LaCTPublishedLayer(32, 2, 8, muon_steps=3, ns_dtype=ns_dtype).to(dtype).eval()
    x = torch.randn(1, 32, 32, dtype=dtype)
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert conv.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")
    seen = []
    original = torch_block.newton_schulz

    def spy(G, *args, dtype=None, **kwargs):
        seen.append(dtype or G.dtype)   # the dtype it iterates in (None: G's)
        return original(G, *args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch_block, "newton_schulz", spy)
    with torch.no_grad():
        conv(x)
    assert seen == [ns_dtype]


def test_a_compiled_variant_with_bf16_newton_schulz_converts_exactly():
    """Variant 2 written with ``torch.compile`` (LaCT's release compiles its operator) and its
    bf16 Newton–Schulz: every pass is already satisfied, so the conversion is exact and checked
    step by step; the compiled original rounds the bf16 iteration differently from its own ops run
    eagerly, so the check compares the traced program with the original run eagerly (it used to
    refuse this conversion as a bug)."""
    torch.manual_seed(0)
    layer = LaCTPublishedLayer(16, 2, 8, update_theta=False, weight_norm=False, muon_steps=5).eval()
    x = torch.randn(1, 32, 16)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        with torch.no_grad():
            compiled_out = layer(x)
        conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    report = conv.ttt2la_report.layers[0]
    assert report.runtime.startswith("block_linear_attention")
    assert all(p.status == "already_satisfied" for p in report.passes)
    with torch.no_grad():
        assert rel_rms_error(compiled_out, layer(x)) > 1e-4    # the two roundings do differ here
    exact = LaCTPublishedLayer(16, 2, 8, update_theta=False, weight_norm=False, muon_steps=5,
                               ns_dtype=torch.float64)
    exact.load_state_dict(layer.state_dict())
    exact = exact.double().eval()
    inputs = drawn_after(x.double(), torch.Generator().manual_seed(1))

    @torch.no_grad()
    def errors_on(i):
        ref = exact(inputs(i))
        return {"output": (rel_rms_error(conv(inputs(i).float()), ref),
                           rel_rms_error(layer(inputs(i).float()), ref))}

    assert_no_worse_than_original(errors_on)


def test_conversion_does_not_compile_the_code_as_written(monkeypatch):
    """LaCT's release compiles its operator; converting it traces and checks its eager ops, so the
    conversion compiles nothing (an inductor compile of the operator was most of the time a
    conversion took), while the layer as written still compiles when the user calls it."""
    compiled = []

    def recording(gm, _inputs):
        compiled.append(gm)
        return gm.forward

    for name in ("silu_grad", "unit_rows", "orthogonalize", "block_causal_swiglu_ttt"):
        fn = getattr(lact_published, name)._torchdynamo_orig_callable
        monkeypatch.setattr(lact_published, name, torch.compile(fn, backend=recording))
    torch.manual_seed(0)
    layer = LaCTPublishedLayer(16, 2, 8, update_theta=False, weight_norm=False).eval()
    x = torch.randn(1, 32, 16)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
        assert compiled == []
        with torch.no_grad():
            layer(x)
        assert compiled                 # the user's own calls still compile
        torch._dynamo.reset()
    assert conv.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")


# -- the authors' squared-error variant: a delta rule, refused where it must be ------------------

def _mse(muon: bool, **variant) -> LaCTPublishedLayer:
    torch.manual_seed(5)
    return LaCTPublishedLayer(H * D, H, CHUNK["fp64"], base_lr=0.3, muon=muon,
                              ns_dtype=torch.float64, inner_loss="mse", **variant).double()


@pytest.mark.parametrize("level", [1, 2])
def test_a_squared_error_with_muon_names_newton_schulz_and_its_remedy(level):
    """Trained on ``0.5‖f(k) − v‖²``, the final layer's step reads the final layer, and Muon
    orthogonalises it: its normalisation makes the update nonlinear in the state. The refusal
    names that line and ``remove_muon`` as the pass that removes it; ``strict=False`` runs the
    loop recurrently, exactly."""
    layer = _mse(True)
    x = torch.randn(2, 5 * CHUNK["fp64"], H * D, dtype=torch.float64)
    with pytest.raises(ttt2la.NonReducibleError) as refused:
        ttt2la.convert(layer, level=level, example_inputs=(x,))
    error = refused.value
    file, line = error.where.rsplit(":", 1)
    assert error.state == "w1" and file == "zoo/lact_published.py"
    body, first = inspect.getsourcelines(lact_published.orthogonalize)   # Newton–Schulz
    assert first < int(line) < first + len(body)
    assert "remove_muon (level >= 6)" in error.remedy
    kept = ttt2la.convert(layer, level=level, example_inputs=(x,), strict=False)
    assert kept.ttt2la_report.layers[0].schedule == "recurrent"
    variant = _mse(True, **VARIANT[level])
    variant.load_state_dict(layer.state_dict())
    assert rel_rms_error(kept(x), variant(x)) <= TOLERANCE[torch.float64]


def test_a_squared_error_without_muon_converts_exactly_at_level_2():
    """Without Muon the squared error's step is affine in the state (a delta rule over chunks):
    level 2 converts it, equal to variant 2 run by its own loop, outputs and every gradient."""
    layer = _mse(False)
    variant = _mse(False, **VARIANT[2])
    variant.load_state_dict(layer.state_dict())
    x = torch.randn(2, 5 * CHUNK["fp64"], H * D, dtype=torch.float64)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    for xs in (x, torch.randn(3, 3 * CHUNK["fp64"] + 2, H * D, dtype=torch.float64)):
        got, ref = _outputs_and_grads(converted, xs), _outputs_and_grads(variant, xs)
        _compare(got, ref, _within(TOLERANCE[torch.float64]))


def _within(tol: float):
    """A ``_compare`` bound: every error at most ``tol``."""
    def bound(name, error):
        assert error <= tol, f"{name}: {error:.3g}"
    return bound
