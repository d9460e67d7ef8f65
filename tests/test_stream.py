"""Stateful decoding: a sequence fed to a converted layer (or model) in pieces gives the outputs
of feeding it whole, for pieces of any sizes, including pieces that end inside a chunk.

The reference is the *original* layer (the zoo's own Python loop, which shares no code with
ttt2la) run on the whole sequence. Layers are built as the variant their level converts exactly
(level 1: Θ frozen; level 2: no weight norm either), so the tolerances are the project's exact
ones: fp32 within 1e-5 relative RMS; with Muon the layer is compared in float64 (within 1e-10),
where Newton–Schulz does not amplify rounding beyond it. Hypothesis draws the sequence length,
the batch size and the split points; every case is converted once per module.
"""
from __future__ import annotations

import re

import pytest
import module_scoped
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import (LaCTFoldedLayer, LaCTHeadsLayer, PerTokenInlineTTTLayer,
                         PerTokenTTTLayer, TinyLaCTLM)

from equivalence import in_pieces, splits

D = 16
CASES = {
    # name: (factory, level, dtype, chunk size)
    "folded-level1-weight-norm": (lambda: LaCTFoldedLayer(D, 2, 4, muon=False, base_lr=0.3,
                                                          update_theta=False), 1, torch.float32, 4),
    "heads-level2-momentum-muon-f64": (lambda: LaCTHeadsLayer(D, 2, 5, base_lr=0.3,
                                                              update_theta=False,
                                                              weight_norm=False),
                                       2, torch.float64, 5),
    "per-token-level0": (lambda: PerTokenTTTLayer(D, 2), 0, torch.float32, 1),
}
_built = module_scoped.cache()


def _case(name):
    """(original layer, converted layer) for ``name``, converted once."""
    if name not in _built:
        factory, level, dtype, C = CASES[name]
        torch.manual_seed(7)
        layer = factory().to(dtype)
        x = torch.randn(2, 3 * C + 2, D, dtype=dtype)
        _built[name] = (layer, ttt2la.convert(layer, level=level, example_inputs=(x,)))
    return _built[name]


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=12)
@given(split=splits(23))
@example(split=(2, 23, [1, 2, 3, 4, 5, 6]))      # token by token through the first chunks
@example(split=(1, 20, [4, 8, 12]))               # pieces that end on chunk boundaries
@example(split=(2, 1, []))                        # one token
def test_pieces_equal_the_whole_sequence(name, split):
    B, L, cuts = split
    layer, conv = _case(name)
    dtype = CASES[name][2]
    gen = torch.Generator().manual_seed(B * 1000 + L)
    x = torch.randn(B, L, D, generator=gen).to(dtype)
    with torch.no_grad():
        ref = layer(x)
        got, state = in_pieces(conv, x, cuts)
    assert rel_rms_error(got, ref) <= TOLERANCE[dtype], (cuts, rel_rms_error(got, ref))
    assert state.tokens == L


def test_the_state_holds_fast_weights_momentum_and_the_open_chunk():
    _layer, conv = _case("heads-level2-momentum-muon-f64")
    C = CASES["heads-level2-momentum-muon-f64"][3]
    x = torch.randn(2, 2 * C + 3, D, dtype=torch.float64)
    with torch.no_grad():
        _y, state = conv(x, return_ttt_state=True)
    assert isinstance(state, ttt2la.TTTState)
    assert state.fast_weights and state.momentum
    assert state.open_tokens == 3 and state.tokens == 2 * C + 3
    assert len(state.open) == len(state.sources) > 0 and all(3 in t.shape for t in state.open)
    # the momentum after two updates is not zero: the next piece must start from it
    assert all(float(m.abs().max()) > 0 for m in state.momentum.values())
    _y, per_token = _case("per-token-level0")[1](torch.randn(1, 5, D), return_ttt_state=True)
    assert per_token.open_tokens == 0 and per_token.tokens == 5


def test_state_that_does_not_fit_is_refused():
    _layer, conv = _case("folded-level1-weight-norm")
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        _y, state = conv(x, return_ttt_state=True)
        with pytest.raises(ttt2la.StreamingError, match="batch size"):
            conv(torch.randn(3, 2, D), ttt_state=state, return_ttt_state=True)
        other = _case("per-token-level0")[1]
        with pytest.raises(ttt2la.StreamingError, match="another layer"):
            other(torch.randn(2, 2, D), ttt_state=state, return_ttt_state=True)
        with pytest.raises(ttt2la.StreamingError, match="TTTState"):
            conv(x, ttt_state={"w1": 0}, return_ttt_state=True)


