"""Refusals that name what was found, the user's line and what converts instead: a loop that
starts at an offset, a stream read at a stride, an `if` on the loop's index, a state passed
to another layer, a call at length 0, a state stored narrower than the loop computes, a token
read once per chunk straight from the sequence, a table longer than the sequence, a loop that pads its own last chunk, outputs joined after another piece, a loop over heads around the token or chunk loop, a value of the loop read after it, a loop whose final state alone is read after it, states stored for the code after the loop, an output fed into the next chunk, a last piece joined as if it were the loop's last chunk, a schedule of steps that each take the same stretch of the sequence, iterations that run other ops, a size of no form in the length — each op named by the torch call and the line that made it, never by the traced graph's text."""
from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ttt2la

HERE = "test_refusal_messages.py"


def _line_of(fn, marker: str = "# <- named") -> int:
    """The line of ``fn``'s source that ends with ``marker``."""
    lines, start = inspect.getsourcelines(fn)
    (i,) = [i for i, line in enumerate(lines) if line.rstrip().endswith(marker)]
    return start + i


class TokenMemory(nn.Module):
    """A decayed outer-product memory read per token; ``d`` sets the state's shape."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            outs.append((q[:, t, :, None] * S).sum(1))
        return torch.stack(outs, 1)


def test_a_state_of_another_layer_at_the_same_batch_is_named_so():
    """A state whose sizes differ beyond the batch is another layer's, not a batch change."""
    torch.manual_seed(0)
    wide = ttt2la.convert(TokenMemory(8), level=0, example_inputs=(torch.randn(2, 12, 8),))
    narrow = ttt2la.convert(TokenMemory(6), level=0, example_inputs=(torch.randn(2, 12, 6),))
    _, state = wide(torch.randn(2, 5, 8), return_ttt_state=True)
    with pytest.raises(ttt2la.StreamingError) as refused:
        narrow(torch.randn(2, 5, 6), ttt_state=state)
    message = str(refused.value)
    assert "batch size changed" not in message, message
    assert "another layer" in message and "(2, 8, 8)" in message, message
    assert "Pass each layer the ttt_state that layer returned" in message, message


def test_a_state_at_another_batch_size_is_still_named_so():
    """A state whose sizes differ in the batch alone: the batch size changed."""
    torch.manual_seed(0)
    layer = ttt2la.convert(TokenMemory(8), level=0, example_inputs=(torch.randn(2, 12, 8),))
    _, state = layer(torch.randn(2, 5, 8), return_ttt_state=True)
    with pytest.raises(ttt2la.StreamingError, match="the batch size changed"):
        layer(torch.randn(3, 5, 8), ttt_state=state)


class BufferedTokenMemory(TokenMemory):
    """The same memory writing its outputs into a buffer: at length 0 it returns an empty one."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        o = torch.zeros_like(v)
        for t in range(x.shape[1]):
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            o[:, t] = (q[:, t, :, None] * S).sum(1)
        return o


def test_an_empty_sequence_returns_what_the_layer_as_written_returns():
    """At length 0 the loop runs no iteration: an exact conversion returns the layer's own
    output for it (an empty sequence of outputs)."""
    torch.manual_seed(0)
    layer = BufferedTokenMemory(8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    x = torch.randn(2, 0, 8)
    assert converted(x).shape == layer(x).shape == (2, 0, 8)


class FromTokenOne(TokenMemory):
    """Token 0 handled before the loop, the loop from 1 (`range(1, T)`)."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = k[:, 0, :, None] * v[:, 0, None, :]
        outs = [(q[:, 0, :, None] * S).sum(1)]
        for t in range(1, x.shape[1]):  # <- loop
            S = 0.9 * S + k[:, t, :, None] * v[:, t, None, :]
            outs.append((q[:, t, :, None] * S).sum(1))
        return torch.stack(outs, 1)


