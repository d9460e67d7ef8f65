"""Errors are interface: whatever a caller passes, only a ``ttt2la.ConversionError`` escapes.

A catalogue of wrong calls of a converted layer — an optional mask passed when the layer was
converted without one (or left out, or ``None``, when it was converted with one), a mask of
the wrong rank or length, extra or unknown arguments, inputs of the wrong rank or width, another
value of a plain Python argument the conversion built in, an input the layer's own code
rejects (another dtype than the weights, an empty axis a reshape cannot infer) — and of wrong
arguments to ``convert`` and ``inspect``. Each wrong call of the converted layer raises a
``ConversionError`` that names the input or the user's line that failed and says what the
layer was converted for; where the layer as written fails on the call with another error, the
converted layer's error is also of that class. A call the original accepts is never answered
with another output.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.utils._pytree as pytree

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import TitansLinearMemory, ViTTTClosedFormBlock

B, L, D = 2, 20, 8


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


MASK = torch.arange(B * L).reshape(B, L) % 3 != 0

WRONG_CALLS = [
    ("mask of another length", (_x(B, L, D),), {"store_mask": torch.ones(B, L + 1).bool()}),
    ("mask without batch", (_x(B, L, D),), {"store_mask": torch.ones(L).bool()}),
    ("mask of rank 3", (_x(B, L, D),), {"store_mask": torch.ones(B, L, 1).bool()}),
    ("mask positional", (_x(B, L, D), MASK), {}),
    ("mask None", (_x(B, L, D),), {"store_mask": None}),
    ("mask a list", (_x(B, L, D),), {"store_mask": [1, 0]}),
    ("mask an int", (_x(B, L, D),), {"store_mask": 1}),
    ("extra positional", (_x(B, L, D), MASK, MASK), {}),
    ("unknown keyword", (_x(B, L, D),), {"foo": 1}),
    ("no input", (), {}),
    ("input without batch", (_x(L, D),), {}),
    ("input too wide", (_x(B, L, D + 1),), {}),
    ("input of integers", (_x(B, L, D, dtype=torch.long),), {}),
    ("input a list", ([[0.0] * D] * L,), {}),
    ("input in a list", ([_x(B, L, D)],), {}),
    ("input in a tuple", ((_x(B, L, D),),), {}),
    ("the right call", (_x(B, L, D),), {}),
    ("the right call, masked", (_x(B, L, D),), {"store_mask": MASK}),
]


def _outcome(module, args, kwargs):
    try:
        return module(*args, **kwargs), None
    except Exception as e:              # the error is what is compared
        return None, e


def _same_outputs(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    for u, v in zip(la, lb):
        if isinstance(u, torch.Tensor):
            if not isinstance(v, torch.Tensor) or u.shape != v.shape or \
                    rel_rms_error(v.detach(), u.detach()) > TOLERANCE[torch.float32]:
                return False
        elif u != v:
            return False
    return True


@pytest.fixture(scope="module")
def memories():
    torch.manual_seed(0)
    memory = TitansLinearMemory(D, 4)
    x = torch.randn(B, L, D)
    plain = ttt2la.convert(memory, level=0, example_inputs=(x,))
    masked = ttt2la.convert(memory, level=0, example_inputs=(x,),
                            example_kwargs={"store_mask": MASK})
    return memory, {"converted without a mask": plain, "converted with a mask": masked}


@pytest.mark.parametrize("how", ["converted without a mask", "converted with a mask"])
@pytest.mark.parametrize("name,args,kwargs", WRONG_CALLS, ids=[c[0] for c in WRONG_CALLS])
def test_a_wrong_call_is_the_original_error_or_a_conversion_error(memories, how, name, args,
                                                                    kwargs):
    memory, converted = memories[0], memories[1][how]
    want, original_error = _outcome(memory, args, kwargs)
    got, error = _outcome(converted, args, kwargs)
    if error is None:
        assert original_error is None, f"the original raised {original_error!r}"
        assert _same_outputs(want, got)
    else:
        assert isinstance(error, ttt2la.ConversionError), f"{type(error).__name__}: {error}"
        assert "converted for" in str(error), str(error)
        if isinstance(error, ttt2la.RejectedCallError):
            assert original_error is not None and isinstance(error, type(original_error)), \
                f"{type(error).__name__}: {error} (the original: {original_error!r})"


def test_the_message_names_the_input_and_what_to_pass(memories):
    converted = memories[1]["converted with a mask"]
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(B, L, D), store_mask=torch.ones(B, L + 1).bool())
    text = str(refused.value)
    assert "'store_mask'" in text and f"{L + 1} tokens" in text and f"has {L}" in text
    assert "'store_mask': a tensor [B, L]" in text and "#0: a tensor [B, L, 8]" in text
    plain = memories[1]["converted without a mask"]
    with pytest.raises(ttt2la.UnsupportedShapeError,
                       match="'store_mask' = a tensor, but it was converted with 'store_mask' "
                             "left at its default None"):
        plain(torch.randn(B, L, D), store_mask=MASK)


def test_an_argument_built_otherwise_than_the_example_is_refused_naming_it(memories):
    """The graphs take a call's inputs flattened, so a tensor wrapped in a list or a tuple
    flattened to the example's inputs and ran, where the layer's own code fails on it: the
    converted layer names the argument, how it was built and how the example's was."""
    converted = memories[1]["converted with a mask"]
    x = torch.randn(B, L, D)
    for wrapped, built in (([x], r"a list \[a tensor\]"), ((x,), r"a tuple \[a tensor\]")):
        with pytest.raises(ttt2la.UnsupportedShapeError,
                           match=rf"#0 = {built}, where the call it was converted from passed "
                                 r"a tensor\. It was converted for calls with #0: a tensor"):
            converted(wrapped, store_mask=MASK)
    with pytest.raises(ttt2la.UnsupportedShapeError, match=r"'store_mask' = a dict \{'m': a "
                                                           r"tensor\}, where the call it was"):
        converted(x, store_mask={"m": MASK})