def _altered(state, field):
    """``state`` with one field changed as a caller might by hand."""
    import dataclasses

    changes = {
        "values None": dict(values=(None,) * len(state.values)),
        "values dropped": dict(values=()),
        "values on meta": dict(values=tuple(v.to("meta") for v in state.values)),
        "open dropped": dict(open=()),
        "open of another dtype": dict(open=tuple(t.double() for t in state.open)),
        "open of another width": dict(open=tuple(t[..., :1] for t in state.open)),
        "open_tokens negative": dict(open_tokens=-1),
        "open_tokens beyond a chunk": dict(open_tokens=100),
        "open_tokens as text": dict(open_tokens="3"),
        "open_tokens not the open chunk's": dict(open_tokens=0),
        "tokens negative": dict(tokens=-5),
        "roles renamed": dict(roles=tuple("x" for _ in state.roles)),
        "sources renamed": dict(sources=tuple("x" for _ in state.sources)),
    }
    return dataclasses.replace(state, **changes[field])


@pytest.mark.parametrize("field", [
    "values None", "values dropped", "values on meta", "open dropped", "open of another dtype",
    "open of another width", "open_tokens negative", "open_tokens beyond a chunk",
    "open_tokens as text", "open_tokens not the open chunk's", "tokens negative", "roles renamed",
    "sources renamed"])
def test_a_state_altered_by_hand_is_refused_naming_what_differs(field):
    """A ``TTTState`` is the layer's own: one altered since (a dropped open chunk, a count that
    no longer matches it, tensors of another kind) is refused before any op runs, never read
    as another state nor failing deep in the plan."""
    _layer, conv = _case("folded-level1-weight-norm")
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        _y, state = conv(x[:, :3], return_ttt_state=True)
        assert state.open_tokens == 3
        with pytest.raises(ttt2la.StreamingError, match="pass the ttt_state the layer returned, "
                                                        "unaltered"):
            conv(x[:, 3:], ttt_state=_altered(state, field))


def test_return_ttt_state_is_a_switch():
    _layer, conv = _case("per-token-level0")
    with pytest.raises(ttt2la.InvalidInputError, match="return_ttt_state must be True or False"):
        conv(torch.randn(1, 4, D), return_ttt_state="yes")


class _MeanCentred(LaCTFoldedLayer):
    """A layer whose code after the loop subtracts the mean over the sequence."""

    def forward(self, x):
        y = super().forward(x)
        return y - y.mean(dim=1, keepdim=True)


def test_a_layer_mixing_tokens_outside_the_loop_cannot_carry_state():
    torch.manual_seed(0)
    layer = _MeanCentred(D, 2, 4, muon=False, update_theta=False, weight_norm=False)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 14, D),))
    x = torch.randn(2, 9, D)
    assert rel_rms_error(conv(x), layer(x)) <= TOLERANCE[torch.float32]   # whole: fine
    with pytest.raises(ttt2la.StreamingError, match="mixes tokens"):
        conv(x, return_ttt_state=True)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(3)
    model = TinyLaCTLM(40, D, 2, 2, 4, muon=False, update_theta=False, weight_norm=False)
    ids = torch.randint(0, 40, (2, 14))
    return model, ttt2la.convert(model, level=2, example_inputs=(ids,))


