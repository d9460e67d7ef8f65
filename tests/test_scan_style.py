"""Scan-style TTT: inputs pre-chunked to ``[N, B, H, K, f]``, a ``scan`` helper looping over
``xs[i]``, outputs written ``out[i] = y`` and a second call for the ``L % K`` remaining tokens.

The linear layer with the dot-product loss converts exactly at levels 0–2 (outputs and every
parameter gradient against the layer as written, at the example's length and others, partial
mini-batches and examples shorter than one mini-batch included); TTT-Linear and TTT-MLP, with
the layer norm inside the reconstruction loss, are refused at every level naming the norm.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.frontend.capture import trace
from ttt2la.frontend.discover import discover
from ttt2la.frontend.loops import find_loops
from ttt2la.frontend.prechunked import split_axis, unchunk_streams
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import ttt_scan
from ttt2la.zoo.ttt_scan import ScanLinearTTTLayer, ScanTTTLinearLayer, ScanTTTMLPLayer

TOL = TOLERANCE[torch.float32]
aten = torch.ops.aten


def _randomised(layer):
    """Learnable rates, position offsets and gates away from their initial values."""
    torch.manual_seed(11)
    with torch.no_grad():
        layer.lr_weight.normal_(0.0, 0.5)
        layer.lr_bias.normal_(0.0, 0.5)
        layer.position_offset.uniform_(-0.2, 0.3)
        layer.post_norm.weight.uniform_(0.5, 1.5)
    return layer


# -- the zoo layer is what its docstring says ---------------------------------------------------

def _per_token_reference(layer: ScanLinearTTTLayer, x: torch.Tensor) -> torch.Tensor:
    """The linear scan layer token by token: inside mini-batch j, token t reads
    ``W_j + scale_t Σ_{s≤t} lr_s k_sᵀ v_s``; the next mini-batch starts from
    ``W_j + scale_{K-1} Σ_s lr_s k_sᵀ v_s``."""
    B, L, d = x.shape
    H, K = layer.num_heads, layer.mini_batch_size
    f = d // H
    q = F.linear(x, layer.q_proj.weight).view(B, L, H, f)
    k = F.linear(x, layer.k_proj.weight).view(B, L, H, f)
    v = F.linear(x, layer.v_proj.weight).view(B, L, H, f)
    rate = torch.sigmoid(torch.einsum("bld,hd->blh", x, layer.lr_weight)
                         + layer.lr_bias[:, 0]) * (1.0 / f)                        # [B, L, H]
    scale = (1.0 / torch.arange(1, K + 1, dtype=x.dtype) + layer.position_offset).clamp(min=0)
    W = layer.W.unsqueeze(0).repeat(B, 1, 1, 1)                                    # [B, H, f, f]
    rows = []
    for start in range(0, L, K):
        acc = torch.zeros_like(W)
        for t in range(start, min(start + K, L)):
            acc = acc + rate[:, t, :, None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
            Wt = W + scale[t - start] * acc
            rows.append(q[:, t] + torch.einsum("bhf,bhfg->bhg", q[:, t], Wt))
        W = W + scale[K - 1] * acc
    y = torch.stack(rows, dim=1).reshape(B, L, d)
    y = F.layer_norm(y, (d,), layer.post_norm.weight, layer.post_norm.bias, eps=1e-6)
    return F.linear(y, layer.o_proj.weight)


@pytest.mark.parametrize("L", [1, 3, 4, 7, 9])
def test_scan_linear_layer_is_causal_linear_attention_token_by_token(L):
    layer = _randomised(ScanLinearTTTLayer(4, 2, 3))
    x = torch.randn(2, L, 4)
    assert rel_rms_error(layer(x), _per_token_reference(layer, x)) <= TOL


# -- the frontend pieces -----------------------------------------------------------------------

def test_split_axis_finds_the_one_axis_split_into_chunks():
    assert split_axis((2, 3, 12, 4), (2, 3, 3, 4, 4)) == (2, 4)
    assert split_axis((2, 3, 12, 4), (2, 3, 3, 4, 4), axis=2) == (2, 4)
    assert split_axis((2, 2, 2, 1), (2, 2, 1, 2, 1)) is None        # axis 1 or 2: ambiguous
    assert split_axis((2, 2, 2, 1), (2, 2, 1, 2, 1), axis=2) == (2, 2)
    assert split_axis((2, 12), (2, 12, 1, 1)) is None
    # the sequence and the features split in one view: [B, L, H·D] -> [B, N, K, H, D]
    assert split_axis((2, 32, 32), (2, 4, 8, 2, 16)) == (1, 8)
    assert split_axis((2, 32, 96), (2, 4, 8, 3, 2, 16), axis=1) == (1, 8)
    assert split_axis((2, 32, 96), (2, 4, 8, 3, 2, 15)) is None        # the features do not fit


class OneViewChunks(torch.nn.Module):
    """Mini-batches cut by one view that splits the sequence and the heads together,
    ``[B, L, H·D] -> [B, N, K, H, D]``, moved mini-batch first, taken as ``q[i]`` in the loop."""

    def __init__(self, d: int = 16, heads: int = 2, chunk: int = 4):
        super().__init__()
        self.H, self.D, self.C = heads, d // heads, chunk
        self.q, self.k, self.v = (torch.nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        B, L, d = x.shape
        n = L // self.C
        q, k, v = (p(x).view(B, n, self.C, self.H, self.D).permute(1, 0, 3, 2, 4)
                   for p in (self.q, self.k, self.v))
        W = x.new_zeros(B, self.H, self.D, self.D)
        outs = []
        for i in range(n):
            qc, kc, vc = q[i], k[i], v[i]
            W = W + 0.1 * kc.transpose(-1, -2) @ vc
            outs.append(qc @ W)
        return torch.stack(outs, 0).permute(1, 0, 3, 2, 4).reshape(B, L, d)


def test_mini_batches_cut_by_one_view_of_sequence_and_heads_convert_exactly():
    torch.manual_seed(0)
    layer = OneViewChunks()
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 16),))
    assert converted.ttt2la_report.layers[0].runtime.startswith("block_linear_attention")
    assert_same_function(converted, layer, [torch.randn(3, 12, 16), torch.randn(1, 32, 16)])


def test_discovery_reads_the_mini_batch_size_from_the_reshape():
    layer = ScanLinearTTTLayer(4, 2, 5)
    (cand,) = discover(layer, (torch.randn(2, 17, 4),))
    assert max(cand.chunk_sizes) == 5 and cand.loop.function == "scan"


def _two_call_scan(W, q, k, K: int):
    """A scan over mini-batches of ``K`` tokens, then the remainder: the zoo's style, small."""
    B, L, f = q.shape
    n, rest = divmod(L, K)
    outs = []

    def run(W, qs, ks, size):
        m = qs.shape[1] // size
        xs = {"q": qs.reshape(B, m, size, f).transpose(0, 1),
              "k": ks.reshape(B, m, size, f).transpose(0, 1)}
        out = torch.empty(m, B, size, f)

        def step(W, x):
            W = W + x["k"].mT @ x["k"]
            return W, x["q"] @ W

        W, out = ttt_scan.scan(step, W, xs, out)
        return out.transpose(0, 1).reshape(B, m * size, f), W

    y, W = run(W, q[:, :n * K], k[:, :n * K], K)
    outs.append(y)
    if rest:
        outs.append(run(W, q[:, -rest:], k[:, -rest:], rest)[0])
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("L,K", [(11, 3), (12, 3), (9, 4)])
def test_unchunking_rewrites_selects_into_slices_and_keeps_the_function(L, K):
    args = (torch.randn(2, 3, 3) * 0.1, torch.randn(2, L, 3), torch.randn(2, L, 3))
    gm = trace(lambda W, q, k: _two_call_scan(W, q, k, K), *args)
    (loop, _depth), = [ld for ld in find_loops(gm) if ld[0].function == "scan"]
    expected = gm(*args)
    assert unchunk_streams(gm, loop)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    offsets = sorted({n.args[2] for n in ops if n.target is aten.slice.Tensor
                      and n.args[0] is placeholders[2] and n.args[1] == 1})
    assert offsets == list(range(0, L, K))                     # one chunk slice per iteration
    assert not any(n.target is aten.select_scatter.default for n in ops)
    assert sum(n.target is aten.cat.default for n in ops) == 1
    assert rel_rms_error(gm(*args), expected) <= TOL


