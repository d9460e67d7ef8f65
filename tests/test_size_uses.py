"""Python values of the length and the batch size found by running the code
(``frontend.size_uses``): spellings the source reading does not know — ``x.size(dim=1)``,
``B, T = x.shape[:2]``, ``numel()``, ``len()``, a lambda or a ``functools.partial`` helper, a value
of ``T % 8`` passed to an op or looked up in a dict, NumPy on it, its text, ``int(T)``,
``operator.index(T)``, ``bit_length()``, ``pow(T, 3, 8)``, ``0.5 * T``, ``[a, b][T % 2]`` (of
numbers, or of tensors computed there), ``'%d' % T``, ``min(T, 20.5)``, ``0.5 * abs(T)``, ``0.5 * int(T)`` — in the code that calls the
loop's function, and branches on the batch size, which no source reading looks for. A converted layer computes
the code's function at every shape, or refuses the shape; never another branch's output."""
import functools
import inspect
import math
import operator
import sys
from math import sqrt

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.frontend.size_uses import probe_sizes, size_uses

import size_helpers
from shape_checks import each_call_same_or_refused, loop_line, same_or_refused

D = 8
BETA, LR = 0.5, 0.1


def _close(o, T, scale=2):
    return o * scale if T % 8 else o + 2


close_lambda = lambda o, T: o * 2 if T % 8 else o + 2      # noqa: E731
close_partial = functools.partial(_close, scale=2)


