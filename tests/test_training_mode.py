"""A layer whose code differs in training mode (dropout, batch norm) converts as it comes.

``nn.Module`` starts in training mode, where dropout draws a random mask no rewrite can reproduce
draw for draw. ``convert`` traces and checks every layer in evaluation mode and leaves every
module's mode as it found it; a layer whose output differs in training mode says so in its
report, runs its code as written in training mode when its conversion is exact (the same draws
as the original), and refuses training mode when it is lossy. A layer whose code does not depend
on the mode runs its converted graphs in both.
"""
from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
from torch import nn

import ttt2la
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, LaCTPublishedLayer

FP32 = TOLERANCE[torch.float32]
D = 16


class Dropped(nn.Module):
    """A per-token memory with dropout on its keys (inside the loop) or on its output."""

    def __init__(self, inside: bool, norm: bool = False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.drop = nn.Dropout(0.2)
        self.inside = inside
        self.norm = nn.BatchNorm1d(D) if norm else None

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        S = x.new_zeros(x.shape[0], D, D)
        outs = []
        for t in range(x.shape[1]):
            kt = self.drop(k[:, t]) if self.inside else k[:, t]
            S = S + kt[:, :, None] * v[:, t, None, :]
            outs.append((q[:, t, :, None] * S).sum(1))
        y = torch.stack(outs, 1)
        if self.norm is not None:
            y = self.norm(y.transpose(1, 2)).transpose(1, 2)
        return y if self.inside else self.drop(y)


def _layer_report(conv):
    layer, = conv.ttt2la_report.layers
    return layer


@pytest.mark.parametrize("inside", [False, True])
def test_a_layer_with_dropout_converts_in_training_mode(inside):
    torch.manual_seed(0)
    layer = Dropped(inside)                                 # training mode, as constructed
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert layer.training and conv.training and conv.drop.training
    report = _layer_report(conv)
    assert report.runtime.startswith("chunk_linear_attention")
    assert any("converted for evaluation mode" in n and "drop (Dropout)" in n
               for n in report.notes), report.notes
    conv.eval()
    layer.eval()
    assert rel_rms_error(conv(x), layer(x)) <= FP32
    assert "training mode" not in " ".join(report.runs)
    conv.train()
    layer.train()
    torch.manual_seed(1)
    got = conv(x)
    torch.manual_seed(1)
    want = layer(x)
    assert torch.equal(got, want)                           # the same draws: the code as written
    assert any("training mode" in shape and ran.startswith("as written")
               for shape, ran in report.runs.items()), report.runs


def test_a_layer_without_mode_dependence_runs_its_graphs_in_training_mode():
    torch.manual_seed(0)
    layer = Dropped(False)
    layer.drop.p = 0.0                      # dropout of nothing: the same in both modes
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert conv._ttt2la.training_dependence == ""
    assert conv.training
    assert rel_rms_error(conv(x), layer(x)) <= FP32
    assert not any("training mode" in shape for shape in _layer_report(conv).runs)


def test_batch_norm_statistics_are_left_as_they_were():
    torch.manual_seed(0)
    layer = Dropped(True, norm=True)
    layer.drop.p = 0.0
    before = {n: b.clone() for n, b in layer.named_buffers()}
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,), inplace=True)
    assert "norm (BatchNorm1d)" in conv._ttt2la.training_dependence
    for name, b in conv.named_buffers():
        assert torch.equal(b, before[name]), name


def test_a_streaming_call_in_training_mode_is_refused():
    torch.manual_seed(0)
    conv = ttt2la.convert(Dropped(True), level=0, example_inputs=(torch.randn(2, 12, D),))
    with pytest.raises(ttt2la.StreamingError, match="evaluation mode"):
        conv(torch.randn(2, 5, D), return_ttt_state=True)
    conv.eval()
    y, state = conv(torch.randn(2, 5, D), return_ttt_state=True)
    assert state.tokens == 5


