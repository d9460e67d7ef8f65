"""The plan a converted layer runs is the plan its report names, at every batch size and length.

Converted LaCT layers (Muon and momentum, level 2) must run ``block_linear_attention`` at every
batch size, not only the one they were traced at — checked by the plan's type and by replacing
the runtime op with one that returns zeros, which must change the layer's output. A plan that
cannot be carried over to a new batch size is refused under ``strict=True`` and recorded per
shape otherwise; backends are named as resolved and refused at convert time when they cannot run;
``convert`` catches a wrong lowering at a lossy level; a non-reducible loop kept with
``strict=False`` runs the user's own code.
"""
from __future__ import annotations

import os

import pytest
import module_scoped
import torch
import torch.nn as nn

import ttt2la
import ttt2la.lowering.lift as lift_module
from ttt2la.converted import is_converted
from ttt2la.errors import PlanFallbackError
from ttt2la.lowering import LiftedPlan, LiftedProgram, Plan
from ttt2la.testing import CountOps, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTHeadsLayer

STYLES = {"folded": LaCTFoldedLayer, "heads": LaCTHeadsLayer}
C = 4
LENGTHS = (1, 3, C, 2 * C + 1, 5 * C)
BLOCK = "block_linear_attention[torch]"

_lact = module_scoped.cache()


def _lact_level2(style):
    """A LaCT layer with momentum and Muon (two Newton–Schulz steps), fp32, and its level-2
    conversion (traced at B = 2)."""
    if style not in _lact:
        torch.manual_seed(0)
        layer = STYLES[style](8, 2, C, momentum=True, muon=True, muon_steps=2, base_lr=0.3)
        x = torch.randn(2, 3 * C + 1, 8)
        _lact[style] = layer, ttt2la.convert(layer, level=2, example_inputs=(x,))
    return _lact[style]


def _state(conv):
    return next(m._ttt2la for m in conv.modules() if is_converted(m))


@pytest.mark.parametrize("style", list(STYLES))
def test_the_named_plan_runs_at_every_batch_size_and_length(style):
    _layer, conv = _lact_level2(style)
    report = conv.ttt2la_report.layers[0]
    assert report.runtime == BLOCK
    state = _state(conv)
    for B in (1, 2, 3, 4):
        for L in LENGTHS:
            out = conv(torch.randn(B, L, 8))
            assert out.shape == (B, L, 8) and torch.isfinite(out).all()
        plan = state.loop_for(B).plan
        assert isinstance(plan, LiftedPlan), (B, type(plan))
        assert plan.implementation == BLOCK
        assert report.runs[f"batch {B}"] == BLOCK
    assert report.fallbacks == {}


@pytest.mark.parametrize("style", list(STYLES))
def test_zeroing_the_runtime_op_changes_the_output_at_every_batch_size(style, monkeypatch):
    _layer, conv = _lact_level2(style)
    xs = {B: torch.randn(B, 3 * C + 2, 8, generator=torch.Generator().manual_seed(B))
          for B in (1, 2, 3, 4)}
    with torch.no_grad():
        before = {B: conv(x) for B, x in xs.items()}

    def zeros(phi_q, phi_k, v, *, initial_state=None, **options):
        return torch.zeros_like(v), torch.zeros_like(initial_state)

    monkeypatch.setattr(lift_module, "block_linear_attention", zeros)
    with torch.no_grad():
        for B, x in xs.items():
            assert rel_rms_error(conv(x), before[B]) > 0.1, B


# --- a small layer written here: a linear fast weight, optionally column-normalised ----------

class LinearTTT(nn.Module):
    """Per chunk: ``W ← W + kᵀ(η⊙v)`` (then ``W ← W / ‖W‖_col`` with ``norm``), read ``q W``."""

    def __init__(self, d=6, norm=False):
        super().__init__()
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.lr = nn.Linear(d, 1, bias=False)
        self.w0 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.norm = norm

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        lr = torch.sigmoid(self.lr(x))
        W = self.w0.expand(B, -1, -1)
        outs = []
        for s in range(0, L, C):
            W = W + k[:, s:s + C].transpose(1, 2) @ (v[:, s:s + C] * lr[:, s:s + C])
            if self.norm:
                W = W / (W.norm(dim=1, keepdim=True) + 1e-5)
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


def _linear(norm=False, **kwargs):
    torch.manual_seed(1)
    layer = LinearTTT(norm=norm)
    return layer, ttt2la.convert(layer, example_inputs=(torch.randn(2, 3 * C, 6),), **kwargs)


def _refuse_resizing(monkeypatch):
    def refuse(self, program):
        raise ttt2la.UnsupportedTTTError("planted: cannot re-size")

    monkeypatch.setattr(LiftedProgram, "resized", refuse)


