"""Python values a loop computes from its index by a step (a comparison, ``%``, ``//``, a clamp):
refused naming the line and the index variable where they reach a condition or a tensor, since
the traces see only the first few iterations, where such a value may not have changed yet; the
legitimate uses of an index (slice bounds, tests of the first and the last iteration, a switch
of the configuration) still convert, and the per-token tensor the refusal asks for converts
exactly at every length."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
from torch import nn

import ttt2la
from ttt2la.frontend.index_values import index_step
from ttt2la.frontend.loops import _loops_in_file

from equivalence import assert_same_function

HERE = "test_index_values.py"
D, C = 8, 4


def _line_of(fn, marker: str = "# <- named") -> int:
    """The line of ``fn``'s source that ends with ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    (i,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(marker)]
    return start + i


class ChunkMemory(nn.Module):
    """Chunked linear attention (update, then read); ``rule`` says how its loop uses the chunk
    index ``j`` beside the slice bounds."""

    def __init__(self, rule: str, every: int = 4):
        super().__init__()
        self.rule, self.every = rule, every
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        R = self.every
        tokens = torch.arange(T, device=x.device)
        keep_t = (tokens // C % R != 0).to(x.dtype)             # the remedy: one per token
        lr_t = torch.where(tokens // C < 10, 0.1, 0.01).to(x.dtype)
        S = x.new_zeros(B, D, D)
        out = []
        for j, s in enumerate(range(0, T, C)):
            e = min(s + C, T)
            kv = k[:, s:e].transpose(1, 2) @ v[:, s:e]
            if self.rule == "reset by if":
                if j % R == 0:  # <- if
                    S = torch.zeros_like(S)
                S = S + 0.1 * kv
            elif self.rule == "reset by product":
                keep = float(j % R != 0)  # <- keep
                S = keep * S + 0.1 * kv  # <- product
            elif self.rule == "per token":
                S = keep_t[s:e].amax() * S + lr_t[s:e].amax() * kv
            elif self.rule == "step schedule":
                S = S + (0.1 if j < 10 else 0.01) * kv  # <- schedule
            else:
                S = S * (0.5 if j == 0 else 1.0) + 0.1 * kv
            out.append(q[:, s:e] @ S)
        return torch.cat(out, 1)


def _convert(layer, T: int = 16):
    torch.manual_seed(0)
    return ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, T, D),))


