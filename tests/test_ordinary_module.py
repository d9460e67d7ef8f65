"""A converted model is an ordinary module: it deep-copies, pickles (``pickle``, ``torch.save``),
refuses to be converted again with a clear error, and compiles with
``torch.compile(fullgraph=True)``.

References are the original models (the zoo's own code) or the converted model before the
copy; the language model is converted once per module.
"""
from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch

import ttt2la
import ttt2la.lowering.specialize
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTHeadsLayer, PerTokenTTTLayer, ScanEtaTTTLayer, TinyLaCTLM

FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(5)
    model = TinyLaCTLM(40, 16, 2, 2, 4, muon=False, update_theta=False, weight_norm=False)
    ids = torch.randint(0, 40, (2, 14))
    return model, ttt2la.convert(model, level=2, example_inputs=(ids,))


def _ids(B=2, L=11, seed=0):
    return torch.randint(0, 40, (B, L), generator=torch.Generator().manual_seed(seed))


def test_deepcopy_gives_an_independent_model_with_the_same_outputs(lm):
    model, conv = lm
    ids = _ids()
    with torch.no_grad():
        before = conv(ids)
    twin = copy.deepcopy(conv)
    assert type(twin.blocks[0].ttt) is type(conv.blocks[0].ttt)
    assert twin.lm_head.weight is twin.embed.weight              # the tie survives the copy
    with torch.no_grad():
        assert torch.equal(twin(ids), before)
        for p in twin.parameters():
            p.mul_(0.5)
        assert torch.equal(conv(ids), before)                   # the original is untouched
        assert rel_rms_error(twin(ids), before) > 1e-3
    assert rel_rms_error(before, model(ids)) <= FP32
    shallow = copy.copy(conv.blocks[0].ttt)                    # shares parameters, no re-trace
    assert shallow.qkv is conv.blocks[0].ttt.qkv and shallow._ttt2la is conv.blocks[0].ttt._ttt2la


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_model_loads_back_converted_with_identical_outputs(lm, how):
    _model, conv = lm
    ids = _ids(3, 17, seed=1)
    with torch.no_grad():
        before = conv(ids)
    if how == "pickle":
        back = pickle.loads(pickle.dumps(conv))
    else:
        buf = io.BytesIO()
        torch.save(conv, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)
    layer = back.blocks[1].ttt
    assert type(layer).__name__ == "ConvertedLaCTFoldedLayer" and isinstance(layer,
                                                                             LaCTFoldedLayer)
    assert back.ttt2la_report.level == 2
    with torch.no_grad():
        assert torch.equal(back(ids), before)
    # the report's record of what ran stays live on the loaded model
    assert back.ttt2la_report.layers[1].runs is layer._ttt2la.runs
    assert any("block_linear_attention" in v for v in layer._ttt2la.runs.values())


def test_converting_a_converted_model_says_it_is_converted_already(lm):
    model, conv = lm
    with pytest.raises(ttt2la.AlreadyConvertedError, match="already converted at level 2"):
        ttt2la.convert(conv, level=1)
    with pytest.raises(ttt2la.AlreadyConvertedError, match="blocks.0.ttt"):
        ttt2la.inspect(conv, show=False)
    assert isinstance(ttt2la.AlreadyConvertedError("x"), ttt2la.ConversionError)
    # the model it was converted from still converts
    assert type(model.blocks[0].ttt) is LaCTFoldedLayer


def test_activation_checkpointing_recomputes_the_first_call_as_it_ran(lm, monkeypatch):
    """The first call at a shape prepares its graphs out of sight of autograd: activation
    checkpointing recomputes the call on the prepared graphs and must see the tensors it saved
    the first time (non-reentrant checkpointing counts them). Its feature graphs are planned
    whatever their size here, as large ones are (``PLANNED_FROM_BYTES``)."""
    monkeypatch.setattr(ttt2la.lowering.specialize, "PLANNED_FROM_BYTES", 0)
    model, conv = lm
    twin, ids = copy.deepcopy(conv), _ids(2, 13, seed=2)        # a fresh cache, a new length
    twin.train()
    checkpointed = torch.utils.checkpoint.checkpoint(twin, ids, use_reentrant=False)
    checkpointed.pow(2).mean().backward()
    reference = copy.deepcopy(model).train()
    reference(ids).pow(2).mean().backward()
    mine = dict(twin.named_parameters())
    for name, p in reference.named_parameters():
        assert rel_rms_error(mine[name].grad, p.grad) <= FP32, name


