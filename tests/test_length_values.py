"""Python values the layer computes from the call's length — a branch, a clamp, a chunk size —
may change outside the lengths the probes traced: such a layer computes the code's function at
every length (an exact conversion checks each new length against the code as written once) or
refuses the length (lossy), naming the line; a chunk size that moves between probe lengths is
refused at conversion, naming the line that derives it."""
import functools
import math
import operator

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.errors import UnsupportedShapeError, UnsupportedTTTError

from equivalence import assert_same_function

D = 8


class LengthRule(nn.Module):
    """Chunked linear attention with momentum whose chunk size and rate ``rule(T)`` computes
    from the length."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        C, lr = self.rule(T)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, C):
            outs.append(q[:, s:s + C] @ S)
            M = 0.5 * M + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
            S = S + lr * M
        return torch.cat(outs, 1)


class Branch(LengthRule):
    """``if T < 12:`` another rate — the probes trace longer sequences only."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        lr = 0.1
        if T < 12:
            lr = 0.5
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + lr * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return torch.cat(outs, 1)


def capped(T):
    return max(1, min(4, T // 2)), 0.1


def test_branch_on_the_length_is_exact_at_every_length():
    torch.manual_seed(0)
    layer = Branch(capped)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    assert any("values of the length" in n for n in conv.ttt2la_report.layers[0].notes)
    assert_same_function(conv, layer, [torch.randn(2, T, D) for T in (3, 11, 12, 17)])


def test_capped_chunk_is_exact_at_every_length():
    torch.manual_seed(0)
    layer = LengthRule(capped)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    assert_same_function(conv, layer, [torch.randn(2, T, D) for T in (2, 5, 7, 8, 21)])


def test_lossy_conversion_refuses_an_untraced_length():
    torch.manual_seed(0)
    layer = LengthRule(capped)
    conv = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, 16, D),))
    assert not conv.ttt2la_report.exact               # momentum removed
    conv(torch.randn(1, 16, D))                       # the example's length runs
    with pytest.raises(UnsupportedShapeError, match=r"length 7.*self.rule\(T\)"):
        conv(torch.randn(1, 7, D))


@pytest.mark.parametrize("rule,line", [
    (lambda T: (math.ceil(T / 4), 0.1), "C, lr = self.rule(T)"),
    (lambda T: (max(1, int(math.sqrt(T))), 0.1), "C, lr = self.rule(T)")])
def test_chunk_size_of_the_length_is_refused_naming_the_line(rule, line):
    with pytest.raises(UnsupportedTTTError, match=r"chunks of another size") as e:
        ttt2la.convert(LengthRule(rule), level=0, example_inputs=(torch.randn(2, 32, D),))
    assert line in str(e.value) and "bug" not in str(e.value)


def test_uses_of_the_length_in_the_source():
    """Branches, clamps and chunk sizes of the length are found; a tensor op of the length, a
    guard that raises and a clamp of the loop index are not."""
    import inspect
    from ttt2la.frontend.length_values import length_values
    file = inspect.getsourcefile(LengthRule)
    loop = inspect.getsourcelines(LengthRule.forward)[1] + 6
    found = {v.what for v in length_values(file, loop, (1, -2, 3))}
    assert found == {"computes the chunk size C from", "sets the chunk size from"}
    loop = inspect.getsourcelines(Branch.forward)[1] + 8
    assert [v.what for v in length_values(file, loop, (1, -2, 3))] == ["branches on"]


def test_streamed_piece_of_an_untraced_length_is_refused():
    torch.manual_seed(0)
    layer = Branch(capped)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    with pytest.raises(UnsupportedShapeError, match=r"length 5.*if T < 12"):
        conv(torch.randn(1, 5, D), return_ttt_state=True)


class CountedBranch(Branch):
    """``Branch`` counting its calls in a buffer."""

    def __init__(self, rule):
        super().__init__(rule)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_checking_a_new_length_is_not_counted_as_a_call():
    """The check of a new length against the code as written runs both; a buffer the forward
    updates advances once per call all the same."""
    torch.manual_seed(0)
    layer = CountedBranch(capped)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, D),))
    with torch.no_grad():
        for T in (3, 11, 3):
            conv(torch.randn(2, T, D))
    assert conv.calls.item() == 3


class BranchAfterLoop(nn.Module):
    """Chunked linear attention whose code after the loop branches on the length: the probe
    lengths (14, 15, 18) all take ``o * 2``, a multiple of 8 takes ``o + 2``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        o = torch.cat(outs, 1)
        o = o * 2 if T % 8 else o + 2
        return o


def doubled_unless_eight(o, T):
    return o * 2 if T % 8 else o + 2


class HelperBranchAfterLoop(BranchAfterLoop):
    """``BranchAfterLoop`` with its branch in a helper function: the source reading follows the
    call, and the trace at the example's length names the line too."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return doubled_unless_eight(torch.cat(outs, 1), T)


