"""``convert(compile=...)``: each converted layer's plan under ``torch.compile``.

The compiled plan computes what the eager plan computes, outputs and every gradient; the layer
says in its report that it compiled and, where a compiler failed or its recompile limit was
reached, that it runs eagerly; a backend failing at the example inputs is refused at convert
time; a bad ``compile`` value is refused with what it takes.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import pickle

import pytest
import torch

import ttt2la
import ttt2la.runtime.block
from ttt2la.cli import ran_plans
from ttt2la.testing import TOLERANCE, assert_within_precision_criterion, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, ScanEtaTTTLayer

FP32 = TOLERANCE[torch.float32]


@contextlib.contextmanager
def compiling():
    """TorchDynamo on (the suite turns it off), with fresh caches before and after."""
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        try:
            yield
        finally:
            torch._dynamo.reset()


def _layer(muon: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return LaCTFoldedLayer(16, 2, 4, muon=muon, update_theta=False, weight_norm=False)


def _functions_ran(monkeypatch) -> list:
    """The names of the block op's eager ``out=`` Functions as they run (a compiler traces
    plain products instead, so an empty list means the plan ran compiled)."""
    ran = []
    for function in (ttt2la.runtime.block.ChunkIncrements, ttt2la.runtime.block.ReadStates):
        monkeypatch.setattr(function, "apply", functools.partial(
            lambda apply, name, *args: ran.append(name) or apply(*args),
            function.apply, function.__name__))
    return ran


def _notes(model) -> list[str]:
    return [n for layer in model.ttt2la_report.layers for n in layer.notes]


def _output_and_gradients(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [x, *params])
    return out.detach(), grads


@pytest.mark.parametrize("length", [12, 22])
def test_the_compiled_plan_computes_the_eager_plan_outputs_and_gradients(monkeypatch, length):
    """The plan compiled (aot_eager) against the same conversion run eagerly, at a length of
    whole chunks and one with a partial last chunk: outputs, the input's and every parameter's
    gradient within fp32's bound; the block op's eager Functions do not run, so the compiled
    graph did; the report names the compiler in what ran."""
    layer = _layer()
    example = (torch.randn(1, 12, 16),)
    eager = ttt2la.convert(layer, level=2, example_inputs=example)
    with compiling():
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
        x = torch.randn(2, length, 16)
        ran = _functions_ran(monkeypatch)
        out, grads = _output_and_gradients(compiled, x)
    assert ran == []
    ref, ref_grads = _output_and_gradients(eager, x)
    assert rel_rms_error(out, ref) <= FP32
    for g, r in zip(grads, ref_grads):
        assert rel_rms_error(g, r) <= FP32
    runs = compiled.ttt2la_report.layers[0].runs
    assert runs and all(v.endswith("under torch.compile (aot_eager)") for v in runs.values())
    assert any("runs under torch.compile (aot_eager)" in n for n in _notes(compiled))
    assert not any("torch.compile" in v for v in eager.ttt2la_report.layers[0].runs.values())
    assert ran_plans(compiled, 2).endswith(", under torch.compile (aot_eager)")
    assert "torch.compile" not in ran_plans(eager, 2)


def test_compile_true_means_inductor_and_other_values_are_refused():
    from ttt2la.compiled_plan import compiler_backend
    assert compiler_backend(True) == "inductor"
    assert compiler_backend(None) is None and compiler_backend(False) is None
    layer, example = _layer(), (torch.randn(1, 12, 16),)
    for value, said in ((3, "compile must be None, a bool or a torch.compile backend name"),
                        ("no-such-backend", "names no torch.compile backend")):
        with pytest.raises(ttt2la.InvalidInputError, match=said):
            ttt2la.convert(layer, level=2, example_inputs=example, compile=value)


def _backend(name: str, fail_after: int):
    """A registered backend that compiles ``fail_after`` graphs as aot_eager, then fails."""
    from torch._dynamo import lookup_backend, register_backend
    compiled = []

    def backend(gm, example_inputs):
        if len(compiled) >= fail_after:
            raise RuntimeError("this test's backend refuses the graph")
        compiled.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    register_backend(backend, name)
    return name


def test_a_backend_failing_at_the_example_is_refused_at_convert_time():
    name = _backend("ttt2la_test_refusing", fail_after=0)
    with compiling(), pytest.raises(ttt2la.CompileError) as e:
        ttt2la.convert(_layer(), level=2, example_inputs=(torch.randn(1, 12, 16),),
                       compile=name)
    message = str(e.value)
    assert "this test's backend refuses the graph" in message
    assert "convert without compile=" in message


def test_a_backend_failing_later_leaves_the_layer_eager_and_the_report_says_so():
    """The backend compiles the example's graph, then fails on a new shape: that call's output
    is the eager plan's, and the layer runs eagerly from then on, as its fallbacks say."""
    name = _backend("ttt2la_test_failing_later", fail_after=1)
    layer, example = _layer(), (torch.randn(1, 12, 16),)
    eager = ttt2la.convert(layer, level=2, example_inputs=example)
    x = torch.randn(3, 20, 16)
    with compiling(), torch.no_grad():
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile=name)
        out = compiled(x)
    with torch.no_grad():
        assert rel_rms_error(out, eager(x)) <= FP32
    fallbacks = compiled.ttt2la_report.layers[0].fallbacks
    assert any("failed on a call" in v and "runs eagerly since" in v for v in fallbacks.values())