def test_strict_refuses_a_fallback_at_a_new_batch_size(monkeypatch):
    _layer, conv = _linear()
    assert conv.ttt2la_report.layers[0].runtime == BLOCK
    _refuse_resizing(monkeypatch)
    with pytest.raises(PlanFallbackError, match="strict=True"):
        conv(torch.randn(3, 2 * C, 6))
    assert issubclass(PlanFallbackError, ttt2la.ConversionError)


def test_a_fallback_without_strict_is_recorded_for_its_shape(monkeypatch):
    layer, conv = _linear(strict=False)
    report = conv.ttt2la_report.layers[0]
    _refuse_resizing(monkeypatch)
    x = torch.randn(3, 2 * C + 1, 6)
    assert rel_rms_error(conv(x), layer(x)) <= 1e-5
    assert "batch 3" in report.fallbacks and "planted" in report.fallbacks["batch 3"]
    assert report.runs["batch 3"].startswith("torch.vmap(")
    assert isinstance(_state(conv).loop_for(3).plan, Plan)
    assert "fallback at batch 3" in report.to_markdown()


def test_auto_names_the_backend_that_runs():
    _layer, conv = _linear(backend="auto")
    assert conv.ttt2la_report.layers[0].runtime == BLOCK


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="Triton can run here")
def test_triton_where_it_cannot_run_is_refused_at_convert_time(monkeypatch):
    # on this CPU Triton runs only in its interpreter, which the kernel tests may have switched
    # on for the whole process: say, as on a machine without it, that the kernels cannot run
    from ttt2la.runtime.triton import support
    monkeypatch.setattr(support, "_devices_ok", lambda tensors: False)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="triton"):
        _linear(backend="triton")


def test_generic_plans_honour_the_backend():
    # the column norm keeps the loop semi-parallel at level 1: no runtime op takes it
    layer, conv = _linear(norm=True, level=1, backend="torch")
    assert conv.ttt2la_report.layers[0].runtime.startswith("torch.vmap(semi-parallel")
    _layer, naive = _linear(norm=True, level=1, backend="naive")
    assert naive.ttt2la_report.layers[0].runtime == "torch(recurrent loop)"
    x = torch.randn(2, 2 * C + 3, 6)
    assert rel_rms_error(naive(x), layer(x)) <= 1e-5
    with pytest.raises(ttt2la.UnsupportedTTTError, match="triton"):
        _linear(norm=True, level=1, backend="triton")


def test_convert_catches_a_wrong_lowering_at_a_lossy_level(monkeypatch):
    real = lift_module.block_linear_attention

    def off_by_a_percent(*args, **kwargs):
        o, final = real(*args, **kwargs)
        return o * 1.01, final

    monkeypatch.setattr(lift_module, "block_linear_attention", off_by_a_percent)
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, C, momentum=True, muon=False)
    with pytest.raises(ttt2la.ConversionError, match="lowered plan"):
        ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 3 * C + 1, 8),))


def test_a_non_reducible_loop_kept_without_strict_runs_the_users_code():
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(8, 2, C, momentum=True, muon=True, muon_steps=2)
    x = torch.randn(2, 3 * C + 1, 8)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,), strict=False)
    report = conv.ttt2la_report.layers[0]
    assert report.runtime == "kept as written (recurrent)"
    assert report.schedule == "recurrent"
    assert not any(is_converted(m) for m in conv.modules())
    y = torch.randn(3, 2 * C + 3, 8)
    assert torch.equal(conv(y), layer(y))




def test_the_lifted_plan_does_a_fixed_number_of_ops_whatever_the_length(monkeypatch):
    _layer, conv = _lact_level2("folded")
    state = _state(conv)
    counts = {}
    for L in (4 * C, 32 * C):
        loop = state.loop_for(2)
        seen = []
        handle = loop.register_forward_pre_hook(lambda _m, a: seen.append(a))
        with torch.no_grad():
            conv(torch.randn(2, L, 8))
        handle.remove()
        _given, states0, invariants = loop.plan_inputs(seen[0])
        real = lift_module.block_linear_attention

        def opaque(*args, **kwargs):     # the runtime op's own ops are not the plan's
            with torch.utils._python_dispatch._disable_current_modes():
                return real(*args, **kwargs)

        monkeypatch.setattr(lift_module, "block_linear_attention", opaque)
        with torch.no_grad(), CountOps() as mode:
            loop.plan(states0, invariants)
        monkeypatch.setattr(lift_module, "block_linear_attention", real)
        counts[L] = mode.count
    assert counts[4 * C] == counts[32 * C], counts
