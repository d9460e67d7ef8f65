"""A constant each padded token adds, whatever its value, is found at conversion.

The plan pads a partial last chunk with zeros where its first-order probe of the body finds the
padded tokens inert; ``Σ_t (v_t + 1)`` or a count of the chunk's tokens has no gradient along
them and passes that probe, yet a zero token adds to it. The conversion compares the exact
converted layer against the layer as written at a length that leaves the last chunk partial:
exact conversions then run partial chunks as written, lossy ones refuse them, and a sum that
zeros leave alone keeps the plan.
"""
from __future__ import annotations

import math
import pickle

import pytest
import module_scoped
import torch
from torch import nn

import ttt2la
from equivalence import assert_same_function

D, HEADS, C = 16, 2, 4


class PerTokenConstant(nn.Module):
    """A fast weight and a fast bias stepped per chunk; the bias by a sum over the chunk's
    tokens of ``v + 1`` (``"plus_one"``), of ``v`` (``"sum"``: zeros add nothing), its mean
    (``"mean"``: the probe of the body sees it), or the
    output normalised by a count of the tokens seen, made with ``ones_like`` (``"count"``).
    ``norm`` renormalises the fast weight's columns after each step (level 2 drops it: a lossy
    conversion). Returns the outputs and the final fast weight and bias (or count): the last
    chunk's step shows only there."""

    def __init__(self, rule: str, norm: bool = False):
        super().__init__()
        self.rule, self.norm, self.dh = rule, norm, D // HEADS
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.W0 = nn.Parameter(torch.randn(HEADS, self.dh, self.dh) * 0.1)
        self.b0 = nn.Parameter(torch.randn(HEADS, 1, self.dh) * 0.1)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, HEADS, self.dh).permute(2, 0, 3, 1, 4)
        W = self.W0.unsqueeze(0).repeat(B, 1, 1, 1)
        b = self.b0.unsqueeze(0).repeat(B, 1, 1, 1)
        n = torch.ones(B, HEADS, 1, 1)
        ys = []
        for i in range(math.ceil(T / C)):
            s = i * C
            qc, kc, vc = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]
            ys.append((qc @ W + b) / n)
            W = W + 0.1 * kc.transpose(-1, -2) @ vc
            if self.norm:
                W = W / W.norm(dim=-2, keepdim=True)
            if self.rule == "plus_one":
                b = b + 0.1 * (vc + 1).sum(2, keepdim=True)
            elif self.rule == "sum":
                b = b + 0.1 * vc.sum(2, keepdim=True)
            elif self.rule == "mean":
                b = b + 0.1 * vc.mean(2, keepdim=True)
            else:
                n = n + torch.ones_like(kc[..., :1]).sum(2, keepdim=True)
        y = torch.cat(ys, 2).transpose(1, 2).reshape(B, T, D)
        last = n if self.rule == "count" else b       # the final state the rule steps
        return torch.cat([y.flatten(1), W.flatten(1), last.flatten(1)], 1)


_cache = module_scoped.cache()


def _converted(rule: str, norm: bool = False, level: int = 2):
    key = rule, norm, level
    if key not in _cache:
        torch.manual_seed(0)
        layer = PerTokenConstant(rule, norm)
        _cache[key] = layer, ttt2la.convert(layer, level=level,
                                            example_inputs=(torch.randn(2, 8 * C, D),))
    return _cache[key]


def _partial_runs(conv) -> dict:
    return {k: v for k, v in conv.ttt2la_report.layers[0].runs.items() if "partial" in k}


@pytest.mark.parametrize("rule", ["plus_one", "count"])
def test_a_constant_per_padded_token_runs_partial_chunks_as_written(rule):
    """Exact conversions: every length equals the layer as written, outputs and gradients; a
    partial last chunk runs as written and the report says why."""
    layer, conv = _converted(rule)
    report = conv.ttt2la_report.layers[0]
    assert any("zero padding changes the layer's outputs" in n for n in report.notes), \
        report.notes
    assert_same_function(conv, layer, [torch.randn(2, 10, D), torch.randn(3, 8 * C, D)])
    runs = _partial_runs(conv)
    assert runs and all(v.startswith("as written") and "a zero token does not cancel" in v
                        for v in runs.values()), runs
    assert not any("partial" not in k and v.startswith("as written")
                   for k, v in report.runs.items()), report.runs


