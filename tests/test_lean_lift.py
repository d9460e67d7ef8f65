"""A lifted layer runs its token-local features once over the whole sequence, and LaCT's weight
norm on the runtime op.

Each case is a small chunked TTT layer written here by hand — a linear fast weight read by
``φ(q) W`` and updated by ``φ(k)ᵀ(η⊙v)`` (optionally through momentum and a weight norm) — with
its own kernel feature map: token by token (``silu``), or mixing the tokens of a chunk (minus the
chunk mean, a cumulative sum), which must not run over the whole sequence. Every converted layer
equals the layer's own loop (float64, relative RMS ≤ 1e-10, outputs and every gradient) at every
batch size and length, whichever way it runs; and the converted LaCT operator reads its
non-contiguous inputs where they lie, copying no sequence-sized tensor.
"""
from __future__ import annotations

import collections

import pytest
import module_scoped
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import ttt2la
from equivalence import assert_same_function
from ttt2la.lowering import LiftedPlan
from ttt2la.testing import rel_rms_error

C = 4
D = 6
F64 = 1e-10


def token_silu(x):
    return F.silu(x)


def minus_chunk_mean(x):            # mixes the chunk's tokens
    return x - x.mean(dim=1, keepdim=True)


def chunk_cumsum(x):                # mixes the chunk's tokens causally
    return torch.cumsum(x, dim=1)


def row_norm(W, n, eps=1e-5):       # LaCT's weight norm over the key axis of [Dk, Dv]
    return W / (W.norm(dim=1, keepdim=True) + eps) * n


class FeatureTTT(nn.Module):
    """Per chunk: read ``φ(q) W``, then ``M ← β M + φ(k)ᵀ(η⊙v)``, ``W ← norm(W + M)``."""

    def __init__(self, phi, momentum=True, norm=None):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.lr = nn.Linear(D, 1, bias=False)
        self.beta = nn.Linear(D, 1, bias=False)
        self.w0 = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.phi, self.momentum, self.norm = phi, momentum, norm

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.phi(self.q(x)), self.phi(self.k(x)), self.v(x)
        lr = torch.sigmoid(self.lr(x))
        beta = torch.sigmoid(self.beta(x))
        W = self.w0.expand(B, -1, -1)
        target = W.norm(dim=1, keepdim=True)
        M = torch.zeros_like(W)
        out = torch.zeros_like(v)
        e = 0
        for s in range(0, L - C, C):
            e = s + C
            out[:, s:e] = q[:, s:e] @ W
            G = k[:, s:e].transpose(1, 2) @ (v[:, s:e] * lr[:, s:e])
            M = beta[:, s:e].mean(dim=1, keepdim=True) * M + G if self.momentum else G
            W = W + M
            if self.norm is not None:
                W = self.norm(W, target)
        out[:, e:] = q[:, e:] @ W
        return out


class ChunkFeatureTTT(FeatureTTT):
    """The same, with the feature map applied chunk by chunk inside the loop."""

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        lr = torch.sigmoid(self.lr(x))
        W = self.w0.expand(B, -1, -1)
        out = torch.zeros_like(v)
        e = 0
        for s in range(0, L - C, C):
            e = s + C
            out[:, s:e] = self.phi(q[:, s:e]) @ W
            W = W + self.phi(k[:, s:e]).transpose(1, 2) @ (v[:, s:e] * lr[:, s:e])
        out[:, e:] = self.phi(q[:, e:]) @ W
        return out


#: name: (layer, runs whole, schedule). Token-mixing maps are not inert to a padded last
#: chunk, so those layers take lengths that are multiples of the chunk (refused otherwise).
CASES = {
    "token features": (lambda: FeatureTTT(token_silu), True, "parallel"),
    "chunk-mean features": (lambda: ChunkFeatureTTT(minus_chunk_mean), False, "parallel"),
    "chunk-cumsum features": (lambda: ChunkFeatureTTT(chunk_cumsum), False, "parallel"),
    "weight norm": (lambda: FeatureTTT(token_silu, norm=row_norm), True, "semi-parallel"),
}