class Gained(ViTTTClosedFormBlock):
    """A single-step block with a plain Python argument, which a conversion builds in."""

    def forward(self, x, gain: float = 1.0):
        return super().forward(x) * gain


def test_a_built_in_python_value_is_checked_not_silently_reused():
    """Another value of a plain Python argument, which the graphs hold built in: an exact
    conversion runs the code as written on it (the report's runs say so, naming it); a lossy
    one, whose simplified function the code as written does not compute, refuses naming it."""
    torch.manual_seed(0)
    block = Gained(8, 2, update_gate=False)
    x = torch.randn(2, 6, 8)
    converted = ttt2la.convert(block, level=0, example_inputs=(x,),
                               example_kwargs={"gain": 2.0})
    assert _same_outputs(block(x, gain=2.0), converted(x, gain=2.0))
    assert _same_outputs(block(x, gain=3.0), converted(x, gain=3.0))
    runs = converted.ttt2la_report.layers[0].runs
    assert runs["called with 'gain' = 3.0, where it was converted with 2.0"].startswith(
        "as written"), runs
    lossy = ttt2la.convert(block, level=6, example_inputs=(x,), example_kwargs={"gain": 2.0})
    assert not lossy.ttt2la_report.exact
    with pytest.raises(ttt2la.UnsupportedShapeError, match="2.0 it was converted with"):
        lossy(x, gain=3.0)
    lossy = ttt2la.convert(block, level=6, example_inputs=(x,))     # gain left at its default
    with pytest.raises(ttt2la.UnsupportedShapeError, match="'gain' left at its default 1.0"):
        lossy(x, gain=3.0)


class Scaled(torch.nn.Module):
    """A chunked linear memory with two plain Python arguments of one type, which a conversion
    builds in: a call passing one of them in the other's place means another function."""

    C = 4

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x, in_scale: float = 1.0, out_scale: float = 1.0):
        q, k, v = self.qkv(x * in_scale).chunk(3, dim=-1)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, 1) * out_scale


@pytest.fixture(scope="module")
def scaled():
    """``Scaled`` and its conversions from a call passing both scales by keyword, and from one
    passing ``out_scale`` only."""
    torch.manual_seed(0)
    layer = Scaled()
    x = torch.randn(B, 12, D)
    both = ttt2la.convert(layer, level=0, example_inputs=(x,),
                          example_kwargs={"in_scale": 2.0, "out_scale": 3.0})
    out = ttt2la.convert(layer, level=0, example_inputs=(x,), example_kwargs={"out_scale": 3.0})
    return layer, both, out