@pytest.mark.parametrize("make", [
    lambda: LaCTFoldedLayer(16, 2, 4, muon=False, update_theta=False, weight_norm=False),
    # features chunk by chunk, the padding of a partial last chunk probed per tail length
    lambda: LaCTHeadsLayer(16, 2, 4, muon=False, update_theta=False, weight_norm=False),
], ids=["whole-sequence features", "chunked features"])
def test_torch_compile_fullgraph_runs_the_converted_layer(make):
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 13, 16),))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
        # a second shape recompiles with symbolic sizes, a third runs that graph
        for shape in [(2, 13, 16), (3, 10, 16), (2, 19, 16)]:
            x = torch.randn(*shape, requires_grad=True)
            y = compiled(x)
            assert rel_rms_error(y, layer(x)) <= FP32
            (g_compiled,) = torch.autograd.grad(y.square().sum(), x)
            (g_eager,) = torch.autograd.grad(conv(x).square().sum(), x)
            assert rel_rms_error(g_compiled, g_eager) <= FP32
        torch._dynamo.reset()


def test_a_compiler_traces_the_block_ops_plain_batched_products(monkeypatch):
    """Under a compiler the block op's increments and reads are traced as plain batched
    products, which it fuses and plans itself; eagerly they run as the per-head ``out=``
    Functions. Outputs and gradients agree either way."""
    ran = []
    for function in (ttt2la.runtime.block.ChunkIncrements, ttt2la.runtime.block.ReadStates):
        monkeypatch.setattr(function, "apply", functools.partial(
            lambda apply, name, *args: ran.append(name) or apply(*args),
            function.apply, function.__name__))
    torch.manual_seed(0)
    layer = LaCTFoldedLayer(16, 2, 4, muon=True, muon_steps=2, update_theta=False,
                            weight_norm=False)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 12, 16),))
    x = torch.randn(2, 12, 16, requires_grad=True)
    ran.clear()
    eager = conv(x)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    assert sorted(set(ran)) == ["ChunkIncrements", "ReadStates"]
    ran.clear()
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")(x)
        (g_compiled,) = torch.autograd.grad(compiled.square().sum(), x)
        torch._dynamo.reset()
    assert ran == []
    assert rel_rms_error(compiled, eager) <= FP32
    assert rel_rms_error(g_compiled, g_eager) <= FP32


class _EightsBranch(ScanEtaTTTLayer):
    """TTT-Linear's scan with a branch on the length its plan does not make."""

    def forward(self, x):
        o = super().forward(x)
        return o * 2 if x.shape[1] % 8 else o + 2


def test_torch_compile_fullgraph_names_a_layer_whose_code_reads_the_length():
    """A branch on the length around the scan (``o * 2 if T % 8 else o + 2``, mini-batches of
    4) makes each new length checked against the code as written: a full graph cannot hold
    that, and the compiler's refusal carries ttt2la's reason and what to do."""
    torch.manual_seed(0)
    layer = _EightsBranch(16, 2, 4)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 13, 16),))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(conv, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match="computes Python values of the length") as e:
            compiled(torch.randn(3, 10, 16))
        assert "without fullgraph=True" in str(e.value)
        torch._dynamo.reset()
        y = torch.compile(conv, backend="aot_eager")(x := torch.randn(3, 10, 16))
        assert rel_rms_error(y, layer(x)) <= FP32
        torch._dynamo.reset()


def _compiled_like_eager(conv, x, backend="eager"):
    """The compiled layer's output and input gradient equal the eager ones."""
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        x = x.clone().requires_grad_()
        y = torch.compile(conv, backend=backend)(x)
        y = y[0] if isinstance(y, tuple) else y
        (g,) = torch.autograd.grad(y.square().sum(), x)
    y0 = conv(x)
    y0 = y0[0] if isinstance(y0, tuple) else y0
    (g0,) = torch.autograd.grad(y0.square().sum(), x)
    assert rel_rms_error(y, y0) <= FP32 and rel_rms_error(g, g0) <= FP32