def _length(name, L):
    return L if CASES[name][1] else C * (1 + L // C)
_cache = module_scoped.cache()


def _converted(name, level=1):
    if (name, level) not in _cache:
        torch.manual_seed(0)
        layer = CASES[name][0]().double()
        x = torch.randn(2, _length(name, 3 * C + 2), D, dtype=torch.float64)
        _cache[name, level] = layer, ttt2la.convert(layer, level=level, example_inputs=(x,))
    return _cache[name, level]


def _plan(conv, B):
    state = next(m._ttt2la for m in conv.modules() if hasattr(m, "_ttt2la"))
    return state.loop_for(B).plan


@pytest.mark.parametrize("name", list(CASES))
def test_feature_maps_run_whole_only_when_token_local(name):
    _, whole, schedule = CASES[name]
    _, conv = _converted(name)
    for B in (1, 2, 3):
        plan = _plan(conv, B)
        assert isinstance(plan, LiftedPlan)
        assert plan.lifted.whole_sequence is whole
        assert plan.schedule == schedule


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 5 * C + 3))
def test_lifted_layers_equal_their_loop(name, B, L):
    layer, conv = _converted(name)
    L = _length(name, L)
    x = torch.randn(B, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(B * L))
    assert_same_function(conv, layer, x, tol=F64)


class OtherNormTTT(FeatureTTT):
    """A weight norm the op does not run: another ε, or over the value axis of ``[Dk, Dv]``."""

    def __init__(self, eps, dim):
        super().__init__(token_silu, momentum=False)
        self.eps, self.dim = eps, dim

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = F.silu(self.q(x)), F.silu(self.k(x)), self.v(x)
        lr = torch.sigmoid(self.lr(x))
        W = self.w0.expand(B, -1, -1)
        target = W.norm(dim=self.dim, keepdim=True)
        out = torch.zeros_like(v)
        e = 0
        for s in range(0, L - C, C):
            e = s + C
            out[:, s:e] = q[:, s:e] @ W
            W = W + k[:, s:e].transpose(1, 2) @ (v[:, s:e] * lr[:, s:e])
            W = W / (W.norm(dim=self.dim, keepdim=True) + self.eps) * target
        out[:, e:] = q[:, e:] @ W
        return out


@pytest.mark.parametrize("eps,dim", [(1e-6, 1), (1e-5, 2)])
def test_a_weight_norm_the_op_does_not_compute_is_not_lifted(eps, dim):
    torch.manual_seed(0)
    layer = OtherNormTTT(eps, dim).double()
    x = torch.randn(2, 3 * C + 2, D, dtype=torch.float64)
    conv = ttt2la.convert(layer, level=1, example_inputs=(x,))
    assert not isinstance(_plan(conv, 2), LiftedPlan)
    assert_same_function(conv, layer, x, tol=F64)


class _Copies(TorchDispatchMode):
    """Counts ops that write a new tensor of at least ``size`` elements by copying."""

    COPIES = {"aten.clone.default", "aten.copy_.default", "aten.cat.default",
              "aten._to_copy.default", "aten.constant_pad_nd.default"}

    def __init__(self, size):
        super().__init__()
        self.size, self.seen = size, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.COPIES and isinstance(out, torch.Tensor) \
                and out.numel() >= self.size:
            self.seen[str(func)] += 1
        return out


@pytest.mark.parametrize("level", [1, 2])
def test_lact_operator_reads_non_contiguous_sequences_without_copies(level):
    from ttt2la.zoo import LaCTPublishedLayer
    torch.manual_seed(0)
    layer = LaCTPublishedLayer(64, 2, 16, muon=False)
    conv = ttt2la.convert(layer, level=level, example_inputs=(torch.randn(1, 40, 64),))
    op = next(m for m in conv.modules() if hasattr(m, "_ttt2la"))
    captured = {}
    op.register_forward_pre_hook(lambda m, a: captured.setdefault("args", a))
    x = torch.randn(1, 100, 64)
    with torch.no_grad():
        conv(x)
        q = captured["args"][0]
        assert not q.is_contiguous()        # heads folded by a permute: a strided view
        with _Copies(size=q.numel()) as copies:
            y = op(*captured["args"])
    assert sum(copies.seen.values()) == 0, copies.seen
    ref = LaCTPublishedLayer(64, 2, 16, muon=False, update_theta=False,
                             weight_norm=level == 1)
    ref.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert rel_rms_error(conv(x), ref(x)) <= 1e-5
    assert y.shape == q.shape


class _NormedKeys(torch.nn.Module):
    """Keys layer-normed chunk by chunk inside the loop: ``native_layer_norm`` has three results
    (the output, its mean and rstd), which the search for the chunk's token axes steps over."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(d, 3 * d, bias=False)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(B, D, D)
        outs = []
        for s in range(0, T, 4):
            outs.append(q[:, s:s + 4] @ S)
            S = S + 0.1 * self.norm(k[:, s:s + 4]).mT @ v[:, s:s + 4]
        return torch.cat(outs, 1)


def test_a_norm_inside_the_loop_runs_at_every_length():
    torch.manual_seed(0)
    layer = _NormedKeys()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert_same_function(conv, layer, [torch.randn(1, 7, 8), torch.randn(2, 33, 8)])
