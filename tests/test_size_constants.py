"""Numbers the code derives from the input's shape or the loop index inside the loop: exact at
every batch size and length, or refused naming the line — never the traced shape's number run at
another shape."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.func import grad

import ttt2la
from ttt2la.errors import UnsupportedShapeError, UnsupportedTTTError

from equivalence import assert_same_function

D, C = 8, 4


class ChunkRule(nn.Module):
    """Chunked linear attention whose step size ``rate(B, T)`` the forward computes from sizes."""

    def __init__(self, rate):
        super().__init__()
        self.rate = rate
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.proj(x).chunk(3, -1)
        step = self.rate(B, T)
        S = x.new_zeros(B, D, D)
        out = []
        for s in range(0, T, C):
            out.append(q[:, s:s + C] @ S)
            S = S + step * (k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C])
        return torch.cat(out, 1)


class IndexRule(nn.Module):
    """Each chunk's update divided by its index plus one: a step of the loop index."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], D, D)
        out = []
        for n, s in enumerate(range(0, x.shape[1], C)):
            out.append(q[:, s:s + C] @ S)
            S = S + (k[:, s:s + C].transpose(1, 2) @ v[:, s:s + C]) / (n + 1)
        return torch.cat(out, 1)


class MeanLossMemory(nn.Module):
    """A memory per head stepped down the gradient of ``F.mse_loss`` with its default mean over
    batch, heads, tokens and channels: its step scales with one over the batch size."""

    def __init__(self, width=16, heads=2, chunk=4):
        super().__init__()
        self.heads, self.dh, self.chunk = heads, width // heads, chunk
        self.proj = nn.Linear(width, 3 * width, bias=False)
        self.M0 = nn.Parameter(0.1 * torch.randn(heads, self.dh, self.dh))
        self.log_rate = nn.Parameter(torch.full((heads, 1, 1), 2.0))

    @staticmethod
    def loss(M, k, v):
        return F.mse_loss(k @ M, v)

    def forward(self, x):
        B, T, W = x.shape
        q, k, v = self.proj(x).view(B, T, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        M = self.M0.expand(B, -1, -1, -1)
        out = []
        for qc, kc, vc in zip(q.split(self.chunk, 2), k.split(self.chunk, 2),
                              v.split(self.chunk, 2)):
            M = M - self.log_rate.exp() * grad(self.loss)(M, kc, vc)
            out.append(qc @ M)
        return torch.cat(out, 2).transpose(1, 2).reshape(B, T, W)


def _converted(layer, B=2, T=16, **kw):
    torch.manual_seed(0)
    return ttt2la.convert(layer, level=2, example_inputs=(torch.randn(B, T, layer_width(layer)),),
                          **kw)


def layer_width(layer):
    return layer.proj.in_features


@pytest.fixture(scope="module")
def per_batch():
    torch.manual_seed(1)
    layer = ChunkRule(lambda B, T: 1.0 / B)
    return _converted(layer), layer


@pytest.fixture(scope="module")
def mean_loss():
    torch.manual_seed(2)
    layer = MeanLossMemory()
    return _converted(layer, T=12), layer


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(2, 23))
def test_a_step_of_the_batch_size_is_exact_at_every_batch_size(per_batch, B, T):
    conv, layer = per_batch
    assert_same_function(conv, layer, torch.randn(B, T, D, generator=torch.Generator()
                                                  .manual_seed(B * 100 + T)))


def test_other_batch_sizes_run_as_written_and_say_why(per_batch):
    conv, layer = per_batch
    assert_same_function(conv, layer, [torch.randn(3, 16, D), torch.randn(1, 9, D)])
    runs = conv.ttt2la_report.to_dict()["layers"][0]["runs"]
    why = [v for k, v in runs.items() if "untraced batch size" in k]
    assert why and all("depends on the batch size" in w and "test_size_constants.py" in w
                       for w in why), runs
    assert "batch 3, length 16, untraced batch size" in runs, runs


def test_a_lossy_conversion_refuses_other_batch_sizes(per_batch):
    conv, _ = per_batch
    lossy = copy.deepcopy(conv)
    lossy._ttt2la.as_written = None          # what a lossy conversion holds: nothing to run
    with torch.no_grad():
        lossy(torch.randn(2, 16, D))
        with pytest.raises(UnsupportedShapeError, match="batch size 2 only") as refused:
            lossy(torch.randn(3, 16, D))
    assert "depends on the batch size" in str(refused.value)
    assert "test_size_constants.py:" in str(refused.value)


