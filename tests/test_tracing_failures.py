"""A catalogue of code ttt2la's shapes-only trace cannot stand for: every entry is refused with a
``ConversionError`` that names the layer and the source line, never a raw torch exception (or a
crash: NumPy on a fake tensor takes the process down unless it is stopped first).

Every layer is a small chunked loop with one construct the tracer cannot handle; the line to be
named is marked in its source with ``# <- named``.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn

import ttt2la

C = 3


class _Loop(nn.Module):
    """Projections and a fast weight shared by the catalogue's layers."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)

    def qkv(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        return q, k, v, self.w.expand(x.shape[0], -1, -1)


class ItemAsRate(_Loop):
    """``.item()`` inside the loop: a Python float read from the chunk."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            rate = 1.0 / (1.0 + k[:, s:s + C].pow(2).mean().item())  # <- named
            W = W + rate * k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class ItemBeforeLoop(_Loop):
    """``.item()`` before the loop: a rate read from the whole input."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        rate = x.abs().mean().item()  # <- named
        outs = []
        for s in range(0, x.shape[1], C):
            W = W + rate * k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class TolistOfData(_Loop):
    """``.tolist()`` of data: per-chunk rates as Python numbers."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        rates = torch.sigmoid(x[:, :, 0].mean(0)).tolist()  # <- named
        outs = []
        for s in range(0, x.shape[1], C):
            W = W + rates[s] * k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class IfOnChunk(_Loop):
    """A Python ``if`` on a tensor inside the loop."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            if k[:, s:s + C].mean() > 0:  # <- named
                W = W + k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class WhileOnState(_Loop):
    """A ``while`` whose condition reads the fast weight."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            W = W + k[:, s:s + C].mT @ v[:, s:s + C]
            while W.abs().max() > 1e4:  # <- named
                W = W / 2
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class RangeOfTensor(_Loop):
    """``range`` over a tensor: the number of inner steps read from the data."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        steps = (x[0, 0, 0] > 0).long() + 1
        outs = []
        for s in range(0, x.shape[1], C):
            for _ in range(steps):  # <- named
                W = W + k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class BooleanMaskKeys(_Loop):
    """Boolean-mask indexing: the number of keys kept depends on their values."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            kept = k[:, s:s + C][k[:, s:s + C].sum(-1) > 0]  # <- named
            W = W + kept.sum(0)[:, None] * v[:, s:s + C].mean(1)[:, None, :]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class NonzeroCount(_Loop):
    """``nonzero``: a shape that depends on the data, used as a number."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            hits = torch.nonzero(k[:, s:s + C, 0] > 0).shape[0]  # <- named
            W = W + (hits + 1) * k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class UniqueCount(_Loop):
    """``unique``: the number of distinct values scales the step."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            distinct = torch.unique(k[:, s:s + C].round())  # <- named
            W = W + distinct.numel() * (k[:, s:s + C].mT @ v[:, s:s + C])
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class NumpyStep(_Loop):
    """NumPy inside the loop (under fake tensors this would crash the process)."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            scale = float(np.tanh(k[:, s:s + C].detach().numpy()).mean())  # <- named
            W = W + scale * k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class LeastSquaresStep(_Loop):
    """An op with no shape-only implementation (``linalg.lstsq``)."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            fit = torch.linalg.lstsq(k[:, s:s + C], v[:, s:s + C]).solution  # <- named
            W = W + 0.1 * fit
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class IterateOverBatch(_Loop):
    """Iterating a tensor: a Python loop over the batch inside the chunk loop."""

    def forward(self, x):
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            W = W + k[:, s:s + C].mT @ v[:, s:s + C]
            W = torch.stack([w / (1 + w.norm()) for w in W])  # <- named
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


class FixedLength(_Loop):
    """A layer that refuses every length but its example's."""

    def forward(self, x):
        assert x.shape[1] == 11, "this layer runs at length 11 only"  # <- named
        q, k, v, W = self.qkv(x)
        outs = []
        for s in range(0, x.shape[1], C):
            W = W + k[:, s:s + C].mT @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        return torch.cat(outs, dim=1)


CATALOGUE = [ItemAsRate, ItemBeforeLoop, TolistOfData, IfOnChunk, WhileOnState, RangeOfTensor,
             BooleanMaskKeys, NonzeroCount, UniqueCount, NumpyStep, LeastSquaresStep,
             IterateOverBatch, FixedLength]


def _named_line(cls) -> int:
    lines, start = inspect.getsourcelines(cls)
    (i,) = [i for i, line in enumerate(lines) if line.rstrip().endswith("# <- named")]
    return start + i


@pytest.mark.parametrize("cls", CATALOGUE, ids=lambda c: c.__name__)
def test_tracing_failure_is_a_conversion_error_naming_the_layer_and_line(cls):
    torch.manual_seed(0)
    layer = cls()
    x = torch.randn(2, 11, 6)
    layer(x)                                    # the layer itself runs
    with pytest.raises(ttt2la.ConversionError) as info:
        ttt2la.convert(layer, level=2, example_inputs=(x,))
    text = str(info.value)
    assert cls.__name__ in text, text
    assert f"test_tracing_failures.py:{_named_line(cls)}" in text, text


def test_numpy_is_usable_again_after_a_refused_trace():
    """The trace's NumPy guard is lifted when tracing ends, refused or not."""
    with pytest.raises(ttt2la.ConversionError):
        ttt2la.convert(NumpyStep(), level=2, example_inputs=(torch.randn(2, 11, 6),))
    assert np.asarray(torch.ones(2)).tolist() == [1.0, 1.0]


class TwoPasses(nn.Module):
    """Two different loops over the sequence in one forward (gated slot attention's two passes):
    the second reads the first's outputs."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    @staticmethod
    def scan(q, k, v):
        S = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
        out = []
        for t in range(q.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            out.append((q[:, t, None] @ S).squeeze(1))
        return torch.stack(out, 1)

    @staticmethod
    def read(q, k, v):
        S = q.new_zeros(q.shape[0], q.shape[-1], v.shape[-1])
        out = []
        for t in range(q.shape[1]):
            S = S + k[:, t, :, None] * v[:, t, None, :]
            out.append((q[:, t, None] @ S).squeeze(1))
        return torch.stack(out, 1)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.read(q, k, self.scan(q, k, v).softmax(-1))


def test_two_loops_over_the_sequence_are_refused_naming_the_loop_and_the_fix():
    """The refusal names the loop it tried (its line, the layer) and says what converts: one loop
    per module call, each in a submodule of its own."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(TwoPasses(), level=0, example_inputs=(torch.randn(2, 12, 8),))
    message = str(refused.value)
    assert "the loop at tests/test_tracing_failures.py:" in message or \
        "test_tracing_failures.py:" in message.split("the loop at", 1)[-1], message
    assert "in TwoPasses" in message and "a submodule of its own" in message, message


class TwoMemories(nn.Module):
    """A memory over chunks of 8 tokens, then another over tokens (``second="token"``) or over
    chunks (``second="chunk"``), their outputs summed: two loops over the sequence, one after
    the other, in one call."""

    def __init__(self, d: int = 8, second: str = "token", chunk: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.second, self.chunk = second, chunk

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        S = torch.zeros_like(W)
        outs, ys, C = [], [], self.chunk
        for s in range(0, x.shape[1], C):                               # <- first
            W = W + k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]
            outs.append(q[:, s:s + C] @ W)
        if self.second == "token":
            for t in range(x.shape[1]):                                 # <- second
                S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
                ys.append((q[:, t, None] @ S).squeeze(1))
            return torch.cat(outs, 1) + torch.stack(ys, 1)
        for s in range(0, x.shape[1], 8):                               # <- second
            ys.append(k[:, s:s + 8] @ S)
            S = 0.5 * S + q[:, s:s + 8].transpose(1, 2) @ v[:, s:s + 8]
        return torch.cat(outs, 1) + torch.cat(ys, 1)


def _marked(cls, mark: str, second: str) -> list[int]:
    """The lines of ``cls.forward`` marked ``# <- mark`` (the second loop of its ``second``
    kind: the token loop comes first in the source)."""
    lines, start = inspect.getsourcelines(cls.forward)
    found = [start + i for i, line in enumerate(lines) if line.rstrip().endswith(f"# <- {mark}")]
    return found if mark == "first" else [found[0 if second == "token" else 1]]


@pytest.mark.parametrize("second,length,chunk", [("token", 8, 8), ("token", 48, 8),
                                                  ("chunk", 48, 8), ("token", 8, 32)])
def test_a_second_loop_beside_the_first_is_refused_naming_both(second, length, chunk):
    """A loop over the sequence after another, in one call, is refused naming both loops and
    what converts, whatever the example's length: an example of one chunk runs the chunk loop
    once at every probe length of the token loop, where nothing else tells the two apart, and a
    conversion from it ran one chunk at every length (a silent wrong answer); chunks of 32
    still run one at twice an example of 8 tokens. The refusal is the public class, naming
    source lines, never the graph's text."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(TwoMemories(second=second, chunk=chunk), level=0,
                       example_inputs=(torch.randn(2, length, 8),), strict=False)
    assert type(refused.value) is ttt2la.UnsupportedTTTError
    message = str(refused.value)
    for line in _marked(TwoMemories, "first", second) + _marked(TwoMemories, "second", second):
        assert f"test_tracing_failures.py:{line}" in message, (line, message)
    assert "submodule of its own" in message and "in TwoMemories" in message, message
    assert "%" not in message and "call_function" not in message, message


class OneLoop(nn.Module):
    """A decayed linear memory over tokens."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        return TwoPasses.scan(*self.qkv(x).chunk(3, -1))


def test_a_model_keeps_its_layer_of_two_loops_as_written():
    """In a model, the layer of two loops is left as written, the other layer converted, and
    the converted model computes the model at another length than the example's."""
    torch.manual_seed(0)
    model = nn.Sequential(OneLoop(), TwoMemories()).eval()
    converted = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 8, 8),),
                               strict=False)
    notes = " ".join(converted.ttt2la_report.notes)
    assert "not converted: 1:" in notes and "in 1 (TwoMemories)" in notes, notes
    x = torch.randn(2, 24, 8)
    with torch.no_grad():
        want, got = model(x), converted(x)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


