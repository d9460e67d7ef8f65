"""Single-step (bidirectional) TTT: the ViTTT-like block steps its fast weights once over the whole
image and every token reads them. Its only Python loop runs over the nine conv offsets, which
must not be taken for a loop over the sequence; the step is one chunk, lowered exactly.

Verdicts at levels 0–2: with the gate's kernel Θ stepped (as published), level 0 is refused
naming the ``silu`` through which W1's update reads Θ; at levels 1–2 the converted block is the
block written with Θ frozen (outputs and every gradient within fp32 tolerance); written with Θ
frozen it converts exactly at every level. At level 6 ``remove_muon`` takes the gradient
normalisation ``g/(‖g‖+1)`` out of both increments.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ttt2la
from equivalence import assert_same_function
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import ViTTTBlock



def frozen_gate_twin(block: ViTTTBlock) -> ViTTTBlock:
    """The same block (same parameters) written with the gate's kernel Θ not stepped."""
    twin = ViTTTBlock(block.dim, block.num_heads, block.height, block.width, update_gate=False,
                      grad_norm=block.grad_norm, lr=block.lr)
    twin.load_state_dict(block.state_dict())
    return twin


@settings(max_examples=3, deadline=None)
@given(B=st.integers(1, 3), h=st.integers(2, 3), w=st.integers(2, 4), heads=st.integers(1, 2),
       head_dim=st.sampled_from([2, 4]), update_gate=st.booleans(), grad_norm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_vittt_verdicts_at_levels_0_to_2(B, h, w, heads, head_dim, update_gate, grad_norm,
                                         seed):
    torch.manual_seed(seed)
    block = ViTTTBlock(heads * head_dim, heads, h, w, update_gate=update_gate,
                       grad_norm=grad_norm)
    x = torch.randn(B, h * w, heads * head_dim)
    for level in (0, 1, 2):
        if update_gate and level == 0:
            with pytest.raises(ttt2la.NonReducibleError) as refused:
                ttt2la.convert(block, level=0, example_inputs=(x,))
            assert "silu" in refused.value.op and "vittt.py:" in refused.value.where
            assert "freeze_theta" in str(refused.value)
            continue
        converted = ttt2la.convert(block, level=level, example_inputs=(x,))
        layer = converted.ttt2la_report.layers[0]
        assert layer.exact == (not update_gate)
        assert layer.schedule == "parallel"
        roles = {s.name: s.role for s in layer.states}
        assert roles["W1"] == "final" and roles.get("W2", "theta") == "theta"
        reference = frozen_gate_twin(block) if update_gate else block
        assert_same_function(converted, reference, x)
        x2 = torch.randn(B % 3 + 1, h * w, heads * head_dim)   # another batch size
        assert_same_function(converted, reference, x2)


def test_the_offset_loop_is_not_a_sequence_loop_and_the_length_is_fixed():
    torch.manual_seed(0)
    block = ViTTTBlock(8, 2, 2, 3, update_gate=False)
    converted = ttt2la.convert(block, level=2, example_inputs=(torch.randn(2, 6, 8),))
    layer = converted.ttt2la_report.layers[0]
    assert layer.chunk_size == 6 and layer.order == "inclusive"   # one chunk: the whole image
    assert {s.name for s in layer.states} == {"W1", "taps"}
    with pytest.raises(ttt2la.UnsupportedShapeError, match="6 tokens"):
        converted(torch.randn(2, 8, 8))
    with pytest.raises(ttt2la.StreamingError, match="single-step"):       # nothing to continue
        converted(torch.randn(2, 6, 8), return_ttt_state=True)


def hand_written_step(block: ViTTTBlock, x: torch.Tensor) -> torch.Tensor:
    """The block with Θ frozen and no gradient normalisation, in closed form: the GLU is linear
    attention gated by ``silu(q W2)`` on the output and ``silu(k W2)`` on the values, the
    convolution a 3×3 local linear attention (``F.conv2d``/``F.unfold``, no offset loop)."""
    B, N, C = x.shape
    H, D, h, w = block.num_heads, C // block.num_heads, block.height, block.width
    q, k, v = block.qkv(x).view(B, N, 3, H, D).unbind(2)                   # [B, N, H, D]
    q, k, v = F.normalize(q, dim=-1), F.normalize(k, dim=-1), v / N
    gk = F.silu(torch.einsum("bnhd,hde->bnhe", k, block.w2))
    W1 = block.w1 + 1.0 * torch.einsum("bnhd,bnhe->bhde", k, v * gk)
    o_glu = torch.einsum("bnhd,bhde->bnhe", q, W1) * F.silu(
        torch.einsum("bnhd,hde->bnhe", q, block.w2))
    as_image = lambda t: t.reshape(B, N, C).transpose(1, 2).reshape(B, C, h, w)  # noqa: E731
    patches = F.unfold(as_image(k), 3, padding=1).view(B, C, 9, N)            # k around each pixel
    taps = block.taps + 1.0 * torch.einsum("bcjn,bcn->bcj", patches, as_image(v).view(B, C, N))
    o_conv = torch.stack([F.conv2d(as_image(q)[i:i + 1], taps[i].view(C, 1, 3, 3), padding=1,
                                   groups=C) for i in range(B)]).view(B, C, N).transpose(1, 2)
    return block.proj(o_glu.reshape(B, N, C) + o_conv)


@settings(max_examples=5, deadline=None)
@given(B=st.integers(1, 3), h=st.integers(1, 4), w=st.integers(1, 4), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_block_is_gated_and_local_linear_attention(B, h, w, heads, seed):
    torch.manual_seed(seed)
    block = ViTTTBlock(2 * heads, heads, h, w, update_gate=False, grad_norm=False).double()
    x = torch.randn(B, h * w, 2 * heads, dtype=torch.float64)
    assert rel_rms_error(block(x), hand_written_step(block, x)) <= TOLERANCE[torch.float64]


def test_remove_muon_takes_the_gradient_normalisation_out_at_level_6():
    torch.manual_seed(0)
    block = ViTTTBlock(8, 2, 2, 3, update_gate=False)
    x = torch.randn(2, 6, 8)
    converted = ttt2la.convert(block, level=6, example_inputs=(x,))
    passes = {p.name: p for p in converted.ttt2la_report.layers[0].passes}
    assert passes["remove_muon"].status == "applied"
    assert "W1's increment" in passes["remove_muon"].reason
    assert "taps's increment" in passes["remove_muon"].reason


class LearnedStepSize(torch.nn.Module):
    """One clipped step ``W + η · g/(‖g‖+1)`` with a learned step size per head."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.w1 = torch.nn.Parameter(torch.randn(1, heads, self.d, self.d) * self.d ** -0.5)
        self.lr = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        g = k.transpose(-2, -1) @ (v / N)
        g = g / (g.norm(dim=-2, keepdim=True) + 1)
        W = self.w1 + F.softplus(self.lr)[None, :, None, None] * g
        return (q @ W).transpose(1, 2).reshape(B, N, C)


def test_remove_muon_keeps_a_learned_step_size_outside_the_normalisation():
    """Level 6 folds the normalisation alone: the step size stays a parameter that trains."""
    torch.manual_seed(0)
    layer = LearnedStepSize()
    x = torch.randn(2, 16, 16)
    converted = ttt2la.convert(layer, level=6, example_inputs=(x,))
    passes = {p.name: p for p in converted.ttt2la_report.layers[0].passes}
    assert passes["remove_muon"].status == "applied"
    assert "`torch.div`" in passes["remove_muon"].reason
    grad, = torch.autograd.grad(converted(x).square().sum(), [converted.lr])
    assert grad.abs().min() > 0
    with torch.no_grad():
        before = converted(x)
        converted.lr.add_(1.0)
        assert rel_rms_error(converted(x), before) > 0.01


class FoldedImageStep(torch.nn.Module):
    """A step over an image's positions with the heads folded into the batch, its gradient by
    ``torch.func.grad`` of ``bmm``s: the probe traces at other lengths fail in fake tensors."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.w = torch.nn.Parameter(torch.randn(heads, self.d, self.d) * 0.3)

    def forward(self, img):
        B, C, Hi, Wi = img.shape
        N = Hi * Wi
        q, k, v = (t.reshape(B, N, self.H, self.d).transpose(1, 2).reshape(B * self.H, N, self.d)
                   for t in self.qkv(img.flatten(2).transpose(1, 2)).chunk(3, -1))
        W0 = self.w.repeat(B, 1, 1)
        g = torch.func.grad(lambda w: -(torch.bmm(k, w) * v).sum() / k.shape[1])(W0)
        o = torch.bmm(q, W0 - 0.5 * g).reshape(B, self.H, N, self.d).transpose(1, 2)
        return o.reshape(B, N, C).transpose(1, 2).reshape(B, C, Hi, Wi)


def test_probe_traces_that_fail_log_nothing():
    """A failed probe is expected and reported: fake tensors' ERROR records of it (with their
    tracebacks) would tell the user that a conversion which worked went wrong."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(handler)
    try:
        torch.manual_seed(0)
        layer = FoldedImageStep()
        x = torch.randn(2, 16, 4, 4)
        converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    finally:
        logger.removeHandler(handler)
    assert not records, records[0].getMessage()
    assert_same_function(converted, layer, x)


class EinsumStep(torch.nn.Module):
    """One gradient step of per-head fast weights over the whole sequence, its products written
    as ``einsum`` over ``[B, N, H, d]`` tokens, then every token reads the stepped weights."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.W1 = torch.nn.Parameter(torch.randn(heads, self.d, self.d) * self.d ** -0.5)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.H, self.d).unbind(2)
        W = self.W1.unsqueeze(0).expand(B, -1, -1, -1).clone().requires_grad_(True)
        with torch.enable_grad():
            loss = -(torch.einsum("bnhd,bhde->bnhe", k, W) * v).sum() / N
            g, = torch.autograd.grad(loss, W, create_graph=True)
        return torch.einsum("bnhd,bhde->bnhe", q, W - g).reshape(B, N, C)


@pytest.mark.parametrize("level", [0, 2])
def test_a_single_step_never_runs_on_an_op_that_reads_tokens_in_order(level):
    """Every token reads the weights stepped on all of them: the step keeps its one-chunk plan
    where it is not lifted onto the bidirectional op, never a causal one (which read each token
    before the later ones were stepped on, and failed the lowering's check)."""
    torch.manual_seed(0)
    layer = EinsumStep()
    x = torch.randn(2, 12, 16)
    converted = ttt2la.convert(layer, level=level, example_inputs=(x,))
    report, = converted.ttt2la_report.layers
    assert converted.ttt2la_report.exact
    assert not report.runtime.startswith(("chunk_linear_attention", "block_linear_attention")), \
        report.runtime
    assert_same_function(converted, layer, x)


class SharedWeightStep(torch.nn.Module):
    """One closed-form step of per-head fast weights kept as the parameter is stored: the
    parameter ``[H, d, d]`` (or ``[d, d]`` with one head) plus a ``[B, H, d, d]`` increment,
    broadcast over the batch by the addition itself."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.H, self.d = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        shape = (heads, self.d, self.d) if heads > 1 else (self.d, self.d)
        self.W1 = torch.nn.Parameter(torch.randn(*shape) * self.d ** -0.5)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        step = k.transpose(-2, -1) @ v / N
        W = self.W1 + 0.7 * (step if self.H > 1 else step[:, 0])
        y = q @ W if self.H > 1 else (q[:, 0] @ W)[:, None]
        return y.transpose(1, 2).reshape(B, N, C)


@pytest.mark.parametrize("heads", [1, 2])
def test_a_weight_broadcast_over_the_batch_by_the_step_is_the_state(heads):
    torch.manual_seed(heads)
    layer = SharedWeightStep(16, heads)
    x = torch.randn(2, 12, 16)
    converted = ttt2la.convert(layer, level=2, example_inputs=(x,))
    assert converted.ttt2la_report.exact
    assert_same_function(converted, layer, [x, torch.randn(3, 12, 16)])


class ImageStep(torch.nn.Module):
    """A single step over an image given as ``[B, C, H, W]``: 1×1-conv projections, a depthwise
    3×3 conv added to the values, the positions flattened into tokens (``view(B, heads, d, N)``),
    and a GLU fast weight ``(q W1') ⊙ silu(q W2)`` with ``W1`` stepped once on every token
    (with ``step_gate``, ``W2`` too: a lossy conversion at level 1)."""

    def __init__(self, channels: int = 8, heads: int = 2, step_gate: bool = False):
        super().__init__()
        self.heads, self.d, self.step_gate = heads, channels // heads, step_gate
        self.qkv = torch.nn.Conv2d(channels, 3 * channels, 1, bias=False)
        self.dw = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.W1 = torch.nn.Parameter(torch.randn(heads, self.d, self.d) / self.d ** 0.5)
        self.W2 = torch.nn.Parameter(torch.randn(heads, self.d, self.d) / self.d ** 0.5)

    def forward(self, img):
        B, C, hh, ww = img.shape
        q, k, v = self.qkv(img).chunk(3, 1)
        v = v + self.dw(v)
        N = hh * ww
        q, k, v = (t.reshape(B, self.heads, self.d, N).transpose(-1, -2) for t in (q, k, v))
        W1, W2 = self.W1.unsqueeze(0), self.W2.unsqueeze(0)
        gate = F.silu(k @ W2)
        W1n = W1 + 0.5 * k.transpose(-1, -2) @ (v * gate) / N
        if self.step_gate:
            W2 = W2 + 0.5 * k.transpose(-1, -2) @ (v * (k @ W1) * torch.sigmoid(k @ W2)) / N
        o = (q @ W1n) * F.silu(q @ W2)
        return o.transpose(-1, -2).reshape(B, C, hh, ww)


def test_an_image_step_counts_its_positions_as_tokens_and_runs_other_image_sizes_as_written():
    """The channel axis was taken for the sequence: the note called 8 channels "tokens", and
    every other image size was refused as a tensor ``[B, L, 4, 4]``."""
    torch.manual_seed(0)
    layer = ImageStep().eval()
    x = torch.randn(2, 8, 4, 4)
    converted = ttt2la.convert(layer, level=0, example_inputs=(x,))
    report = converted.ttt2la_report.layers[0]
    assert report.exact
    note = next(n for n in report.notes if "single-step" in n)
    assert "an image of 4 × 4 (axes 2, 3 of #0: 16 tokens)" in note, note
    assert "8 tokens" not in note and "channels" not in note, note
    for other in (torch.randn(1, 8, 3, 5), torch.randn(3, 8, 6, 6)):
        assert rel_rms_error(converted(other), layer(other)) <= TOLERANCE[torch.float32]
    assert converted(x).shape == x.shape
    assert any("an image of 3 × 5" in k and v.startswith("as written") for k, v in
               report.runs.items()), report.runs
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(2, 4, 4, 4))          # the channels stay the example's
    assert "[B, 8, 4, 4]" in str(refused.value) and "L" not in str(refused.value).split("[")[1]


def test_a_lossy_image_step_refuses_other_image_sizes_naming_them():
    torch.manual_seed(0)
    layer = ImageStep(step_gate=True).eval()
    converted = ttt2la.convert(layer, level=1, example_inputs=(torch.randn(2, 8, 4, 4),))
    with pytest.raises(ttt2la.UnsupportedShapeError) as refused:
        converted(torch.randn(1, 8, 3, 5))
    msg = str(refused.value)
    assert "called with an image of 3 × 5 (axes 2, 3 of #0: 15 tokens)" in msg, msg
    assert "converted for an image of 4 × 4 (axes 2, 3 of #0: 16 tokens) only" in msg, msg
    assert "test_single_step.py" in msg and "[B, L" not in msg, msg


class LoopedBlocks(torch.nn.Module):
    """A ViT-like stack that loops over its TTT blocks (``for block in self.blocks``): a loop
    over blocks, not over the sequence, whose body runs each block's single step."""

    def __init__(self, depth=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ViTTTBlock(8, 2, 2, 3, update_gate=False)
                                          for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_model_looping_over_its_blocks_converts_each_block():
    """The model's loop takes no chunk, so its forward is no TTT layer of its own: each block
    converts on its own, exactly, rather than the model as one step holding both (whose check
    then saw its blocks change class under it) — and the report says why the model is not."""
    torch.manual_seed(0)
    model = LoopedBlocks()
    conv = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 6, 8),))
    assert [layer.module_path for layer in conv.ttt2la_report.layers] == ["blocks.0", "blocks.1"]
    assert any("runs the TTT layers blocks.0, blocks.1, converted on their own" in n
               for n in conv.ttt2la_report.notes), conv.ttt2la_report.notes
    assert_same_function(conv, model, torch.randn(3, 6, 8))


class _LoopedMLP(torch.nn.Module):
    """A memory model whose forward loops over its layers (``for w in self.weights``)."""

    def __init__(self, d: int):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)])

    def forward(self, x):
        for w in self.weights:
            x = x @ w
        return x