class HiddenBranchAfterLoop(HelperBranchAfterLoop):
    """``HelperBranchAfterLoop`` calling its helper through a ``functools.partial`` held by the
    layer, which no source reading resolves: the run of the code (``length_uses``) finds the
    branch, and the trace at the example's length names the line."""

    def __init__(self):
        super().__init__()
        self.close = functools.partial(doubled_unless_eight)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return self.close(torch.cat(outs, 1), T)


def doubled_unless_eight_through_operator(o, T):
    return o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2


class HiddenThroughOperator(HiddenBranchAfterLoop):
    """``HiddenBranchAfterLoop`` whose helper passes the length through ``operator.mul``, a
    function of C under a plain float on the left: the run reads it at the helper's line."""

    def __init__(self):
        super().__init__()
        self.close = functools.partial(doubled_unless_eight_through_operator)


class LoopThroughOperator(BranchAfterLoop):
    """``BranchAfterLoop`` with the length passed through ``operator.mul``."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        o = torch.cat(outs, 1)
        o = o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2
        return o


def doubled_unless_eight_conditional(o, T):
    return o * 2 if (0.5 * (T if T > 0 else 1)) % 8 else o + 2


class HiddenConditional(HiddenBranchAfterLoop):
    """``HiddenBranchAfterLoop`` whose helper reads the length under a plain float inside a
    conditional expression, where CPython reads its value without asking it: the run reads the
    expression at the helper's line."""

    def __init__(self):
        super().__init__()
        self.close = functools.partial(doubled_unless_eight_conditional)


def doubled_unless_eight_comprehension(o, T):
    return o * 2 if (0.5 * [n for n in (T,)][0]) % 8 else o + 2


class HiddenComprehension(HiddenBranchAfterLoop):
    """``HiddenBranchAfterLoop`` whose helper reads the length under a plain float through a list
    comprehension, which the run does not follow: the name of the length in it stands for it."""

    def __init__(self):
        super().__init__()
        self.close = functools.partial(doubled_unless_eight_comprehension)


class StepBranch(nn.Module):
    """One test-time step over all tokens, whose code after the step branches on the length:
    the probes trace lengths past 6 only."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)
        self.W0 = nn.Parameter(torch.randn(D, D) * 0.1)

    def forward(self, x):
        N = x.shape[1]
        q, k, v = self.proj(x).chunk(3, -1)
        W = self.W0.unsqueeze(0) + 0.1 * k.transpose(1, 2) @ v / N
        o = q @ W
        o = o * 2 if x.shape[1] > 6 else o + 2
        return o


def same_or_refused(converted, original, xs):
    """Each call of ``converted`` gives ``original``'s output within 1e-5 relative RMS error, or
    is refused with a ``ConversionError`` — never another output."""
    from ttt2la.errors import ConversionError
    from ttt2la.testing import rel_rms_error
    for x in xs:
        with torch.no_grad():
            want = original(x)
            try:
                got = converted(x)
            except ConversionError:
                continue
        assert rel_rms_error(got, want) <= 1e-5, f"length {x.shape[1]}"


BRANCHED = {"loop": (BranchAfterLoop, "o = o * 2 if T % 8 else o + 2", (16, 8, 24, 32, 12, 17)),
            "helper": (HelperBranchAfterLoop, "return o * 2 if T % 8 else o + 2",
                       (16, 8, 24, 12, 17)),
            "hidden": (HiddenBranchAfterLoop, "return o * 2 if T % 8 else o + 2",
                       (16, 8, 24, 12, 17)),
            "hidden, operator": (HiddenThroughOperator,
                                 "return o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2",
                                 (16, 8, 24, 12, 17)),
            "hidden, conditional": (HiddenConditional,
                                    "return o * 2 if (0.5 * (T if T > 0 else 1)) % 8 else o + 2",
                                    (16, 8, 24, 12, 17)),
            "hidden, comprehension": (HiddenComprehension,
                                      "return o * 2 if (0.5 * [n for n in (T,)][0]) % 8 else o + 2",
                                      (16, 8, 24, 12, 17)),
            "loop, operator": (LoopThroughOperator,
                               "o = o * 2 if (0.5 * operator.mul(T, 2)) % 8 else o + 2",
                               (16, 8, 24, 32, 12, 17)),
            "step": (StepBranch, "o = o * 2 if x.shape[1] > 6 else o + 2", (6, 3, 5, 7, 12))}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", sorted(BRANCHED))
def test_branch_at_the_example_length_runs_as_written_there(kind, strict):
    """The example's length takes another branch than every probe length: the conversion names
    the line and the op the traces there differ in (``o + 2`` where the probes' code runs
    ``o * 2``), and runs the code as written at that length (no bug reported), the plan where
    it was checked to agree; every length gives the original's output."""
    make, line, lengths = BRANCHED[kind]
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, lengths[0], D),),
                          strict=strict)
    report = conv.ttt2la_report.layers[0]
    note = next(n for n in report.notes if "another function at the example's length" in n)
    assert line in note and f"length {lengths[0]}" in note
    assert f"is `torch.add` at length {lengths[0]} and `torch.mul` at lengths" in note, note
    assert report.check["rel_rms_error"] <= 1e-5
    same_or_refused(conv, layer, [torch.randn(2, T, D) for T in lengths])
    assert any(k.endswith(f"length {lengths[0]}, length values") and v.startswith("as written")
               for k, v in report.runs.items())


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["loop", "step"])
def test_branch_at_the_example_length_in_a_model(kind, strict):
    """Two such layers in a model: the model converts, and every length gives its output or is
    refused."""
    make, _line, lengths = BRANCHED[kind]
    torch.manual_seed(0)
    model = nn.Sequential(make(), nn.Linear(D, D), make())
    conv = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, lengths[0], D),),
                          strict=strict)
    assert conv.ttt2la_report.layers
    same_or_refused(conv, model, [torch.randn(2, T, D) for T in lengths])


