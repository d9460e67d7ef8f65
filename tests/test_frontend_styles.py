"""TTT loops written in other styles: one-statement chunk slicing, a first iteration that
initialises the state, update-then-apply loops with a partial last chunk, examples too short to
show the loop or laid out non-contiguously, ``torch.autograd.grad`` in the loop; and layers the
theory excludes (a norm or nonlinearity after the final layer) refused by name, never frozen.

Every converted layer is compared with the layer as written (its own Python loop): outputs and
every parameter gradient within the fp32 tolerance.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import module_scoped
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import grad

import ttt2la
from equivalence import assert_same_function
from ttt2la.zoo import ttt_linear
from ttt2la.zoo.one_line_slices import OneLineSliceLayer
from ttt2la.zoo.ttt_linear import TTTLinearAutogradLayer, TTTLinearFuncGradLayer



def _line_of(module, text: str) -> int:
    """The line of ``module``'s source that contains ``text`` (once)."""
    lines, _ = inspect.getsourcelines(module)
    hits = [i + 1 for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, hits
    return hits[0]


# -- iteration splitting ----------------------------------------------------------------------

def _one_statement_loop(W, q, k, v):
    outs = []
    for s in range(0, q.shape[1], 2):
        qi, ki, vi = q[:, s:s + 2], k[:, s:s + 2], v[:, s:s + 2]
        outs.append(qi @ W)
        W = W + ki.mT @ vi
    return torch.cat(outs, dim=1)


def test_iterations_split_where_the_loop_body_starts_again():
    """The last update is dead, so the last iteration lost its k and v slices: every
    iteration is still one copy of the body, the last one shorter."""
    from ttt2la.frontend.capture import trace
    from ttt2la.frontend.loops import count_iterations, find_loops, split_iterations

    gm = trace(_one_statement_loop, torch.randn(3, 3), *torch.randn(3, 1, 7, 3))
    (loop, depth), = [ld for ld in find_loops(gm) if ld[0].function == "_one_statement_loop"]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and
             any(loop.contains(f) for f in n.meta.get("ttt2la_frames", ()))]
    n = count_iterations(nodes)
    iters = split_iterations(nodes, depth, n, loop)
    assert n == 4 and len(iters) == 4
    sizes = [len(it) for it in iters]
    assert sizes[1] == sizes[2] and sizes[3] < sizes[2]
    targets = [[x.target for x in it] for it in iters]
    assert targets[1] == targets[2]
    assert sum(t == torch.ops.aten.slice.Tensor for t in targets[3]) < \
        sum(t == torch.ops.aten.slice.Tensor for t in targets[2])


class OneLineUpdateInABlock(nn.Module):
    """A loop body that is one ``if``/``elif`` (or ``with``) statement, whose read and update
    share a line: ``outs.append(qc @ W); W = W + ...``. Its ops on that line share their keys,
    so no op marks an iteration; the body steps back inside the block, at the slices' line."""

    def __init__(self, block: str, d: int = 8, C: int = 4):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.block, self.C = block, C

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = x.new_zeros(x.shape[0], x.shape[-1], x.shape[-1]), []
        for i in range(0, x.shape[1], self.C):
            if self.block == "if":
                W = W * 0.5
            elif self.block == "elif":
                qc, kc, vc = q[:, i:i + self.C], k[:, i:i + self.C], v[:, i:i + self.C]
                outs.append(qc @ W); W = W + 0.1 * kc.transpose(1, 2) @ vc  # noqa: E702
            else:
                with torch.autograd.set_grad_enabled(torch.is_grad_enabled()):
                    qc, kc, vc = q[:, i:i + self.C], k[:, i:i + self.C], v[:, i:i + self.C]
                    outs.append(qc @ W); W = W + 0.1 * kc.transpose(1, 2) @ vc  # noqa: E702
        return torch.cat(outs, 1)


