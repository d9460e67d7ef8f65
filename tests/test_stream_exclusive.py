"""Streaming loops that read the state before updating it (exclusive order) and whose last token
or chunk is only read: fed in pieces, they give the outputs *and* the carried state of feeding the
sequence whole.

Such a loop never folds its last token (chunk) into the state, so a piece must leave it open:
the next piece starts from the state before it and reads it again. The references are
hand-written token loops (their own projections, rules and constants) that also return the state
after every token, so the carried state is checked against the rule itself, not only against
another call of the converted layer. fp32 throughout, within the project's 1e-5 relative RMS.
"""
from __future__ import annotations

import math

import pytest
import module_scoped
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from torch import nn

import ttt2la
from ttt2la.stream import StreamCall, advance
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import DeltaMemoryLayer, LaCTFoldedLayer, LaCTHeadsLayer

from equivalence import in_pieces, splits

D, H = 16, 2
TOL = TOLERANCE[torch.float32]


class ReadThenWriteTTT(nn.Module):
    """A per-token linear TTT layer in exclusive order: token ``t`` reads ``W`` with its query,
    then writes ``η_t k_tᵀ v_t`` into it. With ``skip_last`` the loop leaves the last token's
    write out explicitly; without it the last write is dead code (the output never reads it)."""

    def __init__(self, d, h, *, skip_last=False):
        super().__init__()
        self.h, self.dh, self.skip_last = h, d // h, skip_last
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.lr = nn.Linear(d, h)
        self.w0 = nn.Parameter(torch.randn(h, d // h, d // h) / math.sqrt(d // h))

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.h, self.dh).unbind(2)
        eta = F.softplus(self.lr(x))
        W = self.w0.expand(B, -1, -1, -1)
        outs = []
        for t in range(L):
            outs.append((q[:, t].unsqueeze(-2) @ W).squeeze(-2))
            if not self.skip_last or t < L - 1:
                W = W + eta[:, t, :, None, None] * (k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2))
        return torch.stack(outs, 1).reshape(B, L, d)


# -- hand-written references: outputs and the state after every token ------------------------

def _heads(lin, x):
    B, L, _ = x.shape
    return (x @ lin.weight.T).view(B, L, H, D // H)


def delta_reference(layer, x):
    """The delta rule token by token, ``S ← α S; S ← S − β k (kᵀS − v)``: (output, states)
    where ``states[t]`` is ``S`` after ``t`` tokens (``states[0]`` the zero memory)."""
    B, L, _ = x.shape
    dh = D // H
    q = F.normalize(_heads(layer.q_proj, x), dim=-1) / math.sqrt(dh)
    k = F.normalize(_heads(layer.k_proj, x), dim=-1)
    v = _heads(layer.v_proj, x)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T + layer.b_proj.bias)
    alpha = None if layer.a_proj is None else \
        torch.sigmoid(x @ layer.a_proj.weight.T + layer.a_proj.bias + 3.0)
    S = torch.zeros(B, H, dh, dh)
    states, outs = [S], []
    for t in range(L):
        if layer.read == "before":
            outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], S))
        if alpha is not None:
            S = alpha[:, t, :, None, None] * S
        err = torch.einsum("bhi,bhij->bhj", k[:, t], S) - v[:, t]
        S = S - beta[:, t, :, None, None] * torch.einsum("bhi,bhj->bhij", k[:, t], err)
        if layer.read == "after":
            outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], S))
        states.append(S)
    o = torch.stack(outs, 1).reshape(B, L, D)
    return o @ layer.o_proj.weight.T, states


def read_then_write_reference(layer, x):
    """``ReadThenWriteTTT`` token by token: (output, states) as ``delta_reference``."""
    B, L, _ = x.shape
    dh = D // H
    proj = (x @ layer.qkv.weight.T).view(B, L, 3, H, dh)
    q, k, v = proj[:, :, 0], proj[:, :, 1], proj[:, :, 2]
    eta = torch.log1p(torch.exp(x @ layer.lr.weight.T + layer.lr.bias))
    W = layer.w0.unsqueeze(0).repeat(B, 1, 1, 1)
    states, outs = [W], []
    for t in range(L):
        outs.append(torch.einsum("bhi,bhij->bhj", q[:, t], W))
        W = W + eta[:, t, :, None, None] * torch.einsum("bhi,bhj->bhij", k[:, t], v[:, t])
        states.append(W)
    return torch.stack(outs, 1).reshape(B, L, D), states


# -- the layers, converted once ------------------------------------------------------------

TOKEN_CASES = {
    # name: (factory, reference, whether the last token is only read); the delta-rule layers
    # run on the delta_rule op, the read-then-write ones on the generic parallel schedule, and
    # "-naive" on the recurrent token loop (backend="naive")
    "delta-before": (lambda: DeltaMemoryLayer(D, H, read="before"), delta_reference, True),
    "delta-before-naive": (lambda: DeltaMemoryLayer(D, H, read="before"), delta_reference, True),
    "delta-after": (lambda: DeltaMemoryLayer(D, H, read="after"), delta_reference, False),
    "delta-gated-before-func": (lambda: DeltaMemoryLayer(D, H, decay=True, read="before",
                                                         grad="func"), delta_reference, True),
    "read-then-write": (lambda: ReadThenWriteTTT(D, H), read_then_write_reference, True),
    "read-then-write-skip-last": (lambda: ReadThenWriteTTT(D, H, skip_last=True),
                                  read_then_write_reference, True),
}
CHUNK_CASES = {
    # name: (factory, level, chunk size); both read each chunk before updating with it and
    # only read the last chunk; the momentum layers' stateful calls run the generic schedule
    "lact-folded": (lambda: LaCTFoldedLayer(D, H, 4, muon=False, momentum=False, base_lr=0.3,
                                            update_theta=False, weight_norm=False), 2, 4),
    "lact-heads-momentum": (lambda: LaCTHeadsLayer(D, H, 3, base_lr=0.3, muon=False,
                                                   update_theta=False, weight_norm=False), 2, 3),
}
_built = module_scoped.cache()


