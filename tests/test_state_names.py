"""Carried states are named after the user's own variables, however the loop holds them.

Each loop below carries two fast weights: as separate variables, assigned one by one or by one
tuple (directly or from a step function), in a dict (updated key by key or rebuilt as a dict
literal), in one variable holding a tuple, and updated by a helper that names its argument the
same for both, and by one helper on one line of two statements. The rolled-up program (and the report) names each state after its own variable
or key — never a joined ``wa_wb`` — and numbers them only where the code has one name for both.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import ttt2la
from ttt2la.frontend.capture import trace
from ttt2la.frontend.loops import find_loops
from ttt2la.frontend.rollup import roll_up

C = 2


def step(wa, wb, k, v):
    return wa + k.mT @ v, wb + 0.5 * k.mT @ v


def sgd(W, g):
    W = W - 0.1 * g
    return W


def separate(wa, wb, q, k, v):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ wa + qi @ wb)
        wa = wa + ki.mT @ vi
        wb = wb + 0.5 * ki.mT @ vi
    return torch.cat(outs, 1)


def one_tuple(wa, wb, q, k, v):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ wa + qi @ wb)
        wa, wb = wa + ki.mT @ vi, wb + 0.5 * ki.mT @ vi
    return torch.cat(outs, 1)


def tuple_from_step(wa, wb, q, k, v):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ wa + qi @ wb)
        wa, wb = step(wa, wb, ki, vi)
    return torch.cat(outs, 1)


def dict_by_key(wa, wb, q, k, v):
    state = {"fast_a": wa, "fast_b": wb}
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ state["fast_a"] + qi @ state["fast_b"])
        state["fast_a"] = state["fast_a"] + ki.mT @ vi
        state["fast_b"] = state["fast_b"] + 0.5 * ki.mT @ vi
    return torch.cat(outs, 1)


def dict_literal(wa, wb, q, k, v):
    state = {"fast_a": wa, "fast_b": wb}
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ state["fast_a"] + qi @ state["fast_b"])
        state = {"fast_a": state["fast_a"] + ki.mT @ vi,
                 "fast_b": state["fast_b"] + 0.5 * ki.mT @ vi}
    return torch.cat(outs, 1)


def dict_call(wa, wb, q, k, v):
    state = dict(fast_a=wa, fast_b=wb)
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ state["fast_a"] + qi @ state["fast_b"])
        state = dict(fast_a=state["fast_a"] + ki.mT @ vi, fast_b=state["fast_b"] - ki.mT @ vi)
    return torch.cat(outs, 1)


def helper_for_each(wa, wb, q, k, v):
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ wa + qi @ wb)
        wa = sgd(wa, -ki.mT @ vi)
        wb = sgd(wb, ki.mT @ vi)
    return torch.cat(outs, 1)


def tuple_in_one_variable(wa, wb, q, k, v):
    w = (wa, wb)
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ w[0] + qi @ w[1])
        w = step(w[0], w[1], ki, vi)
    return torch.cat(outs, 1)


def _dict_step(p, x):
    qi, ki, vi = x
    p = pytree.tree_map(lambda w: w + ki.mT @ vi, p)
    return p, qi @ p["fast_a"] + qi @ p["fast_b"]


def scanned_dict(wa, wb, q, k, v):
    """A dict of fast weights made by a literal, carried through ``carry, y = step(carry, x)``:
    the tuple's names are the carry and the step's output, not the states'."""
    carry = {"fast_a": wa * 1.0, "fast_b": wb * 1.0}
    outs = []
    for s in range(0, q.shape[1], C):
        carry, y = _dict_step(carry, (q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]))
        outs.append(y)
    return torch.cat(outs, 1)


def semicolons(wa, wb, q, k, v):
    """Both weights stepped by the same helper on one line, as two statements."""
    outs = []
    for s in range(0, q.shape[1], C):
        qi, ki, vi = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
        outs.append(qi @ wa + qi @ wb)
        wa = sgd(wa, -ki.mT @ vi); wb = sgd(wb, -0.5 * ki.mT @ vi)  # noqa: E702
    return torch.cat(outs, 1)


def _state_names(fn) -> list[str]:
    g = torch.Generator().manual_seed(0)
    wa, wb = (torch.randn(2, 3, 3, generator=g) for _ in range(2))
    q, k, v = (torch.randn(2, 4 * C, 3, generator=g) for _ in range(3))
    gm = trace(fn, wa, wb, q, k, v)
    (loop, depth), = [ld for ld in find_loops(gm) if ld[0].function == fn.__name__]
    return [s.name for s in roll_up(gm, loop, depth).program.states]