class FromChunkOne(TokenMemory):
    """Chunk 0 handled before the loop, the loop over chunks from the second."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = k[:, :4].mT @ v[:, :4]
        outs = [q[:, :4] @ S]
        for s in range(4, x.shape[1], 4):  # <- loop
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].mT @ v[:, s:s + 4]
        return torch.cat(outs, 1)


@pytest.mark.parametrize("cls,start,remedy", [
    (FromTokenOne, "starts at token 1", "`for t in range(T)`"),
    (FromChunkOne, "starts at chunk 1 (token 4)", "`for s in range(0, T, 4)`")],
    ids=["token", "chunk"])
def test_a_loop_that_starts_at_an_offset_is_named_so(cls, start, remedy):
    """A loop from the second token or chunk, the first handled before it: the refusal says
    where the loop starts and to write one loop from 0, the state starting from zeros."""
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(cls(), level=0, example_inputs=(torch.randn(2, 16, 8),))
    message = str(refused.value)
    assert f"the loop at tests/{HERE}:{_line_of(cls.forward, '# <- loop')}" in message, message
    assert start in message and remedy in message, message
    assert "initial value (zeros)" in message, message


class TwoTokensPerStep(TokenMemory):
    """Two tokens of one sequence per iteration, read by index (`k[:, i * 2 + j]`)."""

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        k2 = torch.cat([k, k.flip(1)], -1).reshape(B, 2 * T, D)
        S = x.new_zeros(B, D, D)
        outs = []
        for i in range(T):
            for j in range(2):
                kj = k2[:, i * 2 + j]  # <- named
                S = 0.9 * S + kj[:, :, None] * v[:, i, None, :]
            outs.append((q[:, i, :, None] * S).sum(1))
        return torch.stack(outs, 1)


def test_a_sequence_read_at_a_stride_is_named_so():
    """Several tokens of one sequence per iteration: the refusal names the read, not control
    flow, and says to view the sequence with an axis for them and read `k[:, i, j]`."""
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(TwoTokensPerStep(), level=0, example_inputs=(torch.randn(2, 12, 8),))
    message = str(refused.value)
    assert "control flow" not in message, message
    assert f"{HERE}:{_line_of(TwoTokensPerStep.forward)}" in message, message
    assert "reads 2 tokens of one sequence by index" in message, message
    assert "k.view(B, T, 2, ...)" in message and "k[:, i, j]" in message, message


class UpdateEveryFewTokens(TokenMemory):
    """Every token reads the memory; the memory takes the last 4 tokens every 4 tokens."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        acc = torch.zeros_like(S)
        outs = []
        for t in range(x.shape[1]):
            outs.append((q[:, t, :, None] * S).sum(1))
            acc = acc + k[:, t, :, None] * v[:, t, None, :]
            if (t + 1) % 4 == 0:  # <- named
                S = S + 0.5 * acc
                acc = torch.zeros_like(acc)
        return torch.stack(outs, 1)