@pytest.mark.parametrize("block", ["elif", "with"])
def test_a_one_line_update_inside_a_block_converts_exactly(block):
    torch.manual_seed(3)
    layer = OneLineUpdateInABlock(block)
    x = torch.randn(2, 16, 8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact and report.last_chunk == "apply_only"
    assert_same_function(converted, layer, [x, torch.randn(3, 12, 8), torch.randn(1, 22, 8)])


# -- exact conversions -------------------------------------------------------------------------

@settings(max_examples=3)
@given(B=st.integers(1, 2), H=st.integers(1, 2), D=st.sampled_from([2, 3, 4]),
       C=st.integers(2, 5), r=st.integers(1, 5), order=st.sampled_from(["apply_first",
                                                                          "update_first"]))
def test_one_statement_slicing_converts_exactly_at_levels_0_to_2(B, H, D, C, r, order):
    torch.manual_seed(C * 10 + D)
    layer = OneLineSliceLayer(H * D, H, C, order=order)
    L = 3 * C + min(r, C)
    x = torch.randn(B, L, H * D)
    for level in (0, 1, 2):
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        report = converted.ttt2la_report.layers[0]
        assert report.exact and report.schedule == "parallel"
        assert report.last_chunk == ("apply_only" if order == "apply_first" else "update")
        assert_same_function(converted, layer, [x, torch.randn(B + 1, 2 * C + 1, H * D)])


@pytest.mark.parametrize("order,L", [("apply_first", 1), ("update_first", 3),
                                     ("apply_first", 6)])
def test_examples_shorter_than_the_loop_convert(order, L):
    """Chunk 6: one token, half a chunk, one chunk — the loop is read at longer lengths."""
    torch.manual_seed(L)
    layer = OneLineSliceLayer(8, 2, 6, order=order)
    x = torch.randn(2, L, 8)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert converted.ttt2la_report.layers[0].chunk_size == 6
    assert_same_function(converted, layer, [x, torch.randn(2, 23, 8)])


class LastRateScan(nn.Module):
    """ttt-lm-pytorch's mini-batches: the sequence reshaped to ``[n, B, ..., K, ...]`` before the
    loop, each update scaled by its mini-batch's last rate, taken from the end
    (``etas[i][:, -1][:, -1]``); the code takes whole mini-batches only."""

    def __init__(self, d: int = 8, K: int = 4):
        super().__init__()
        self.K = K
        self.W = nn.Parameter(torch.randn(d, d) * 0.3)
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.rate = nn.Linear(d, 1)

    def forward(self, x):
        B, L, d = x.shape
        n = L // self.K
        q, k, v = (t.reshape(B, n, self.K, d).transpose(0, 1) for t in self.proj(x).chunk(3, -1))
        etas = torch.sigmoid(self.rate(x)).transpose(1, 2).reshape(B, 1, n, self.K)
        etas = etas.permute(2, 0, 1, 3)                             # [n, B, 1, K]
        W = self.W.expand(B, d, d)
        outs = []
        for i in range(n):
            last = etas[i][:, -1][:, -1]
            outs.append(q[i] @ W)
            W = W + last[:, None, None] * k[i].transpose(1, 2) @ v[i]
        return torch.cat(outs, 1)


@pytest.mark.parametrize("L", [4, 12])
def test_a_slice_from_the_end_is_no_second_mini_batch(L):
    """A select from the end shows no second chunk: an example of one mini-batch is read at
    longer lengths; and the select of the rewritten mini-batch's rate is read as it is."""
    torch.manual_seed(L)
    layer = LastRateScan()
    x = torch.randn(2, L, 8)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert converted.ttt2la_report.layers[0].chunk_size == 4
    assert_same_function(converted, layer, [x, torch.randn(3, 16, 8)], conditioned=True)


def test_non_contiguous_example_inputs_convert():
    torch.manual_seed(0)
    layer = OneLineSliceLayer(8, 2, 4)
    x = torch.randn(18, 2, 8).transpose(0, 1)          # [B, L, d], not contiguous
    assert not x.is_contiguous()
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    y = torch.randn(2, 8, 11).permute(0, 2, 1)
    assert_same_function(converted, layer, [x, y])


class FirstIterationInitialises(nn.Module):
    """A hand-written loop whose first iteration creates the fast weight from a parameter."""

    def __init__(self, d=6, C=3):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.C = C

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = None, []
        for s in range(0, x.shape[1], self.C):
            if W is None:
                W = 2.0 * self.w.expand(x.shape[0], -1, -1)
            W = W + 0.5 * k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


def test_first_iteration_that_initialises_the_state_converts():
    torch.manual_seed(1)
    layer = FirstIterationInitialises()
    x = torch.randn(2, 11, 6)
    for level in (0, 1, 2):
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        assert converted.ttt2la_report.layers[0].schedule == "parallel"
        assert_same_function(converted, layer, [x, torch.randn(3, 7, 6)])


class StateScaledLayer(nn.Module):
    """The step size is read from the fast weight alone: ``sigmoid(mean(W²))``."""

    def __init__(self, d=6, C=3):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.C = C

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            rate = torch.sigmoid(W.pow(2).mean(dim=(-2, -1), keepdim=True))
            W = W + rate * (k[:, s:s + self.C].mT @ v[:, s:s + self.C])
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


def test_rate_read_from_the_state_alone_converts_semi_parallel():
    """A state-local map of the final layer: only it runs chunk by chunk, exactly."""
    torch.manual_seed(2)
    layer = StateScaledLayer()
    x = torch.randn(2, 13, 6)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert converted.ttt2la_report.layers[0].schedule == "semi-parallel"
    assert_same_function(converted, layer, [x, torch.randn(1, 8, 6)])


# -- refusals the theory calls for ----------------------------------------------------------------

TTT_LINEAR = [   # the first with W as its only fast weight, the second with a bias beside it
    (TTTLinearFuncGradLayer, False, "`F.layer_norm`", "z = F.layer_norm(z"),
    (TTTLinearAutogradLayer, True, "`torch.pow`", "var = ((z - mu) ** 2)"),
]


@pytest.mark.parametrize("cls,bias,op,code", TTT_LINEAR, ids=["func_grad", "autograd_grad"])
def test_ttt_linear_is_refused_naming_the_layer_norm_at_every_level(cls, bias, op, code):
    torch.manual_seed(0)
    layer = cls(8, 2, 4, bias=bias)
    x = torch.randn(2, 14, 8)
    line = _line_of(ttt_linear, code)
    for level in (0, 1, 2):
        with pytest.raises(ttt2la.NonReducibleError) as info:
            ttt2la.convert(layer, level=level, example_inputs=(x,))
        e = info.value
        assert e.op == op and e.where == f"zoo/ttt_linear.py:{line}"
        assert e.state == "W" and "final-layer state W" in str(e)
        assert "No pass removes this" in e.remedy
        assert "freeze_theta" not in str(e)
    report = ttt2la.inspect(layer, example_inputs=(x,), show=False)
    for level in (0, 1, 2):
        verdict = report.layers[0].levels[level]
        assert verdict == f"recurrent: {op} at zoo/ttt_linear.py:{line}", verdict


@pytest.mark.parametrize("level", [1, 2])
def test_ttt_linear_is_kept_as_written_not_frozen_when_not_strict(level):
    torch.manual_seed(0)
    layer = TTTLinearFuncGradLayer(8, 2, 4)
    x = torch.randn(2, 14, 8)
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,), strict=False)
    report = converted.ttt2la_report.layers[0]
    assert [s.role for s in report.states][:1] == ["final"]
    assert all(p.status != "applied" for p in report.passes if p.name == "freeze_theta")
    assert report.runtime == "kept as written (recurrent)"
    assert_same_function(converted, layer, [x])