def test_two_conversions_of_one_class_compile_each_its_own():
    """A graph compiled for one converted layer never runs for another of the same class:
    compiled one after the other, level 2 and level 6 of one layer each give their own output
    (the second ran the first's graph: 136 % off)."""
    from ttt2la.zoo import LaCTHeadsLayer

    torch.manual_seed(0)
    layer = LaCTHeadsLayer(8, 2, 4, muon=False, update_theta=False, weight_norm=False)
    example = (torch.randn(2, 16, 8),)
    x = torch.randn(3, 20, 8)
    torch._dynamo.reset()
    for level in (2, 6):
        _compiled_like_eager(ttt2la.convert(layer, level=level, example_inputs=example), x)
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["folded constants", "forward-mode derivatives"])
def test_plans_that_cannot_be_traced_run_between_compiled_graphs(case):
    """Folded constants (a lossy level) and forward-mode derivatives (Titans' affine scan)
    cannot be traced into a compiled graph (a raw TorchRuntimeError): such a layer says why
    and runs between graphs, as eagerly."""
    from ttt2la.zoo import PerTokenTTTLayer, TitansLinearMemory

    torch.manual_seed(0)
    if case == "folded constants":
        layer, level, says = PerTokenTTTLayer(8, 2), 6, "constants"
    else:
        layer, level, says = TitansLinearMemory(8, 4), 2, "forward-mode"
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, 8),))
    assert says in conv._ttt2la.compile_break
    torch._dynamo.reset()
    _compiled_like_eager(conv, torch.randn(3, 20, 8))
    torch._dynamo.reset()


def test_a_plan_that_traces_enters_the_compiled_graph():
    """The exact per-token layer has no reason to break the graph: it compiles whole."""
    from ttt2la.zoo import PerTokenTTTLayer

    torch.manual_seed(0)
    conv = ttt2la.convert(PerTokenTTTLayer(8, 2), level=2, example_inputs=(torch.randn(2, 16, 8),))
    assert conv._ttt2la.compile_break == ""
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        y = torch.compile(conv, fullgraph=True, backend="eager")(torch.randn(3, 20, 8))
        torch._dynamo.reset()
    assert y.shape == (3, 20, 8)


def test_fullgraph_compilation_of_a_layer_between_graphs_says_why():
    """``fullgraph=True`` on a layer that runs between compiled graphs is refused by TorchDynamo
    with the reason the layer cannot be traced and what to do instead."""
    from ttt2la.zoo import TitansLinearMemory

    torch.manual_seed(0)
    conv = ttt2la.convert(TitansLinearMemory(8, 4), level=2, example_inputs=(torch.randn(2, 16, 8),))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported) as refused:
            torch.compile(conv, fullgraph=True, backend="eager")(torch.randn(3, 20, 8))
        torch._dynamo.reset()
    message = str(refused.value)
    assert "forward-mode differentiation" in message, message
    assert "without fullgraph=True" in message, message


def _routed_layer(case: str):
    """A layer converted exactly, a call the plan does not take (``ConvertedState.route``, or a
    partial chunk the plan finds it cannot pad), and the report's run it makes (``None``: the
    code as written fails on it, naming its line)."""
    from test_as_written import ChunkMeanGate
    from test_size_constants import ChunkRule
    from test_whole_chunk_loops import ReshapedToTheLength

    layer, example, x, run = {
        "partial chunk": (ChunkMeanGate(), (2, 16, 16), (3, 10, 16), "partial last chunk"),
        "another batch size": (ChunkRule(_per_batch), (2, 16, 8), (3, 16, 8),
                               "untraced batch size"),
        "untraced length": (ReshapedToTheLength(), (2, 32, 16), (1, 20, 16), None),
        "length 0": (PerTokenTTTLayer(8, 2), (2, 16, 8), (3, 0, 8), None),
    }[case]
    conv = ttt2la.convert(layer, level=2 if case != "untraced length" else 0,
                          example_inputs=(torch.randn(*example),))
    return layer, conv, torch.randn(*x), run