class VmappedMemory(torch.nn.Module):
    """Titans-like, as lucidrains writes it: the memory model's gradient on every chunk by
    ``vmap(grad(…))`` over ``functional_call``, summed over the chunks, no loop over them."""

    C = 4

    def __init__(self, d: int = 8):
        super().__init__()
        self.d = d
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.memory = _LoopedMLP(d)

    def forward(self, x):
        B, L, d = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        params = dict(self.memory.named_parameters())

        def loss(p, kc, vc):
            return (torch.func.functional_call(self.memory, p, (kc,)) - vc).pow(2).mean()

        kc, vc = k.reshape(-1, self.C, d), v.reshape(-1, self.C, d)
        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, kc, vc)
        W = self.memory.weights[0] - 0.1 * grads["weights.0"].reshape(B, -1, d, d).cumsum(1)
        return (q.reshape(B, -1, self.C, d) @ W).reshape(B, L, d)


def test_a_memory_model_called_under_vmap_is_part_of_its_caller():
    """The memory model runs inside ``vmap(grad(…))`` only, on the transform's wrapped tensors:
    its loop over its layers was taken for a TTT layer of its own, whose inputs (dead once the
    transform returned) failed every trace, and the caller was refused. Its calls are its
    caller's: the caller converts, as one step, exactly."""
    torch.manual_seed(0)
    layer, x = VmappedMemory(), torch.randn(2, 16, 8)
    report = ttt2la.inspect(layer, example_inputs=(x,), show=False)
    assert [r.module_path for r in report.layers] == [""], report
    conv = ttt2la.convert(layer, level=0, example_inputs=(x,))
    assert conv.ttt2la_report.exact
    assert_same_function(conv, layer, torch.randn(3, 16, 8))