def with_output_dropout(layer_class: type) -> type:
    """``layer_class`` with dropout on its output, in its own forward."""

    class WithDropout(layer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.drop = nn.Dropout(0.1)

        def forward(self, x):
            return self.drop(super().forward(x))

    return WithDropout


#: A LaCT layer whose chunk loop is in its own forward, with dropout on its output.
DroppedLaCT = with_output_dropout(LaCTFoldedLayer)


def test_a_lossy_conversion_refuses_training_mode_and_runs_in_evaluation_mode():
    torch.manual_seed(0)
    layer = DroppedLaCT(8, 2, 4, muon=False)
    x = torch.randn(2, 16, 8)
    conv = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert not conv.ttt2la_report.exact
    with pytest.raises(ttt2la.UnsupportedTTTError, match="evaluation mode.*Dropout"):
        conv(x)
    conv.eval()
    assert conv(x).shape == x.shape


def test_dropout_outside_the_layer_that_owns_the_loop_is_no_concern():
    """LaCT's published layer hands its loop to an operator submodule: dropout in the layer
    around it runs as written, in either mode."""

    torch.manual_seed(0)
    layer = with_output_dropout(LaCTPublishedLayer)(8, 2, 4, muon=False)
    conv = ttt2la.convert(layer, level=2, example_inputs=(torch.randn(2, 16, 8),))
    assert conv.ttt._ttt2la.training_dependence == ""
    assert conv(torch.randn(2, 16, 8)).shape == (2, 16, 8)        # training mode, converted


def test_a_pickled_layer_keeps_its_mode_dependence():
    torch.manual_seed(0)
    layer = Dropped(False)
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    again = pickle.loads(pickle.dumps(conv))
    assert again._ttt2la.training_dependence == conv._ttt2la.training_dependence != ""
    assert again.training
    torch.manual_seed(3)
    got = again(x)
    torch.manual_seed(3)
    assert torch.equal(got, layer(x))


def test_a_sweep_on_calibration_alone_traces_on_it_and_times_evaluation_mode():
    """Calibration inputs are model inputs: without ``example_inputs`` they are the example
    too. The lossy levels of a layer with dropout refuse training mode, so the sweep times
    every row in evaluation mode, and leaves the model in the mode it found it."""
    torch.manual_seed(0)
    layer = DroppedLaCT(8, 2, 4, muon=False)
    report = ttt2la.sweep(layer, calibration=(torch.randn(2, 16, 8),), levels=[0, 2],
                          time_budget=1.0)
    rows = {r.label: r for r in report.rows}
    assert rows["level 2"].runtime.startswith("block_linear_attention")
    assert all(r.tokens_per_s and r.tokens_per_s > 0 for r in report.rows)
    assert layer.training


def test_under_torch_compile_training_mode_still_runs_the_code_as_written():
    """Compiled, the converted layer enters the graph as one call of its evaluation-mode
    graphs; in training mode a mode-dependent layer takes its code as written instead."""
    torch.manual_seed(0)
    layer = Dropped(False)
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    # the suite runs compiled code eagerly (conftest.py); compile for real here
    with torch.compiler.set_stance("default"), torch._dynamo.config.patch(disable=False):
        torch._dynamo.reset()
        dropped = (torch.compile(conv, backend="eager")(x) == 0).float().mean()
        assert 0.1 < dropped < 0.3                          # dropout's 0.2 of the outputs
        conv.eval()
        layer.eval()
        torch._dynamo.reset()
        assert rel_rms_error(torch.compile(conv, backend="eager")(x), layer(x)) <= FP32


def test_a_call_the_code_as_written_rejects_in_training_mode_names_the_users_line():
    """In training mode a mode-dependent layer runs its code as written; a call that code cannot
    take is a ``RejectedCallError`` naming the user's line, as in evaluation mode."""
    torch.manual_seed(0)
    conv = ttt2la.convert(Dropped(inside=True), level=0, example_inputs=(torch.randn(2, 12, D),))
    conv.train()
    with pytest.raises(ttt2la.RejectedCallError) as info:
        conv(torch.randn(2, 12, D, dtype=torch.float64))
    assert isinstance(info.value, RuntimeError)
    assert "ran its code as written (in training mode)" in str(info.value)
    assert "test_training_mode.py:" in info.value.where, info.value.where


class StoppedWhileTraining(nn.Module):
    """A chunked memory that stops gradients only in training mode: through its write keys
    (``keys``) or through its fast weights between chunks (``tbptt``, truncated backprop). Its
    output is the same in both modes; its gradients are not."""

    def __init__(self, where: str, chunk: int = 4):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        self.where, self.chunk = where, chunk

    def forward(self, x):
        q, k, v = self.q(x), nn.functional.normalize(self.k(x), dim=-1), self.v(x)
        if self.where == "keys" and self.training:
            k = k.detach()
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], self.chunk):
            outs.append(q[:, i:i + self.chunk] @ W)
            if self.where == "tbptt" and self.training:
                W = W.detach()
            W = W + 0.1 * k[:, i:i + self.chunk].transpose(1, 2) @ v[:, i:i + self.chunk]
        return torch.cat(outs, 1)


def _gradients_of(module, x):
    params = list(module.parameters())
    return dict(zip([n for n, _ in module.named_parameters()], torch.autograd.grad(
        module(x).pow(2).sum(), params, allow_unused=True)))