# the calls ``Scaled`` takes as its conversion from ``(x, in_scale=2.0, out_scale=3.0)``
SAME_CALLS = [
    ("keywords in the other order", lambda x: ((x,), {"out_scale": 3.0, "in_scale": 2.0})),
    ("all positional", lambda x: ((x, 2.0, 3.0), {})),
    ("one positional, one keyword", lambda x: ((x, 2.0), {"out_scale": 3.0})),
    ("all keywords", lambda x: ((), {"out_scale": 3.0, "x": x, "in_scale": 2.0})),
]


@pytest.mark.parametrize("name,call", SAME_CALLS, ids=[c[0] for c in SAME_CALLS])
def test_a_call_means_what_its_forward_binds_it_to(scaled, name, call):
    """Arguments are matched to the forward's parameters by name: the same values spelled
    another way (keywords reordered, by position, by keyword) are the same call."""
    layer, converted = scaled[0], scaled[1]
    x = torch.randn(3, 16, D)
    args, kwargs = call(x)
    with torch.no_grad():
        want = layer(x, in_scale=2.0, out_scale=3.0)
        assert rel_rms_error(converted(*args, **kwargs), want) <= TOLERANCE[torch.float32]


# calls another function than the conversion's, their values bound to other parameters: (call,
# the argument the report's runs name); run as written, never as the conversion's call
OTHER_VALUES = [
    ("scales swapped by keyword", lambda x: ((x,), {"out_scale": 2.0, "in_scale": 3.0}),
     "'in_scale' = 3.0, where it was converted with 2.0"),
    ("scales swapped by position", lambda x: ((x, 3.0, 2.0), {}),
     "'in_scale' = 3.0, where it was converted with 2.0"),
    ("out_scale left out", lambda x: ((x,), {"in_scale": 2.0}),
     "'out_scale' = 1.0, where it was converted with 3.0"),
]

# calls the forward does not take: (call, what the refusal names)
OTHER_CALLS = [
    ("an unknown keyword", lambda x: ((x,), {"in_scale": 2.0, "out_scale": 3.0, "scale": 1.0}),
     "unexpected keyword argument 'scale'"),
    ("a positional argument too many", lambda x: ((x, 2.0, 3.0, 4.0), {}),
     "too many positional arguments"),
]


@pytest.mark.parametrize("name,call,named", OTHER_VALUES, ids=[c[0] for c in OTHER_VALUES])
def test_a_keyword_is_never_taken_for_another(scaled, name, call, named):
    """A call whose values bind to other parameters than the conversion's computes what the
    layer computes for it (the code as written), whatever order or spelling its arguments come
    in, and the report's runs name the parameter."""
    layer, converted = scaled[0], scaled[1]
    args, kwargs = call(torch.randn(B, 12, D))
    with torch.no_grad():
        got, want = converted(*args, **kwargs), layer(*args, **kwargs)
    assert rel_rms_error(got, want) <= TOLERANCE[torch.float32]
    ran = converted.ttt2la_report.layers[0].runs.get(f"called with {named}", "")
    assert ran.startswith("as written"), converted.ttt2la_report.layers[0].runs


@pytest.mark.parametrize("name,call,named", OTHER_CALLS, ids=[c[0] for c in OTHER_CALLS])
def test_a_call_the_forward_does_not_take_is_refused(scaled, name, call, named):
    """A call that does not bind to the forward's parameters is refused naming what it
    passes, whatever order or spelling its arguments come in."""
    converted = scaled[1]
    args, kwargs = call(torch.randn(B, 12, D))
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(*args, **kwargs)
    assert named in str(refused.value) and "converted for" in str(refused.value), \
        str(refused.value)