# -- the exact conversion ----------------------------------------------------------------------

# d_model >= 4: the layer's post norm over two features makes its own fp32 gradients ~10% off
# a float64 evaluation at some inputs, which no comparison at 1e-5 can survive.
@settings(max_examples=3)
@given(B=st.integers(1, 2), H=st.integers(1, 2), f=st.sampled_from([4, 5]),
       K=st.integers(2, 5), n=st.integers(0, 3), r=st.integers(0, 4))
def test_scan_linear_layer_converts_exactly_at_levels_0_to_2(B, H, f, K, n, r):
    torch.manual_seed(K + 7 * n + 13 * r)
    layer = _randomised(ScanLinearTTTLayer(H * f, H, K))
    L = max(n * K + min(r, K - 1), 1)
    x = torch.randn(B, L, H * f)
    others = [torch.randn(B + 1, 2 * K + 1, H * f), torch.randn(1, 3 * K, H * f),
              torch.randn(B, max(K - 1, 1), H * f)]
    for level in (0, 1, 2):
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        report = converted.ttt2la_report.layers[0]
        assert report.exact and report.schedule == "parallel" and report.chunk_size == K
        assert [s.name for s in report.states] == ["W"]
        assert_same_function(converted, layer, [x, *others])


def test_mini_batches_of_one_token_laid_out_first_are_still_a_scan():
    """``xs[i]`` of ``[N, B, H, 1, f]`` (mini-batch size 1): the unit split is a cut into
    mini-batches, lowered onto a runtime op like any other size — mini-batches of one token are
    token by token, so onto the token-causal op; a unit axis that a per-token loop indexes in
    place (one head's ``view(B, L, 1, D)``) is not a cut (``test_delta_lowering``)."""
    torch.manual_seed(5)
    layer = _randomised(ScanLinearTTTLayer(8, 2, 1))
    x = torch.randn(2, 9, 8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.chunk_size == 1
    assert report.runtime.startswith("chunk_linear_attention"), report.runtime
    assert_same_function(converted, layer, [x, torch.randn(1, 4, 8)])


# -- refusals: the norm inside the loss ----------------------------------------------------------

def _norm_lines() -> range:
    lines, start = inspect.getsourcelines(ttt_scan.layer_norm_l2_grad)
    return range(start, start + len(lines))


REFUSED = [(ScanTTTLinearLayer, "W"), (ScanTTTMLPLayer, "W2")]


@pytest.mark.parametrize("cls,final", REFUSED, ids=["ttt_linear", "ttt_mlp"])
@settings(max_examples=1)
@given(B=st.integers(1, 2), K=st.integers(2, 4), r=st.integers(0, 3))
def test_ttt_linear_and_mlp_scans_are_refused_naming_the_layer_norm(cls, final, B, K, r):
    torch.manual_seed(K + r)
    layer = cls(4, 2, K)
    x = torch.randn(B, 3 * K + min(r, K - 1), 4)
    for level in (0, 1, 2):
        with pytest.raises(ttt2la.NonReducibleError) as info:
            ttt2la.convert(layer, level=level, example_inputs=(x,))
        e = info.value
        file, line = e.where.split(" ")[0].split(":")
        assert file == "zoo/ttt_scan.py" and int(line) in _norm_lines(), e.where
        assert e.state == final and f"final-layer state {final}" in str(e)
        assert "normalisation" in str(e) and "No pass removes this" in e.remedy
        assert "freeze_theta" not in str(e)


def test_ttt_linear_scan_is_kept_as_written_when_not_strict():
    torch.manual_seed(3)
    layer = ScanTTTLinearLayer(4, 2, 3)
    x = torch.randn(2, 11, 4)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,), strict=False)
    report = converted.ttt2la_report.layers[0]
    assert report.runtime == "kept as written (recurrent)"
    assert_same_function(converted, layer, [x, torch.randn(1, 7, 4)])
    inspected = ttt2la.inspect(layer, example_inputs=(x,), show=False)
    assert all(inspected.layers[0].levels[k].startswith("recurrent:") for k in (0, 1, 2))