@pytest.mark.parametrize("where", ["keys", "tbptt"])
def test_a_gradient_stop_only_in_training_mode_trains_as_written(where):
    """The outputs agree in both modes, so only the gradients show the difference: in training
    mode the converted layer runs the code as written, with its stops; in evaluation mode, which
    has none, its plan."""
    torch.manual_seed(0)
    layer = StoppedWhileTraining(where)
    x = torch.randn(2, 12, D)
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report = _layer_report(conv)
    assert report.exact
    for training in (True, False):
        conv.train(training)
        layer.train(training)
        want, got = _gradients_of(layer, x), _gradients_of(conv, x)
        for name, w in want.items():
            g = got[name]
            assert (w is None) == (g is None), (training, name)
            if w is not None:
                assert rel_rms_error(g, w) <= FP32, (training, name)
    note, = [n for n in report.notes if "converted for evaluation mode" in n]
    assert "its gradients differ in training mode" in note, note
    assert "its own code reads `self.training` at test_training_mode.py:" in note, note
    assert any("training mode" in shape and ran.startswith("as written")
               for shape, ran in report.runs.items()), report.runs
    assert any(ran.startswith("block_linear_attention") for ran in report.runs.values()), \
        report.runs                         # evaluation mode ran the plan


class OwnBranch(nn.Module):
    """A per-token memory that halves its step size in training mode, with a dropout of
    ``p`` on its keys."""

    def __init__(self, p: float):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        k = self.drop(k)
        lr = 0.5 if self.training else 1.0
        S = x.new_zeros(x.shape[0], D, D)
        outs = []
        for t in range(x.shape[1]):
            S = S + lr * k[:, t, :, None] * v[:, t, None, :]
            outs.append((q[:, t, :, None] * S).sum(1))
        return torch.stack(outs, 1)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_the_training_mode_note_names_what_differs(p):
    """A dropout of nothing does not act in training mode: the note names the layer's own read
    of ``self.training``, and the dropout only where it drops something."""
    torch.manual_seed(0)
    conv = ttt2la.convert(OwnBranch(p), level=0, example_inputs=(torch.randn(2, 6, D),))
    why = conv._ttt2la.training_dependence
    assert why.startswith("its output differs in training mode"), why
    assert "its own code reads `self.training` at test_training_mode.py:" in why, why
    assert ("drop (Dropout)" in why) == (p > 0), why


def test_a_dropout_alone_is_named_alone():
    torch.manual_seed(0)
    conv = ttt2la.convert(Dropped(True), level=0, example_inputs=(torch.randn(2, 12, D),))
    why = conv._ttt2la.training_dependence
    assert "drop (Dropout)" in why and "self.training" not in why, why


class StateStoppedWhileTraining(nn.Module):
    """A chunked memory returning its output and its final fast weight, which it detaches only
    in training mode: the output and its gradients are the same in both modes, the returned
    state's gradients are not."""

    def __init__(self, chunk: int = 4):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.v = nn.Linear(D, D, bias=False)
        self.chunk = chunk

    def forward(self, x):
        q, k, v = self.q(x), nn.functional.normalize(self.k(x), dim=-1), self.v(x)
        W = x.new_zeros(x.shape[0], D, D)
        outs = []
        for i in range(0, x.shape[1], self.chunk):
            outs.append(q[:, i:i + self.chunk] @ W)
            W = W + 0.1 * k[:, i:i + self.chunk].transpose(1, 2) @ v[:, i:i + self.chunk]
        if self.training:
            W = W.detach()
        return torch.cat(outs, 1), W


def _gradients_of_both(module, x, seed=0):
    """The gradients of a random projection of each of ``module(x)``'s two outputs, summed,
    with respect to ``x`` and every parameter (zero where unread)."""
    xi = x.clone().requires_grad_()
    y, W = module(xi)
    gen = torch.Generator().manual_seed(seed)
    loss = (y * torch.randn(y.shape, generator=gen)).sum() + (
        (W * torch.randn(W.shape, generator=gen)).sum() if W.requires_grad else 0)
    names = ["x", *(n for n, _ in module.named_parameters())]
    wrt = [xi, *module.parameters()]
    got = torch.autograd.grad(loss, wrt, allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for n, p, g in zip(names, wrt, got)}


@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 20))
def test_a_stop_on_a_returned_state_only_in_training_mode_trains_as_written(batch, length):
    """Only the second output's gradients differ between the modes: the converted layer, in
    training mode, still trains the gradients the layer stops exactly as the layer does."""
    torch.manual_seed(0)
    layer = StateStoppedWhileTraining()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, D),))
    why = conv._ttt2la.training_dependence
    assert why.startswith("its gradients differ in training mode"), why
    assert "its own code reads `self.training` at test_training_mode.py:" in why, why
    x = torch.randn(batch, length, D)
    for training in (True, False):
        conv.train(training)
        layer.train(training)
        want, got = _gradients_of_both(layer, x), _gradients_of_both(conv, x)
        for name, w in want.items():
            assert rel_rms_error(got[name], w) <= FP32, (training, name)
