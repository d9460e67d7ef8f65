"""TTT code written in sequence-parallel form, as titans-pytorch writes its memory: every chunk's
gradient at once, then momentum over the chunks as a scan (shifted copies joined, or a prefix
sum). Traced, that is one step whose update runs along the sequence in order; step 5 cannot
remove a momentum that is an op inside the step, so it says so (``not_applicable``, naming the
scan's line) where a step that every token reads alike is ``already_satisfied``.
"""
from __future__ import annotations

import inspect

import pytest
import module_scoped
import torch

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error

TOL = TOLERANCE[torch.float32]


def gated_scan(gates: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``h_j = gates_j · h_(j-1) + values_j`` along axis 1 by doubling (Hillis–Steele)."""
    step = 1
    while step < gates.shape[1]:
        gates_before = torch.cat([torch.ones_like(gates[:, :step]), gates[:, :-step]], dim=1)
        values_before = torch.cat([torch.zeros_like(values[:, :step]), values[:, :-step]], dim=1)
        values = values + gates[..., None, None] * values_before
        gates = gates * gates_before
        step *= 2
    return values


class ParallelMemory(torch.nn.Module):
    """A linear memory stepped on every chunk at once: ``scan`` says how the chunks' surprises
    reach the weights each chunk reads — "gated" (momentum, by ``gated_scan``), "prefix" (a
    running sum, ``cumsum``) or "total" (all of them: one step every token reads alike). With
    ``bias`` the memory is ``x @ W + b``: a bias added over the tokens, which is no step."""

    def __init__(self, dim: int = 8, heads: int = 2, chunk: int = 4, scan: str = "gated",
                 bias: bool = False):
        super().__init__()
        self.heads, self.chunk, self.scan = heads, chunk, scan
        self.weight = torch.nn.Parameter(torch.randn(heads, dim // heads, dim // heads) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(heads, dim // heads)) if bias else None
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.to_momentum = torch.nn.Linear(dim, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        H, C = self.heads, self.chunk
        n = L // C
        q, k, v = (t.reshape(B, n, C, H, D // H).permute(0, 3, 1, 2, 4)
                   for t in self.qkv(x).chunk(3, dim=-1))            # [B, H, n, C, d]
        w = self.weight[None, :, None]                               # [1, H, 1, d, d]
        b = 0 if self.bias is None else self.bias[None, :, None, None]
        surprise = k.transpose(-1, -2) @ (v - (k @ w + b)) / C       # [B, H, n, d, d]
        if self.scan == "total":
            reads = w + surprise.sum(dim=2, keepdim=True)
        else:
            surprise = surprise.flatten(0, 1)
            if self.scan == "gated":
                gates = self.to_momentum(x).sigmoid().reshape(B, n, C, H).mean(2)
                summed = gated_scan(gates.permute(0, 2, 1).flatten(0, 1), surprise)
            else:
                summed = surprise.cumsum(dim=1)
            reads = w + summed.view(B, H, n, *summed.shape[2:])
        y = q @ reads + b                                            # [B, H, n, C, d]
        return y.permute(0, 2, 3, 1, 4).reshape(B, L, D)


def _line_of(fn, text: str) -> str:
    lines, first = inspect.getsourcelines(fn)
    return f"test_sequence_parallel.py:{first + next(i for i, s in enumerate(lines) if text in s)}"


@module_scoped.cached
def converted(scan: str, level: int, bias: bool = False):
    torch.manual_seed(0)
    layer = ParallelMemory(scan=scan, bias=bias)
    return layer, ttt2la.convert(layer, level=level, example_inputs=(torch.randn(2, 32, 8),))


def _status(model, name: str) -> dict:
    layer = model.ttt2la_report.to_dict()["layers"][0]
    return next(p for p in layer["passes"] if p["name"] == name)


@pytest.mark.parametrize("scan, bias", [("gated", False), ("prefix", False), ("total", False),
                                        ("gated", True)])
def test_a_sequence_parallel_step_converts_exactly(scan, bias):
    layer, fast = converted(scan, 0, bias)
    x = torch.randn(3, 32, 8)
    assert rel_rms_error(fast(x), layer(x)) <= TOL
    grads = [torch.autograd.grad(m(x).square().sum(), list(m.parameters()), allow_unused=True)
             for m in (fast, layer)]
    for mine, theirs in zip(*grads):
        assert (mine is None) == (theirs is None)
        assert theirs is None or rel_rms_error(mine, theirs) <= TOL


@pytest.mark.parametrize("scan, line", [("gated", "gates_before = torch.cat"),
                                        ("prefix", "summed = surprise.cumsum")])
def test_momentum_inside_a_scan_is_not_called_removed(scan, line):
    """Level 5 keeps the scan, and the report says so and where, instead of "no momentum"."""
    layer, fast = converted(scan, 5)
    result = _status(fast, "remove_momentum")
    assert result["status"] == "not_applicable"
    where = _line_of(gated_scan if scan == "gated" else ParallelMemory.forward, line)
    assert where in result["reason"] and "keeps it" in result["reason"]
    x = torch.randn(2, 32, 8)
    with torch.no_grad():
        assert rel_rms_error(fast(x), layer(x)) <= TOL      # kept: the function as written


def test_a_step_every_token_reads_alike_has_no_momentum():
    _, fast = converted("total", 5)
    assert _status(fast, "remove_momentum")["status"] == "already_satisfied"