class _Linear(nn.Module):
    def __init__(self, d=6, C=3):
        super().__init__()
        self.proj = nn.Linear(d, 3 * d, bias=False)
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.C = C


def _tanh_binding_loss(W, k, v):
    return -(torch.tanh(k @ W) * v).sum()


class TanhFinalLayer(_Linear):
    """``f(x) = tanh(x W)``: a nonlinear final layer."""

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            outs.append(torch.tanh(q[:, s:s + self.C] @ W))
            W = W - grad(_tanh_binding_loss)(W, k[:, s:s + self.C], v[:, s:s + self.C])
        return torch.cat(outs, dim=1)


class StateGatedLayer(_Linear):
    """Each token's rate is read from the fast weight itself: ``sigmoid(k_t·W·1)``."""

    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            ki, vi = k[:, s:s + self.C], v[:, s:s + self.C]
            rate = torch.sigmoid((ki @ W).sum(-1, keepdim=True))
            W = W + ki.mT @ (rate * vi)
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("cls,op,code", [
    (TanhFinalLayer, "`torch.tanh`", "return -(torch.tanh(k @ W) * v).sum()"),
    (StateGatedLayer, "`torch.sigmoid`", "rate = torch.sigmoid("),
], ids=["nonlinear_final_layer", "state_dependent_rate"])
def test_nonlinear_final_layer_and_state_dependent_rate_are_refused(cls, op, code):
    torch.manual_seed(0)
    layer = cls()
    x = torch.randn(2, 11, 6)
    for level in (0, 1, 2):
        with pytest.raises(ttt2la.NonReducibleError) as info:
            ttt2la.convert(layer, level=level, example_inputs=(x,))
        e = info.value
        assert e.op == op and e.where.startswith("tests/test_frontend_styles.py:")
        assert f"{op} at " in str(e) and code in str(e) and "No pass removes this" in e.remedy