@pytest.mark.parametrize("fn, names", [
    (separate, ["wa", "wb"]),
    (one_tuple, ["wa", "wb"]),
    (tuple_from_step, ["wa", "wb"]),
    (dict_by_key, ["fast_a", "fast_b"]),
    (dict_literal, ["fast_a", "fast_b"]),
    (dict_call, ["fast_a", "fast_b"]),
    (helper_for_each, ["wa", "wb"]),
    (tuple_in_one_variable, ["w0", "w1"]),
    (scanned_dict, ["fast_a", "fast_b"]),
    (semicolons, ["wa", "wb"]),
])
def test_each_state_is_named_after_its_own_variable(fn, names):
    assert sorted(_state_names(fn)) == names


class DictStateLayer(nn.Module):
    """Two linear fast weights held in a dict and updated key by key, per chunk of 4."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.w0 = nn.Parameter(torch.randn(2, d, d) * 0.1)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.q(x), F.normalize(self.k(x), dim=-1), self.v(x)
        memory = {"keys_to_values": self.w0[0].expand(B, d, d),
                  "slow_copy": self.w0[1].expand(B, d, d)}
        outs = []
        for s in range(0, L, 4):
            qi, ki, vi = q[:, s:s + 4], k[:, s:s + 4], v[:, s:s + 4]
            outs.append(qi @ memory["keys_to_values"] + qi @ memory["slow_copy"])
            memory["keys_to_values"] = memory["keys_to_values"] + ki.mT @ vi
            memory["slow_copy"] = memory["slow_copy"] + 0.1 * ki.mT @ vi
        return torch.cat(outs, 1)


def test_the_report_names_dict_held_states_by_their_keys():
    torch.manual_seed(0)
    converted = ttt2la.convert(DictStateLayer(), level=0,
                               example_inputs=(torch.randn(2, 16, 8),))
    report = converted.ttt2la_report.layers[0]
    assert sorted(s.name for s in report.states) == ["keys_to_values", "slow_copy"]
    assert "keys_to_values" in report.to_markdown()


class CaseClashLayer(nn.Module):
    """A fast weight ``W`` beside a value named ``w`` from a loop-invariant weight: in fx's
    snake-case naming both want the node name ``w``."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.P = nn.Parameter(torch.randn(d, d) / d)

    def forward(self, x):
        W = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for s in range(0, x.shape[1], 4):
            xc = x[:, s:s + 4]
            w = torch.tanh(xc @ self.P.T)
            outs.append(w @ W)
            W = W + xc.mT @ w
        return torch.cat(outs, 1)


def test_names_that_differ_only_in_case_keep_their_own_values():
    """Each body input is bound to its own value, however fx renames its node: before, the
    generated code read the state ``W`` where the body meant the weight named ``w``."""
    from equivalence import assert_same_function

    torch.manual_seed(0)
    layer = CaseClashLayer()
    converted = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert [s.name for s in converted.ttt2la_report.layers[0].states] == ["W"]
    assert_same_function(converted, layer, [torch.randn(3, 20, 8)])


def decayed_step(S, k, v, g):
    return g.unsqueeze(-1) * S + k.unsqueeze(-1) * v.unsqueeze(-2)


class HelperGatedMemory(nn.Module):
    """A gate computed before the loop and viewed inside a helper whose line binds no name."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.decay = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        g = torch.sigmoid(self.decay)
        S = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1])
        outs = []
        for t in range(x.shape[1]):
            S = decayed_step(S, k[:, t], v[:, t], g)
            outs.append((q[:, t, :, None] * S).sum(-2))
        return torch.stack(outs, 1)


def test_an_invariant_a_helper_computes_is_named_after_what_it_views():
    """The rule names the gate ``g`` the helper views, never a trace name (``unsqueeze_4``)."""
    torch.manual_seed(0)
    conv = ttt2la.convert(HelperGatedMemory(), level=2, example_inputs=(torch.randn(2, 12, 8),))
    state, = conv.ttt2la_report.layers[0].states
    assert state.update_rule == "S' = g·S + k⊙v", state.update_rule


class InlineStep(nn.Module):
    """A single step whose stepped weights no statement of the layer assigns."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.W1 = nn.Parameter(torch.randn(heads, self.d, self.d) * self.d ** -0.5)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        return (q @ (self.W1 + 0.7 * k.mT @ v / N)).transpose(1, 2).reshape(B, N, C)


def test_a_state_no_line_of_the_layer_names_takes_no_name_from_the_code_that_called_it():
    """The frames outside the layer (ttt2la's own, which traced it) name nothing."""
    torch.manual_seed(0)
    fast = ttt2la.convert(InlineStep(), level=0, example_inputs=(torch.randn(2, 12, 16),))
    assert [s.name for s in fast.ttt2la_report.layers[0].states] == ["state0"]
