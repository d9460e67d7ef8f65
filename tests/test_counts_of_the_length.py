"""Numbers of items that are values of the length or the batch size: the chunks a loop appended
(``len(outs)``, with items before the loop, after it, or more than one per iteration),
``len(range(0, T, C))``, the pieces of a tensor cut along the token or batch axis
(``len(x.split(C, 1))``, ``len(x.unbind(0))``), a stride (``x.stride(0) // D``) and a tensor made
of the shape (``int(torch.tensor(x.shape)[1])``). CPython hands out each as a plain
``int``; the source reading and the run still find the code's decisions on them, so a converted
layer computes the code's function at every shape or refuses the shape. Inside the loop, a
decision on the number of chunks appended so far is refused like one on the loop index."""
import inspect

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.frontend.length_values import length_values
from ttt2la.frontend.size_uses import size_uses

import size_helpers
from shape_checks import each_call_same_or_refused, loop_line, same_or_refused

D = 8
BETA, LR = 0.5, 0.1

#: helpers the source reading does not follow (a lambda): only the run sees their counts
chunks_of = lambda x: len(range(0, x.shape[1], 4))      # noqa: E731
pieces_of = lambda x: len(x.split(4, 1))                 # noqa: E731
appended = lambda outs: len(outs)                        # noqa: E731


class Counted(nn.Module):
    """Chunked linear attention with momentum; ``finish`` reads a count of the length after the
    loop (level 5 removes the momentum: ``simplified`` is the lossy conversion's function)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        return self.finish(torch.cat(outs, 1), x, outs)

    def simplified(self, x, c: float):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + LR * c * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return self.finish(torch.cat(outs, 1), x, outs)


class LenOuts(Counted):
    def forward(self, x):                       # the count read in the loop's own function
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        n = len(outs)
        o = torch.cat(outs, 1)
        return o * 2 if n > 5 else o + 2

    def finish(self, o, x, outs):
        return o * 2 if len(outs) > 5 else o + 2


class LenOutsValue(Counted):
    def finish(self, o, x, outs):
        return o * (1 + appended(outs) % 3)


class LenRange(Counted):
    def finish(self, o, x, outs):
        return o * 2 if chunks_of(x) > 5 else o + 2


class LenSplitValue(Counted):
    def finish(self, o, x, outs):
        return o * (1 + pieces_of(x) % 3)


class LenUnbind(Counted):
    def finish(self, o, x, outs):
        return o * 2 if len(x.unbind(1)) > 20 else o + 2


class Stride(Counted):
    def finish(self, o, x, outs):
        return o * 2 if x.contiguous().stride(0) // D > 20 else o + 2


class TensorOfShape(Counted):
    def finish(self, o, x, outs):
        return o * 2 if int(torch.tensor(x.shape)[1]) > 20 else o + 2


class GrownElsewhere(Counted):
    def forward(self, x):                       # a helper of another file appends the chunks
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            size_helpers.grow(outs, q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        return self.finish(torch.cat(outs, 1), x, outs)

    def finish(self, o, x, outs):
        return o * 2 if len(outs) > 5 else o + 2


class SumOfPieces(Counted):
    def finish(self, o, x, outs):
        return o * 2 if sum(1 for _ in x.unbind(1)) > 20 else o + 2


class ListOfPieces(Counted):
    def finish(self, o, x, outs):
        return o * 2 if len(list(x.split(4, 1))) > 5 else o + 2


class PiecesComprehended(Counted):
    def finish(self, o, x, outs):
        return o * 2 if len([c for c in x.split(4, 1)]) > 5 else o + 2


class ChunksOfAView(Counted):
    def finish(self, o, x, outs):               # padded to whole chunks, then viewed as them
        padded = torch.nn.functional.pad(x, (0, 0, 0, (-x.shape[1]) % 4))
        return o * 2 if padded.reshape(-1, 4, D).shape[0] // x.shape[0] > 5 else o + 2


class Bounds(Counted):
    """The chunks' bounds listed besides the outputs: a start, each chunk's middle and end (two
    per iteration) and the length after the loop; ``finish`` reads their count."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs, bounds = [], [0]
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            bounds.extend((s + 2, s + 4))
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        bounds.append(T)
        return self.finish(torch.cat(outs, 1), x, bounds)

    def simplified(self, x, c: float):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs, bounds = [], [0]
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            bounds.extend((s + 2, s + 4))
            S = S + LR * c * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        bounds.append(T)
        return self.finish(torch.cat(outs, 1), x, bounds)

    def finish(self, o, x, bounds):
        return o * 2 if appended(bounds) > 15 else o + 2


class BoundsValue(Bounds):
    def finish(self, o, x, bounds):
        return o * (1 + appended(bounds) % 3)


SPELLINGS = {c.__name__: c for c in (LenOuts, LenOutsValue, LenRange, LenSplitValue, LenUnbind,
                                     Stride, TensorOfShape, GrownElsewhere, SumOfPieces,
                                     ListOfPieces, PiecesComprehended, ChunksOfAView, Bounds,
                                     BoundsValue)}


class OneSample(Counted):
    def finish(self, o, x, outs):
        return o * 2 if len(x.unbind(0)) == 1 else o + 2


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_each_count_is_the_code_function_at_every_length(name):
    """The example's length 18 (5 chunks) takes the probes' branch; 24 and 32 take the other
    (or another value). Exact: the original's output and gradients at each; lossy: the
    simplified function or a refusal."""
    for level in (0, 5):
        torch.manual_seed(0)
        layer = SPELLINGS[name]()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 18, D),))
        notes = " ".join(conv.ttt2la_report.layers[0].notes)
        assert "computes Python values of" in notes and "the length" in notes, notes
        seen = [same_or_refused(layer, conv, T) for T in (18, 16, 24, 14, 32)]
        if level == 0:
            assert seen == ["same"] * 5
        else:
            assert seen[0] == "simplified" and "refused" in seen, seen