# -- tracing failures: a ConversionError naming the layer and the source line -------------------

class _Catalogue(_Linear):
    pass


class BranchOnValue(_Catalogue):
    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            if W.norm() > 1e3:
                W = W / 2
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


class ItemInLoop(_Catalogue):
    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            n = self.C + int(k[:, s].abs().sum().item() < 0)
            W = W + k[:, s:s + n].mT @ v[:, s:s + n]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


class TolistMask(_Catalogue):
    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        keep = (x[0, :, 0] > 0).tolist()
        for s in range(0, x.shape[1], self.C):
            if keep[s]:
                W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


class SummedOutputs(_Catalogue):
    def forward(self, x):
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, o = self.w.expand(x.shape[0], -1, -1), 0
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            o = o + (q[:, s:s + self.C] @ W).mean(dim=1, keepdim=True)
        return o


class OnlyItsOwnLength(_Catalogue):
    def forward(self, x):
        if x.shape[1] != 11:
            raise ValueError("this layer runs at length 11 only")
        q, k, v = self.proj(x).chunk(3, dim=-1)
        W, outs = self.w.expand(x.shape[0], -1, -1), []
        for s in range(0, x.shape[1], self.C):
            W = W + k[:, s:s + self.C].mT @ v[:, s:s + self.C]
            outs.append(q[:, s:s + self.C] @ W)
        return torch.cat(outs, dim=1)


@pytest.mark.parametrize("cls,code", [
    (BranchOnValue, "if W.norm() > 1e3:"),
    (ItemInLoop, "n = self.C + int(k[:, s].abs().sum().item() < 0)"),
    (TolistMask, "keep = (x[0, :, 0] > 0).tolist()"),
    (SummedOutputs, "for s in range(0, x.shape[1], self.C):"),
    (OnlyItsOwnLength, 'raise ValueError("this layer runs at length 11 only")'),
])
def test_tracing_failures_name_the_layer_and_the_source_line(cls, code):
    torch.manual_seed(0)
    with pytest.raises(ttt2la.ConversionError) as info:
        ttt2la.convert(cls(), level=2, example_inputs=(torch.randn(2, 11, 6),))
    text = str(info.value)
    assert cls.__name__ in text
    lines, start = inspect.getsourcelines(cls)
    line = start + next(i for i, s in enumerate(lines) if code in s)
    assert f"test_frontend_styles.py:{line}" in text, text


# -- a model's loop over its blocks -----------------------------------------------------------

class AutogradStepReturned(nn.Module):
    """``torch.autograd.grad`` after ``requires_grad_()`` on an expanded parameter, the chunks'
    reads concatenated and returned as they are (no projection after the loop)."""

    def __init__(self, loss: str, d: int = 16, heads: int = 2, chunk: int = 4):
        super().__init__()
        self.loss, self.H, self.D, self.C = loss, heads, d // heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(heads, self.D, self.D) * 0.1)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.H, self.D).permute(2, 0, 3, 1, 4)
        W = self.W0.unsqueeze(0).expand(B, -1, -1, -1)
        outs = []
        for s in range(0, L, self.C):
            kc, vc = k[:, :, s:s + self.C], v[:, :, s:s + self.C]
            with torch.enable_grad():
                W = W.requires_grad_()
                pred = kc @ W
                loss = (pred - vc).pow(2).sum() if self.loss == "mse" else -(pred * vc).sum()
                (g,) = torch.autograd.grad(loss, W, create_graph=True)
            W = W - 0.05 * g
            outs.append(q[:, :, s:s + self.C] @ W)
        return torch.cat(outs, dim=2).transpose(1, 2).reshape(B, L, d)