@settings(max_examples=8)
@given(split=splits(19))
@example(split=(1, 19, list(range(1, 19))))       # decode token by token
def test_stream_decodes_a_whole_model_piece_by_piece(lm, split):
    model, conv = lm
    B, L, cuts = split
    gen = torch.Generator().manual_seed(L)
    ids = torch.randint(0, 40, (B, L), generator=gen)
    stream = ttt2la.Stream(conv)
    bounds = [0, *cuts, L]
    with torch.no_grad():
        ref = model(ids)
        got = torch.cat([stream.stream(ids[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
    assert rel_rms_error(got, ref) <= TOLERANCE[torch.float32]
    assert stream.tokens == L and set(stream.states) == {"blocks.0.ttt", "blocks.1.ttt"}
    stream.reset()
    with torch.no_grad():
        assert rel_rms_error(stream.stream(ids), ref) <= TOLERANCE[torch.float32]
    # outside ``stream`` the model runs whole sequences as before
    with torch.no_grad():
        assert torch.equal(conv(ids), conv(ids))


def test_a_stream_branches_by_fork_and_by_deepcopy(lm):
    """A beam's branches: ``fork`` continues on the same model, sharing the prefix and its
    gradient history; ``copy.deepcopy`` copies the model and the state's values. Each branch
    gives what the whole sequence gives, and the original stream continues unchanged."""
    import copy

    model, conv = lm
    ids = torch.randint(0, 40, (2, 17), generator=torch.Generator().manual_seed(5))
    other = ids.clone()
    other[:, 9:] = (other[:, 9:] + 1) % 40
    stream = ttt2la.Stream(conv)
    stream.stream(ids[:, :9])                           # records gradients: history to keep
    branches = [stream.fork(), copy.deepcopy(stream)]
    with torch.no_grad():
        for branch, seq in zip(branches, (other, other)):
            assert rel_rms_error(branch.stream(seq[:, 9:]), model(seq)[:, 9:]) <= \
                TOLERANCE[torch.float32]
        assert rel_rms_error(stream.stream(ids[:, 9:]), model(ids)[:, 9:]) <= \
            TOLERANCE[torch.float32]
    assert branches[1].model is not conv and branches[0].model is conv
    fork = stream.fork()
    fork.reset()
    assert stream.tokens == 17 and fork.tokens == 0


class AttentionBeside(torch.nn.Module):
    """A hybrid block: causal softmax attention in a module of its own, then the TTT layer."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.attn = torch.nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, ids):
        x = self.lm.embed(ids)
        L = ids.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        for block in self.lm.blocks:
            x = block(x)
        return self.lm.lm_head(self.lm.norm(x))


def test_tokens_mixed_outside_the_converted_layers_are_refused_not_streamed(lm):
    """Attention outside the TTT layers keeps no state a stream carries: the second piece is
    checked against the whole sequence, and refused."""
    model, _ = lm
    torch.manual_seed(0)
    hybrid = AttentionBeside(model).eval()
    ids = torch.randint(0, 40, (2, 16))
    conv = ttt2la.convert(hybrid, level=2, example_inputs=(ids,)).eval()
    stream = ttt2la.Stream(conv)
    with torch.no_grad():
        stream.stream(ids[:, :8])                   # from the start: as the whole piece
        with pytest.raises(ttt2la.StreamingError, match="mixes tokens"):
            stream.stream(ids[:, 8:])
    assert stream.tokens == 0                       # and the stream starts again


class LastLogits(AttentionBeside):
    """The hybrid block returning the last token's logits only."""

    def forward(self, ids):
        return super().forward(ids)[:, -1]


def test_mixing_is_found_where_the_model_returns_the_last_tokens_logits(lm):
    model, _ = lm
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (2, 16))
    conv = ttt2la.convert(LastLogits(model).eval(), level=2, example_inputs=(ids,)).eval()
    stream = ttt2la.Stream(conv)
    with torch.no_grad():
        stream.stream(ids[:, :8])
        with pytest.raises(ttt2la.StreamingError, match="mixes tokens"):
            stream.stream(ids[:, 8:])


class Styled(torch.nn.Module):
    """The language model with a style vector added to every token, passed with each piece;
    with ``attention``, causal attention beside the TTT layers as well."""

    def __init__(self, lm, attention: bool = False):
        super().__init__()
        self.lm = lm
        self.attn = torch.nn.MultiheadAttention(D, 2, batch_first=True) if attention else None

    def forward(self, ids, style):
        x = self.lm.embed(ids) + style[:, None]
        if self.attn is not None:
            mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)
            x = x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        for block in self.lm.blocks:
            x = block(x)
        return self.lm.lm_head(self.lm.norm(x))


def test_what_every_piece_passes_alike_and_a_reused_buffer_stream_as_the_whole(lm):
    """The check passes a tensor every piece hands over as the same object once (a style
    vector, not joined along the tokens), and keeps copies of the pieces it compares (a caller
    decoding into one buffer writes over it)."""
    model, _ = lm
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(2))
    style = torch.randn(2, D)
    conv = ttt2la.convert(Styled(model), level=2, example_inputs=(ids, style)).eval()
    stream = ttt2la.Stream(conv)                # evaluation mode: the check runs
    with torch.no_grad():
        got = torch.cat([stream.stream(ids[:, :5], style), stream.stream(ids[:, 5:], style)], 1)
        assert rel_rms_error(got, Styled(model)(ids, style)) <= TOLERANCE[torch.float32]
    torch.manual_seed(1)
    mixing = ttt2la.convert(Styled(model, attention=True), level=2,
                            example_inputs=(ids, style)).eval()
    stream = ttt2la.Stream(mixing)                   # checked, its style passed once
    with torch.no_grad():
        stream.stream(ids[:, :5], style)
        with pytest.raises(ttt2la.StreamingError, match="mixes tokens"):
            stream.stream(ids[:, 5:], style)
    import copy

    stream = ttt2la.Stream(copy.deepcopy(lm[1]).eval())
    buffer = torch.zeros(2, 4, dtype=torch.long)     # a chunk a piece, one buffer
    with torch.no_grad():
        outs = []
        for t in range(0, 12, 4):
            buffer.copy_(ids[:, t:t + 4])
            outs.append(stream.stream(buffer))
        assert rel_rms_error(torch.cat(outs, 1), model(ids)) <= TOLERANCE[torch.float32]


def test_a_piece_that_fails_in_a_later_layer_advances_no_layer(lm):
    """The first block has run on the piece when the second fails: the stream keeps every
    layer where the previous piece ended, and the next pieces equal the whole sequence."""
    model, conv = lm
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(5))
    stream = ttt2la.Stream(conv)

    def refuse(_module, _args):
        raise ValueError("this piece is refused")

    with torch.no_grad():
        ref = model(ids)
        first = stream.stream(ids[:, :5])
        handle = conv.blocks[1].ttt.register_forward_pre_hook(refuse)
        try:
            with pytest.raises(ValueError, match="refused") as failed:
                stream.stream(ids[:, 5:8])
        finally:
            handle.remove()
        assert stream.tokens == 5 and all(v.tokens == 5 for v in stream.states.values())
        assert any("no layer's state advanced" in n for n in failed.value.__notes__)
        rest = stream.stream(ids[:, 5:])
    assert rel_rms_error(torch.cat([first, rest], 1), ref) <= TOLERANCE[torch.float32]