def _per_batch(B, T):
    return 1.0 / B


@pytest.mark.parametrize("case", ["partial chunk", "another batch size", "untraced length",
                                  "length 0"])
def test_compiled_calls_take_the_eager_calls_route(case):
    """A call the plan does not take runs under ``torch.compile`` as it runs eagerly: the code
    as written, equal to the original (the report's runs saying so), or the same
    ``ConversionError`` where that code fails. The compiled call went straight to the plan, and
    a raw TorchRuntimeError escaped (the plan's own refusal of a partial chunk it cannot pad, a
    length or size its graphs do not hold)."""
    torch.manual_seed(0)
    layer, conv, x, run = _routed_layer(case)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        compiled = torch.compile(conv, backend="eager")
        if run is None:
            with pytest.raises(ttt2la.ConversionError) as eager:
                conv(x)
            with pytest.raises(ttt2la.ConversionError) as got:
                compiled(x)
            assert eager.value.args[0].split(", and that code failed")[0] == \
                got.value.args[0].split(", and that code failed")[0]
        else:
            x = x.requires_grad_()
            y = compiled(x)
            (g,) = torch.autograd.grad(y.square().sum(), x)
        torch._dynamo.reset()
    if run is not None:
        y0, y1 = conv(x), layer(x)
        (g0,) = torch.autograd.grad(y0.square().sum(), x)
        (g1,) = torch.autograd.grad(y1.square().sum(), x)
        assert rel_rms_error(y, y0) <= FP32 and rel_rms_error(y, y1) <= FP32
        assert rel_rms_error(g, g0) <= FP32 and rel_rms_error(g, g1) <= FP32
        runs = conv.ttt2la_report.to_dict()["layers"][0]["runs"]
        assert any(run in k for k in runs), runs


class _ScaledChunkMemory(torch.nn.Module):
    """A chunked memory whose forward takes a plain float, as a user's scale or temperature."""

    def __init__(self, d: int = 8, chunk: int = 4):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.chunk = chunk

    def forward(self, x, scale: float = 1.0):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        q = q * scale
        W, outs = x.new_zeros(B, d, d), []
        for s in range(0, L, self.chunk):
            outs.append(q[:, s:s + self.chunk] @ W)
            W = W + k[:, s:s + self.chunk].transpose(1, 2) @ v[:, s:s + self.chunk]
        return torch.cat(outs, 1)


@pytest.mark.parametrize("scale", [2.0, 3.0])
def test_a_compiled_call_with_a_plain_float_equals_the_original(scale):
    """``torch.compile`` of a layer whose forward takes a float, called at another length with
    the example's value and with another: the compiled call computes what the original does.
    It raised TorchDynamo's internal error, a tuple subclass built from a generator inside the
    graphs sized per (batch, length)."""
    torch.manual_seed(0)
    layer = _ScaledChunkMemory()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8), 2.0))
    x = torch.randn(2, 13, 8)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False), \
            torch.no_grad():
        torch._dynamo.reset()
        try:
            y = torch.compile(conv, backend="eager")(x, scale)
        finally:
            torch._dynamo.reset()
        assert rel_rms_error(y, layer(x, scale)) <= FP32


def test_fullgraph_with_another_float_says_to_compile_without_it():
    """Under ``fullgraph=True`` a call with another float than the example's (run as written,
    between graphs) is refused saying so: TorchDynamo could not format the traced float into
    the call's description and said only "BUILD_STRING type error"."""
    torch.manual_seed(0)
    layer = _ScaledChunkMemory()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8), 2.0))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False), \
            torch.no_grad():
        torch._dynamo.reset()
        try:
            compiled = torch.compile(conv, backend="eager", fullgraph=True)
            compiled(torch.randn(2, 16, 8), 2.0)
            # recompiled for another value, the float is traced as a symbol
            with pytest.raises(Exception, match="Compile it without fullgraph=True"):
                compiled(torch.randn(2, 16, 8), 0.5)
        finally:
            torch._dynamo.reset()


