"""``ttt2la.convert`` end to end on the zoo layers: exactness against the variants each level
must equal, refusals, training, dtype and shape coverage.

A model trained as variant k converts exactly at level k, so the reference for level k on a full
LaCT layer is the same layer built as variant k (same state_dict) and run by its own Python loop.
Conversions are cached per layer configuration (they trace the layer); hypothesis then draws the
configuration from a small set and the batch size and length freely, since the converted layer
must work at any (B, L) without being converted again.

With Muon on, the comparison runs in float64 at the float64 tolerance: Newton–Schulz amplifies
rounding in the small singular directions of a chunk update, so two correct fp32
implementations of the same Muon step (the zoo's loop and the runtime's batched one) can differ
by more than 1e-5 in gradients — a property of Muon, not of the conversion. float64 shows the
conversion is exact; without Muon the check runs in fp32 at 1e-5.
"""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTHeadsLayer, PerTokenTTTLayer, TinyLaCTLM

FP32 = TOLERANCE[torch.float32]
STYLES = {"folded": LaCTFoldedLayer, "heads": LaCTHeadsLayer}
VARIANT = {1: dict(update_theta=False), 2: dict(update_theta=False, weight_norm=False)}

_converted: dict = {}


def _dtype(muon: bool) -> torch.dtype:
    return torch.float64 if muon else torch.float32


def _layers(style, H, D, C, momentum, muon, level):
    """(full layer, variant-`level` layer with the same weights, converted full layer)."""
    key = (style, H, D, C, momentum, muon, level)
    if key not in _converted:
        torch.manual_seed(hash(key) % 2**31)
        cls = STYLES[style]
        dtype = _dtype(muon)
        full = cls(H * D, H, C, momentum=momentum, muon=muon, base_lr=0.3).to(dtype)
        variant = cls(H * D, H, C, momentum=momentum, muon=muon, base_lr=0.3,
                      **VARIANT[level]).to(dtype)
        variant.load_state_dict(full.state_dict())
        x = torch.randn(2, 3 * C + 5, H * D, dtype=dtype)
        conv = ttt2la.convert(full, level=level, example_inputs=(x,))
        _converted[key] = (full, variant, conv)
    return _converted[key]


def _outputs_and_grads(module, x):
    x = x.clone().requires_grad_(True)
    out = module(x)
    params = [p for p in module.parameters()]
    weight = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * weight).sum(), [x, *params], allow_unused=True)
    return out, dict(zip(["x", *[n for n, _ in module.named_parameters()]], grads))


def _assert_equal(conv, ref, x):
    tol = TOLERANCE[x.dtype]
    out_c, g_c = _outputs_and_grads(conv, x)
    out_r, g_r = _outputs_and_grads(ref, x)
    assert rel_rms_error(out_c, out_r) <= tol
    for name, g in g_r.items():
        if g is None:                   # unused at this length (e.g. no update when L <= C)
            assert g_c[name] is None or float(g_c[name].abs().max()) == 0.0
            continue
        assert g_c[name] is not None, name
        assert rel_rms_error(g_c[name], g) <= tol, name


configs = st.sampled_from(["folded", "heads"]).flatmap(lambda style: st.tuples(
    st.just(style), st.sampled_from([1, 2]), st.sampled_from([4, 6]),
    st.booleans(), st.booleans()))


# each example converts a layer (it traces it): no shrinking, which would convert many more
HEAVY = settings(max_examples=6, deadline=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate])


@HEAVY
@given(cfg=configs, B=st.integers(1, 3), data=st.data())
def test_level2_equals_variant2_run_recurrently(cfg, B, data):
    style, H, D, momentum, muon = cfg
    C = 8 if muon else data.draw(st.sampled_from([3, 8]))
    L = data.draw(st.integers(1, 5 * C + 7))
    full, variant, conv = _layers(style, H, D, C, momentum, muon, 2)
    layer = conv.ttt2la_report.layers[0]
    assert layer.schedule == "parallel"
    assert [p.status for p in layer.passes] == ["applied", "applied"]
    _assert_equal(conv, variant, torch.randn(B, L, H * D, dtype=_dtype(muon)))


@HEAVY
@given(cfg=configs, B=st.integers(1, 3), data=st.data())
def test_level1_runs_semi_parallel_and_equals_variant1(cfg, B, data):
    style, H, D, momentum, muon = cfg
    C = 8 if muon else 5
    L = data.draw(st.integers(1, 5 * C + 7))
    full, variant, conv = _layers(style, H, D, C, momentum, muon, 1)
    assert conv.ttt2la_report.layers[0].schedule == "semi-parallel"
    _assert_equal(conv, variant, torch.randn(B, L, H * D, dtype=_dtype(muon)))


@pytest.mark.parametrize("style", ["folded", "heads"])
def test_level0_refuses_the_full_layer_and_names_the_theta_update(style):
    torch.manual_seed(0)
    layer = STYLES[style](16, 2, 4)
    x = torch.randn(2, 19, 16)
    with pytest.raises(ttt2la.NonReducibleError) as info:
        ttt2la.convert(layer, level=0, example_inputs=(x,))
    err = info.value
    assert "Θ" in str(err) and "freeze_theta" in str(err)
    source = STYLES[style].__module__.split(".")[-1] + ".py:"
    assert source in str(err) and err.where and source in err.where
    assert err.state in ("w0", "w2", "W0", "W2", "dW0", "dW2", "dw0", "dw2")