@pytest.mark.parametrize("rule,every,origin,use", [
    ("reset by if", 16, "# <- if", "the `if` at"),
    ("reset by product", 4, "# <- keep", "which enters tensor arithmetic"),
    ("step schedule", 4, "# <- schedule", "which enters tensor arithmetic"),
], ids=["if every 16 chunks", "product every 4 chunks", "step after 10 chunks"])
def test_a_step_of_the_loop_index_beyond_the_traces_is_refused_naming_the_line(
        rule, every, origin, use):
    """Same in every traced iteration, other ones later: no trace can see the reset or the
    schedule's step; the source names its line and variable, with the per-token tensor that
    converts (before, each converted "exactly" and was 0.1 to 4 off past the traces)."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        _convert(ChunkMemory(rule, every))
    message = str(refused.value)
    assert f"{HERE}:{_line_of(ChunkMemory.forward, origin)}" in message, message
    assert "the loop variable `j`" in message and use in message, message
    if rule == "reset by product":
        assert f"{HERE}:{_line_of(ChunkMemory.forward, '# <- product')}" in message, message
    assert "torch.arange(T" in message and "keep[s:e].amax()" in message, message


def test_the_remedy_converts_exactly_at_lengths_past_the_period():
    """The reset and the schedule computed per token before the loop and read by the chunk's
    slice: exact past the 4-chunk period and the 10-chunk step, partial chunks included."""
    torch.manual_seed(1)
    layer = ChunkMemory("per token", every=4)
    converted = _convert(layer)
    assert converted.ttt2la_report.exact
    assert_same_function(converted, layer, [torch.randn(1, 97, D)])


def test_legitimate_uses_of_the_index_convert():
    """Slice bounds (`min(s + C, T)`), a test of the first chunk, and switches of the
    configuration whose other arms hold steps the traces never ran."""
    torch.manual_seed(2)
    layer = ChunkMemory("first chunk")
    assert_same_function(_convert(layer), layer, [torch.randn(2, 37, D)])


# -- the source analysis on its own: loops written below, no trace ----------------------------

def _steps(fn) -> str | None:
    """What ``index_step`` finds in the loop of ``fn`` (the finding's origin), or ``None``."""
    import ast
    file = os.path.abspath(inspect.getsourcefile(fn))
    start = fn.__code__.co_firstlineno
    (loop,) = [lp for lp in _loops_in_file(file) if lp.function == fn.__name__
               and lp.line > start and lp.line <= start + len(inspect.getsourcelines(fn)[0])
               and not any(o.line < lp.line <= o.body_end for o in _loops_in_file(file)
                           if o.function == fn.__name__ and o is not lp)]
    found = index_step(loop)
    return None if found is None else ast.unparse(found.step.origin)


def slices_and_bounds(q, k, S, T, o):
    for i in range(-(-T // C)):
        s, e = i * C, min((i + 1) * C, T)
        blk = s // C
        S = S + k[:, s:e].mT @ k[:, s:e] + k.narrow(1, s, e - s).sum() + o[:, blk].sum()
        o[:, s:e] = q[:, s:e] @ S
    return o


def first_and_last(q, k, S, T, M):
    n = -(-T // C)
    for j, s in enumerate(range(0, T, C)):
        if j > 0 and s + C < T:
            M = k[:, s:s + C].mT @ k[:, s:s + C] if M is None else 0.9 * M
        if not j or j == n - 1:
            S = S + M
        S = S * (1.0 if s >= C else 0.5)
    return S


def counted_by_hand(q, k, S, T):
    n_seen = 0
    for kc in k.split(C, 1):
        S = S + kc.mT @ kc
        if n_seen % 8 == 7:
            S = S / 2
        n_seen += 1
    return S


def clamped_schedule(q, k, S, T):
    for t in range(T):
        lr = min(t, 100) / 100
        S = S + lr * k[:, t, :, None] * k[:, t, None, :]
    return S


def rounded_schedule(q, k, S, T):
    for t in range(T):
        S = S.mul_(round(t / 1000) + 1)
    return S


def membership(q, k, S, T):
    for t in range(T):
        S = torch.where(torch.tensor(t in (5, 900)), 0 * S, S) + k[:, t].sum()
    return S


def window_positions(q, k, S, T, W):
    for t in range(T):
        lo = max(0, t - W)
        S = S + k[:, lo:t + 1].sum(1).mean() + k[:, t % W].sum()
    return S


def halved_every_ten(q, k, S, T):
    for j, s in enumerate(range(0, T, C)):
        i = s // C                                  # the counter again: by the loop's step
        lr = 0.1 * 0.5 ** (j // 10) if i > 0 else 0.2
        S = S + lr * k[:, s:s + C].mT @ k[:, s:s + C]
    return S


def while_counter(q, k, S, T):
    s = 0
    while s < T:
        S = S + k[:, s:s + C].sum()
        if s % 64 == 0:
            S = S * 0
        s += C
    return S


@pytest.mark.parametrize("fn,origin", [
    (slices_and_bounds, None),
    (first_and_last, None),
    (window_positions, None),
    (counted_by_hand, "n_seen % 8"),
    (clamped_schedule, "min(t, 100)"),
    (rounded_schedule, "round(t / 1000)"),
    (membership, "t in (5, 900)"),
    (halved_every_ten, "j // 10"),
    (while_counter, "s % 64"),
    (ChunkMemory.forward, "j % R"),
], ids=lambda v: getattr(v, "__name__", v))
def test_the_source_analysis_tells_steps_from_positions_and_ends(fn, origin):
    assert _steps(fn) == origin