@pytest.mark.parametrize("case", ["untraced length", "length 0"])
def test_a_compiled_call_run_as_written_fails_as_the_eager_call(case, monkeypatch):
    """The code as written of a call the plan does not take runs outside TorchDynamo, so its
    failure is the eager call's ``RejectedCallError``, naming the user's line with torch's own
    error, whatever TorchDynamo can trace of the way there: with the user's class remembered
    per class (a lookup TorchDynamo traces without a graph break) the code as written was
    traced on fake tensors, and TorchDynamo's TorchRuntimeError escaped, naming no line."""
    from ttt2la import original_class as lookup

    remembered, look_up = {}, lookup.original_class

    def original_class(cls):
        if cls not in remembered:
            remembered[cls] = look_up(cls)
        return remembered[cls]

    monkeypatch.setattr(lookup, "original_class", original_class)
    torch.manual_seed(0)
    _, conv, x, _ = _routed_layer(case)
    with pytest.raises(ttt2la.RejectedCallError) as eager:
        conv(x)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        with pytest.raises(Exception) as got:
            torch.compile(conv, backend="eager")(x)
        torch._dynamo.reset()
    assert type(got.value) is type(eager.value), repr(got.value)
    assert str(got.value) == str(eager.value)
    assert ".py:" in got.value.where


def test_a_cast_layer_compiles_at_its_first_call_at_the_new_dtype():
    """A layer cast after conversion (``.double()``) is converted again at its first call at the
    new dtype (``recast``): compiled, that call converts outside the compiler's trace and equals
    the eager call and the original in float64. The conversion traced inside the compiler's
    trace, its sizes symbolic, and failed ('Node' object is not iterable)."""
    from ttt2la.zoo import lact_layer

    torch.manual_seed(0)
    layer = lact_layer("folded", variant=2, d_model=16, num_heads=2, chunk_size=4, muon_steps=2)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 16),))
    cast = copy.deepcopy(conv).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        y = torch.compile(cast, backend="eager")(x)
        torch._dynamo.reset()
    F64 = TOLERANCE[torch.float64]
    assert y.dtype == torch.float64
    assert rel_rms_error(y, cast(x)) <= F64
    assert rel_rms_error(y, copy.deepcopy(layer).double()(x)) <= F64


@pytest.mark.parametrize("make,level", [
    (lambda: LaCTFoldedLayer(16, 2, 4, muon=False, update_theta=False, weight_norm=False), 2),
    (lambda: PerTokenTTTLayer(8, 2), 6),
], ids=["block op", "folded constants"])
def test_torch_export_traces_the_converted_layer(make, level):
    """``torch.export`` traces the plan's tensor ops at the exported shape, and the program
    computes the layer's function: the block op's ``out=`` writes, kept in the program, failed
    when it ran on weights that require grad (export traces the plain ops instead)."""
    torch.manual_seed(0)
    layer = make()
    width = 16 if level == 2 else 8
    x = torch.randn(2, 12, width)
    conv = ttt2la.convert(layer, level=level, example_inputs=(x,))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        program = torch.export.export(conv, (x,))
    y = program.module()(x)             # with grad: the weights require it
    assert rel_rms_error(y.detach(), conv(x).detach()) <= FP32
    if level == 2:                      # exact
        assert rel_rms_error(y.detach(), layer(x).detach()) <= FP32


def test_torch_export_of_a_plan_it_cannot_trace_says_why():
    """A plan that takes forward-mode derivatives at run time (Titans' affine scan) cannot be
    traced by export (a raw ``AttributeError`` from its fake tensors): it is refused with the
    reason and what to export instead."""
    from ttt2la.zoo import TitansLinearMemory

    torch.manual_seed(0)
    conv = ttt2la.convert(TitansLinearMemory(8, 4), level=2, example_inputs=(torch.randn(2, 16, 8),))
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        with pytest.raises(ttt2la.UnsupportedExportError) as refused:
            torch.export.export(conv, (torch.randn(2, 16, 8),))
    message = str(refused.value)
    assert "forward-mode differentiation" in message and "Export the original" in message, message