def _converted(name):
    if name not in _built:
        torch.manual_seed(5)
        if name in TOKEN_CASES:
            layer, level, C = TOKEN_CASES[name][0](), 0, 4
        else:
            factory, level, C = CHUNK_CASES[name]
            layer = factory()
        x = torch.randn(2, 3 * C + 2, D)
        backend = "naive" if name.endswith("-naive") else "auto"
        _built[name] = (layer, ttt2la.convert(layer, level=level, example_inputs=(x,),
                                              backend=backend))
    return _built[name]


def _same_state(got, want):
    """Two ``TTTState``s carry the same thing: fast weights, momentum and open tokens."""
    assert got.names == want.names and got.open_tokens == want.open_tokens
    assert got.tokens == want.tokens
    for a, b in zip(got.values, want.values):
        assert rel_rms_error(a, b) <= TOL, rel_rms_error(a, b)
    for a, b in zip(got.open, want.open):      # projected piece by piece: rounding differs
        assert a.shape == b.shape and rel_rms_error(a, b) <= TOL


@pytest.mark.parametrize("name", list(TOKEN_CASES))
@settings(max_examples=10, deadline=None)
@given(split=splits(13, 4))
@example(split=(2, 11, [5]))                       # the reported split
@example(split=(1, 6, [1, 2, 3, 4, 5]))            # token by token
@example(split=(3, 1, []))                         # one token
def test_per_token_pieces_give_the_whole_outputs_and_state(name, split):
    B, L, cuts = split
    _factory, reference, read_only_last = TOKEN_CASES[name]
    layer, conv = _converted(name)
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(100 * B + L))
    with torch.no_grad():
        want, states = reference(layer, x)
        assert rel_rms_error(layer(x), want) <= TOL          # the reference is the layer
        got, state = in_pieces(conv, x, cuts)
        _y, whole = conv(x, return_ttt_state=True)
    assert rel_rms_error(got, want) <= TOL, (cuts, rel_rms_error(got, want))
    # the state holds the memory after every token the loop folded in; the token it only
    # read stays open, to be read again (and folded) when the sequence goes on
    folded = L - 1 if read_only_last else L
    assert state.open_tokens == L - folded and state.tokens == L
    (S,) = state.values
    assert rel_rms_error(S, states[folded]) <= TOL, rel_rms_error(S, states[folded])
    _same_state(state, whole)


@pytest.mark.parametrize("name", list(TOKEN_CASES))
def test_continuing_folds_the_last_read_token(name):
    """After a piece, one more token: its output reads the memory with the previous piece's
    last token folded in."""
    _factory, reference, _ = TOKEN_CASES[name]
    layer, conv = _converted(name)
    x = torch.randn(2, 7, D, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want, states = reference(layer, x)
        _y, state = conv(x[:, :6], return_ttt_state=True)
        y, state = conv(x[:, 6:], ttt_state=state, return_ttt_state=True)
    assert rel_rms_error(y, want[:, 6:]) <= TOL, rel_rms_error(y, want[:, 6:])
    assert rel_rms_error(state.values[0], states[7 - state.open_tokens]) <= TOL


@pytest.mark.parametrize("name", list(CHUNK_CASES))
@settings(max_examples=10, deadline=None)
@given(split=splits(17, 4))
@example(split=(2, 14, [5, 6]))                    # pieces ending inside chunks
@example(split=(1, 12, [4, 8]))                    # pieces ending on chunk boundaries
def test_chunked_pieces_give_the_whole_outputs_and_state(name, split):
    B, L, cuts = split
    layer, conv = _converted(name)
    C = CHUNK_CASES[name][2]
    x = torch.randn(B, L, D, generator=torch.Generator().manual_seed(100 * B + L))
    with torch.no_grad():
        want = layer(x)
        got, state = in_pieces(conv, x, cuts)
        _y, whole = conv(x, return_ttt_state=True)
    assert rel_rms_error(got, want) <= TOL, (cuts, rel_rms_error(got, want))
    # the last chunk, full or not, is only read: it stays open
    assert state.open_tokens == L - (math.ceil(L / C) - 1) * C
    _same_state(state, whole)


def test_a_plan_that_drops_an_updated_state_is_refused():
    """A plan that returns no value for a state the loop updates cannot be continued from:
    the stateful call says so instead of restarting that state from its old value."""
    _layer, conv = _converted("delta-before")
    x = torch.randn(2, 5, D)
    seen = {}

    def spy(states0, invariants):
        seen["args"] = (states0, invariants)
        raise RuntimeError("stop")

    with torch.no_grad():
        conv(x, return_ttt_state=True)          # the locality check runs once, before the spy
    loop = conv._ttt2la.loop_for(2)
    loop.plan, real = spy, loop.plan
    try:
        with pytest.raises(RuntimeError, match="stop"), torch.no_grad():
            conv(x, return_ttt_state=True)
    finally:
        loop.plan = real
    states0, invariants = seen["args"]
    outputs, _finals = real(states0, invariants)

    def forgetful(s, i):
        return outputs, [None] * len(s)

    with pytest.raises(ttt2la.StreamingError, match="returns no value for it"):
        advance(forgetful, loop.program, states0, invariants, StreamCall(None, x.shape[1]),
                "this loop")


def test_an_empty_first_piece_is_refused():
    _layer, conv = _converted("delta-before")
    with pytest.raises(ttt2la.ConversionError, match="empty"):
        conv(torch.randn(2, 0, D), return_ttt_state=True)
