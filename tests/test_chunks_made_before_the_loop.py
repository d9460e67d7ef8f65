"""Chunks cut or sliced before the loop, or made by a generator the loop statement iterates, or windows
that do not overlap (``t.unfold(1, C, C)``, read by index or unbound).

``zip(*(t.split(C, 1) for t in (q, k, v)))`` built before the loop, ``qs = q.split(C, 1)`` read
as ``qs[i]``, a list of ``q[:, i:i+C]`` slices (by a comprehension, or by a loop that only appends
slices, transposed or not), a generator expression or a generator method in
the loop statement, and a pre-chunked ``[B, N, K, d]`` sequence unbound before the loop or
stacked back with ``torch.stack``, and a mini-batch-first sequence whose iterations each give one
item of a unit axis joined by ``cat`` (a scan over groups of one mini-batch): each converts exactly
onto the runtime op, outputs and every gradient within the fp32 bound at other batches and lengths.
A plan that fails on the example itself is called ttt2la's bug, at the loop's line. Pieces every iteration reads (heads
cut before a loop over chunks) stay loop-invariant, and a plan whose output has another shape
than the loop's is refused, never returned.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ttt2la
from equivalence import assert_same_function

D, C = 8, 4


class ChunksBeforeTheLoop(nn.Module):
    """One additive fast-weight layer (read, then update), its chunks taken in one of ``STYLES``."""

    def __init__(self, style: str):
        super().__init__()
        self.style = style
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.w0 = nn.Parameter(torch.randn(D, D) * 0.1)

    def _chunks(self, *ts):
        for i in range(0, ts[0].shape[1], C):
            yield tuple(t[:, i:i + C] for t in ts)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = F.normalize(k, dim=-1)
        W = self.w0.expand(x.shape[0], -1, -1)
        if self.style == "pre_chunked_unbind_list":
            return self._pre_chunked(x, q, k, v, W)
        if self.style == "mini_batch_first_items":
            return self._mini_batch_first(x, q, k, v, W)
        if self.style == "appended_transposed_keys":
            return self._transposed_keys(x, q, k, v, W)
        if self.style.startswith("unfold"):
            return self._unfolded(q, k, v, W)
        if self.style == "zip_of_split_generator":
            chunks = zip(*(t.split(C, 1) for t in (q, k, v)))
        elif self.style == "zip_of_split_list":
            chunks = zip(*[t.split(C, 1) for t in (q, k, v)])
        elif self.style == "list_of_slices":
            chunks = [(q[:, i:i + C], k[:, i:i + C], v[:, i:i + C]) for i in range(0, x.shape[1], C)]
        elif self.style == "generator_of_slices":
            chunks = ((q[:, i:i + C], k[:, i:i + C], v[:, i:i + C]) for i in range(0, x.shape[1], C))
        elif self.style == "generator_method":
            chunks = self._chunks(q, k, v)
        elif self.style == "appended_slices":        # a loop that only cuts, then the TTT loop
            chunks = []
            for i in range(0, x.shape[1], C):
                chunks.append((q[:, i:i + C], k[:, i:i + C], v[:, i:i + C]))
        else:  # "indexed_pieces"
            qs, ks, vs = q.split(C, 1), k.split(C, 1), v.split(C, 1)
            chunks = ((qs[i], ks[i], vs[i]) for i in range(len(qs)))
        outs = []
        for qc, kc, vc in chunks:
            outs.append(qc @ W)
            W = W + kc.transpose(1, 2) @ vc
        return torch.cat(outs, 1)

    def _transposed_keys(self, x, q, k, v, W):
        qs, kts, vs = [], [], []
        for i in range(0, x.shape[1], C):
            qs.append(q[:, i:i + C])
            kts.append(k[:, i:i + C].transpose(1, 2))
            vs.append(v[:, i:i + C])
        outs = []
        for j in range(len(qs)):
            outs.append(qs[j] @ W)
            W = W + kts[j] @ vs[j]
        return torch.cat(outs, 1)

    def _unfolded(self, q, k, v, W):
        """Windows that do not overlap, ``t.unfold(1, C, C)``: ``[B, N, D, C]``, tokens last."""
        qs, ks, vs = (t.unfold(1, C, C) for t in (q, k, v))
        outs = []
        if self.style == "unfold_indexed":
            for i in range(qs.shape[1]):
                outs.append(qs[:, i].mT @ W)
                W = W + ks[:, i] @ vs[:, i].mT
        else:  # "unfold_unbind"
            for qc, kc, vc in zip(qs.unbind(1), ks.unbind(1), vs.unbind(1)):
                outs.append(qc.mT @ W)
                W = W + kc @ vc.mT
        return torch.cat(outs, 1)

    def _pre_chunked(self, x, q, k, v, W):
        B, L, _ = x.shape
        batches = list(zip(*(t.reshape(B, L // C, C, D).unbind(1) for t in (q, k, v))))
        outs = []
        for qc, kc, vc in batches:
            outs.append(qc @ W)
            W = W + kc.transpose(1, 2) @ vc
        return torch.stack(outs, 1).reshape(B, L, D)

    def _mini_batch_first(self, x, q, k, v, W):
        """Mini-batch-first ``[N, B, C, D]`` read as ``t[i]``, each iteration's output an item of
        a unit axis (a scan over groups of one mini-batch, each group's outputs stacked), the
        items joined by ``cat`` into ``[N, B, C, D]``: N items, not N chunks of C tokens."""
        B, L, _ = x.shape
        qs, ks, vs = (t.reshape(B, L // C, C, D).transpose(0, 1) for t in (q, k, v))
        outs = []
        for i in range(L // C):
            outs.append(torch.stack([qs[i] @ W]))
            W = W + ks[i].transpose(1, 2) @ vs[i]
        return torch.cat(outs, 0).transpose(0, 1).reshape(B, L, D)


STYLES = ["mini_batch_first_items", "zip_of_split_generator", "zip_of_split_list", "list_of_slices", "generator_of_slices",
          "generator_method", "indexed_pieces", "pre_chunked_unbind_list", "appended_slices",
          "appended_transposed_keys", "unfold_indexed", "unfold_unbind"]


@pytest.fixture(scope="module", params=STYLES)
def converted(request):
    torch.manual_seed(0)
    layer = ChunksBeforeTheLoop(request.param)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 4 * C, D),))


def test_each_style_lifts_onto_the_runtime_op_exactly(converted):
    _, conv = converted
    report, = conv.ttt2la_report.layers
    assert conv.ttt2la_report.exact
    assert report.schedule == "parallel" and report.runtime.startswith("block_linear_attention"), \
        (report.schedule, report.runtime)


@settings(max_examples=3, deadline=None)
@given(B=st.integers(1, 3), n=st.integers(1, 9))
def test_each_style_is_the_same_function_at_other_shapes(converted, B, n):
    layer, conv = converted
    assert_same_function(conv, layer, torch.randn(B, n * C, D))


class HeadsCutBeforeTheLoop(nn.Module):
    """Heads cut before a loop over chunks, every head read by every iteration: the head pieces
    are loop-invariant values, not chunks."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        heads = [t.split(D // 2, -1) for t in (q, k, v)]
        Ws = [x.new_zeros(x.shape[0], D // 2, D // 2) for _ in range(2)]
        outs = []
        for i in range(0, x.shape[1], C):
            per_head = []
            for h in range(2):
                qh, kh, vh = (t[h][:, i:i + C] for t in heads)
                per_head.append(qh @ Ws[h])
                Ws[h] = Ws[h] + kh.transpose(1, 2) @ vh
            outs.append(torch.cat(per_head, -1))
        return torch.cat(outs, 1)


def test_pieces_every_iteration_reads_are_no_chunks():
    torch.manual_seed(0)
    layer = HeadsCutBeforeTheLoop()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 4 * C, D),))
    assert conv.ttt2la_report.exact
    assert_same_function(conv, layer, [torch.randn(3, 5 * C + 1, D), torch.randn(1, 2, D)])