def test_a_failure_of_ttt2la_while_reading_a_layer_is_a_refusal_naming_its_loop(monkeypatch):
    """Whatever fails inside ttt2la while it reads a candidate loop (here made to) is that
    layer's refusal, naming its loop and asking for a report, never a raw exception."""
    import ttt2la.conversion as conversion

    def broken(cand, seq_len):
        raise RuntimeError("an internal failure")

    monkeypatch.setattr(conversion, "recognize_layer", broken)
    layer = ViTTTBlock(8, 2, 2, 2, update_gate=False)
    with pytest.raises(ttt2la.UnsupportedTTTError,
                       match=r"ttt2la failed while reading the loop at .*vittt.py:\d+.*"
                             r"RuntimeError: an internal failure.*Please report this layer"):
        ttt2la.convert(layer, level=0, example_inputs=(torch.randn(2, 4, 8),))


class _ImageTokensStep(torch.nn.Module):
    """One test-time step over the tokens of an ``h × w`` image, passed as plain arguments
    (``forward(x, h, w)``, as ViT³ blocks take them), then a sum over the image's rows above and
    below each token, a loop over the three offsets."""

    def __init__(self, dim: int):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.w = torch.nn.Parameter(torch.randn(dim, dim) * dim ** -0.5)

    def forward(self, x, h, w):
        B, N, C = x.shape
        q, k, v = self.qkv(x).chunk(3, -1)
        y = q @ (self.w + k.transpose(1, 2) @ v / N)
        image = F.pad(y.transpose(1, 2).reshape(B, C, h, w), (0, 0, 1, 1))
        rows = torch.zeros_like(image[:, :, :h])
        for dy in range(3):
            rows = rows + image[:, :, dy:dy + h]
        return y + rows.flatten(2).transpose(1, 2)