def test_a_parameter_the_example_left_out_is_checked_by_name(scaled):
    """Converted from ``(x, out_scale=3.0)``: ``in_scale=3.0`` runs as written, the runs
    naming ``in_scale`` (its default is built in), not as ``out_scale=3.0``; ``in_scale`` passed
    at its default, by position or keyword, is the conversion's call."""
    layer, converted = scaled[0], scaled[2]
    x = torch.randn(B, 12, D)
    with torch.no_grad():
        assert rel_rms_error(converted(x, in_scale=3.0), layer(x, in_scale=3.0)) <= \
            TOLERANCE[torch.float32]
    ran = converted.ttt2la_report.layers[0].runs.get(
        "called with 'in_scale' = 3.0, where it was converted with its default 1.0", "")
    assert ran.startswith("as written"), converted.ttt2la_report.layers[0].runs
    with torch.no_grad():
        want = layer(x, out_scale=3.0)
        for args, kwargs in [((x, 1.0, 3.0), {}), ((x,), {"in_scale": 1.0, "out_scale": 3.0}),
                             ((x,), {"out_scale": 3.0, "in_scale": 1.0})]:
            assert rel_rms_error(converted(*args, **kwargs), want) <= TOLERANCE[torch.float32]


def test_two_layers_called_with_other_keywords_are_traced_apart():
    """Two layers of one class, called with one value passed as two different keywords, are
    two calls: each is traced for its own (a conversion reused across them ran one as the
    other)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Scaled(), Scaled()

        def forward(self, x):
            return self.a(x, in_scale=2.0) + self.b(x, out_scale=2.0)

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(B, 12, D)
    converted = ttt2la.convert(model, level=0, example_inputs=(x,))
    with torch.no_grad():
        assert rel_rms_error(converted.b(x, out_scale=2.0), model.b(x, out_scale=2.0)) <= \
            TOLERANCE[torch.float32]


def test_an_optional_argument_passed_at_its_default_is_the_call_converted(memories):
    """Converted without a mask, the mask passed as ``None`` (by position or keyword) is the
    same call; converted with one, the mask passed by position or keyword, in any order, is
    too."""
    memory, converted = memories[0], memories[1]
    x = torch.randn(B, L, D)
    with torch.no_grad():
        plain = memory(x)[0]
        for args, kwargs in [((x, None), {}), ((x,), {"store_mask": None}),
                             ((), {"store_mask": None, "x": x})]:
            got = converted["converted without a mask"](*args, **kwargs)[0]
            assert rel_rms_error(got, plain) <= TOLERANCE[torch.float32]
        masked = memory(x, store_mask=MASK)[0]
        for args, kwargs in [((x, MASK), {}), ((), {"store_mask": MASK, "x": x})]:
            got = converted["converted with a mask"](*args, **kwargs)[0]
            assert rel_rms_error(got, masked) <= TOLERANCE[torch.float32]


class _Forward(torch.nn.Module):
    """A module of a given ``forward``, for binding calls without converting anything."""


def _signature_of(forward, args: tuple, kwargs: dict):
    from ttt2la.frontend.call_signature import CallSignature

    module = type("Layer", (_Forward,), {"forward": forward})()
    return CallSignature.of(args, kwargs, module)


def _spelled(signature, *args, **kwargs):
    return signature.spelled(args, kwargs, {}, {}, "layer")


def test_calls_are_spelled_as_the_example_through_args_and_kwargs():
    """A forward taking ``*args`` and ``**kwargs`` binds too: values of ``*rest`` by position,
    of ``**options`` by name; one the example did not pass there, or a missing one, is named."""
    def forward(self, x, *rest, gain=1.0, **options):
        return x

    a, b = torch.ones(2), torch.zeros(2)
    sig = _signature_of(forward, (a, b), {"eps": 0.5, "gain": 2.0})
    args, kwargs = _spelled(sig, a, b, gain=2.0, eps=0.5)
    assert args == (a, b) and list(kwargs.items()) == [("eps", 0.5), ("gain", 2.0)]
    args, kwargs = _spelled(sig, b, a, eps=0.5, gain=2.0)
    assert args[0] is b and args[1] is a
    for call, named in [(((a, b), {"eps": 0.5, "gain": 2.0, "tol": 1}), "'tol' (**options)"),
                        (((a, b), {"gain": 2.0}), "'eps' (**options)"),
                        (((a,), {"eps": 0.5, "gain": 2.0}), "#0 of *rest"),
                        (((a, b, b), {"eps": 0.5, "gain": 2.0}), "1 more positional")]:
        with pytest.raises(ttt2la.UnsupportedShapeError, match=re.escape(named)):
            _spelled(sig, *call[0], **call[1])


def test_keywords_are_matched_by_name_where_the_forward_does_not_bind():
    """A forward whose signature cannot bind a call (``self`` in ``*args``) keeps its positional
    inputs as given, and still matches keywords by name, never by position."""
    def forward(*args, **kwargs):
        return args[1]

    a = torch.ones(2)
    sig = _signature_of(forward, (a,), {"in_scale": 2.0, "out_scale": 3.0})
    assert sig.binding is None
    args, kwargs = _spelled(sig, a, out_scale=3.0, in_scale=2.0)
    assert list(kwargs.items()) == [("in_scale", 2.0), ("out_scale", 3.0)]
    with pytest.raises(ttt2la.UnsupportedShapeError, match="keyword argument 'scale'"):
        _spelled(sig, a, in_scale=2.0, scale=3.0)


class Heads(torch.nn.Module):
    """A per-token memory whose heads are split by a reshape that infers its last size."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, -1) for t in self.qkv(x).chunk(3, -1))
        S = x.new_zeros(B, 2, D // 2, D // 2)
        outs = []
        for t in range(T):
            S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
            outs.append((q[:, t, :, :, None] * S).sum(-2))
        return torch.stack(outs, 1).reshape(B, T, D)


REJECTED = [("bf16 input, fp32 weights", _x(B, L, D, dtype=torch.bfloat16)),
            ("an empty batch", _x(0, L, D)), ("an empty sequence", _x(B, 0, D))]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name,x", REJECTED, ids=[r[0] for r in REJECTED])
def test_a_call_the_layers_own_code_rejects_names_its_line(name, x, streaming, capfd):
    """The error says which line of the layer failed and what the layer was converted for; it
    is also the class the layer as written raises, and chains that error. Nothing else is
    printed (torch.fx prints a failing line of its generated code)."""
    torch.manual_seed(0)
    layer = Heads()
    converted = ttt2la.convert(layer, level=0, example_inputs=(_x(B, L, D),))
    with pytest.raises(RuntimeError) as original:
        layer(x)
    capfd.readouterr()
    with pytest.raises(ttt2la.RejectedCallError) as refused:
        if streaming:
            converted(x, return_ttt_state=True)
        else:
            converted(x)
    assert capfd.readouterr().err == ""
    error = refused.value
    assert isinstance(error, RuntimeError) and isinstance(error.__cause__, RuntimeError)
    assert error.where is not None and "test_call_errors.py" in error.where
    assert "t.view(B, T, 2, -1)" in str(error) and "converted for" in str(error)
    assert str(original.value).splitlines()[0] in str(error)


def test_an_empty_batch_runs_the_code_as_written():
    """An empty batch costs nothing as written: an exact conversion runs the layer's own code on
    it, returning what the layer returns (and failing where it fails, above), and says so."""
    from ttt2la.zoo import PerTokenTTTLayer
    torch.manual_seed(0)
    layer = PerTokenTTTLayer(D, 2)
    converted = ttt2la.convert(layer, level=0, example_inputs=(_x(B, L, D),))
    x = _x(0, L, D)
    with torch.no_grad():
        y = converted(x)
        assert torch.equal(y, layer(x))
    assert converted.ttt2la_report.layers[0].runs["batch 0"].startswith("as written")


class MiniBatches(torch.nn.Module):
    """A scan-style layer: the sequence viewed as ``[B, N, K, D]`` mini-batches, which only a
    length that is a multiple of ``K`` allows (the converted loop reads the sequence unchunked,
    so such a call fails inside it rather than at the view)."""

    K = 4

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T // self.K, self.K, D) for t in self.qkv(x).chunk(3, -1))
        W = x.new_zeros(B, D, D)
        outs = []
        for i in range(T // self.K):
            outs.append(q[:, i] @ W)
            W = W + k[:, i].mT @ v[:, i]
        return torch.stack(outs, 1).reshape(B, T, D)


def test_a_call_the_loop_fails_on_is_answered_by_the_code_as_written():
    """Where the converted loop fails, the layer as written decides: its own error, naming its
    line, where it fails too."""
    torch.manual_seed(0)
    layer = MiniBatches()
    converted = ttt2la.convert(layer, level=0, example_inputs=(_x(B, 16, D),))
    x = _x(1, 10, D)
    with pytest.raises(RuntimeError) as original:
        layer(x)
    with pytest.raises(ttt2la.RejectedCallError) as refused:
        converted(x)
    error = refused.value
    assert isinstance(error, RuntimeError) and "test_call_errors.py" in (error.where or "")
    assert "t.view(B, T // self.K, self.K, D)" in str(error)
    assert str(original.value).splitlines()[0] in str(error)


def test_where_only_the_loop_fails_the_output_is_the_code_as_written_with_a_warning(monkeypatch):
    """A call the converted loop fails on but the layer as written runs (a conversion fault) is
    answered by the code as written, the same function; a warning and the report's runs say so."""
    torch.manual_seed(0)
    layer = MiniBatches()
    converted = ttt2la.convert(layer, level=0, example_inputs=(_x(B, 16, D),))
    from ttt2la.converted import LoopModule

    def broken(self, *args, **kwargs):
        raise RuntimeError("a fault of the converted loop")

    monkeypatch.setattr(LoopModule, "forward", broken)
    x = _x(3, 12, D)
    with pytest.warns(RuntimeWarning, match="a fault of the converted loop"):
        got = converted(x)
    with torch.no_grad():
        assert rel_rms_error(got, layer(x)) <= TOLERANCE[torch.float32]
    assert any("the loop failed" in key for key in converted.ttt2la_report.layers[0].runs), \
        converted.ttt2la_report.layers[0].runs


WRONG_ARGUMENTS = [
    ("inputs a dict", {"x": torch.randn(B, L, D)}, None),
    ("inputs a generator", (t for t in [torch.randn(B, L, D)]), None),
    ("inputs a string", "x", None),
    ("inputs an int", 3, None),
    ("inputs nested lists", [torch.randn(B, L, D).tolist()], None),
    ("inputs a NumPy array", (torch.randn(B, L, D).numpy(),), None),
    ("inputs empty", (), None),
    ("inputs of length 0", (torch.randn(B, 0, D),), None),
    ("inputs with NaN", (torch.full((B, L, D), float("nan")),), None),
    ("kwargs a list", (torch.randn(B, L, D),), [("store_mask", MASK)]),
    ("kwargs unknown", (torch.randn(B, L, D),), {"foo": 1}),
    ("kwargs a mask of another length", (torch.randn(B, L, D),),
     {"store_mask": torch.ones(B, L + 1).bool()}),
    ("no inputs, no embedding", None, None),
]


@pytest.mark.parametrize("entry", ["convert", "inspect"])
@pytest.mark.parametrize("name,inputs,kwargs", WRONG_ARGUMENTS,
                         ids=[a[0] for a in WRONG_ARGUMENTS])
def test_wrong_arguments_to_convert_and_inspect_are_conversion_errors(entry, name, inputs,
                                                                       kwargs):
    torch.manual_seed(0)
    memory = TitansLinearMemory(D, 4)
    with pytest.raises(ttt2la.ConversionError):
        if entry == "convert":
            ttt2la.convert(memory, level=0, example_inputs=inputs, example_kwargs=kwargs)
        else:
            ttt2la.inspect(memory, example_inputs=inputs, example_kwargs=kwargs, show=False)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_named(value):
    """A weight holding NaN or inf (a diverged training run) is named before any work, not
    reported as a failed check of the lowering; an infinite buffer (a mask) is no error."""
    from ttt2la.validation import check_finite_weights

    torch.manual_seed(0)
    layer = TitansLinearMemory(D, 4)
    name, weight = next(iter(layer.named_parameters()))
    with torch.no_grad():
        weight.view(-1)[0] = value
    with pytest.raises(ttt2la.InvalidInputError,
                       match=rf"TitansLinearMemory\.{re.escape(name)} \(1\).*finite weights"):
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(B, L, D),))
    masked = torch.nn.Linear(2, 2)
    masked.register_buffer("mask", torch.full((2, 2), float("-inf")).triu(1))
    check_finite_weights(masked)