def test_past_the_recompile_limit_new_shapes_run_eagerly_and_the_report_says_so(monkeypatch):
    layer, example = _layer(), (torch.randn(1, 12, 16),)
    with compiling(), torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
        ran = _functions_ran(monkeypatch)
        compiled(torch.randn(1, 12, 16))
        assert ran == []                        # the example's shape: compiled
        compiled(torch.randn(2, 16, 16))
        assert ran                              # a second shape, past a limit of one: eager
    fallbacks = compiled.ttt2la_report.layers[0].fallbacks
    assert any("recompile limit" in v for v in fallbacks.values())


def test_copies_and_unpickled_layers_keep_compiling(monkeypatch):
    layer, example = _layer(), (torch.randn(1, 12, 16),)
    with compiling():
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
        for other in (copy.deepcopy(compiled), pickle.loads(pickle.dumps(compiled))):
            ran = _functions_ran(monkeypatch)
            with torch.no_grad():
                other(torch.randn(2, 12, 16))
            assert ran == []
            monkeypatch.undo()


class _EightsBranch(ScanEtaTTTLayer):
    """TTT-Linear's scan with a branch on the length its plan does not make."""

    def forward(self, x):
        o = super().forward(x)
        return o * 2 if x.shape[1] % 8 else o + 2


def test_a_layer_whose_plan_cannot_be_traced_runs_eagerly_and_says_why():
    torch.manual_seed(0)
    layer = _EightsBranch(16, 2, mini_batch_size=4)
    with compiling():
        compiled = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(1, 12, 16),),
                                  compile="aot_eager")
    assert any("asked for torch.compile, and its plan runs eagerly: its code computes Python "
               "values of the length" in n for n in _notes(compiled))


def test_a_plan_compiled_by_inductor_meets_the_precision_criterion_with_muon():
    """Inductor fuses Newton–Schulz's elementwise steps, rounding differently from the eager
    plan: the compiled conversion is judged like any fp32 one with Muon, against a float64
    evaluation of the same function, no worse than twice the variant as written (outputs and
    every gradient). Skipped where inductor cannot compile (no C++ compiler)."""
    torch.manual_seed(0)
    full = LaCTFoldedLayer(8, 2, 8, muon=True, base_lr=0.3, muon_steps=2)
    variant = LaCTFoldedLayer(8, 2, 8, muon=True, base_lr=0.3, update_theta=False,
                              weight_norm=False, muon_steps=2)
    variant.load_state_dict(full.state_dict())
    x = torch.randn(2, 29, 8)
    with compiling():
        try:
            compiled = ttt2la.convert(full, level=2, example_inputs=(x,), compile=True)
        except ttt2la.CompileError as e:
            pytest.skip(f"inductor cannot compile here: {e}")
        assert_within_precision_criterion(compiled, variant, x)
    runs = compiled.ttt2la_report.layers[0].runs
    assert runs and all(v.endswith("under torch.compile (inductor)") for v in runs.values())


class _Scaled(LaCTFoldedLayer):
    """A layer taking a Python number beside its tensor."""

    def forward(self, x, scale: float):
        return super().forward(x) * scale


def test_calls_with_values_other_than_tensors_run_the_plan_eagerly_and_say_so(monkeypatch):
    torch.manual_seed(0)
    layer = _Scaled(16, 2, 4, update_theta=False, weight_norm=False, muon=False)
    example = (torch.randn(1, 12, 16), 0.5)
    eager = ttt2la.convert(layer, level=2, example_inputs=example)
    with compiling(), torch.no_grad():
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
        x = torch.randn(2, 12, 16)
        ran = _functions_ran(monkeypatch)
        out = compiled(x, 0.5)
    assert ran                                  # the eager block op ran
    with torch.no_grad():
        assert rel_rms_error(out, eager(x, 0.5)) <= FP32
    fallbacks = compiled.ttt2la_report.layers[0].fallbacks
    assert any("values other than tensors" in v for v in fallbacks.values())


def test_with_torchdynamo_off_the_plan_runs_eagerly_and_nothing_claims_it_compiled(monkeypatch):
    """TorchDynamo disabled (as this suite has it) or the stance ``force_eager``: a compiled
    function runs eagerly, so the layer runs its plan eagerly and neither its runs nor the
    conversion's note say it compiled."""
    layer, example = _layer(), (torch.randn(1, 12, 16),)
    off = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
    assert any("it is off here" in n for n in _notes(off))
    with compiling():
        compiled = ttt2la.convert(layer, level=2, example_inputs=example, compile="aot_eager")
    ran = _functions_ran(monkeypatch)
    with torch.no_grad():
        compiled(torch.randn(3, 12, 16))
        off(torch.randn(3, 12, 16))
    assert ran
    for model in (compiled, off):
        runs = model.ttt2la_report.layers[0].runs
        assert runs["batch 3"] and "torch.compile" not in runs["batch 3"]