@pytest.mark.parametrize("loss", ["mse", "dot"])
def test_an_autograd_step_whose_reads_are_the_output_converts_exactly(loss):
    """Traced with autograd live, the layer's graph returned its one output unflattened, which
    the copied output spec then read as a list of its batch rows: every conversion failed."""
    torch.manual_seed(0)
    layer = AutogradStepReturned(loss)
    x = torch.randn(2, 16, 16)
    for level in (0, 2):
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        assert_same_function(converted, layer, [x, torch.randn(3, 10, 16)])


class AutogradOfAWeight(nn.Module):
    """Titans' style: the loop under ``enable_grad``, ``autograd.grad`` of fast weights made
    from a parameter — they require grad because the parameter does, no ``requires_grad_()``."""

    def __init__(self, d: int = 16, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(d, d) * d ** -0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        outs = []
        with torch.enable_grad():
            W = self.W0.expand(x.shape[0], -1, -1)
            for s in range(0, x.shape[1], self.C):
                kc, vc = k[:, s:s + self.C], v[:, s:s + self.C]
                outs.append(q[:, s:s + self.C] @ W)
                loss = 0.5 * ((kc @ W - vc) ** 2).sum()
                (g,) = torch.autograd.grad(loss, W, create_graph=True)
                W = W - 0.1 * g
        return torch.cat(outs, 1)


def test_an_autograd_step_on_a_weight_that_requires_grad_converts():
    """It runs eagerly because the parameter requires grad; the trace passes it so and records
    the step with autograd live (it failed every probe shape, "does not require grad", with
    advice to let the layer run at other lengths)."""
    torch.manual_seed(0)
    layer = AutogradOfAWeight()
    x = torch.randn(2, 16, 16)
    for level in (0, 2):
        converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
        assert converted.ttt2la_report.layers[0].exact
        assert_same_function(converted, layer, [x, torch.randn(3, 10, 16)])


#: The lengths ``_ResidualBlocks`` ran at, kept outside the module (a write on the module itself
#: would be a side effect, refused at conversion).
_LENGTHS_SEEN: list[int] = []


class _ResidualBlocks(nn.Module):
    """A model looping over its blocks with a residual add in its own loop body: a loop, but
    over layers, taking no chunk of the sequence."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([OneLineSliceLayer(8, 2, 4) for _ in range(3)])

    def forward(self, x):
        _LENGTHS_SEEN.append(x.shape[1])
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_loop_over_blocks_is_no_ttt_loop_and_is_not_run_at_longer_lengths():
    """Its blocks convert, the report says why the model's own loop is not one, and it is
    never run at the doubling lengths that find the chunk size of a loop shorter than its
    example (which ran the whole model up to 4096 tokens)."""
    model = _ResidualBlocks()
    x = torch.randn(2, 9, 8)
    _LENGTHS_SEEN.clear()
    converted = ttt2la.convert(model, level=2, example_inputs=(x,))
    assert {layer.module_path for layer in converted.ttt2la_report.layers} == \
        {"blocks.0", "blocks.1", "blocks.2"}
    note, = [n for n in converted.ttt2la_report.notes if n.startswith("not converted: <model>")]
    assert "takes no chunk or token of the sequence" in note and "test_frontend_styles.py" in note
    assert _LENGTHS_SEEN and max(_LENGTHS_SEEN) <= 2 * x.shape[1]
    with torch.no_grad():
        assert ttt2la.testing.rel_rms_error(converted(x), model(x)) <= 1e-5


class _Stacked(nn.Module):
    """Products with a list of matrices in turn: a loop over weights, not over the sequence."""

    def forward(self, x, weights):
        for w in weights:
            x = x @ w
        return x


class _ReadThroughAStack(nn.Module):
    """A chunked fast weight read through a submodule whose own loop runs over its weights."""

    def __init__(self, d=8, C=4):
        super().__init__()
        self.C, self.stack = C, _Stacked()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.w0 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.w1 = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        W, outs = self.w1.expand(x.shape[0], -1, -1), []
        for i in range(0, x.shape[1], self.C):
            outs.append(self.stack(q[:, i:i + self.C], [self.w0, W]))
            W = W + 0.1 * k[:, i:i + self.C].transpose(1, 2) @ v[:, i:i + self.C]
        return torch.cat(outs, dim=1)


def test_a_submodule_of_a_converted_layer_is_no_layer_of_the_report():
    """The submodule's own loop (over weights) is no TTT loop, but it runs as part of the layer
    converted around it: the report notes no conversion of it."""
    torch.manual_seed(0)
    layer, x = _ReadThroughAStack(), torch.randn(2, 14, 8)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert [rl.module_path for rl in converted.ttt2la_report.layers] == [""]
    assert not [n for n in converted.ttt2la_report.notes if "stack" in n], \
        converted.ttt2la_report.notes
    with torch.no_grad():
        assert ttt2la.testing.rel_rms_error(converted(x), layer(x)) <= 1e-5


class InnerLossReturned(nn.Module):
    """A loop that keeps each chunk's inner loss beside its read (``grad_and_value``)."""

    def __init__(self, d: int = 16, chunk: int = 4):
        super().__init__()
        self.C = chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.W0 = nn.Parameter(torch.randn(d, d) * d ** -0.5)

    @staticmethod
    def score(W, k, v):
        return -((k @ W) * v).sum()

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        W = self.W0.expand(x.shape[0], -1, -1)
        outs, losses = [], []
        for s in range(0, x.shape[1], self.C):
            g, inner = torch.func.grad_and_value(self.score)(W, k[:, s:s + self.C],
                                                             v[:, s:s + self.C])
            W = W - 0.1 * g
            outs.append(q[:, s:s + self.C] @ W)
            losses.append(inner)
        return torch.cat(outs, 1), torch.stack(losses).mean()


def test_a_second_per_chunk_output_is_refused_naming_both_and_what_to_do():
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(InnerLossReturned(), level=2, example_inputs=(torch.randn(2, 16, 16),))
    message = str(info.value)
    assert "2 values of each iteration are used after the loop" in message, message
    assert message.count("test_frontend_styles.py") >= 3 and "Drop the others" in message


class HeadLoopInsideTokenLoop(nn.Module):
    """Per-token linear attention with a loop over heads inside the loop over tokens, laid
    out head first, one state per head in a list (flash-linear-attention's loop-per-head
    reference style)."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.H = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = (t.view(B, T, self.H, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        S = [x.new_zeros(B, d // self.H, d // self.H) for _ in range(self.H)]
        o = torch.zeros_like(v)
        for t in range(T):
            for h in range(self.H):
                S[h] = S[h] + k[:, h, t, :, None] * v[:, h, t, None, :]
                o[:, h, t] = (q[:, h, t, :, None] * S[h]).sum(1)
        return o.transpose(1, 2).reshape(B, T, d)


def test_a_loop_over_heads_inside_the_token_loop_is_refused_naming_it_and_what_to_do():
    """It was refused as a loop reading the sequence in reverse, which it does not."""
    with pytest.raises(ttt2la.UnsupportedTTTError) as info:
        ttt2la.convert(HeadLoopInsideTokenLoop(), level=2, example_inputs=(torch.randn(2, 8, 16),))
    message = str(info.value)
    lines, start = inspect.getsourcelines(HeadLoopInsideTokenLoop.forward)
    inner = start + next(i for i, line in enumerate(lines) if "for h in range" in line)
    assert f"test_frontend_styles.py:{inner} in forward, which runs inside the TTT loop" \
        in message, message
    assert "Vectorise the inner loop" in message and "reverse" not in message


def test_a_layer_traced_with_autograd_live_converts_without_torch_deprecation_noise():
    """Copying the traced graph's code generator trips a ``LeafSpec`` deprecation inside
    torch, which every such conversion printed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ttt2la.convert(AutogradOfAWeight(), level=2, example_inputs=(torch.randn(2, 16, 16),))


class HeadLoopInsideChunkLoop(nn.Module):
    """Linear attention per chunk with a loop over heads inside the loop over chunks, one
    state per head in a list; the heads laid out after the sequence (``q[:, s:e, h]``) or
    before it (``q[:, h, s:e]``)."""

    def __init__(self, layout: str, d: int = 16, heads: int = 2, chunk: int = 4):
        super().__init__()
        self.layout, self.H, self.C = layout, heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)

    def forward(self, x):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, d // self.H).unbind(2)
        if self.layout == "heads_first":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        S = [x.new_zeros(B, d // self.H, d // self.H) for _ in range(self.H)]
        outs = []
        for s in range(0, T, self.C):
            per_head = []
            for h in range(self.H):
                if self.layout == "heads_first":
                    qh, kh, vh = q[:, h, s:s + self.C], k[:, h, s:s + self.C], v[:, h, s:s + self.C]
                else:
                    qh, kh, vh = q[:, s:s + self.C, h], k[:, s:s + self.C, h], v[:, s:s + self.C, h]
                per_head.append(qh @ S[h])
                S[h] = S[h] + kh.mT @ vh
            outs.append(torch.stack(per_head, 2))
        return torch.cat(outs, 1).reshape(B, T, d)


@pytest.mark.parametrize("layout", ["heads_after", "heads_first"])
def test_a_loop_over_heads_inside_the_chunk_loop_converts_exactly_in_either_layout(layout):
    """Laid out head first, the heads loop was taken for the TTT loop (its ``q[:, h]`` read
    as the loop's slice), and its two iterations were refused as too few."""
    torch.manual_seed(0)
    layer = HeadLoopInsideChunkLoop(layout)
    x = torch.randn(2, 16, 16)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    lines, start = inspect.getsourcelines(HeadLoopInsideChunkLoop.forward)
    outer = start + next(i for i, line in enumerate(lines) if "for s in range" in line)
    assert report.exact and f"test_frontend_styles.py:{outer}" in report.loop_src, report.loop_src
    assert_same_function(converted, layer, [x, torch.randn(3, 22, 16)])


# -- a per-token loop that projects its own token ---------------------------------------------

class ProjectsItsToken(nn.Module):
    """Gated linear attention token by token, each token projected inside the loop
    (``self.qkv(x[:, t]).view(B, 3, H, Dh).unbind(1)``, or ``reshape``) and its read flattened
    back to ``[B, d]`` before the output projection, also inside the loop."""

    def __init__(self, d: int = 16, heads: int = 2, split: str = "view"):
        super().__init__()
        self.H, self.Dh, self.split = heads, d // heads, split
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, heads)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, L, d = x.shape
        S = x.new_zeros(B, self.H, self.Dh, self.Dh)
        ys = []
        for t in range(L):
            xt = x[:, t]
            qkv = self.qkv(xt)
            qkv = qkv.view(B, 3, self.H, self.Dh) if self.split == "view" else \
                qkv.reshape(B, 3, self.H, self.Dh)
            q, k, v = qkv.unbind(1)
            a = torch.sigmoid(self.gate(xt))[..., None, None]
            S = a * S + nn.functional.normalize(k, dim=-1)[..., :, None] * v[..., None, :]
            ys.append(self.out(torch.einsum("bhk,bhkv->bhv", q, S).reshape(B, d)))
        return torch.stack(ys, 1)


_projected = module_scoped.cache()


def _projects_its_token(split):
    """The layer and its level-0 conversion (once per spelling)."""
    if split not in _projected:
        torch.manual_seed(0)
        layer = ProjectsItsToken(split=split)
        conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 16),))
        _projected[split] = layer, conv
    return _projected[split]


