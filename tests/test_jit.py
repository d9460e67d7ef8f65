"""A converted layer under TorchScript: ``torch.jit.trace`` of an exact conversion records the
layer's code as written (the trace the original gives, with a warning, once per trace though
its check traces the layer again, and a report entry), a
lossy conversion or a call carrying state is refused by name, and ``torch.jit.script`` of a
converted layer, or of a model holding one, raises ``UnsupportedExportError``.

References: the original layer traced with the same inputs, its trace called at the same
shapes (the trace of either is specialised to the traced length, so both are compared at
another length too).
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import module_scoped
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import GatedChunkMemory, PerTokenInlineTTTLayer, lact_layer

#: Layers traced in this process; LaCT, whose trace crashed the interpreter when the plan's ops
#: were recorded, is traced in a process of its own (``_TWO_TRACES``).
EXACT = {
    "gated memory, level 0": (lambda: GatedChunkMemory(8, 2, 4), 8, 0),
    "per-token layer, level 0": (lambda: PerTokenInlineTTTLayer(8, 2), 8, 0),
}
LENGTH = 16
_PAIRS = module_scoped.cache()


def _pair(name: str):
    """The original layer (float32, evaluation mode) and its conversion at the name's level,
    converted once per module."""
    if name not in _PAIRS:
        make, d, level = EXACT[name]
        torch.manual_seed(0)
        original = make().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = ttt2la.convert(original, level=level,
                                       example_inputs=(torch.randn(2, LENGTH, d),))
        assert converted.ttt2la_report.exact
        _PAIRS[name] = original, converted, d
    return _PAIRS[name]


def _trace(module, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(module, (x,), check_trace=False)


@pytest.mark.parametrize("name", EXACT)
@settings(max_examples=4, deadline=None)
@given(B=st.integers(1, 3), chunks=st.integers(1, 4), grad=st.booleans(), seed=st.integers(0, 99))
def test_jit_trace_of_an_exact_conversion_is_the_originals_trace(name, B, chunks, grad, seed):
    """Traced with or without gradients, an exact conversion runs its code as written: the
    trace computes what the original's trace computes, and a warning and the report's runs say
    the trace holds the code as written."""
    original, converted, d = _pair(name)
    torch.manual_seed(seed)
    x = torch.randn(B, 4 * chunks, d)
    with torch.set_grad_enabled(grad):
        want = _trace(original, x)
        with pytest.warns(RuntimeWarning, match="torch.jit.trace: the trace records the layer's "
                                                "code as written, not its plan"):
            got = _trace(converted, x)
        x2 = torch.randn_like(x)
        assert rel_rms_error(got(x2), want(x2)) <= TOLERANCE[torch.float32]
        assert rel_rms_error(got(x2), original(x2)) <= TOLERANCE[torch.float32]
    assert any(key.endswith("torch.jit.trace") for key in converted._ttt2la.runs)


def test_jit_trace_warns_once_per_trace_though_its_check_traces_again():
    """``torch.jit.trace`` checks its trace by tracing the layer again (``check_trace``, on by
    default): the layer's warning is given once per trace, the check's trace included."""
    original, converted, d = _pair("gated memory, level 0")
    x = torch.randn(2, 8, d)
    with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.jit.trace(converted, (x,))
    ours = [w for w in seen if "torch.jit.trace: the trace records" in str(w.message)]
    assert len(ours) == 2, [str(w.message) for w in ours]


def _outcome(traced, x):
    """``traced(x)``, or its error's type and last line where it raises."""
    try:
        return traced(x)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"