class _SharedAcrossDepth(torch.nn.Module):
    """One TTT layer run ``runs`` times per call (weights shared across depth)."""

    def __init__(self):
        super().__init__()
        self.ttt = PerTokenInlineTTTLayer(D, 2)
        self.runs = 2

    def forward(self, x):
        for _ in range(self.runs):
            x = x + self.ttt(x)
        return x


@pytest.fixture(scope="module")
def shared_across_depth():
    torch.manual_seed(3)
    model = _SharedAcrossDepth()
    return model, ttt2la.convert(model, level=2, example_inputs=(torch.randn(2, 9, D),))


@settings(max_examples=6)
@given(split=splits(13))
def test_a_layer_run_twice_per_call_streams_each_run_on_its_own_state(shared_across_depth,
                                                                       split):
    model, conv = shared_across_depth
    B, L, cuts = split
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(L))
    stream = ttt2la.Stream(conv)
    bounds = [0, *sorted(set(cuts)), L]
    with torch.no_grad():
        got = torch.cat([stream(x[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
        assert rel_rms_error(got, model(x)) <= TOLERANCE[torch.float32]
    assert set(stream.states) == {"ttt", "ttt (run 2)"}


def test_a_layer_running_more_often_than_before_in_a_sequence_is_refused(shared_across_depth):
    _model, conv = shared_across_depth
    stream = ttt2la.Stream(conv)
    with torch.no_grad():
        stream(torch.randn(1, 3, D))
        conv.runs = 3                   # a run more than the sequence's first piece had
        try:
            with pytest.raises(ttt2la.StreamingError, match="ran 3 time.* and 2 in the previous"):
                stream(torch.randn(1, 1, D))
        finally:
            conv.runs = 2
    assert set(stream.states.values()) == {None}


def test_stream_needs_a_converted_model():
    with pytest.raises(ttt2la.StreamingError, match="no converted"):
        ttt2la.Stream(torch.nn.Linear(2, 2))


class _UpdateThenApplyChunks(torch.nn.Module):
    """A chunked layer that updates its fast weight with a chunk before reading it there."""

    def __init__(self, d, C):
        super().__init__()
        self.C = C
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        W = self.w0.expand(x.shape[0], -1, -1)
        outs = []
        for i in range(0, x.shape[1], self.C):
            W = W + 0.1 * k[:, i:i + self.C].transpose(1, 2) @ v[:, i:i + self.C]
            outs.append(q[:, i:i + self.C] @ W)
        return torch.cat(outs, dim=1)


@pytest.fixture(scope="module")
def update_first():
    torch.manual_seed(11)
    layer = _UpdateThenApplyChunks(8, 4)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))


@settings(max_examples=8)
@given(chunks=st.integers(1, 6), cut_chunks=st.lists(st.integers(1, 5), max_size=3),
       tail=st.integers(1, 3))
def test_update_then_apply_chunks_continue_on_chunk_boundaries_only(update_first, chunks,
                                                                     cut_chunks, tail):
    layer, conv = update_first
    assert conv.ttt2la_report.layers[0].order == "inclusive"
    x = torch.randn(2, 4 * chunks, 8, generator=torch.Generator().manual_seed(chunks))
    cuts = sorted({4 * c for c in cut_chunks if c < chunks})
    with torch.no_grad():
        got, state = in_pieces(conv, x, cuts)
        assert rel_rms_error(got, layer(x)) <= TOLERANCE[torch.float32]
        assert state.open_tokens == 0
        # a piece ending inside a chunk: the chunk's outputs are not final yet
        with pytest.raises(ttt2la.StreamingError, match="chunk boundary"):
            conv(x[:, :tail], ttt_state=state, return_ttt_state=True)


class _PaddedToWholeChunks(torch.nn.Module):
    """A chunked layer that pads its sequence to whole chunks before its loop and views it as
    chunks (``F.pad``, then ``view``), as many published TTT layers do. ``gated``: a decay
    gate's logits are padded with zeros too, so the padding halves the memory per padded token
    (padding that is not inert); else an apply-then-update delta step whose padding is."""

    def __init__(self, d, C, gated):
        super().__init__()
        self.C, self.gated = C, gated
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.gate = torch.nn.Linear(d, 1)
        self.w0 = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        B, T, D = x.shape
        C, pad = self.C, (-x.shape[1]) % self.C
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
        g = torch.nn.functional.pad(self.gate(x), (0, 0, 0, pad))
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        N = (T + pad) // C
        q, k, v, g = (t.view(B, N, C, -1) for t in (q, k, v, g))
        W, outs = self.w0.expand(B, D, D), []
        for i in range(N):
            outs.append(q[:, i] @ W)
            if self.gated:
                W = torch.sigmoid(g[:, i]).prod(dim=1, keepdim=True) * W \
                    + k[:, i].transpose(1, 2) @ v[:, i]
            else:
                lr = torch.sigmoid(g[:, i])
                W = W - k[:, i].transpose(1, 2) @ (lr * (k[:, i] @ W - v[:, i]))
        return torch.cat(outs, dim=1)[:, :T]


@pytest.fixture(scope="module", params=[False, True], ids=["inert-padding", "gate-padded"])
def padded_to_whole_chunks(request):
    torch.manual_seed(13)
    layer = _PaddedToWholeChunks(8, 4, request.param)
    return layer, ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 14, 8),))