@pytest.mark.parametrize("split", ["view", "reshape"])
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(B=st.integers(1, 3), L=st.integers(1, 40))
def test_a_token_projected_inside_its_loop_converts_onto_the_token_causal_op(split, B, L):
    """The read reaches the code after it laid out batch-major over the tokens, where the
    trace's view of one token's contiguous read cannot apply: the converted layer runs it, and
    equals the loop."""
    layer, conv = _projects_its_token(split)
    report, = conv.ttt2la_report.layers
    assert report.runtime.startswith("chunk_linear_attention") and report.exact, report.runtime
    assert_same_function(conv, layer, torch.randn(B, L, 16))


class _LastChunkAppliedAfter(nn.Module):
    """LaCT's loop: apply, then update, over all chunks but the last, which is applied after
    the loop; the loop's apply multiplies in place (``hh.mul_(gate)``), the one after it writes
    the product the other way round (``gate * hh``)."""

    def __init__(self, d=8, C=4):
        super().__init__()
        self.C = C
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.w0 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.w1 = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        W, C, L = self.w1.expand(x.shape[0], -1, -1), self.C, x.shape[1]
        outs = []
        for s in range(0, L - C, C):
            qc, kc, vc = q[:, s:s + C], k[:, s:s + C], v[:, s:s + C]
            gate = torch.nn.functional.silu(qc @ self.w0, inplace=True)
            hh = qc @ self.w2
            hh.mul_(gate)
            outs.append(hh @ W)
            W = W + 0.1 * (torch.nn.functional.silu(kc @ self.w0) * (kc @ self.w2)).mT @ vc
        qc = q[:, L - C:] if L % C == 0 else q[:, L - L % C:]
        outs.append((torch.nn.functional.silu(qc @ self.w0) * (qc @ self.w2)) @ W)
        return torch.cat(outs, dim=1)