class Momentum(nn.Module):
    """Chunked linear attention with momentum, its loop in ``run``; ``forward`` hands the loop's
    output to ``finish``, which each spelling writes its own way (level 5 removes the momentum,
    so ``simplified`` is the function a lossy conversion computes)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)
        self.close_attr = _close

    def run(self, x, c=None):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            M = BETA * M + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            S = S + LR * M
        return torch.cat(outs, 1)

    def run_simplified(self, x, c: float):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + LR * c * k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
        return torch.cat(outs, 1)

    def forward(self, x):
        return self.finish(self.run(x), x)

    def simplified(self, x, c: float):
        return self.finish(self.run_simplified(x, c), x)


class SizeKeyword(Momentum):
    def finish(self, o, x):
        T = x.size(dim=1)
        return o * 2 if T % 8 else o + 2


class ShapeSlice(Momentum):
    def finish(self, o, x):
        B, T = x.shape[:2]
        return o * 2 if T % 8 else o + 2


class Numel(Momentum):
    def finish(self, o, x):
        return o * 2 if x[0].numel() % (8 * D) else o + 2


class Len(Momentum):
    def finish(self, o, x):
        T = len(x[0])
        return o * 2 if T % 8 else o + 2


class Lambda(Momentum):
    def finish(self, o, x):
        return close_lambda(o, x.shape[1])


class Partial(Momentum):
    def finish(self, o, x):
        return close_partial(o, x.shape[1])


class Attribute(Momentum):
    def finish(self, o, x):
        return self.close_attr(o, x.shape[1])


class Value(Momentum):
    def finish(self, o, x):
        return o * (1 + x.shape[1] % 8)


class ComparedValue(Momentum):
    def finish(self, o, x):
        return o + o * float(x.shape[1] % 8 == 0)


class Lookup(Momentum):
    def finish(self, o, x):
        return o * {0: 3.0}.get(x.shape[1] % 8, 2.0)


class MathBranch(Momentum):
    def finish(self, o, x):
        return o * 2 if math.log2(x.shape[1]) % 1 else o + 2


class MathValue(Momentum):
    def finish(self, o, x):
        return o * math.floor(math.log(x.shape[1]))


class ImportedMath(Momentum):
    def finish(self, o, x):
        return o * 2 if sqrt(x.shape[1]) % 1 else o + 2


class HelperMath(Momentum):
    def finish(self, o, x):
        return o + 2 if size_helpers.whole_root(x.shape[1]) else o * 2


class HelperRange(Momentum):
    def finish(self, o, x):
        return o * 2 if size_helpers.chunk_count(x) > 5 else o + 2


class NumpyBranch(Momentum):
    def finish(self, o, x):
        return o * 2 if np.sqrt(x.shape[1]) % 1 else o + 2


class NumpyClip(Momentum):
    def finish(self, o, x):
        return o * 2 if np.clip(x.shape[1] % 8, 0, 1) else o + 2


class Text(Momentum):
    def finish(self, o, x):
        return o * 2 if f"{x.shape[1]}".endswith(("2", "4", "5", "8", "0")) else o + 2


class TextKey(Momentum):
    """Scales looked up by the text of the length, as a cache keyed by it holds them."""

    SCALES = {"scale_16": 3.0, "scale_24": 3.0, "scale_32": 3.0}

    def finish(self, o, x):
        return o * self.SCALES.get(f"scale_{x.shape[1]}", 2.0)


class IntCall(Momentum):
    def finish(self, o, x):
        return o * 2 if int(x.shape[1]) % 8 else o + 2


class IndexCall(Momentum):
    def finish(self, o, x):
        return o * 2 if operator.index(x.shape[1]) % 8 else o + 2


class BitLength(Momentum):
    def finish(self, o, x):
        return o * 2 if (x.shape[1] % 8).bit_length() else o + 2


class PowModulus(Momentum):
    def finish(self, o, x):
        return o * 2 if pow(x.shape[1], 3, 8) else o + 2


class FloatLeft(Momentum):
    def finish(self, o, x):
        return o * 2 if (0.5 * x.shape[1]) % 4 else o + 2


class ListIndex(Momentum):
    def finish(self, o, x):
        return o * [3.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0][x.shape[1] % 8]


class OutputIndex(Momentum):
    def finish(self, o, x):
        return (o + 2, o * 2)[(x.shape[1] % 8 + 7) // 8]


class EveryWindow(Momentum):
    def finish(self, o, x):
        return o + 2 if x.size(dim=1) % 24 == 0 else o * 2


class InConstants(Momentum):
    """Membership in a tuple of constants: the tuple compares its items one by one and stops
    at the first equal, so a run at a length among them reaches one comparison only."""

    def finish(self, o, x):
        return o + 2 if x.size(1) in (16, 24, 32) else o * 2


class AnyOfConstants(Momentum):
    """The same test in a comprehension over constants, which ``any`` stops early."""

    def finish(self, o, x):
        return o + 2 if any(t == x.shape[1] for t in (16, 24, 32)) else o * 2


class LoopOverConstants(Momentum):
    """A decision of the length in a ``for`` loop over constants, which makes the same
    iterations at every length (not an iteration of the sequence)."""

    def finish(self, o, x):
        hit = False
        for t in (16, 24, 32):
            if x.size(1) == t:
                hit = True
        return o + 2 if hit else o * 2


class MinFloat(Momentum):
    def finish(self, o, x):
        return o * min(x.shape[1], 20.5)


def _length(x):
    return x.shape[1]


class HelperFloat(Momentum):
    def finish(self, o, x):
        return o * 2 if (0.5 * _length(x)) % 4 else o + 2


class AbsFloat(Momentum):
    def finish(self, o, x):
        return o * 2 if (0.5 * abs(x.shape[1])) % 4 else o + 2


class IntFloat(Momentum):
    def finish(self, o, x):
        return o * 2 if (0.5 * int(x.shape[1])) % 4 else o + 2


class MadeLength:
    def __init__(self, x):
        self.x = x

    def length(self):
        return self.x.shape[1]


class MethodOfMadeFloat(Momentum):
    def finish(self, o, x):
        return o * 2 if (0.5 * MadeLength(x).length()) % 4 else o + 2


class SortedInPlace(Momentum):
    def finish(self, o, x):
        sizes = [x.shape[1], 20.5]
        sizes.sort()
        return o * sizes[0]


class PercentText(Momentum):
    def finish(self, o, x):
        return o * 2 if ("%d" % x.shape[1]).endswith(("2", "4", "5", "8", "0")) else o + 2


SPELLINGS = {c.__name__: c for c in (SizeKeyword, ShapeSlice, Numel, Len, Lambda, Partial,
                                     Attribute, Value, ComparedValue, Lookup, MathBranch,
                                     MathValue, ImportedMath, HelperMath, HelperRange,
                                     NumpyBranch, NumpyClip,
                                     Text, TextKey, IntCall, IndexCall, BitLength, PowModulus,
                                     FloatLeft, ListIndex, OutputIndex, PercentText, MinFloat,
                                     HelperFloat, SortedInPlace, AbsFloat, IntFloat,
                                     MethodOfMadeFloat, EveryWindow, LoopOverConstants,
                                     InConstants, AnyOfConstants)}


class OneSample(Momentum):
    """A branch for a batch of one, as code that also takes unbatched inputs writes it."""

    def finish(self, o, x):
        return o * 2 if x.shape[0] == 1 else o + 2


class BatchValue(Momentum):
    def finish(self, o, x):
        return o * (1 + x.size(0) % 4)


class LargeBatch(Momentum):
    def finish(self, o, x):
        B = len(x)
        return o * 2 if B > 3 else o + 2


BATCH_SPELLINGS = {c.__name__: c for c in (OneSample, BatchValue, LargeBatch)}


def _end(s, T):
    return s + 4 if s + 4 < T else T


class EndHelper(Momentum):
    """Each chunk's end computed by a helper the loop calls: a decision of an iteration, which
    the traces unroll, in a function of no loop."""

    def run(self, x, c=None):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            e = _end(s, T)
            outs.append(q[:, s:e] @ S)
            M = BETA * M + k[:, s:e].transpose(1, 2) @ v[:, s:e]
            S = S + LR * M
        return torch.cat(outs, 1)

    def run_simplified(self, x, c: float):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            e = _end(s, T)
            outs.append(q[:, s:e] @ S)
            S = S + LR * c * k[:, s:e].transpose(1, 2) @ v[:, s:e]
        return torch.cat(outs, 1)

    def finish(self, o, x):
        return o


class WholeChunks(Momentum):
    """The sequence viewed as its whole chunks before the loop (``T // 4`` of them): a size the
    converted graph computes at every length of whole chunks, the only lengths the code runs at."""

    def run(self, x, c=None):
        B, T, _ = x.shape
        q, k, v = (t.reshape(B, T // 4, 4, D).unbind(1) for t in self.proj(x).chunk(3, -1))
        S, M = x.new_zeros(B, D, D), x.new_zeros(B, D, D)
        outs = []
        for qc, kc, vc in zip(q, k, v):
            outs.append(qc @ S)
            M = BETA * M + kc.transpose(1, 2) @ vc
            S = S + LR * M
        return torch.cat(outs, 1)

    def run_simplified(self, x, c: float):
        B, T, _ = x.shape
        q, k, v = (t.reshape(B, T // 4, 4, D).unbind(1) for t in self.proj(x).chunk(3, -1))
        S = x.new_zeros(B, D, D)
        outs = []
        for qc, kc, vc in zip(q, k, v):
            outs.append(qc @ S)
            S = S + LR * c * kc.transpose(1, 2) @ vc
        return torch.cat(outs, 1)

    def finish(self, o, x):
        return o


#: what each layer's note quotes of the line that uses the length
NAMED = {"SizeKeyword": "o * 2 if T % 8", "ShapeSlice": "o * 2 if T % 8",
         "Numel": "x[0].numel() % (8 * D)", "Len": "T = len(x[0])", "Lambda": "o * 2 if T % 8",
         "Partial": "o * scale if T % 8", "Attribute": "o * scale if T % 8",
         "Value": "1 + x.shape[1] % 8", "ComparedValue": "x.shape[1] % 8 == 0",
         "Lookup": ".get(x.shape[1] % 8", "OneSample": "x.shape[0] == 1",
         "BatchValue": "1 + x.size(0) % 4", "LargeBatch": "B = len(x)",
         "MathBranch": "math.log2(x.shape[1]) % 1", "MathValue": "math.floor(math.log(",
         "ImportedMath": "sqrt(x.shape[1]) % 1", "HelperMath": "math.sqrt(n) % 1 == 0",
         "HelperRange": "size_helpers.chunk_count(x) > 5",
         "NumpyBranch": "np.sqrt(x.shape[1]) % 1", "NumpyClip": "np.clip(x.shape[1] % 8, 0, 1)",
         "Text": 'f"{x.shape[1]}".endswith', "TextKey": 'SCALES.get(f"scale_{x.shape[1]}"',
         "IntCall": "int(x.shape[1]) % 8", "IndexCall": "operator.index(x.shape[1]) % 8",
         "BitLength": "(x.shape[1] % 8).bit_length()", "PowModulus": "pow(x.shape[1], 3, 8)",
         "FloatLeft": "(0.5 * x.shape[1]) % 4", "ListIndex": "2.0, 2.0][x.shape[1] % 8]",
         "OutputIndex": "(o + 2, o * 2)[(x.shape[1] % 8 + 7) // 8]",
         "PercentText": '("%d" % x.shape[1]).endswith', "MinFloat": "min(x.shape[1], 20.5)",
         "HelperFloat": "(0.5 * _length(x)) % 4", "SortedInPlace": "sizes.sort()",
         "AbsFloat": "(0.5 * abs(x.shape[1])) % 4", "IntFloat": "(0.5 * int(x.shape[1])) % 4",
         "MethodOfMadeFloat": "(0.5 * MadeLength(x).length()) % 4",
         "EveryWindow": "x.size(dim=1) % 24 == 0",
         "LoopOverConstants": "if x.size(1) == t:",
         "InConstants": "x.size(1) in (16, 24, 32)",
         "AnyOfConstants": "t == x.shape[1] for t in (16, 24, 32)"}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_each_spelling_is_the_code_function_at_every_length(name):
    """The example's length 18 takes the probes' branch; lengths that are multiples of 8 take
    the other. An exact conversion gives the original's output and gradients at each, a lossy
    one the simplified function or a refusal; each reports the line."""
    if name in ("HelperFloat", "MethodOfMadeFloat") and sys.version_info < (3, 11):
        pytest.skip("an operand spelled as a call is read on Python 3.11 and later")
    for level in (0, 5):
        torch.manual_seed(0)
        layer = SPELLINGS[name]()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 18, D),))
        notes = " ".join(conv.ttt2la_report.layers[0].notes)
        assert "values of the length" in notes and NAMED[name] in notes, notes
        seen = [same_or_refused(layer, conv, T) for T in (18, 16, 24, 14, 32)]
        if level == 0:
            assert seen == ["same"] * 5
        else:
            assert seen[0] == "simplified" and "refused" in seen, seen


@pytest.mark.parametrize("name", sorted(BATCH_SPELLINGS))
def test_each_batch_spelling_is_the_code_function_at_every_batch_size(name):
    """Converted at batch size 2; batch sizes 1 and 4 and up take the other branch (or value).
    An exact conversion gives the original's output and gradients at each, a lossy one the
    simplified function or a refusal; each reports the line as a value of the batch size."""
    for level in (0, 5):
        torch.manual_seed(0)
        layer = BATCH_SPELLINGS[name]()
        conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 16, D),))
        notes = " ".join(conv.ttt2la_report.layers[0].notes)
        assert "values of the batch size" in notes and NAMED[name] in notes, notes
        seen = [same_or_refused(layer, conv, T, B)
                for B, T in ((2, 16), (1, 16), (4, 16), (3, 12), (8, 20), (1, 24))]
        if level == 0:
            assert seen == ["same"] * 6
        else:
            assert seen[0] == "simplified" and "refused" in seen, seen


@settings(max_examples=10, deadline=None)
@given(name=st.sampled_from(sorted(SPELLINGS)), level=st.sampled_from([0, 5]),
       example=st.integers(6, 26),
       calls=st.lists(st.integers(2, 40) | st.sampled_from([8, 16, 24, 32]), min_size=2,
                      max_size=4))
def test_every_call_is_the_code_function_or_refused(name, level, example, calls):
    """Any example length, any call lengths: each call gives the code's function or is
    refused."""
    each_call_same_or_refused(SPELLINGS[name], level, example, calls)


# --- the run itself ------------------------------------------------------------------------

def chunked(x):
    """Uses of the length the converted graph computes at any length, or that raise, or that
    the loop's own iterations take: none is a use."""
    B, T, _ = x.shape
    assert T % 4 == 0, "whole chunks"
    if x.size(1) % 4:
        raise ValueError("whole chunks")
    n = T // 4
    ends = [min(s + 4, T) for s in range(0, T, 4)]      # the chunks' ends: an iteration's
    xs = x.view(B, len(ends), 4, D)
    out = x.new_zeros(B, T, D)
    for i in range(n):
        e = min(4 * i + 4, T)
        out[:, 4 * i:e] = xs[:, i] * (T == x.shape[1])
    return out[:, :T] * 2


def branching(x):
    B, T = x.shape[:2]
    o = x * 2
    for s in range(0, T, 4):
        o = o + 1
    if x.size(dim=1) % 8:
        o = o + 1
    o = o * (1 + T % 8)
    o = o + torch.tensor(T % 3)
    return o.squeeze(0) if B == 1 else o * B


def uses(fn, L: int = 20, B: int = 3):
    x = torch.randn(B, L, D)
    found = size_uses(lambda: fn(x), L, B, 4, 1, (__file__, loop_line(fn)))
    return [(v.line - inspect.getsourcelines(fn)[1], v.what, v.of) for v in found]


def test_sizes_guards_and_the_loop_are_no_uses():
    assert uses(chunked) == []


@pytest.mark.parametrize("make, lengths", [(EndHelper, (18, 16, 24, 14, 32, 7, 41)),
                                            (WholeChunks, (24, 16, 8, 32, 40, 64, 4))],
                         ids=["EndHelper", "WholeChunks"])
def test_sizes_guards_and_the_loop_are_no_uses_of_a_converted_layer(make, lengths):
    """A lossy conversion, which refuses a length where the code may decide otherwise than at
    the traced ones, computes the simplified function at every length: neither a helper the loop
    calls nor the count of whole chunks is a use of the length."""
    torch.manual_seed(0)
    layer = make()
    conv = ttt2la.convert(layer, level=5, example_inputs=(torch.randn(2, lengths[0], D),))
    notes = " ".join(conv.ttt2la_report.layers[0].notes)
    assert "values of the length" not in notes, notes
    assert [same_or_refused(layer, conv, T) for T in lengths] == ["simplified"] * len(lengths)


def test_branches_values_and_tensors_of_the_length_are_uses():
    assert uses(branching) == [(5, "branches on", "the length"),
                               (7, "passes `Tensor.mul` a number of", "the length"),
                               (8, "makes a tensor of", "the length"),
                               (9, "compares", "the batch size")]


def test_no_size_of_the_layer_is_a_multiple_of_the_run_sizes():
    """A size of the run that is a multiple of ``L*`` (``B*``) must be one of the length (the
    batch size)."""
    for sizes, chunk, unit in (({8, 24, 2}, 4, 1), ({512, 1536, 128, 4}, 2048, 4),
                               ({16, 48}, 1, 1), ({20, 40, 60}, 1, 2), ({64, 192, 320}, 64, 1)):
        L, B = probe_sizes(sizes, chunk, unit)
        assert L % chunk == 0 and L >= max(16, 2 * chunk) and B % unit == 0 and B >= 2 * unit
        assert not any(s % L == 0 or s % B == 0 for s in sizes)
        assert L % B and B % L
