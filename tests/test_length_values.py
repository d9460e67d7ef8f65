"""Python values the layer computes from the call's length — a branch, a clamp, a chunk size —
may change outside the lengths the probes traced: such a layer computes the code's function at
every length (an exact conversion checks each new length against the code as written once) or
refuses the length (lossy), naming the line; a chunk size that moves between probe lengths is
refused at conversion, naming the line that derives it."""
import math

import pytest
import torch
import torch.nn as nn

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