def test_ttt_mlp_at_level_6_says_what_lower_levels_do():
    """collapse_mlp cannot rewrite TTT-MLP's φ, and said to convert at level <= 2, where the
    layer is refused too (a layer norm in its loss): the refusal says that the lower levels keep
    the MLP, and that a layer not reducible there converts with strict=False, recurrent."""
    torch.manual_seed(0)
    layer = ScanTTTMLPLayer(4, 2, 3)
    x = torch.randn(2, 9, 4)
    with pytest.raises(ttt2la.UnsupportedTTTError, match="collapse_mlp") as info:
        ttt2la.convert(layer, level=6, example_inputs=(x,))
    assert "convert at level 2 or below, which keeps φ as written (a layer that is not reducible " \
           "there converts with strict=False, on the recurrent schedule)" in str(
               info.value).replace("Convert at level", "convert at level"), str(info.value)
    kept = ttt2la.convert(layer, level=0, example_inputs=(x,), strict=False)
    assert kept.ttt2la_report.layers[0].schedule == "recurrent" and kept.ttt2la_report.exact
    assert_same_function(kept, layer, x)


class RateAfterChunking(ScanLinearTTTLayer):
    """The rates projected from the input *after* it is cut into mini-batches (the published
    ``get_eta``): not a reshape of one sequence, read back mini-batch by mini-batch."""

    def ttt(self, inputs, size, params):
        B, H, L, f = inputs["q"].shape
        n = L // size
        X = inputs.pop("x").reshape(B, n, size, -1)
        lr = torch.einsum("bnkd,hd->bhnk", X, self.lr_weight) + self.lr_bias[None, :, None]
        xs = {name: t.reshape(B, H, n, size, f).permute(2, 0, 1, 3, 4)
              for name, t in inputs.items()}
        xs["lr"] = torch.sigmoid(lr).unsqueeze(-1).permute(2, 0, 1, 3, 4)  # <- named
        scale = torch.clamp_min(self.position_rate[:size] + self.position_offset[:size], 0.0)
        out = torch.empty(n, B, H, size, f)
        params, out = ttt_scan.scan(lambda c, x: self.mini_batch(c, x, scale), params, xs, out)
        return out.permute(1, 0, 3, 2, 4).reshape(B, n * size, H * f), params

    def forward(self, x):
        B, L, _ = x.shape
        K = self.mini_batch_size
        n, rest = divmod(L, K)
        seq = {"q": self.heads(self.q_proj(x)), "k": self.heads(self.k_proj(x)),
               "v": self.heads(self.v_proj(x))}
        params, outs = self.initial(B), []
        if n:
            inputs = {**{k: t[:, :, :n * K] for k, t in seq.items()}, "x": x[:, :n * K]}
            y, params = self.ttt(inputs, K, params)
            outs.append(y)
        if rest:
            inputs = {**{k: t[:, :, -rest:] for k, t in seq.items()}, "x": x[:, -rest:]}
            outs.append(self.ttt(inputs, rest, params)[0])
        return self.o_proj(self.post_norm(torch.cat(outs, dim=1)))