@pytest.mark.parametrize("B,T", [(1, 12), (2, 12), (3, 12), (1, 20), (2, 18), (3, 7), (4, 8)])
def test_a_mean_loss_over_the_batch_is_exact_at_every_batch_size_and_length(mean_loss, B, T):
    conv, layer = mean_loss
    x = torch.randn(B, T, 16, generator=torch.Generator().manual_seed(B * 100 + T))
    assert_same_function(conv, layer, x)
    with torch.no_grad():
        assert torch.allclose(conv(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rate,moves,line", [
    (lambda B, T: 1.0 / T, "length", "S = S + step"),
    (lambda B, T: 1.0 / math.sqrt(T), "length", "S = S + step"),
    (lambda B, T: 1.0 / math.ceil(T / C), "number of chunks", "S = S + step"),
    (lambda B, T: torch.tensor(1.0 / T), "length", "torch.tensor(1.0 / T)"),
    (lambda B, T: 1 / torch.tensor(T), "length", "1 / torch.tensor(T)"),
    (lambda B, T: torch.as_tensor(T).rsqrt(), "length", "torch.as_tensor(T).rsqrt()"),
], ids=["1/T", "1/sqrt(T)", "1/chunks", "tensor(1/T)", "1/tensor(T)", "as_tensor(T)"])
def test_a_step_of_the_length_is_refused_naming_the_line(rate, moves, line):
    with pytest.raises(UnsupportedTTTError) as e:
        _converted(ChunkRule(rate))
    msg = str(e.value)
    assert f"depends on the {moves}" in msg and "test_size_constants.py:" in msg, msg
    assert line in msg and "as a tensor" in msg and "bug" not in msg, msg


@pytest.mark.parametrize("rate", [lambda B, T: torch.tensor(1.0 / B),
                                  lambda B, T: 1 / torch.tensor(B)], ids=["float", "int"])
def test_a_tensor_made_from_the_batch_size_is_exact_at_every_batch_size(rate):
    torch.manual_seed(5)
    layer = ChunkRule(rate)
    assert_same_function(_converted(layer), layer,
                         [torch.randn(B, T, D) for B, T in ((1, 16), (2, 13), (3, 9))])


@pytest.mark.parametrize("strict", [True, False])
def test_a_step_of_the_loop_index_is_refused_naming_the_line(strict):
    with pytest.raises(UnsupportedTTTError) as e:
        _converted(IndexRule(), strict=strict)
    msg = str(e.value)
    assert "depends on the loop index" in msg and "/ (n + 1)" in msg, msg
    assert "torch.arange" in msg and "bug" not in msg, msg


def test_the_remedy_a_tensor_of_the_length_converts_exactly():
    torch.manual_seed(3)
    layer = ChunkRule(lambda B, T: torch.ones(()) / T)
    conv = _converted(layer)
    assert_same_function(conv, layer, [torch.randn(2, 16, D), torch.randn(3, 32, D),
                                       torch.randn(1, 7, D)])


class BatchMeanStep(nn.Module):
    """One gradient step over all tokens (no loop) of a loss divided by ``N·B`` as a float: the
    step's number moves with the batch size (and, not affinely, the length stays fixed)."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.proj = nn.Linear(dim, 3 * dim)
        self.W1 = nn.Parameter(torch.randn(heads, self.d, self.d) * self.d ** -0.5)

    def forward(self, x):
        B, N, W = x.shape
        q, k, v = self.proj(x).reshape(B, N, 3, self.H, self.d).unbind(2)
        F1 = self.W1.unsqueeze(0).expand(B, -1, -1, -1).clone().requires_grad_(True)
        with torch.enable_grad():
            loss = -(torch.einsum("bnhd,bhde->bnhe", k, F1) * v).sum() / (N * float(B))
            g, = torch.autograd.grad(loss, F1, create_graph=True)
        return torch.einsum("bnhd,bhde->bnhe", q, F1 - 0.5 * g).reshape(B, N, W)


def test_a_single_step_with_a_number_of_the_batch_size_is_exact_at_every_batch_size():
    torch.manual_seed(4)
    layer = BatchMeanStep()
    conv = _converted(layer, T=12)
    assert_same_function(conv, layer, [torch.randn(B, 12, 16) for B in (1, 2, 3, 4)])
    runs = conv.ttt2la_report.to_dict()["layers"][0]["runs"]
    assert "batch 3, length 12, untraced batch size" in runs, runs
    assert "depends on the batch size" in runs["batch 3, length 12, untraced batch size"], runs
