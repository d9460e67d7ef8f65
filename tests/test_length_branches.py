"""A layer whose code branches on the length — after its loop, before it, or in a helper
function it calls — at any level: each call computes the function the code computes at that
length (exact levels: the code's own; lossy levels: the simplified one, with the branch the
code takes there) or is refused, naming the line; never another branch's output."""
import operator

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.errors import ConversionError, UnsupportedTTTError
from ttt2la.frontend.shapes import size_argument
from ttt2la.testing import rel_rms_error

from equivalence import assert_same_function

D = 8
BETA, LR = 0.5, 0.1


def finish(o, T):
    """Doubled, or shifted at a multiple of 8."""
    return o * 2 if T % 8 else o + 2


def shifted(o):
    """``finish`` reading the length off its tensor, through another helper."""
    return finish(o, o.shape[1])


def rate(T):
    return LR if T % 8 else 3 * LR


class Momentum(nn.Module):
    """Chunked linear attention with momentum (level 5 removes it, folding its accumulation);
    ``close`` and ``step`` say how the code after the loop and the rate depend on the
    length."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def rate(self, T):
        return LR

    def close(self, o, T):
        return o * 2

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        lr = self.rate(T)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + lr * M
        return self.close(torch.cat(outs, 1), T)

    def simplified(self, x, c: float):
        """The function level 5 makes of it: the momentum's increment scaled by ``c`` (its
        folded accumulation factor), the branches taken as the code takes them."""
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        lr = self.rate(T)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + lr * c * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return self.close(torch.cat(outs, 1), T)


class BranchAfterLoop(Momentum):
    """The branch written out after the loop."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        o = torch.cat(outs, 1)
        o = o * 2 if T % 8 else o + 2
        return o


class HelperAfterLoop(Momentum):
    """The branch in a plain function the code after the loop calls with the length."""

    def close(self, o, T):
        return finish(o, T)


class MethodAfterLoop(Momentum):
    """The branch in a method the code after the loop calls (``self.close``), which calls a
    helper that reads the length off its tensor."""

    def close(self, o, T):
        return shifted(o)


class HelperRate(Momentum):
    """The branch in a helper the code before the loop calls: the rate inside the loop."""

    def rate(self, T):
        return rate(T)


def finish_through_operator(o, T):
    """``finish`` with the length passed through a function of the ``operator`` module (written
    in C: it starts no frame, and a plain float on the left reads its value without asking it)."""
    return o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2


class HelperThroughOperator(Momentum):
    """``HelperAfterLoop`` calling ``finish_through_operator``."""

    def close(self, o, T):
        return finish_through_operator(o, T)


class MethodThroughOperator(Momentum):
    """The branch in the layer's own ``close`` (the loop's function is ``Momentum.forward``),
    spelled through ``operator.mul``."""

    def close(self, o, T):
        return o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2


def finish_every_window(o, T):
    """``finish`` shifted every 600 tokens only: at lengths the run of the code does not judge
    its decisions at, so only the source reading of the helper finds the branch."""
    return o * 2 if T % 600 else o + 2


class HelperWindow(Momentum):
    """``HelperAfterLoop`` calling ``finish_every_window``: its parameter ``T`` is the length."""

    def close(self, o, T):
        return finish_every_window(o, T)


class MethodWindow(Momentum):
    """The branch every 600 tokens in the layer's own ``close``, which overrides the one of the
    class that defines the loop's function."""

    def close(self, o, T):
        return o * 2 if T % 600 else o + 2


WINDOWS = {"helper, window": (HelperWindow, "return o * 2 if T % 600 else o + 2"),
           "method, window": (MethodWindow, "return o * 2 if T % 600 else o + 2")}