class Keyed(torch.nn.Module):
    """A chunked linear memory given extra keys and values in one dict and two numbers in
    another: a call listing a dict's keys in another order means the same function."""

    C = 4

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x, extra: dict, scales: dict):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k, v, q = k + extra["k"], v + extra["v"], q + scales["shift"]
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, 1) * scales["out"]


def test_a_dict_argument_is_read_by_its_keys_in_any_order():
    """Its leaves were compared by position: keys and values given in the other order ran the
    graphs with the keys as values, and swapped numbers passed for the built-in ones."""
    torch.manual_seed(0)
    layer, x = Keyed(), torch.randn(B, 12, D)
    extra = {"k": torch.randn(B, 12, D), "v": torch.randn(B, 12, D)}
    conv = ttt2la.convert(layer, level=0, example_inputs=(x, extra, {"shift": 1.0, "out": 2.0}))
    swapped = {"v": extra["v"], "k": extra["k"]}
    with torch.no_grad():
        want = layer(x, extra, {"shift": 1.0, "out": 2.0})
        got = conv(x, swapped, {"out": 2.0, "shift": 1.0})
        assert rel_rms_error(got, want) <= TOLERANCE[torch.float32]
        other = {"out": 1.0, "shift": 2.0}         # other values: as written
        assert rel_rms_error(conv(x, extra, other), layer(x, extra, other)) <= \
            TOLERANCE[torch.float32]
        assert any(k.startswith("called with #2['shift'] = 2.0")
                   for k in conv.ttt2la_report.layers[0].runs)
        with pytest.raises(ttt2la.UnsupportedShapeError, match=r"no #2\['out'\]"):
            conv(x, extra, {"shift": 1.0})
        with pytest.raises(ttt2la.UnsupportedShapeError, match=r"#1\['q'\], which the example"):
            conv(x, {**extra, "q": x}, {"shift": 1.0, "out": 2.0})