@settings(max_examples=10)
@given(split=splits(23))
@example(split=(1, 23, [2, 5, 6, 7, 13]))       # pieces ending inside chunks, then token by token
def test_a_layer_padding_its_sequence_to_whole_chunks_continues_from_its_tokens(
        padded_to_whole_chunks, split):
    """The loop reads the padding of every piece that ends inside a chunk; the state carried
    holds that chunk's tokens without it, so the next piece's tokens complete the chunk as the
    whole sequence does."""
    layer, conv = padded_to_whole_chunks
    B, L, cuts = split
    x = torch.randn(B, L, 8, generator=torch.Generator().manual_seed(L))
    with torch.no_grad():
        got, state = in_pieces(conv, x, cuts)
        ref = layer(x)
    assert rel_rms_error(got, ref) <= TOLERANCE[torch.float32], (cuts, rel_rms_error(got, ref))
    assert state.tokens == L and state.open_tokens == L - 4 * ((L - 1) // 4)
    assert all(t.shape[1] == state.open_tokens for t in state.open)


@pytest.mark.parametrize("nested", [False, True], ids=["the_model_is_the_layer", "a_submodule"])
def test_a_layer_kept_as_written_is_named_as_the_reason_not_to_stream(nested):
    """With ``strict=False`` a layer refused at every level is kept as written, whose loop
    restarts at every call: a stream over it is refused for that reason, also when the model
    itself is that layer (its path is empty)."""
    from ttt2la.zoo.ttt_linear import TTTLinearFuncGradLayer

    torch.manual_seed(0)
    layer = TTTLinearFuncGradLayer(8, 2, 4)
    model = torch.nn.Sequential(layer) if nested else layer
    converted = ttt2la.convert(model, level=2, example_inputs=(torch.randn(2, 12, 8),),
                               strict=False)
    named = "0" if nested else "the model (TTTLinearFuncGradLayer) itself"
    with pytest.raises(ttt2la.StreamingError, match=rf"TTT loop of {re.escape(named)} was kept "
                                                   "as the user wrote it"):
        ttt2la.Stream(converted)