THROUGH_OPERATOR = "return o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2"
LAYERS = {"after loop": (BranchAfterLoop, "o = o * 2 if T % 8 else o + 2"),
          "helper": (HelperAfterLoop, "return o * 2 if T % 8 else o + 2"),
          "helper, operator": (HelperThroughOperator, THROUGH_OPERATOR),
          "method": (MethodAfterLoop, "return o * 2 if T % 8 else o + 2"),
          "method, operator": (MethodThroughOperator, THROUGH_OPERATOR),
          "rate": (HelperRate, "return LR if T % 8 else 3 * LR")}


def folded_factor(conv) -> float:
    """The momentum's accumulation factor the lossy conversion folded (1 where it is exact)."""
    for p in conv.ttt2la_report.layers[0].passes:
        if p.name == "remove_momentum" and p.folded:
            return next(iter(p.folded.values()))
    return 1.0


def converted(kind: str, level: int, example: int, seed: int = 0):
    """``(layer, its conversion)``, or ``(layer, the ConversionError refusing it)``."""
    make, _line = {**LAYERS, **WINDOWS}[kind]
    torch.manual_seed(seed)
    layer = make()
    try:
        return layer, ttt2la.convert(layer, level=level,
                                     example_inputs=(torch.randn(2, example, D),))
    except ConversionError as e:
        return layer, e


def same_function_or_refused(layer, conv, T: int) -> str:
    """A call at length ``T``: the original's output and parameter gradients within 1e-5 (an
    exact conversion), the simplified function's output within 1e-5 (a lossy one), or a
    ``ConversionError`` naming the branch's line. Says which."""
    torch.manual_seed(T)
    x = torch.randn(2, T, D)
    exact = conv.ttt2la_report.exact
    if exact:
        try:
            assert_same_function(conv, layer, x)
        except ConversionError as e:
            pytest.fail(f"an exact conversion refused length {T}: {e}")
        return "same"
    with torch.no_grad():
        try:
            got = conv(x)
        except ConversionError as e:
            assert next(line for m, line in (*LAYERS.values(), *WINDOWS.values())
                        if type(layer) is m) in str(e), str(e)
            return "refused"
        want = layer.simplified(x, folded_factor(conv))
    assert rel_rms_error(got, want) <= 1e-5, f"length {T}: not the simplified function"
    return "simplified"


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("level", [0, 4, 5, 6])
def test_other_branch_at_the_example_length(kind, level):
    """The example's length 16 takes the other branch than the probe lengths: an exact
    conversion runs the code as written there, a lossy one is refused at conversion, naming
    the branch's line; every call is the code's function."""
    layer, conv = converted(kind, level, 16)
    line = LAYERS[kind][1]
    if isinstance(conv, ConversionError):
        assert level >= 5 and isinstance(conv, UnsupportedTTTError), conv
        assert line in str(conv) and "exact level" in str(conv) and "length 16" in str(conv)
        return
    assert conv.ttt2la_report.exact, "a lossy conversion converted the other branch"
    for T in (16, 24, 14, 18, 8):
        assert same_function_or_refused(layer, conv, T) == "same"


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("level", [0, 5])
def test_probes_branch_at_the_example_length(kind, level):
    """The example's length 18 takes the probes' branch, lengths 16 and 24 the other: the
    report names the branch's line (in the helper, where it is there), an exact conversion
    checks those lengths against the code as written, a lossy one refuses them."""
    layer, conv = converted(kind, level, 18)
    line = LAYERS[kind][1]
    notes = conv.ttt2la_report.layers[0].notes
    assert any(line in n and "values of the length" in n for n in notes), notes
    seen = [same_function_or_refused(layer, conv, T) for T in (18, 16, 24, 14)]
    if level == 0:
        assert seen == ["same"] * 4
    else:
        assert seen == ["simplified", "refused", "refused", "simplified"]