def test_the_number_of_samples_is_the_code_function_at_every_batch_size():
    for level in (0, 5):
        torch.manual_seed(0)
        layer = OneSample()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))
        notes = " ".join(conv.ttt2la_report.layers[0].notes)
        assert "values of the batch size" in notes, notes
        seen = [same_or_refused(layer, conv, 16, B) for B in (2, 1, 3, 1)]
        if level == 0:
            assert seen == ["same"] * 4
        else:
            assert seen[0] == "simplified" and "refused" in seen, seen


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(sorted(SPELLINGS)), level=st.sampled_from([0, 5]),
       example=st.integers(6, 26), calls=st.lists(st.integers(2, 48), min_size=2, max_size=4))
def test_every_call_is_the_code_function_or_refused(name, level, example, calls):
    each_call_same_or_refused(SPELLINGS[name], level, example, calls)


# --- the source reading and the run, each on its own -----------------------------------------

def after_the_loop(x):
    B, T, _ = x.shape
    outs = []
    for s in range(0, T, 4):
        outs.append(x[:, s:s + 4])
    pieces = x.split(4, dim=1)
    if len(outs) > 5:
        x = x * 2
    if len(pieces) > 5:
        x = x * 2
    if len(x.unbind(1)) > 20:
        x = x * 2
    if len(x.chunk(3, -1)) > 2:          # the feature axis: no value of the length
        x = x * 2
    return x


def test_the_source_reads_counts_of_the_length():
    file = inspect.getsourcefile(after_the_loop)
    first = inspect.getsourcelines(after_the_loop)[1]
    found = length_values(file, loop_line(after_the_loop), (1, -2, 3), after=True)
    assert [(v.line - first, v.what) for v in found] == [
        (6, "branches on"), (8, "branches on"), (10, "branches on")]


def counts(x):
    outs = []
    for s in range(0, x.shape[1], 4):
        outs.append(x[:, s:s + 4])
    a = x * (appended(outs) % 3)
    b = chunks_of(x) > 5
    c = pieces_of(x) > 5
    d = x.stride(0) // D > 20
    e = int(torch.tensor(x.shape)[1]) > 20
    f = len(x.unbind(0)) == 1
    g = x * len(outs) + len(x.split(4, 1))          # affine in the length: no use
    return a, b, c, d, e, f, g


def test_the_run_hands_out_counts_of_the_sizes():
    L, B = 20, 3
    x = torch.randn(B, L, D)
    found = size_uses(lambda: counts(x), L, B, 4, 1, (__file__, loop_line(counts)))
    first = inspect.getsourcelines(counts)[1]
    assert [(v.line - first, v.what, v.of) for v in found] == [
        (4, "passes `Tensor.mul` a number of", "the length"), (5, "compares", "the length"),
        (6, "compares", "the length"), (7, "compares", "the length"),
        (8, "makes a tensor of", "the batch size"), (8, "makes a tensor of", "the length"),
        (9, "compares", "the batch size")]
    assert "len" not in globals() and "range" not in globals()


def no_counts(x):
    outs = []
    for s in range(0, x.shape[1], 4):
        outs.append(x[:, s:s + 4])
    a = sum(1 for c in x.unbind(1) if c is None) % 2 == 0        # a condition: no count
    b = len([c for c in x.unbind(1)][:3]) % 2 == 0                # three of the pieces
    c = len([c * 2 for c in x.split(4, 1)] + [x]) % 2 == 0        # other tensors
    d = x.reshape(x.shape[0], -1, 4, D).shape[2] % 3 == 0        # the chunk's own size
    e = sum(1 for _ in x.unbind(2)) % 3 == 0                      # the features
    return a, b, c, d, e


def test_the_run_counts_no_sequence_but_the_pieces_themselves():
    L, B = 20, 3
    x = torch.randn(B, L, D)
    assert size_uses(lambda: no_counts(x), L, B, 4, 1, (__file__, loop_line(no_counts))) == []


# --- inside the loop: the number of chunks appended so far -----------------------------------

class LateStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], D, D)
        outs = []
        for s in range(0, x.shape[1], 4):
            step = k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            if len(outs) >= 8:  # <- late
                step = 0.5 * step
            S = S + step
            outs.append(q[:, s:s + 4] @ S)
        return torch.cat(outs, 1)


def test_a_step_of_the_chunks_appended_so_far_is_refused_naming_the_line():
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(LateStep(), level=0, example_inputs=(torch.randn(2, 12, D),))
    lines, first = inspect.getsourcelines(LateStep.forward)
    line = first + next(i for i, t in enumerate(lines) if t.rstrip().endswith("# <- late"))
    message = str(refused.value)
    assert f"test_counts_of_the_length.py:{line}" in message, message
    assert "the iteration count `len(outs)`" in message, message



def test_a_count_read_off_a_view_vouches_for_the_lengths_that_decide_alike():
    """The reshape's ``-1`` is read as the number of chunks (``ceil(L / 4)`` times the batch), a
    function the lossy conversion evaluates at a new length: 20 tokens decide as the traced
    ones and run the plan, 24 do not and are refused. Read from two runs alone, it would be no
    line of whole tokens, and every new length refused."""
    torch.manual_seed(0)
    layer = ChunksOfAView()
    conv = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, 18, D),))
    assert [same_or_refused(layer, conv, T) for T in (20, 24)] == ["simplified", "refused"]