class ResetEveryFewChunks(TokenMemory):
    """A chunk loop whose memory starts over every third chunk."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for i, s in enumerate(range(0, x.shape[1], 4)):
            if i % 3 == 0:  # <- named
                S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
            outs.append(q[:, s:s + 4] @ S)
            S = S + k[:, s:s + 4].mT @ v[:, s:s + 4]
        return torch.cat(outs, 1)


@pytest.mark.parametrize("cls,variable", [(UpdateEveryFewTokens, "t"), (ResetEveryFewChunks, "i")],
                         ids=["update every C tokens", "reset every R chunks"])
def test_an_if_on_the_loop_index_is_named_so(cls, variable):
    """Iterations whose ops depend on their index through a Python `if`: the refusal names
    that `if` and its variable, not data-dependent control flow, and says what converts."""
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(cls(), level=0, example_inputs=(torch.randn(2, 24, 8),))
    message = str(refused.value)
    assert "data-dependent" not in message and "submodule" not in message, message
    assert f"{HERE}:{_line_of(cls.forward)}" in message, message
    assert f"tests the loop variable `{variable}`" in message, message
    assert "for s in range(0, T, C)" in message, message


def test_an_empty_piece_of_a_stateful_call_is_refused_naming_the_layer():
    """A stateful call with no tokens has nothing to continue its state with: the refusal
    names the layer's loop and says to skip the call."""
    torch.manual_seed(0)
    layer = BufferedTokenMemory(8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    with pytest.raises(ttt2la.StreamingError) as refused:
        converted(torch.randn(2, 0, 8), return_ttt_state=True)
    message = str(refused.value)
    assert f"{HERE}:" in message and "empty sequence (length 0)" in message, message
    assert "Skip the call" in message, message


def test_an_empty_sequence_under_a_lossy_conversion_is_refused_naming_the_layer():
    """A lossy conversion does not run the layer as written: at length 0 it refuses, naming the
    layer's loop and what to do."""
    from ttt2la.zoo import PerTokenTTTLayer

    torch.manual_seed(0)
    converted = ttt2la.convert(PerTokenTTTLayer(8, 2), level=6,
                               example_inputs=(torch.randn(2, 16, 8),))
    assert converted._ttt2la.as_written is None         # lossy
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(2, 0, 8))
    message = str(refused.value)
    assert "the loop at" in message and "empty sequence (length 0)" in message, message
    assert "Skip the call" in message, message


def _refused_where_another_spelling_converts(refused_layer, converting_layer, x) -> str:
    """The message ``refused_layer``'s conversion raises, after checking that
    ``converting_layer``, the spelling the message offers, converts and equals its source."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(refused_layer, level=0, example_inputs=(x,))
    conv = ttt2la.convert(converting_layer, level=0, example_inputs=(x,))
    with torch.no_grad():
        assert torch.allclose(conv(x), converting_layer(x), rtol=0, atol=1e-5)
    return str(refused.value)


class _ChunkLayer(nn.Module):
    """A chunked layer's projections: ``q, k, v`` of width ``d``, chunks of ``chunk`` tokens."""

    def __init__(self, d: int = 8, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def _plain_loop(self, x):
        """Plain linear attention chunk by chunk: what the layers below add code around."""
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        for s in range(0, x.shape[1], self.C):
            outs.append(q[:, s:s + self.C] @ W)
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
        return torch.cat(outs, 1)


class NarrowState(_ChunkLayer):
    """Fast weights computed in float32 and stored in bfloat16 after every chunk."""

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W = torch.zeros(B, D, D, dtype=torch.bfloat16)
        outs = []
        for s in range(0, T, self.C):
            outs.append(q[:, s:s + self.C] @ W.float())
            W = (W.float() + 0.1 * k[:, s:s + self.C].mT @ v[:, s:s + self.C]).bfloat16()  # <- named
        return torch.cat(outs, 1)


def test_a_state_stored_narrower_than_the_loop_computes_is_named_so():
    """Not a bug of the lowering: the per-step rounding is the function, no parallel plan
    repeats it; the message names the state, its dtype and line, and the remedies."""
    torch.manual_seed(0)
    layer = NarrowState()
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    msg = str(refused.value)
    assert "keeps state W in bfloat16" in msg and "computing in float32" in msg
    assert f"{HERE}:{_line_of(NarrowState.forward)}" in msg and "backend='naive'" in msg
    assert "bug" not in msg
    exact = ttt2la.convert(layer, level=0, backend="naive",
                           example_inputs=(torch.randn(2, 16, 8),))
    x = torch.randn(2, 12, 8)
    with torch.no_grad():
        assert torch.allclose(exact(x), layer(x), rtol=0, atol=1e-6)


class ChunkEndGate(_ChunkLayer):
    """A memory decayed per chunk by the gate of the chunk's last token, read as
    ``g[:, e - 1]`` (``"index"``) or ``g[:, s:e][:, -1]`` (``"slice"``)."""

    def __init__(self, spelling: str, d: int = 8):
        super().__init__(d)
        self.spelling, self.g = spelling, nn.Linear(d, 1)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        g = torch.sigmoid(self.g(x))[..., 0]
        W = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, self.C):
            e = min(s + self.C, T)
            outs.append(q[:, s:e] @ W)
            last = g[:, e - 1] if self.spelling == "index" else g[:, s:e][:, -1]  # <- named
            W = W * last[:, None, None] + k[:, s:e].mT @ v[:, s:e]
        return torch.cat(outs, 1)