def test_torch_export_with_a_dynamic_length_says_why():
    """The converted graphs are specialised per (batch, length): an export that marks the length
    dynamic is refused saying so (export's own error said only that a size was specialised)."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, 8)
    conv = ttt2la.convert(PerTokenTTTLayer(8, 2), level=2, example_inputs=(x,))
    length = torch.export.Dim("L", min=2, max=64)
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        for spec in (({1: length},), {"x": {1: length}}):     # as the original's are written
            with pytest.raises(ttt2la.UnsupportedExportError, match="static shapes"):
                torch.export.export(conv, (x,), dynamic_shapes=spec)


class _OwnStateArgument(_ScaledChunkMemory):
    """A layer whose own forward has a parameter named as the converted layer's streaming one."""

    def forward(self, x, ttt_state: float = 1.0):
        return super().forward(x, ttt_state)


def test_a_layers_own_ttt_state_parameter_passed_by_keyword_is_named_in_the_refusal():
    """The converted forward takes ``ttt_state`` for its streaming state: a layer whose own
    parameter has that name works with it passed by position, and by keyword is refused saying
    the names clash (it said only that a float is no ``TTTState``)."""
    torch.manual_seed(0)
    layer = _OwnStateArgument()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8), 2.0))
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        assert rel_rms_error(conv(x, 2.0), layer(x, 2.0)) <= FP32
    with pytest.raises(ttt2la.StreamingError, match="_OwnStateArgument.forward has a parameter "
                                                    "of that name too.*by position"):
        conv(x, ttt_state=2.0)


def test_a_converted_forward_takes_the_originals_signature_and_exports_by_its_names():
    """``inspect.signature`` of a converted forward is the original's with the streaming
    keywords: a ``dynamic_shapes`` spec written for the original, by position or by argument
    name, exports the converted layer (the converted forward's ``*args`` refused both)."""
    import inspect
    torch.manual_seed(0)
    x = torch.randn(2, 12, 8)
    layer = PerTokenTTTLayer(8, 2)
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    own, got = inspect.signature(layer.forward), inspect.signature(conv.forward)
    assert list(got.parameters) == [*own.parameters, "ttt_state", "return_ttt_state"], got
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        for spec in ((None,), {"x": None}):
            exported = torch.export.export(conv, (x,), dynamic_shapes=spec)
            with torch.no_grad():
                assert rel_rms_error(exported.module()(x), layer(x)) <= FP32


class _Walked(torch.nn.Module):
    """Members met twice (a shared submodule, a parameter under two names), ``None`` entries,
    a non-persistent buffer, a parametrization and a submodule that lists its own parameters
    otherwise than ``nn.Module`` does."""

    def __init__(self, odd: bool):
        super().__init__()
        shared = torch.nn.Linear(3, 3)
        self.a, self.b = shared, shared
        self.seq = torch.nn.Sequential(torch.nn.Linear(2, 2), shared)
        self.seq.add_module("gone", None)
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.q = self.p
        self.register_parameter("unset", None)
        self.register_buffer("buf", torch.zeros(2))
        self.register_buffer("scratch", torch.ones(1), persistent=False)
        self.register_buffer("empty", None)
        self.norm = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(2, 2))
        self.bn = torch.nn.BatchNorm1d(3)
        if odd:
            self.odd = _Reversed()


class _Reversed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield from reversed(list(super().named_modules(memo, prefix, remove_duplicate)))


@pytest.mark.parametrize("odd", [False, True])
def test_a_converted_layer_reads_its_weights_as_named_parameters_and_buffers_name_them(odd):
    """The weights a converted layer passes its graphs at every call are read by a walk of its
    own (the generators cost more than the layer's checks on a small call): the same names, in
    the same order, the same tensors, as ``named_parameters()`` then ``named_buffers()``."""
    from ttt2la.ir import params_and_buffers

    module = _Walked(odd)
    want = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    got = params_and_buffers(module)
    assert list(got) == list(want)
    assert all(got[name] is want[name] for name in want)