def test_an_apply_written_in_place_in_the_loop_and_out_of_place_after_it_converts():
    torch.manual_seed(0)
    layer = _LastChunkAppliedAfter()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 16, 8),))
    assert_same_function(conv, layer, [torch.randn(2, 16, 8), torch.randn(3, 24, 8)])


# -- softmax attention inside the chunk loop --------------------------------------------------

class LocalSoftmaxPlusMemory(nn.Module):
    """Causal softmax attention within each chunk (``F.scaled_dot_product_attention``) plus a
    linear-attention memory of the chunks before it, heads kept apart: a hybrid in the style of
    Infini-attention."""

    def __init__(self, d=16, heads=2, chunk=8):
        super().__init__()
        self.heads, self.chunk = heads, chunk
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        phi_q, phi_k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        memory = x.new_zeros(b, self.heads, d // self.heads, d // self.heads)
        ys = []
        for s in range(0, n, self.chunk):
            sl = slice(s, s + self.chunk)
            local = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True)
            ys.append(local + 0.5 * phi_q[:, :, sl] @ memory)
            memory = memory + phi_k[:, :, sl].transpose(-1, -2) @ v[:, :, sl]
        return self.out(torch.cat(ys, 2).transpose(1, 2).reshape(b, n, d))


def test_softmax_attention_inside_the_chunk_loop_converts_and_batches(capfd):
    """The fused CPU attention kernel has no ``vmap`` batching rule: traced as its math inside
    the loop body, the plan batches it over chunks, silently (torch warns at every call of a
    kernel it must run chunk by chunk), and computes the layer."""
    torch.manual_seed(0)
    layer = LocalSoftmaxPlusMemory()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 24, 16),))
    capfd.readouterr()
    for n in (5, 24, 37):
        assert_same_function(conv, layer, torch.randn(2, n, 16))
    assert "batching rule" not in capfd.readouterr().err
    assert "block_linear_attention" in conv.ttt2la_report.layers[0].runtime


class TokensReadTwoWays(nn.Module):
    """A per-token loop reading its gate as one token (``g[:, t]``) and its keys, values and
    queries as slices of one token (``k[:, t:t + 1]``), as fla's naive Titans reference does."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, 1)

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        g = torch.sigmoid(self.gate(x)).squeeze(-1)
        W = x.new_zeros(B, self.d, self.d)
        outs = []
        for t in range(L):
            W = g[:, t][:, None, None] * W + k[:, t:t + 1].mT @ v[:, t:t + 1]
            outs.append(q[:, t:t + 1] @ W)
        return torch.cat(outs, 1)


@pytest.mark.parametrize("L", [1, 7, 12])
def test_tokens_and_slices_of_one_token_in_one_loop_convert(L):
    """Both read one token per iteration, and were refused as a loop mixing per-token and
    per-chunk streams (with no line named): they advance alike, so the loop converts, exactly
    and onto the token-causal op."""
    torch.manual_seed(0)
    layer = TokensReadTwoWays()
    conv = ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 12, 8),))
    assert "chunk_linear_attention" in conv.ttt2la_report.layers[0].runtime
    assert_same_function(conv, layer, torch.randn(3, L, 8))