class PiecesReadBackwards(ChunksBeforeTheLoop):
    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        qs, ks, vs = q.split(C, 1), k.split(C, 1), v.split(C, 1)
        W = self.w0.expand(x.shape[0], -1, -1)
        outs = []
        for i in reversed(range(len(qs))):
            outs.append(qs[i] @ W)
            W = W + ks[i].transpose(1, 2) @ vs[i]
        return torch.cat(outs[::-1], 1)


def test_pieces_read_from_the_end_are_refused_by_name():
    with pytest.raises(ttt2la.ConversionError, match="takes no chunk or token"):
        ttt2la.convert(PiecesReadBackwards("indexed_pieces"), level=0,
                       example_inputs=(torch.randn(2, 4 * C, D),))


def test_a_plan_output_of_another_shape_is_not_ok():
    from ttt2la.lowering.check import judge

    verdict = judge(torch.zeros(2, 8, 4), torch.zeros(2, 2, 4, 4), None)
    assert verdict["ok"] is False and "(2, 8, 4) where the loop gives (2, 2, 4, 4)" in verdict["shape"]


@pytest.mark.parametrize("level", [0, 2])
def test_a_plan_failing_on_the_example_is_called_a_fault_of_the_lowering(monkeypatch, level):
    """Where the plan fails on the very example the layer as written ran (here a planted fault
    in its output assembly), the conversion says it is ttt2la's bug at the loop's line, at an
    exact level too — not that a lossy conversion does not cover a shape it was converted at."""
    def broken(*a, **k):
        raise RuntimeError("start (0) + length (16) exceeds dimension size (4).")

    for module in ("chunking", "executors", "lift"):
        monkeypatch.setattr(f"ttt2la.lowering.{module}.assemble_outputs", broken)
    torch.manual_seed(0)
    with pytest.raises(ttt2la.ConversionError) as e:
        ttt2la.convert(ChunksBeforeTheLoop("mini_batch_first_items"), level=level,
                       example_inputs=(torch.randn(2, 4 * C, D),))
    msg = str(e.value)
    assert "bug in ttt2la's lowering" in msg and "fails on the example inputs" in msg, msg
    assert "test_chunks_made_before_the_loop.py:" in msg and "exceeds dimension size" in msg, msg
    assert "lossy" not in msg, msg