def test_a_sum_zeros_leave_alone_keeps_the_plan():
    layer, conv = _converted("sum")
    assert not any("partial last chunk" in n for n in conv.ttt2la_report.layers[0].notes)
    assert_same_function(conv, layer, [torch.randn(2, 10, D)])
    assert not any(v.startswith("as written") for v in _partial_runs(conv).values())


def test_a_lossy_conversion_refuses_a_partial_chunk_it_would_pad_wrongly():
    """The padding is judged on the layer converted exactly (level 0) and holds for the lossy
    program: its calls with a partial last chunk raise ``PartialChunkError``; whole chunks
    run."""
    _layer, conv = _converted("plus_one", norm=True, level=2)
    assert not conv.ttt2la_report.layers[0].exact
    conv(torch.randn(2, 4 * C, D))
    with pytest.raises(ttt2la.PartialChunkError, match="a zero token does not cancel"):
        conv(torch.randn(2, 10, D))


class ChunkMeanIncrement(nn.Module):
    """Linear attention whose increment is divided by its chunk's own token count, read from
    the chunk (``k.size(1)`` or ``k.shape[1]``): its features are token-local, so the plan runs
    them over the whole sequence, where no chunk is padded and the trace's ``1 / C`` would be
    the op's scale for a partial chunk too."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(x.shape[0], D, D)
        ys = []
        for s in range(0, x.shape[1], C):
            kc, vc = k[:, s:s + C], v[:, s:s + C]
            if self.spelling == "einsum":
                W = W + torch.einsum("bck,bcv->bkv", kc, vc) / kc.size(1)
            else:
                W = W + kc.transpose(1, 2) @ vc / kc.shape[1]
            ys.append(q[:, s:s + C] @ W)
        return torch.cat(ys, 1)


@pytest.mark.parametrize("spelling", ["einsum", "matmul"])
def test_a_divisor_read_from_the_chunk_runs_partial_chunks_as_written(spelling):
    """The whole-sequence plan on the block op: whole chunks run the op, a partial last chunk
    (whose divisor the trace never saw) runs as written, outputs and every gradient equal."""
    torch.manual_seed(0)
    layer = ChunkMeanIncrement(spelling)
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 8 * C, D),))
    assert conv._ttt2la.plan.lifted.whole_sequence
    assert_same_function(conv, layer, [torch.randn(2, 3 * C, D), torch.randn(2, 10, D),
                                       torch.randn(1, C - 1, D)])
    with torch.no_grad():
        x = torch.randn(1, 2 * C + 1, D)
        assert torch.allclose(conv(x), layer(x), rtol=1e-5, atol=1e-6)
    runs = _partial_runs(conv)
    assert runs and all(v.startswith("as written") and "div by" in v for v in runs.values()), runs
    assert conv.ttt2la_report.layers[0].runs["batch 2"] == "block_linear_attention[torch]"


def test_the_verdict_survives_pickling():
    layer, conv = _converted("count")
    again = pickle.loads(pickle.dumps(conv))
    assert again._ttt2la.program.partial_chunk == conv._ttt2la.program.partial_chunk != ""
    assert_same_function(again, layer, [torch.randn(2, 10, D)])


def test_the_check_is_no_run_of_the_layer():
    """The conversion's own call at a partial length leaves the report's runs empty, also where
    the plan's probe refuses the padding."""
    torch.manual_seed(0)
    conv = ttt2la.convert(PerTokenConstant("mean"), level=2,
                          example_inputs=(torch.randn(2, 8 * C, D),))
    assert conv.ttt2la_report.layers[0].runs == {}


def test_a_probe_the_body_cannot_run_is_a_verdict_not_a_crash(monkeypatch):
    """A body whose shapes the padded chunk does not fit: the padding is not judged inert and
    the error says why, instead of the probe's raw ``RuntimeError``."""
    from ttt2la.lowering import executors

    def unfit(*_args, **_kwargs):
        raise RuntimeError("The expanded size of the tensor (-18) must match\nmore")

    monkeypatch.setattr(executors, "_probe_padding", unfit)
    verdict = executors.padding_problem(None, [], [], None)
    assert verdict.startswith("a probe of the padded chunk, which the loop's body could not "
                              "run (The expanded size of the tensor (-18) must match)"), verdict