def test_a_token_read_once_per_chunk_from_the_sequence_is_named_with_the_spelling_that_converts():
    torch.manual_seed(0)
    msg = _refused_where_another_spelling_converts(ChunkEndGate("index"), ChunkEndGate("slice"),
                                                   torch.randn(2, 16, 8))
    assert "reads one token of every chunk" in msg and "4 apart" in msg
    assert "Take the chunk first" in msg and f"{HERE}:{_line_of(ChunkEndGate.forward)}" in msg


class WindowMemory(_ChunkLayer):
    """A memory stepped per token on the squared error over the last ``c`` tokens (the Omega
    rule), its window sliced from the sequence at each step (``"window"``) or its sums made
    before the loop and read one token at a time (``"sums"``)."""

    def __init__(self, spelling: str, c: int = 3, d: int = 8):
        super().__init__(d)
        self.spelling, self.c = spelling, c

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        k = F.normalize(k, dim=-1)
        if self.spelling == "sums":
            kk = (k[..., :, None] * k[..., None, :]).cumsum(1)
            kv = (k[..., :, None] * v[..., None, :]).cumsum(1)
            late = lambda z: torch.cat([z.new_zeros(B, self.c, D, D), z], 1)[:, :T]  # noqa: E731
            G, Bv = kk - late(kk), kv - late(kv)
        S, ys = x.new_zeros(B, D, D), []
        for t in range(T):
            if self.spelling == "sums":
                Gt, Bt = G[:, t], Bv[:, t]
            else:
                s = max(0, t - self.c + 1)
                kw, vw = k[:, s:t + 1], v[:, s:t + 1]                          # <- named
                Gt, Bt = kw.mT @ kw, kw.mT @ vw
            S = S - 0.1 * (Gt @ S - Bt)
            ys.append(q[:, t:t + 1] @ S)
        return torch.cat(ys, 1)


def test_a_sliding_window_names_the_window_sums_that_convert():
    torch.manual_seed(0)
    msg = _refused_where_another_spelling_converts(WindowMemory("window"), WindowMemory("sums"),
                                                   torch.randn(2, 16, 8))
    assert "reads overlapping spans of the sequence (tokens 0 to 1, then 0 to 2)" in msg
    assert "before the loop" in msg and f"{HERE}:{_line_of(WindowMemory.forward)}" in msg


class RateTable(_ChunkLayer):
    """A rate per position kept in a buffer sized for the longest sequence, read chunk by
    chunk at the loop's index (``"in_loop"``) or sliced to the sequence before it."""

    def __init__(self, where: str, longest: int = 64):
        super().__init__()
        self.where = where
        self.register_buffer("lr_table", 1.0 / torch.sqrt(1.0 + torch.arange(longest).float()))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        table = self.lr_table if self.where == "in_loop" else self.lr_table[:T]
        W = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, self.C):
            lr = table[s:s + self.C][None, :, None]  # <- named
            outs.append(q[:, s:s + self.C] @ W)
            W = W + (k[:, s:s + self.C] * lr).mT @ v[:, s:s + self.C]
        return torch.cat(outs, 1)