@pytest.mark.parametrize("style", ["folded", "heads"])
def test_level0_non_strict_keeps_the_recurrent_executor_exactly(style):
    # the published layer has Muon on: compared in float64 (see the module docstring)
    torch.manual_seed(0)
    layer = STYLES[style](16, 2, 4).double()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 19, 16).double(),),
                          strict=False)
    report = conv.ttt2la_report.layers[0]
    assert report.schedule == "recurrent" and report.exact
    assert any("recurrent" in n for n in report.notes)
    for B, L in [(1, 1), (3, 4), (2, 23), (1, 40)]:
        _assert_equal(conv, layer, torch.randn(B, L, 16, dtype=torch.float64))


@pytest.mark.parametrize("style", ["folded", "heads"])
def test_variant2_layer_converts_exactly_with_both_passes_already_satisfied(style):
    torch.manual_seed(0)
    layer = STYLES[style](16, 2, 8, **VARIANT[2])
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 29, 16),))
    report = conv.ttt2la_report
    assert report.exact
    assert [p.status for p in report.layers[0].passes] == ["already_satisfied"] * 2
    assert all(p.exact for p in report.layers[0].passes)
    assert report.layers[0].check["ok"]
    _assert_equal(conv, layer, torch.randn(3, 45, 16))


@pytest.mark.parametrize("L", [1, 4096])
def test_per_token_layer_is_parallel_and_exact_at_level0(L):
    torch.manual_seed(0)
    layer = PerTokenTTTLayer(32, 2)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 24, 32),))
    report = conv.ttt2la_report.layers[0]
    assert report.schedule == "parallel" and report.exact and report.reducible
    assert "chunk_linear_attention" in report.runtime
    _assert_equal(conv, layer, torch.randn(2, L, 32))


def test_convert_leaves_the_input_model_untouched_and_the_result_trains():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(16, 2, 4)
    before = copy.deepcopy(layer.state_dict())
    x = torch.randn(2, 21, 16)
    out_before = layer(x).detach()
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert type(layer) is LaCTFoldedLayer
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k])
    assert torch.equal(layer(x), out_before)
    assert isinstance(conv, LaCTFoldedLayer)
    assert list(conv.state_dict()) == list(layer.state_dict())
    for p, q in zip(conv.parameters(), layer.parameters()):
        assert p is not q
    # gradients reach every parameter the level-2 layer still uses, an optimizer step moves it
    out = conv(x)
    out.square().mean().backward()
    unused = set()                        # w0/w2 momentum projections stay used; nothing is dropped
    for name, p in conv.named_parameters():
        if name not in unused:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    opt.step()
    assert rel_rms_error(conv(x), out.detach()) > 1e-4


def test_inplace_converts_the_given_model():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(16, 2, 4, **VARIANT[2])
    x = torch.randn(2, 13, 16)
    ref = layer(x).detach()
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,), inplace=True)
    assert conv is layer and type(layer).__name__ == "ConvertedLaCTFoldedLayer"
    assert rel_rms_error(layer(x), ref) <= FP32


def test_bf16_runs_with_a_looser_stated_tolerance():
    torch.manual_seed(0)
    layer = LaCTHeadsLayer(16, 2, 8, muon=False, **VARIANT[2]).to(torch.bfloat16)
    x = torch.randn(2, 27, 16, dtype=torch.bfloat16)
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert conv.ttt2la_report.exact
    y = torch.randn(3, 41, 16, dtype=torch.bfloat16)
    assert conv(y).dtype == torch.bfloat16
    assert rel_rms_error(conv(y), layer(y)) <= TOLERANCE[torch.bfloat16]


def test_language_model_with_an_embedding_needs_no_example_inputs():
    torch.manual_seed(0)
    lm = TinyLaCTLM(50, 16, 2, 2, 8, update_theta=False, weight_norm=False)
    conv = ttt2la.convert(lm, level=2)
    report = conv.ttt2la_report
    assert [layer.module_path for layer in report.layers] == ["blocks.0.ttt", "blocks.1.ttt"]
    assert report.exact and any("inferred" in n for n in report.notes)
    ids = torch.randint(0, 50, (3, 37))
    assert rel_rms_error(conv(ids), lm(ids)) <= FP32


def test_errors_say_what_to_do():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ttt2la.ConversionError, match="example_inputs"):
        ttt2la.convert(mlp)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="no test-time-training loop"):
        ttt2la.convert(mlp, example_inputs=(torch.randn(2, 5, 8),))
    layer = PerTokenTTTLayer(8, 2)
    for bad in (-1, 7, 2.0, True):
        with pytest.raises(ValueError):
            ttt2la.convert(layer, level=bad, example_inputs=(torch.randn(1, 4, 8),))
    for level in (3, 4, 5, 6):
        with pytest.raises(ttt2la.LevelNotImplementedError, match="collapse_mlp"):
            ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 4, 8),))


def test_inspect_reports_what_each_level_gives():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(16, 2, 4)
    report = ttt2la.inspect(layer, example_inputs=(torch.randn(2, 19, 16),))
    (found,) = report.layers
    assert found.loop_src.startswith("zoo/lact_folded.py:")
    assert found.chunk_size == 4 and found.order == "exclusive"
    assert found.last_chunk == "apply_only"
    roles = {s.role for s in found.states}
    assert {"final", "theta", "momentum"} <= roles
    assert found.levels[0].startswith("recurrent")
    assert found.levels[1] == "semi-parallel" and found.levels[2] == "parallel"
    assert all(found.levels[k] == "not implemented" for k in range(3, 7))
    assert "1 TTT layer found" in str(report)