@pytest.mark.parametrize("name", EXACT)
def test_a_traced_conversion_at_another_length_computes_what_the_originals_trace_does(name):
    """A trace is specialised to the traced length (the loop is unrolled there), for the
    original and the converted layer alike: at another length both raise the same error where
    one does (a token loop unrolled past a shorter sequence's end), else both compute the same
    thing where the unrolled loop reaches (a shorter sequence whole, a longer one's first
    traced-length tokens: past them a buffer the code allocates is left uninitialised by
    either trace)."""
    original, converted, d = _pair(name)
    torch.manual_seed(1)
    x = torch.randn(2, LENGTH, d)
    with torch.no_grad():
        want, got = _trace(original, x), _trace(converted, x)
        for L in (LENGTH // 2, 2 * LENGTH):
            x2 = torch.randn(2, L, d)
            expected, actual = _outcome(want, x2), _outcome(got, x2)
            if isinstance(expected, str):
                assert actual == expected
                continue
            reached = min(L, LENGTH)
            assert rel_rms_error(actual[:, :reached],
                                 expected[:, :reached]) <= TOLERANCE[torch.float32]


def test_jit_trace_of_a_lossy_conversion_is_refused_by_name():
    """A lossy conversion computes another function than the code as written, which is all
    the tracer can record: the trace is refused, naming torch.export for the plan (two
    Newton–Schulz steps: the refusal, not the iteration, is under test)."""
    torch.manual_seed(0)
    original = lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4,
                          muon_steps=2).eval()
    x = torch.randn(2, LENGTH, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted = ttt2la.convert(original, level=3, example_inputs=(x,))
    assert not converted.ttt2la_report.exact
    with torch.no_grad(), pytest.raises(ttt2la.UnsupportedTTTError,
                                        match="torch.jit.trace.*lossy.*torch.export.export"):
        _trace(converted, x)


def test_jit_trace_of_a_call_carrying_state_is_refused():
    """The code as written carries no state between calls, so a traced call asking for the
    state after it raises ``StreamingError``."""
    original, converted, d = _pair("gated memory, level 0")
    x = torch.randn(2, LENGTH, d)
    with torch.no_grad(), pytest.raises(ttt2la.StreamingError, match="torch.jit.trace"):
        torch.jit.trace(lambda t: converted(t, return_ttt_state=True)[0], (x,),
                        check_trace=False)


class _Holder(torch.nn.Module):
    """A model holding a converted layer after a projection of its own."""

    def __init__(self, inner: torch.nn.Module, d: int):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.proj(x))


def test_jit_trace_of_a_model_holding_a_converted_layer_is_the_originals_trace():
    """The tracer calls a converted submodule's forward too: a model holding an exact
    conversion traces as the model holding the original does."""
    original, converted, d = _pair("gated memory, level 0")
    torch.manual_seed(2)
    want_model = _Holder(original, d)
    got_model = _Holder(converted, d)
    got_model.proj.load_state_dict(want_model.proj.state_dict())
    x = torch.randn(2, LENGTH, d)
    with torch.no_grad():
        want = _trace(want_model, x)
        with pytest.warns(RuntimeWarning, match="torch.jit.trace"):
            got = _trace(got_model, x)
        x2 = torch.randn_like(x)
        assert rel_rms_error(got(x2), want(x2)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("holder", [False, True], ids=["layer", "model holding it"])
def test_jit_script_of_a_converted_layer_is_refused_by_name(holder):
    """``torch.jit.script`` compiles Python source, and a converted layer's forward is the
    package's: the layer, or a model holding it, is refused with ``UnsupportedExportError``
    saying what to use instead."""
    _, converted, d = _pair("gated memory, level 0")
    target = _Holder(converted, d) if holder else converted
    with pytest.raises(ttt2la.UnsupportedExportError,
                       match="torch.jit.script cannot compile.*gated_memory.py.*torch.jit.trace"):
        torch.jit.script(target)


#: Traces of converted layers one after the other in one process, each printing the relative
#: error of its trace's output against the original's trace: a gated memory, then LaCT variant
#: 2 (exact at levels 0 and 2), without gradients and with.
_TWO_TRACES = """
import warnings, torch, ttt2la
from ttt2la.testing import rel_rms_error
from ttt2la.zoo import GatedChunkMemory, lact_layer
warnings.simplefilter("ignore")
lact = lambda: lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4, muon_steps=2)
for make, d, level, grad in [(lambda: GatedChunkMemory(8, 2, 4), 8, 0, False),
                             (lact, 16, 0, False), (lact, 16, 2, False), (lact, 16, 2, True)]:
    torch.manual_seed(0)
    original = make().eval()
    x = torch.randn(2, 16, d)
    converted = ttt2la.convert(original, level=level, example_inputs=(x,))
    assert converted.ttt2la_report.exact
    with torch.set_grad_enabled(grad):
        want = torch.jit.trace(original, (x,), check_trace=False)
        got = torch.jit.trace(converted, (x,), check_trace=False)
        x2 = torch.randn_like(x)
        print(rel_rms_error(got(x2), want(x2)), flush=True)
"""


def test_converted_layers_traced_one_after_the_other_give_the_originals_traces():
    """Conversions traced one after the other in one process, with and without gradients:
    each trace computes what the original's does, and none is hurt by the one before (run
    apart, so a crash of the interpreter fails this test only)."""
    run = subprocess.run([sys.executable, "-c", _TWO_TRACES], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    errors = [float(line) for line in run.stdout.split()]
    assert len(errors) == 4 and all(e <= TOLERANCE[torch.float32] for e in errors), run.stdout