@pytest.mark.parametrize("level", [0, 2])
def test_rates_computed_after_chunking_by_einsum_convert_exactly(level):
    """The rates projected by ``einsum("bnkd,hd->bhnk", X, w)`` from the input cut into
    mini-batches are read back mini-batch by mini-batch (the product's rows taken per
    mini-batch): the layer converts exactly, where it was refused naming the einsum."""
    torch.manual_seed(0)
    layer = RateAfterChunking(4, 2, 3)
    x = torch.randn(2, 11, 4)
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
    assert converted.ttt2la_report.exact
    assert_same_function(converted, layer, [x, torch.randn(1, 5, 4), torch.randn(3, 19, 4)])


# -- pre-chunked streams taken in the loop statement or on another axis -------------------------

class ChunksTakenBy(torch.nn.Module):
    """Mini-batches cut by a reshape before the loop and handed out ``style``'s way: indexed on
    the chunk axis (``q[:, i]``), selected (``q.select(1, i)``), unbound in the loop statement
    (``zip(q.unbind(1), …)``), or the chunk-first tensors iterated themselves (``zip(q, k, v)``);
    the loop's outputs joined by ``cat``."""

    STYLES = ("index", "select", "unbind", "iterate", "enumerate")

    def __init__(self, d: int, heads: int, chunk: int, style: str):
        super().__init__()
        self.H, self.D, self.C, self.style = heads, d // heads, chunk, style
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.W0 = torch.nn.Parameter(torch.randn(heads, self.D, self.D) / self.D ** 0.5)
        self.lr = torch.nn.Parameter(torch.tensor(0.3))

    def _chunks(self, x):
        """(q, k, v) as ``[B, N, H, K, D]`` (chunk-first ``[N, B, H, K, D]`` to iterate)."""
        B, L, _ = x.shape
        n = L // self.C
        q, k, v = (t.reshape(B, n, self.C, self.H, self.D).transpose(2, 3)
                   for t in self.qkv(x).chunk(3, -1))
        if self.style == "iterate":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        return q, k, v

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self._chunks(x)
        W = self.W0.expand(B, -1, -1, -1)
        outs = []
        if self.style in ("index", "select"):
            for i in range(q.shape[1]):
                qc, kc, vc = (q[:, i], k[:, i], v[:, i]) if self.style == "index" else \
                    (q.select(1, i), k.select(1, i), v.select(1, i))
                outs.append(qc @ W)
                W = W + self.lr * kc.transpose(-1, -2) @ vc
        elif self.style == "unbind":
            for qc, kc, vc in zip(q.unbind(1), k.unbind(1), v.unbind(1)):
                outs.append(qc @ W)
                W = W + self.lr * kc.transpose(-1, -2) @ vc
        elif self.style == "iterate":
            for qc, kc, vc in zip(q, k, v):
                outs.append(qc @ W)
                W = W + self.lr * kc.transpose(-1, -2) @ vc
        else:
            for _, (qc, kc, vc) in enumerate(zip(q.unbind(1), k.unbind(1), v.unbind(1))):
                outs.append(qc @ W)
                W = W + self.lr * kc.transpose(-1, -2) @ vc
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, d)