def test_a_table_longer_than_the_sequence_is_named_with_the_slice_that_converts():
    torch.manual_seed(0)
    msg = _refused_where_another_spelling_converts(RateTable("in_loop"), RateTable("sliced"),
                                                   torch.randn(2, 16, 8))
    assert "reads table, which has 64 rows" in msg and "`table[:T]`" in msg, msg
    assert f"{HERE}:{_line_of(RateTable.forward)}" in msg


class PadsItsLastChunk(_ChunkLayer):
    """A loop that pads its own partial last chunk (``if n < C``), which ttt2la does itself."""

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, self.C):
            qc, kc, vc = q[:, s:s + self.C], k[:, s:s + self.C], v[:, s:s + self.C]
            n = qc.shape[1]
            if n < self.C:
                qc = F.pad(qc, (0, 0, 0, self.C - n))  # <- named
                kc, vc = F.pad(kc, (0, 0, 0, self.C - n)), F.pad(vc, (0, 0, 0, self.C - n))
            W = W + kc.mT @ vc
            outs.append((qc @ W)[:, :n])
        return torch.cat(outs, 1)


def test_a_loop_padding_its_own_last_chunk_is_named_so():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(PadsItsLastChunk(), level=0, example_inputs=(torch.randn(2, 14, 8),))
    msg = str(refused.value)
    assert "the last iteration runs other ops than the others" in msg
    assert "the first of them `F.pad` at " in msg           # the call as the layer writes it
    assert f"{HERE}:{_line_of(PadsItsLastChunk.forward)} (`qc = F.pad(qc" in msg
    assert "aten." not in msg and "in forward on" not in msg
    assert "ttt2la pads a partial last chunk itself" in msg