class OffsetMemory(torch.nn.Module):
    """A chunked linear memory with a keyword that shifts its values and a state it may start
    from and return: a model streams a sequence through it in two calls made otherwise."""

    C = 4

    def __init__(self, d=8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.lr = torch.nn.Linear(d, 1)

    def forward(self, x, offset: float = 0.0, state=None, return_state=False):
        q, k, v = self.qkv(x).chunk(3, -1)
        lr = torch.sigmoid(self.lr(x))
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]) if state is None else state
        outs = []
        for s in range(0, x.shape[1], self.C):
            outs.append(q[:, s:s + self.C] @ S)
            S = S + k[:, s:s + self.C].transpose(1, 2) @ (
                lr[:, s:s + self.C] * (v[:, s:s + self.C] + offset))
        y = torch.cat(outs, 1)
        return (y, S) if return_state else y


class TwoCalls(torch.nn.Module):
    """Calls its memory twice: the first half of the sequence, returning the state; the second
    half from that state, with another offset."""

    def __init__(self):
        super().__init__()
        self.mem = OffsetMemory()

    def forward(self, x):
        h = x.shape[1] // 2
        y1, S = self.mem(x[:, :h], return_state=True)
        return torch.cat([y1, self.mem(x[:, h:], offset=0.5, state=S)], 1)