@pytest.mark.parametrize("style", ChunksTakenBy.STYLES)
@settings(max_examples=2)
@given(B=st.integers(1, 2), H=st.integers(1, 2), K=st.integers(2, 4), n=st.integers(2, 4))
def test_chunks_taken_on_any_axis_or_in_the_loop_statement_convert_exactly(style, B, H, K, n):
    torch.manual_seed(K + 5 * n)
    layer = ChunksTakenBy(4 * H, H, K, style)
    x = torch.randn(B, n * K, 4 * H)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.chunk_size == K
    assert report.runtime.startswith("block_linear_attention"), report.runtime
    assert_same_function(converted, layer, [x, torch.randn(B + 1, (n + 3) * K, 4 * H),
                                            torch.randn(1, K, 4 * H)])


def test_discovery_reads_the_mini_batch_size_of_chunks_taken_in_the_loop_statement():
    for style in ChunksTakenBy.STYLES:
        (cand,) = discover(ChunksTakenBy(8, 2, 3, style), (torch.randn(2, 12, 8),))
        assert cand.chunk_sizes == {3} and cand.slice_lengths == {12}, style
        assert cand.slice_starts == {0, 3, 6, 9}, style


class ChunksListedBeforeTheLoop(ChunksTakenBy):
    """The chunks gathered in a list before the loop, which then iterates over the list."""

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self._chunks(x)
        pieces = [(q[:, i], k[:, i], v[:, i]) for i in range(q.shape[1])]
        W = self.W0.expand(B, -1, -1, -1)
        outs = []
        for qc, kc, vc in pieces:
            outs.append(qc @ W)
            W = W + self.lr * kc.transpose(-1, -2) @ vc
        return torch.cat(outs, 2).transpose(1, 2).reshape(B, L, d)