class JoinedAfterAZeroRow(_ChunkLayer):
    """Next-token binding whose first output, a zero row, is the first piece of the list the
    loop appends to (``"list"``), or padded onto the joined outputs (``"pad"``)."""

    def __init__(self, join: str):
        super().__init__()
        self.join = join

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        k, v, q = k[:, :-1], v[:, 1:], q[:, 1:]
        W = x.new_zeros(B, D, D)
        outs = [x.new_zeros(B, 1, D)] if self.join == "list" else []  # <- named
        for s in range(0, T - 1, self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        y = torch.cat(outs, 1)
        return y if self.join == "list" else F.pad(y, (0, 0, 1, 0))


def test_outputs_joined_after_another_piece_are_named_with_the_join_that_converts():
    torch.manual_seed(0)
    msg = _refused_where_another_spelling_converts(
        JoinedAfterAZeroRow("list"), JoinedAfterAZeroRow("pad"), torch.randn(2, 17, 8))
    assert "the loop's outputs are joined after 1 other piece(s)" in msg
    assert f"{HERE}:{_line_of(JoinedAfterAZeroRow.forward)}" in msg and "F.pad" in msg


class HeadsAroundTheTokens(nn.Module):
    """Each head's memory run in turn: a loop over heads around the loop over the tokens."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).unbind(2)
        heads = []
        for h in range(self.h):
            W = x.new_zeros(B, self.dh, self.dh)
            ys = []
            for t in range(T):  # <- named
                W = W + k[:, t, h, :, None] * v[:, t, h, None, :]
                ys.append(torch.einsum("bk,bkv->bv", q[:, t, h], W))
            heads.append(torch.stack(ys, 1))
        return torch.cat(heads, -1)


def test_a_loop_over_heads_around_the_token_loop_is_named_so():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(HeadsAroundTheTokens(), level=0, example_inputs=(torch.randn(2, 9, 8),))
    msg = str(refused.value)
    assert "which runs the loop at " in msg and "a loop over heads (or rows)" in msg
    assert f"{HERE}:{_line_of(HeadsAroundTheTokens.forward)}" in msg and "batch axis" in msg


class HeadsAroundTheChunks(nn.Module):
    """Each head's memory run in turn over the chunks, the heads laid out before the sequence:
    a loop over heads around the loop over chunks."""

    def __init__(self, d: int = 16, heads: int = 4, chunk: int = 4):
        super().__init__()
        self.h, self.dh, self.C = heads, d // heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.w0 = nn.Parameter(torch.randn(heads, self.dh, self.dh) * 0.1)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, self.dh).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        heads = []
        for h in range(self.h):  # <- heads
            W = self.w0[h].expand(B, -1, -1)
            ys = []
            for s in range(0, T, self.C):  # <- named
                ys.append(q[:, h, s:s + self.C] @ W)
                W = W + k[:, h, s:s + self.C].mT @ v[:, h, s:s + self.C]
            heads.append(torch.cat(ys, 1))
        return torch.stack(heads, 2).reshape(B, T, D)


def test_a_loop_over_heads_around_the_chunk_loop_names_both_loops_in_their_places():
    """With four heads the heads loop's message had the loops inverted (the chunk loop "inside
    the TTT loop, over heads"), and with a per-head initial state it named a raw graph node."""
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(HeadsAroundTheChunks(), level=0, example_inputs=(torch.randn(2, 16, 16),))
    msg = str(refused.value)
    heads = _line_of(HeadsAroundTheChunks.forward, "# <- heads")
    chunks = _line_of(HeadsAroundTheChunks.forward)
    assert "which runs the loop at " in msg and f"{HERE}:{chunks} in forward once per" in msg, msg
    assert f"{HERE}:{heads} in forward)" in msg, msg
    assert "a loop over heads (or rows) around the loop over the sequence" in msg, msg
    assert "placeholder" not in msg and "runs inside the TTT loop" not in msg, msg


def _no_fx_text(message: str) -> None:
    """The op is named as the user wrote it, not by the traced graph's own text."""
    assert "%" not in message and "call_function" not in message, message
    assert "num_users" not in message and "torch.ops." not in message, message


class ReadAfterTheLoop(_ChunkLayer):
    """Code after the loop reads ``h``, a value of the last iteration, neither a carried state
    nor an output."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        for s in range(0, x.shape[1], self.C):
            h = k[:, s:s + self.C] @ W  # <- made
            outs.append(q[:, s:s + self.C] @ W)
            W = W + k[:, s:s + self.C].mT @ (v[:, s:s + self.C] - h)
        return torch.cat(outs, 1) + h.sum()  # <- named


def test_a_value_of_the_loop_read_after_it_is_named_by_both_lines():
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(ReadAfterTheLoop(), level=0, example_inputs=(torch.randn(2, 16, 8),))
    message = str(refused.value)
    assert "code after the loop (`torch.sum` at " in message, message
    assert f"{HERE}:{_line_of(ReadAfterTheLoop.forward)} (`" in message, message
    assert f"{HERE}:{_line_of(ReadAfterTheLoop.forward, '# <- made')} (`" in message, message
    assert "carried state or an output of the loop" in message, message
    _no_fx_text(message)


class SizeOfNoForm(_ChunkLayer):
    """A size after the loop that is neither affine in the length nor in its number of
    chunks: a third of the length, rounded down."""

    def forward(self, x):
        o = self._plain_loop(x)
        return o + o.new_zeros(x.shape[1] // 3).sum()  # <- named


class ArgumentsOfTheLength(_ChunkLayer):
    """A call after the loop whose number of arguments follows the length."""

    def forward(self, x):
        o = self._plain_loop(x)
        return o + o.new_zeros([1] * (x.shape[1] // 3)).sum()  # <- named


@pytest.mark.parametrize("layer, found", [
    (SizeOfNoForm, "neither an affine function of the length nor one of the number of chunks"),
    (ArgumentsOfTheLength, "changes structure with the input shape in the arguments of"),
], ids=["no_form", "follow_the_length"])
def test_sizes_after_the_loop_of_no_form_in_the_length_name_their_line(layer, found):
    torch.manual_seed(0)
    with pytest.raises(ttt2la.UnsupportedTTTError) as refused:
        ttt2la.convert(layer(), level=0, example_inputs=(torch.randn(2, 16, 8),))
    message = str(refused.value)
    assert found in message, message
    assert "`Tensor.new_zeros` at " in message, message
    assert f"{HERE}:{_line_of(layer.forward)} (`" in message, message
    _no_fx_text(message)


def test_an_op_of_no_line_of_the_layer_is_named_by_its_torch_call():
    """An op torch's or ttt2la's own code made while tracing has no line to point at: the
    refusal names the torch call and says so."""
    from ttt2la.ir import SRC, SourceLoc, describe_op, op_at, torch_name
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ops = [graph.call_function(torch.ops.aten.mul.Tensor, (x, 2)),
           graph.call_function(torch.ops.aten.view.default, (x, [4])),
           graph.call_function(torch.ops.aten.slice.Tensor, (x, 0, 0, 2)),
           graph.call_function(torch.ops.aten._to_copy.default, (x,)),
           graph.call_function(torch.ops.aten._softmax.default, (x, 0, False)),
           graph.call_function(torch.ops.aten.silu.default, (x,)),
           graph.call_function(torch.ops.aten.native_layer_norm.default, (x, [4], None, None, 1e-5))]
    assert [torch_name(n) for n in ops] == [
        "`torch.mul`", "`Tensor.view`", "indexing `[...]`", "`Tensor.to`",
        "`torch.ops.aten._softmax`", "`F.silu`", "`F.layer_norm`"]
    assert describe_op(ops[0]) == ("`torch.mul` (made by torch's or ttt2la's own code while "
                                   "tracing, not by a line of the layer)")
    ops[0].meta[SRC] = SourceLoc("layer.py", 12, "forward", "y = x * 2")
    assert describe_op(ops[0]) == "`torch.mul` at layer.py:12 (`y = x * 2`)"
    assert op_at(ops[0]) == "`torch.mul` at layer.py:12" and op_at(ops[5]) == "`F.silu`"
    assert describe_op(x) == "the input `x`"


class LinearFastWeight(nn.Module):
    """Projections and an initial linear fast weight, for the loops below to step."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)


class AccumulatedThenRead(LinearFastWeight):
    """A non-causal step written chunk by chunk: the loop only sums the chunks' updates, and
    every token reads the final weights after it."""

    C = 4

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W = self.w.expand(B, d, d)
        for s in range(0, L, self.C):
            W = W + k[:, s:s + self.C].transpose(1, 2) @ v[:, s:s + self.C] / L  # <- named
        return q @ W


def _refused_naming_its_line(layer: nn.Module, length: int = 16) -> str:
    """The message of ``layer``'s refusal at level 0, checked to name the line its forward
    marks ``# <- named``."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, length, 8),))
    message = str(info.value)
    assert f"{HERE}:{_line_of(type(layer).forward)}" in message, message
    return message


def test_a_loop_whose_final_state_alone_is_read_is_named_a_step_written_in_chunks():
    message = _refused_naming_its_line(AccumulatedThenRead())
    assert "reads the final state `W`" in message and "without the loop" in message


class StoredStates(_ChunkLayer):
    """Every chunk's fast weight stored and read after the loop, the outputs made there."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, Ws = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]  # <- named
            Ws.append(W)
        return torch.cat([q[:, i * self.C:(i + 1) * self.C] @ w for i, w in enumerate(Ws)], 1)


class OutputFedBack(_ChunkLayer):
    """Each chunk's output collected and also mixed into the next chunk's keys."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs, prev = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), [], x.new_zeros(1)
        for s in range(0, x.shape[1], self.C):
            kc = k[:, s:s + self.C] + 0.1 * prev.mean()  # <- read
            W = W + kc.mT @ v[:, s:s + self.C]
            y = q[:, s:s + self.C] @ W  # <- named
            outs.append(y)
            prev = y
        return torch.cat(outs, 1)


class WholeChunksThenTheRest(_ChunkLayer):
    """A loop over whole chunks only; the remaining tokens' values passed through after it, as
    one more piece of the loop's join (``joined``) or after the loop's outputs joined alone."""

    def __init__(self, joined: bool):
        super().__init__()
        self.joined = joined

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        whole = x.shape[1] // self.C * self.C
        for s in range(0, x.shape[1] - self.C + 1, self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        if self.joined:
            outs.append(v[:, whole:])  # <- named
            return torch.cat(outs, 1)
        return torch.cat([torch.cat(outs, 1), v[:, whole:]], 1)


def test_a_last_piece_joined_as_a_chunk_is_named_with_the_spellings_that_convert():
    message = _refused_naming_its_line(WholeChunksThenTheRest(True), length=18)
    assert "range(0, L, C)" in message and "torch.cat([torch.cat(outs, 1), rest], 1)" in message
    torch.manual_seed(0)
    layer = WholeChunksThenTheRest(False)       # the second spelling converts, as it says
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    x = torch.randn(3, 12, 8)
    with torch.no_grad():
        assert torch.allclose(converted(x), layer(x), rtol=1e-5, atol=1e-6)


def test_stored_states_are_named_with_the_outputs_to_collect_instead():
    message = _refused_naming_its_line(StoredStates())
    assert "reads the stored states" in message and "collect the outputs" in message


def test_an_output_fed_into_the_next_chunk_is_named_with_the_line_reading_it():
    """Not "collect the outputs instead": the code does; the output is also carried."""
    message = _refused_naming_its_line(OutputFedBack())
    assert f"{HERE}:{_line_of(OutputFedBack.forward, '# <- read')}" in message
    assert "output `y`" in message and "carried into the next iteration" in message
    assert "collect the outputs" not in message


class ScheduledSteps(LinearFastWeight):
    """LaCT's novel-view schedule: a list of (start, end, update, apply) steps the forward walks,
    here two updates on all the tokens, then a read of them all (of the first half, ``half``)."""

    def __init__(self, half: bool = False):
        super().__init__()
        self.half = half

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs, n = self.w.expand(B, d, d), [], L // 2 if self.half else L
        schedule = [(0, n, True, False), (0, n, True, False), (0, n, False, True)]
        for start, end, update, apply in schedule:  # <- named
            if update:
                ki, vi = k[:, start:end], v[:, start:end]
                W = W + ki.transpose(1, 2) @ (vi - torch.tanh(ki @ W))
            if apply:
                outs.append(q[:, start:end] @ W)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("half, taken", [(False, "each reads the whole sequence"),
                                         (True, r"each takes the same \d+ tokens of the "
                                                "sequence from token 0")])
def test_a_schedule_of_steps_over_the_whole_sequence_is_named_so(half, taken):
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(ScheduledSteps(half=half), level=0,
                       example_inputs=(torch.randn(2, 16, 8),))
    message = str(info.value)
    assert re.search(taken, message) and "a schedule over" in message
    assert f"{HERE}:{_line_of(ScheduledSteps.forward)}" in message
    assert "written without the loop" in message


class DataBranch(nn.Module):
    """A chunk loop whose inner loop decays the state once or twice, by turns: iterations run
    other ops."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        W, outs = x.new_zeros(B, d, d), []
        for s in range(0, L, 4):
            outs.append(q[:, s:s + 4] @ W)
            W = W + k[:, s:s + 4].transpose(1, 2) @ v[:, s:s + 4]
            for _ in range(1 + (s // 4) % 2):
                W = torch.tanh(W)  # <- named
        return torch.cat(outs, 1)


def test_iterations_that_run_other_ops_name_the_first_op_that_differs():
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(DataBranch(), level=0, example_inputs=(torch.randn(2, 16, 8),))
    message = str(info.value)
    assert "iterations 1 and 2 run different ops (iteration" in message, message
    assert f"{HERE}:{_line_of(DataBranch.forward)}" in message