@pytest.mark.parametrize("kind", sorted(WINDOWS))
@pytest.mark.parametrize("level", [0, 5])
def test_probes_branch_at_the_example_length_past_the_run(kind, level):
    """The helper's branch takes the other way at length 600 only, which the run of the code
    cannot tell from a constant: the source reading of the helper names it, and an exact
    conversion checks that length against the code as written, a lossy one refuses it."""
    layer, conv = converted(kind, level, 18)
    notes = conv.ttt2la_report.layers[0].notes
    assert any(WINDOWS[kind][1] in n and "values of the length" in n for n in notes), notes
    seen = [same_function_or_refused(layer, conv, T) for T in (18, 600, 14)]
    assert seen == (["same"] * 3 if level == 0 else ["simplified", "refused", "simplified"])


def test_helper_lines_in_the_source():
    """The uses of the length in the helpers the code around the loop calls, each named at its
    own line: a plain function called with the length, a method, a helper reading the length
    off its tensor, a helper before the loop."""
    import inspect
    from ttt2la.frontend.length_values import length_values
    file = inspect.getsourcefile(Momentum)
    loop = inspect.getsourcelines(Momentum.forward)[1] + 6
    for kind, (make, line) in LAYERS.items():
        if kind == "after loop" or "operator" in kind:     # the run reads ``operator.mul``
            continue
        found = length_values(file, loop, (1, -2, 3), after=True, owner=make)
        assert [(v.what, v.code) for v in found] == [("branches on", line)], kind
        assert found[0].line == next(i + 1 for i, text in enumerate(open(file))
                                     if text.strip() == line)


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(sorted(LAYERS)), level=st.integers(0, 6),
       example=st.integers(6, 26) | st.sampled_from([8, 16, 24]),
       calls=st.lists(st.integers(2, 40) | st.sampled_from([8, 16, 24, 32]), min_size=2,
                      max_size=4))
def test_every_call_is_the_code_function_or_refused(kind, level, example, calls):
    """Random layers, levels, example lengths and call lengths: every call gives the function
    the code computes at its length (the original at exact levels, within 1e-5 for outputs and
    gradients; the simplified function at lossy ones) or is refused — never another branch's
    output."""
    layer, conv = converted(kind, level, example, seed=example)
    if isinstance(conv, ConversionError):
        assert isinstance(conv, UnsupportedTTTError) and LAYERS[kind][1] in str(conv), conv
        return
    for T in [example, *calls]:
        same_function_or_refused(layer, conv, T)


class TopK(nn.Module):
    """A summary of the ``min(T, 16)`` largest values of each feature before the loop: at the
    probe lengths, all past 16, the code around the loop takes ``k = 16``, which fails on a
    shorter example."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        k = min(x.shape[1], 16)
        x = x + x.topk(k, dim=1).values.mean(1, keepdim=True)
        q, k_, v = self.proj(x).chunk(3, -1)
        S, outs = x.new_zeros(x.shape[0], D, D), []
        for s in range(0, x.shape[1], 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + LR * k_[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return torch.cat(outs, 1)


def test_a_clamped_size_the_probes_fit_past_the_example_is_left_to_the_code_there():
    """Converted from 12 tokens, under the clamp: the graph fitted at the probe lengths fails
    there (``topk`` of 16), which was a raw ``RuntimeError`` from the calibration, then called a
    bug in ttt2la. The example's length now runs the code as written, and every other length
    the code's function."""
    torch.manual_seed(0)
    layer = TopK()
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 12, D),))
    for T in (12, 5, 16, 40):
        assert_same_function(conv, layer, torch.randn(2, T, D))


def test_a_size_argument_is_named_by_the_ops_own_name():
    """A refusal of a size the fit cannot read names the argument (``k`` of ``topk``, an item of
    ``view``'s ``size``), not its position in the traced call (``(1,)``)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    topk = g.call_function(torch.ops.aten.topk.default, (x, 16, 1))
    view = g.call_function(torch.ops.aten.view.default, (x, [2, 40, 8]))
    assert size_argument(topk, (1,)) == "`k`" and size_argument(topk, (2,)) == "`dim`"
    assert size_argument(view, (1, 1)) == "item 1 of `size`"