def test_chunks_listed_before_the_loop_convert_exactly():
    """Each listed mini-batch is read by one iteration, in order: they are the loop's chunks."""
    torch.manual_seed(0)
    layer = ChunksListedBeforeTheLoop(8, 2, 3, "index")
    converted = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 12, 8),))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.chunk_size == 3
    assert report.runtime.startswith("block_linear_attention"), report.runtime
    assert_same_function(converted, layer, [torch.randn(3, 21, 8), torch.randn(1, 3, 8)])


class ChunkwiseDeltaReference(torch.nn.Module):
    """DeltaNet in the style of flash-linear-attention's chunkwise reference: the UT transform
    of every mini-batch solved by a loop over a mini-batch's positions, then the loop over
    mini-batches. The loop over positions runs more iterations; the loop over mini-batches is
    the one that walks the sequence."""

    def __init__(self, d: int = 8, chunk: int = 8):
        super().__init__()
        self.C = chunk
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, L, d = x.shape
        n, C = L // self.C, self.C
        q, k, v = self.qkv(x).chunk(3, -1)
        q, k, v = (t.reshape(B, n, C, d) for t in (q, torch.nn.functional.normalize(k, dim=-1), v))
        a = -(k @ k.transpose(-1, -2)).tril(-1)
        for i in range(1, C):
            a[..., i, :i] = a[..., i, :i] + (a[..., i, :, None].clone() * a[..., :, :i].clone()).sum(-2)
        u = (a + torch.eye(C)) @ v
        S = x.new_zeros(B, d, d)
        outs = []
        for i in range(n):
            outs.append(q[:, i] @ S)
            S = S + k[:, i].transpose(-1, -2) @ u[:, i]
        return torch.cat(outs, 1)


