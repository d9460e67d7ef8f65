"""A TTT layer its caller hands a schedule of token offsets computed from the length, as LaCT's
novel-view blocks do (``info["ops"]``): the layer is converted as part of the module that
computes the schedule, so the converted model takes any length, each with its own schedule —
where the layer alone, probed at other lengths with the example's schedule, was refused or
pinned to the example's length. Every conversion is compared with the model as written.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function


class ScheduledMemory(nn.Module):
    """Linear fast weights stepped and read by the steps ``info["ops"]`` lists:
    ``(start, end, update, apply)``."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)

    def forward(self, x, info):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = self.w.expand(B, d, d), []
        for start, end, update, apply in info["ops"]:
            if apply:
                outs.append(q[:, start:end] @ W)
            if update:
                W = W + k[:, start:end].transpose(1, 2) @ v[:, start:end] / (end - start)
        return torch.cat(outs, 1)


class Block(nn.Module):
    """Builds the schedule from the length: chunks of ``C`` read, then stepped on
    (``"chunks"``), or one step on all tokens, then one read of them all (``"whole"``)."""

    def __init__(self, mode: str, d: int = 8, C: int = 4):
        super().__init__()
        self.mode, self.C = mode, C
        self.memory = ScheduledMemory(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        L = x.shape[1]
        if self.mode == "chunks":
            ops = [(s, min(s + self.C, L), True, True) for s in range(0, L, self.C)]
        else:
            ops = [(0, L, True, False), (0, L, False, True)]
        return x + self.out(self.memory(x, {"ops": ops}))


class TwoBlocks(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.blocks = nn.ModuleList([Block(mode), Block(mode)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["chunks", "whole"])
@pytest.mark.parametrize("make", [Block, TwoBlocks])
def test_a_schedule_from_the_caller_converts_for_every_length(make, mode):
    torch.manual_seed(0)
    model = make(mode)
    fast = ttt2la.convert(model, level=2, example_inputs=(torch.randn(2, 16, 8),))
    paths = [layer.module_path for layer in fast.ttt2la_report.layers]
    assert paths == ([""] if make is Block else ["blocks.0", "blocks.1"])
    assert fast.ttt2la_report.exact
    assert_same_function(fast, model, [torch.randn(3, 24, 8), torch.randn(1, 12, 8)])


class CheckingBlock(Block):
    """The same block, which checks its output with a Python ``if`` on a tensor: a caller
    ttt2la cannot trace, so the layer it calls converts alone, for the example's schedule (a
    single step over the example's tokens)."""

    def forward(self, x):
        y = super().forward(x)
        if y.abs().max() > 1e6:
            raise ValueError("diverged")
        return y


def test_a_caller_that_cannot_be_converted_leaves_the_layer_it_calls():
    torch.manual_seed(0)
    model = CheckingBlock("whole")
    x = torch.randn(2, 16, 8)
    fast = ttt2la.convert(model, level=2, example_inputs=(x,))
    assert [layer.module_path for layer in fast.ttt2la_report.layers] == ["memory"]
    assert_same_function(fast, model, [x, torch.randn(3, 16, 8)])