class StepsPerLength(nn.Module):
    """A chunk loop, then a step repeated once per three tokens: code around the loop whose
    number of ops grows with the length, though it slices no token."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], 4):                               # <- loop
            W = W + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            outs.append(q[:, s:s + 4] @ W)
        y = torch.cat(outs, 1)
        for _ in range(x.shape[1] // 3):
            y = 0.5 * y                                                 # <- grows
        return y


def test_code_around_the_loop_that_changes_with_the_length_is_named():
    """The refusal of code around the loop that runs more ops at a longer length names the
    loop and escapes as the public class."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(StepsPerLength(), level=0, example_inputs=(torch.randn(2, 12, 8),))
    assert type(refused.value) is ttt2la.UnsupportedTTTError
    message = str(refused.value)
    lines, start = inspect.getsourcelines(StepsPerLength.forward)
    loop, grows = (next(start + i for i, line in enumerate(lines) if line.rstrip().endswith(m))
                   for m in ("# <- loop", "# <- grows"))
    assert f"the loop at tests/test_tracing_failures.py:{loop} in forward in StepsPerLength" \
        in message, message
    assert f"test_tracing_failures.py:{grows}" in message, message
    assert "%" not in message and "call_function" not in message, message


def test_a_failure_quoted_in_a_note_names_its_public_class():
    """An internal refinement of a refusal is quoted under the public class it escapes as."""
    from ttt2la.frontend.recognize import _ShapeDependent, _first_line
    assert _first_line(_ShapeDependent("runs other ops at length 80\nmore")) == \
        "UnsupportedTTTError: runs other ops at length 80"