def test_the_loop_over_mini_batches_is_chosen_over_a_longer_loop_inside_one():
    """Refused for what it is — a per-mini-batch matrix computed before the loop — naming the
    remedy, not for the lengths its position loop was probed at."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(ChunkwiseDeltaReference(), level=2,
                       example_inputs=(torch.randn(2, 32, 8),))
    message = str(info.value)
    assert "computed after the sequence was cut into mini-batches" in message, message
    assert "inside the loop" in message and "u = (a + torch.eye(C)) @ v" in message


# -- an output buffer read back in another order --------------------------------------------------

class ScanReadBackOtherwise(torch.nn.Module):
    """The scan of TTT-Linear's published code with a linear memory: mini-batches
    ``[N, B, H, K, f]``, a dict carry, ``η = tril(ones) · lr_s / K``, the layer-normed target
    ``LN(v − k)``, the MSE gradient ``K W − V`` at the mini-batch's starting weights and its
    dual form; the outputs written into a buffer (``torch.empty_like(Q)`` or
    ``torch.empty(shape)``; ``carry, outs[i] = step(…)`` or ``carry, y = step(…); outs[i] = y``)
    that the code after the loop reads otherwise than in sequence order: ``interleaved`` puts
    back position ``c`` of mini-batch ``n`` at token ``c·N + n``; ``twice`` un-chunks it and
    divides it by ``1 +`` its mean square."""

    def __init__(self, d: int = 8, heads: int = 2, chunk: int = 4, read: str = "interleaved"):
        super().__init__()
        self.H, self.f, self.K, self.read = heads, d // heads, chunk, read
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.lr = torch.nn.Linear(d, heads)
        self.W0 = torch.nn.Parameter(torch.randn(heads, self.f, self.f) / self.f)
        self.ln = torch.nn.LayerNorm(self.f)
        self.out = torch.nn.Linear(d, d, bias=False)

    @staticmethod
    def step(carry, x):
        W = carry["W"]
        K, V, Q, eta = x["K"], x["V"], x["Q"], x["eta"]
        G = K @ W - V                                     # ∇ of ½‖K W − V‖² at K W
        out = Q @ W - (eta * torch.tril(Q @ K.transpose(-1, -2))) @ G
        return {"W": W - (eta[..., -1, :, None] * K).transpose(-1, -2) @ G}, out

    def forward(self, x):
        B, L, d = x.shape
        H, f, C = self.H, self.f, self.K
        N = L // C
        q, k, v = self.qkv(x).chunk(3, -1)
        target = self.ln(v.view(B, L, H, f) - k.view(B, L, H, f)).reshape(B, L, d)

        def mini_batches(t):
            return t.reshape(B, N, C, H, f).permute(1, 0, 3, 2, 4)          # [N, B, H, K, f]

        Q, K, V = mini_batches(q), mini_batches(k), mini_batches(target)
        lr = torch.sigmoid(self.lr(x)).reshape(B, N, C, H).permute(1, 0, 3, 2)
        eta = torch.tril(torch.ones(C, C)) * lr[..., None, :] / C
        carry = {"W": self.W0.expand(B, -1, -1, -1)}
        if self.read == "interleaved":
            outs = torch.empty_like(Q)
            for i in range(N):
                carry, outs[i] = self.step(carry, {"K": K[i], "V": V[i], "Q": Q[i], "eta": eta[i]})
            o = outs.permute(1, 3, 0, 2, 4).reshape(B, L, d)
        else:
            outs = torch.empty(Q.shape)
            for i in range(N):
                carry, y = self.step(carry, {"K": K[i], "V": V[i], "Q": Q[i], "eta": eta[i]})
                outs[i] = y
            o = outs.permute(1, 0, 3, 2, 4).reshape(B, L, d)
            o = o / (1 + outs.pow(2).mean())
        return self.out(o)


def test_a_buffer_read_back_otherwise_is_the_stack_of_the_outputs():
    """The buffer after the loop is rewritten as ``stack`` of what each iteration writes: the
    same value, read as written by the code after the loop."""
    layer = ScanReadBackOtherwise()
    x = torch.randn(2, 12, 8)
    gm = trace(layer, x)
    (loop, _depth), = [ld for ld in find_loops(gm) if ld[0].function == "forward"]
    expected = gm(x)
    assert unchunk_streams(gm, loop)
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(n.target is aten.select_scatter.default for n in ops)
    assert sum(n.target is aten.stack.default for n in ops) == 1
    assert rel_rms_error(gm(x), expected) <= TOL


@pytest.mark.parametrize("read,level", [("interleaved", 0), ("twice", 2)])
def test_a_scan_whose_buffer_is_read_back_otherwise_converts_exactly(read, level):
    torch.manual_seed(1)
    layer = ScanReadBackOtherwise(read=read)
    x = torch.randn(2, 12, 8)
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.chunk_size == 4, report.runtime
    assert_same_function(converted, layer, [x, torch.randn(3, 20, 8), torch.randn(1, 4, 8)])


def test_a_stream_like_a_rate_that_absorb_lr_leaves_is_named_with_its_line():
    """The scan helper's carried values have no name in the user's code, only the tracer's
    (``carry_y_3``): the step that leaves such a stream names the op that reads it and its
    line, so the reason points at code the user wrote."""
    torch.manual_seed(0)
    layer = ScanLinearTTTLayer(16, 2, 4).eval()
    conv = ttt2la.convert(layer, level=4, example_inputs=(torch.randn(2, 16, 16),),
                          strict=False)
    step, = [p for p in conv.ttt2la_report.layers[0].passes if p.name == "absorb_lr"]
    assert step.status == "not_applicable"
    assert re.search(r"\(read by `[^`]+` at zoo/ttt_scan\.py:\d+\) look like learning rates",
                     step.reason), step.reason