@settings(max_examples=6, deadline=None)
@given(example=st.integers(6, 26), calls=st.lists(st.integers(2, 40), min_size=2, max_size=4),
       kind=st.sampled_from(["loop", "step"]), strict=st.booleans())
def test_branch_after_the_loop_never_gives_another_output(example, calls, kind, strict):
    """Whatever the example's length, each length branches as the code does, or is refused."""
    make = BRANCHED[kind][0]
    torch.manual_seed(example)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(1, example, D),),
                          strict=strict)
    same_or_refused(conv, layer, [torch.randn(2, T, D) for T in [example, *calls]])


@pytest.mark.parametrize("kind,example,lengths", [("loop", 18, (16, 24, 14)),
                                                  ("loop, operator", 18, (16, 24, 14)),
                                                  ("step", 9, (6, 4, 12))])
def test_branch_after_the_loop_is_checked_at_other_lengths(kind, example, lengths):
    """The example takes the probes' branch; the source (or, through ``operator.mul``, the run of
    the code) shows the branch after the loop (or the step), so every other length is checked
    against the code as written, and those that take the other branch run as written."""
    make, line, _lengths = BRANCHED[kind]
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, example, D),))
    assert any(line in n and "values of the length" in n
               for n in conv.ttt2la_report.layers[0].notes)
    same_or_refused(conv, layer, [torch.randn(2, T, D) for T in lengths])
    import inspect
    from ttt2la.frontend.length_values import length_values
    file = inspect.getsourcefile(make)
    loop, first = inspect.getsourcelines(make.forward)[1], line.split(" if")[0]
    if "operator" in kind:          # the run reads ``operator.mul``; the source reading does not
        return
    at = loop + (5 if kind == "loop" else 0)
    found = length_values(file, at, (1, -2, 3), after=True)
    assert [v.what for v in found] == ["branches on"] and found[0].code.startswith(first)
    assert not length_values(file, at, (1, -2, 3))


class WindowAfterLoop(BranchAfterLoop):
    """``BranchAfterLoop`` whose branch takes the other way every 600 tokens only, at lengths
    the run of the code does not judge its decisions at: only the source reading finds it."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        o = torch.cat(outs, 1)
        if T % 600 == 0:
            o = o + 2
        return o


def test_branch_after_the_loop_past_the_run_is_checked_at_other_lengths():
    """The source after the loop shows a branch the run of the code cannot tell from a
    constant: length 600, which takes it, gives the code's output."""
    torch.manual_seed(0)
    layer = WindowAfterLoop()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 18, D),))
    assert any("if T % 600 == 0:" in n and "values of the length" in n
               for n in conv.ttt2la_report.layers[0].notes)
    same_or_refused(conv, layer, [torch.randn(1, T, D) for T in (600, 20)])


@pytest.mark.parametrize("kind", ["hidden", "hidden, operator", "hidden, conditional",
                                  "hidden, comprehension"])
def test_a_hidden_branch_at_the_probes_outcome_is_checked_at_other_lengths(kind):
    """The example takes the probes' branch and no source reading resolves the helper: the run
    of the code finds the branch, and lengths that take the other one (16, 24, 32) give the
    code's output."""
    make, line, _lengths = BRANCHED[kind]
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 18, D),))
    assert any(line in n and "values of the length" in n
               for n in conv.ttt2la_report.layers[0].notes)
    same_or_refused(conv, layer, [torch.randn(2, T, D) for T in (16, 24, 32, 14, 20)])


def test_branch_at_the_example_length_survives_pickling():
    """An unpickled layer runs the code as written at the example's length too: the recipe keeps
    what the conversion's check found."""
    import pickle
    torch.manual_seed(0)
    layer = HelperBranchAfterLoop()
    conv = pickle.loads(pickle.dumps(ttt2la.convert(layer, level=0,
                                                    example_inputs=(torch.randn(2, 16, D),))))
    same_or_refused(conv, layer, [torch.randn(2, T, D) for T in (16, 24, 14)])