def test_a_layer_the_example_run_calls_otherwise_again_runs_that_call_as_written():
    """The layer is converted from its first call; the model's second call, made otherwise
    (a keyword, a state passed), ran into the converted first call's refusal, so the model
    failed on its own example inputs. At an exact level it runs the code as written, the
    report's runs saying so, as for a call unlike both, with another value of the keyword; a
    lossy level refuses, saying why and what to do."""
    torch.manual_seed(0)
    model = TwoCalls()
    conv = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 20, 8),))
    assert_same_function(conv, model, torch.randn(3, 22, 8))
    runs = conv.ttt2la_report.layers[0].runs
    assert runs["made as call 2 of the example run"].startswith("as written"), runs
    assert any(not key.startswith("made as") for key in runs), runs   # the first call: the plan
    x = torch.randn(2, 10, 8)      # made like none of them: another value runs as written
    with torch.no_grad():
        assert rel_rms_error(conv.mem(x, offset=2.0), model.mem(x, offset=2.0)) <= \
            TOLERANCE[torch.float32]
    runs = conv.ttt2la_report.layers[0].runs
    assert any(key.startswith("called with 'offset' = 2.0") for key in runs), runs
    with pytest.raises(ttt2la.UnsupportedShapeError,
                       match=r"mem \(the loop at .*\) is called 2 ways in the model's example "
                             r"run.* a lossy conversion .* Convert at an exact level"):
        ttt2la.convert(model, level=4, example_inputs=(torch.randn(2, 20, 8),))