class ImageBackbone(torch.nn.Module):
    """A hierarchical backbone taking images: a stem makes tokens and ``h, w``, each stage's
    block is called with them, and a strided convolution halves the image between stages."""

    def __init__(self, dims=(8, 16)):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, dims[0], 4, stride=4)
        self.stage0, self.stage1 = _ImageTokensStep(dims[0]), _ImageTokensStep(dims[1])
        self.merge = torch.nn.Conv2d(dims[0], dims[1], 2, stride=2)

    def forward(self, img):
        x = self.merge(self._stage(self.stage0, self.stem(img)))
        return self._stage(self.stage1, x).mean((2, 3))

    @staticmethod
    def _stage(stage, x):
        B, C, h, w = x.shape
        return stage(x.flatten(2).transpose(1, 2), h, w).transpose(1, 2).reshape(B, C, h, w)


def test_a_backbone_taking_images_converts_each_stage_at_its_own_length():
    """The model's input is an image, whose axis 1 holds its channels: that was taken for the
    sequence length of every stage, none of whose inputs has it, and each stage was refused as
    having no sequence. Each stage's sequence is its own input's axis 1: both convert, exactly,
    and an image of another size runs each stage as written (another ``h, w``)."""
    torch.manual_seed(0)
    model = ImageBackbone()
    conv = ttt2la.convert(model, level=0, example_inputs=(torch.randn(2, 3, 16, 16),))
    assert sorted(layer.module_path for layer in conv.ttt2la_report.layers) == \
        ["stage0", "stage1"]
    assert conv.ttt2la_report.exact
    assert_same_function(conv, model, torch.randn(3, 3, 16, 16))
    assert_same_function(conv, model, torch.randn(2, 3, 24, 16))
    runs = {layer.module_path: layer.runs for layer in conv.ttt2la_report.layers}
    assert any(key.startswith("called with #1 = 6") for key in runs["stage0"]), runs
