"""GPU benchmark of the Triton kernels against their recurrent forms, the torch runtime and flash-linear-attention.

Three sections, every time the median of several runs timed with CUDA events after warm-up runs:

(a) LaCT variant 2 (Θ frozen, no weight norm; momentum and Muon kept): 4 heads of 384, chunks of 2048,
    T = 32K, bf16, apply-then-update order. The Triton block op (features given, and with the SwiGLU kernel
    fused in), the torch runtime's parallel op, the recurrent form (the reference's loop over chunks) and, when
    ``ttt2la.zoo`` has it, the whole recurrent LaCT layer (``LaCTFoldedLayer``, projections included) in its
    variant-2 and baseline configurations.
(b) Token-causal linear attention with a per-head decay: B = 8, T = 8192, H = 16, D = 128, bf16, forward and
    forward + backward, Triton against the torch runtime and fla's ``chunk_simple_gla`` when it imports.
(c) Achieved TFLOP/s of the dominant matmuls (the block op's increment and read kernels, Newton–Schulz, the
    token-causal op) against the GPU's bf16 matmul rate, measured here on an 8192³ product.

FLOPs are counted analytically, matmuls only (see ``block_flops``/``chunk_flops``); the backward counts the
matmuls it performs, recomputation included. Each Triton row also reports its relative RMS error against the
torch runtime on the same inputs. Writes a Markdown table to stdout and to ``--out``
(default ``benchmarks/results/gpu-<date>.md``). ``--quick`` shrinks every shape for a smoke run.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttt2la.runtime import block_linear_attention, chunk_linear_attention  # noqa: E402
from ttt2la.runtime.naive import naive_block_linear_attention  # noqa: E402
from ttt2la.runtime.newton_schulz import newton_schulz  # noqa: E402
from ttt2la.testing import rel_rms_error  # noqa: E402

#: Where the benchmark runs (a module constant so a CPU smoke test of this script can redirect it).
DEVICE = "cuda"

#: Dense bf16 matmul rate the vendor states for the chips this is meant for (TFLOP/s, no sparsity).
NOMINAL_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclasses.dataclass
class Row:
    """One measurement of the results table."""
    section: str
    implementation: str
    passes: str
    ms: float | None = None
    tokens: int = 0
    flops: float = 0.0
    error: float | None = None
    note: str = ""


def cuda_ms(fn, *, warmup: int = 2, repeats: int = 7) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def forward_backward(fn, inputs):
    """A closure running ``fn(*inputs)`` and backpropagating the sum of its first output."""
    def run():
        for x in inputs:
            x.grad = None
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return run


def newton_schulz_flops(m: int, n: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` quintic Newton–Schulz steps on an ``m × n`` matrix (``m ≤ n``)."""
    m, n = min(m, n), max(m, n)
    return steps * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


def block_flops(*, B, T, H, Dk, Dv, C, muon_steps, backward=False, swiglu_dims=None):
    """Matmul FLOPs of the exclusive-order block op: increments of the chunks that update, reads of every
    token, Newton–Schulz on every update, and (``swiglu_dims = (D, Dh)``) the fused feature map.

    The backward adds two matmuls per token-level one (``dφQ``/``dW`` and ``dφK``/``d(lr·v)``), and Newton–Schulz
    three times its forward (recomputation, then two matmuls per forward one).
    """
    n = math.ceil(T / C)
    updating = (n - 1) * C
    token_level = 2 * Dk * Dv * (updating + T)
    ns = (n - 1) * newton_schulz_flops(Dk, Dv, muon_steps)
    phi = 4 * swiglu_dims[0] * swiglu_dims[1] * (updating + T) if swiglu_dims else 0
    total = token_level + ns + phi
    if backward:
        total += 2 * token_level + 3 * ns + (3 * phi if swiglu_dims else 0)
    return B * H * total


def chunk_flops(*, B, T, H, K, V, BT=64, backward=False):
    """Matmul FLOPs of the chunked token-causal op with chunks of ``BT`` (masked halves counted, as computed).

    Forward: ``k_jᵀv_j`` and ``q h_j`` (``2·T·K·V`` each), ``q kᵀ`` and ``A v`` (``2·T·BT·(K+V)``). Backward:
    the states again and ``dh`` (``2·T·K·V`` each), ``dq, dk`` and ``dv`` from the states
    (``4·T·K·V``) and the intra-chunk products (``2·T·BT·(3K+2V)``).
    """
    forward = 4 * T * K * V + 2 * T * BT * (K + V)
    if not backward:
        return B * H * forward
    backward_only = 2 * T * K * V + 2 * T * K * V + 4 * T * K * V + 2 * T * BT * (3 * K + 2 * V)
    return B * H * (forward + backward_only)


def measured_peak_tflops(n: int = 8192) -> float:
    """bf16 ``n³`` matmul rate of this GPU, TFLOP/s."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b, warmup=3, repeats=10)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def _attempt(rows, row: Row, measure):
    """Fill ``row`` by ``measure(row)``; a failure becomes a note instead of ending the run."""
    try:
        measure(row)
    except Exception as exc:  # one broken row must not cost the others (device time is scarce)
        row.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        traceback.print_exc()
    rows.append(row)
    print(f"  {row.section} | {row.implementation} | {row.passes} | "
          f"{'-' if row.ms is None else f'{row.ms:.3f} ms'} {row.note}", flush=True)


# ----------------------------------------------------------------------------- (a) LaCT variant 2

def lact_inputs(B, T, H, D, C, seed=0):
    """Unit-norm silu features (as LaCT's layer makes them), values, per-token lr, per-chunk momentum, SwiGLU
    weights in x @ W form."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = torch.bfloat16
    rand = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=torch.float32)  # noqa: E731
    q, k = (F.normalize(F.silu(rand(B, T, H, D)), dim=-1).to(dt) for _ in range(2))
    v = rand(B, T, H, D).to(dt)
    lr = (F.softplus(rand(B, T, H)) * 1e-2).to(dt)
    momentum = torch.sigmoid(rand(B, math.ceil(T / C), H)).to(dt)
    w0, w2 = ((rand(H, D, D) / math.sqrt(D)).to(dt) for _ in range(2))
    return q, k, v, lr, momentum, w0, w2


def section_lact(rows, *, B, T, H, D, C, steps):
    from ttt2la.runtime import triton as kernels
    from ttt2la.runtime.triton.swiglu import swiglu_features

    section = f"(a) LaCT variant 2: B={B} T={T} H={H} D={D} C={C} bf16, momentum + Muon({steps})"
    q, k, v, lr, momentum, w0, w2 = lact_inputs(B, T, H, D, C)
    phi_q, phi_k = swiglu_features(q, w0, w2), swiglu_features(k, w0, w2)
    options = dict(chunk_size=C, order="exclusive", lr=lr, momentum=momentum, muon_steps=steps)
    flops = dict(B=B, T=T, H=H, Dk=D, Dv=D, C=C, muon_steps=steps)
    reference = {}

    def torch_forward(row):
        out = block_linear_attention(phi_q, phi_k, v, backend="torch", **options)[0]
        reference["o"] = out.float()
        row.ms = cuda_ms(lambda: block_linear_attention(phi_q, phi_k, v, backend="torch", **options))
        row.tokens, row.flops = B * T, block_flops(**flops)

    def triton_forward(row):
        out = kernels.block_linear_attention(phi_q, phi_k, v, **options)[0]
        row.error = rel_rms_error(out, reference["o"]) if "o" in reference else None
        row.ms = cuda_ms(lambda: kernels.block_linear_attention(phi_q, phi_k, v, **options))
        row.tokens, row.flops = B * T, block_flops(**flops)

    def fused_forward(row):
        out = kernels.fused_swiglu_block_linear_attention(q, k, v, w0, w2, **options)[0]
        row.error = rel_rms_error(out, reference["o"]) if "o" in reference else None
        row.ms = cuda_ms(lambda: kernels.fused_swiglu_block_linear_attention(q, k, v, w0, w2, **options))
        row.tokens, row.flops = B * T, block_flops(**flops, swiglu_dims=(D, D))

    def materialised_forward(row):
        def run():
            return kernels.block_linear_attention(swiglu_features(q, w0, w2), swiglu_features(k, w0, w2), v,
                                                  **options)
        row.ms = cuda_ms(run)
        row.tokens, row.flops = B * T, block_flops(**flops, swiglu_dims=(D, D))

    def recurrent_forward(row):
        row.ms = cuda_ms(lambda: naive_block_linear_attention(phi_q, phi_k, v, **options), warmup=1, repeats=3)
        row.tokens, row.flops = B * T, block_flops(**flops)

    def grads(fn, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        return forward_backward(fn, leaves)

    def torch_training(row):
        row.ms = cuda_ms(grads(lambda a, b, c: block_linear_attention(a, b, c, backend="torch", **options),
                               (phi_q, phi_k, v)))
        row.tokens, row.flops = B * T, block_flops(**flops, backward=True)

    def triton_training(row):
        row.ms = cuda_ms(grads(lambda a, b, c: kernels.block_linear_attention(a, b, c, **options), (phi_q, phi_k, v)))
        row.tokens, row.flops = B * T, block_flops(**flops, backward=True)

    def fused_training(row):
        row.ms = cuda_ms(grads(lambda *t: kernels.fused_swiglu_block_linear_attention(*t, **options),
                               (q, k, v, w0, w2)))
        row.tokens, row.flops = B * T, block_flops(**flops, backward=True, swiglu_dims=(D, D))

    _attempt(rows, Row(section, "torch runtime, parallel (φ given)", "fwd"), torch_forward)
    _attempt(rows, Row(section, "Triton block op (φ given)", "fwd"), triton_forward)
    _attempt(rows, Row(section, "Triton, SwiGLU φ fused", "fwd"), fused_forward)
    _attempt(rows, Row(section, "torch φ, then Triton block op", "fwd"), materialised_forward)
    _attempt(rows, Row(section, "recurrent form (loop over chunks, φ given)", "fwd"), recurrent_forward)
    _attempt(rows, Row(section, "torch runtime, parallel (φ given)", "fwd+bwd"), torch_training)
    _attempt(rows, Row(section, "Triton block op (φ given)", "fwd+bwd"), triton_training)
    _attempt(rows, Row(section, "Triton, SwiGLU φ fused", "fwd+bwd"), fused_training)
    section_lact_layers(rows, section, B=B, T=T, H=H, D=D, C=C, steps=steps)


def section_lact_layers(rows, section, *, B, T, H, D, C, steps):
    """The whole recurrent LaCT layer (projections, norms and its own chunk loop), if the zoo has it."""
    try:
        from ttt2la.zoo import LaCTFoldedLayer
    except ImportError as exc:
        rows.append(Row(section, "LaCTFoldedLayer (recurrent layer)", "fwd", note=f"not importable: {exc}"))
        return
    x = torch.randn(B, T, H * D, device=DEVICE, dtype=torch.bfloat16)
    for name, kwargs in (("LaCTFoldedLayer, variant 2 (recurrent, whole layer)",
                          dict(update_theta=False, weight_norm=False)),
                         ("LaCTFoldedLayer, baseline (recurrent, whole layer)", {})):
        def measure(row, kwargs=kwargs):
            layer = LaCTFoldedLayer(H * D, H, C, muon_steps=steps, **kwargs).to(DEVICE, torch.bfloat16)
            with torch.no_grad():
                row.ms = cuda_ms(lambda: layer(x), warmup=1, repeats=3)
            row.tokens = B * T
            row.note = "includes projections, norms and Θ updates where enabled; FLOPs not counted"
        _attempt(rows, Row(section, name, "fwd"), measure)


# ----------------------------------------------------------------------------- (b) token-causal

def section_chunk(rows, *, B, T, H, D):
    from ttt2la.runtime import triton as kernels

    section = f"(b) token-causal, per-head decay: B={B} T={T} H={H} D={D} bf16"
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, generator=g, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    log_decay = F.logsigmoid(torch.randn(B, T, H, generator=g, device=DEVICE) + 3)
    scale = D ** -0.5
    reference = {}
    flops = dict(B=B, T=T, H=H, K=D, V=D)

    def runner(which):
        if which == "torch":
            return lambda a, b, c, d: chunk_linear_attention(a, b, c, log_decay=d, scale=scale, backend="torch")
        if which == "triton":
            return lambda a, b, c, d: kernels.chunk_linear_attention(a, b, c, log_decay=d, scale=scale)
        from fla.ops.simple_gla import chunk_simple_gla
        return lambda a, b, c, d: chunk_simple_gla(a, b, c, g=d, scale=scale)

    def forward(which):
        def measure(row):
            fn = runner(which)
            out = fn(q, k, v, log_decay)[0].float()
            if which == "torch":
                reference["o"] = out
            elif "o" in reference:
                row.error = rel_rms_error(out, reference["o"])
            row.ms = cuda_ms(lambda: fn(q, k, v, log_decay))
            row.tokens, row.flops = B * T, chunk_flops(**flops)
        return measure

    def training(which):
        def measure(row):
            leaves = [t.detach().requires_grad_() for t in (q, k, v, log_decay)]
            row.ms = cuda_ms(forward_backward(runner(which), leaves))
            row.tokens, row.flops = B * T, chunk_flops(**flops, backward=True)
        return measure

    try:
        import fla.ops.simple_gla  # noqa: F401
        have_fla = True
    except Exception as exc:  # fla absent (no wheels shipped) or broken on this stack
        have_fla = False
        rows.append(Row(section, "fla chunk_simple_gla", "-", note=f"skipped, fla not importable: {exc}"))
    for passes, make in (("fwd", forward), ("fwd+bwd", training)):
        _attempt(rows, Row(section, "torch runtime", passes), make("torch"))
        _attempt(rows, Row(section, "Triton chunk op", passes), make("triton"))
        if have_fla:
            _attempt(rows, Row(section, "fla chunk_simple_gla", passes), make("fla"))


# ----------------------------------------------------------------------------- (c) dominant matmuls

def section_matmuls(rows, *, B, T, H, D, C, steps):
    from ttt2la.runtime.triton.block import chunk_increments, chunk_read

    section = "(c) dominant matmuls at the LaCT shape"
    q, k, v, lr, momentum, _, _ = lact_inputs(B, T, H, D, C)
    n = math.ceil(T / C)
    states = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32)
    token_flops = B * H * 2 * T * D * D

    def increments(split):
        def measure(row):
            row.ms = cuda_ms(lambda: chunk_increments(k, v, n, C, scale=lr, split_y=split))
            row.tokens, row.flops = B * T, token_flops
            row.note = "lr ⊙ V kept at ~16 bits (2 bf16 matmuls), as with Muon" if split else ""
        return measure

    def read(row):
        row.ms = cuda_ms(lambda: chunk_read(q, states, C))
        row.tokens, row.flops = B * T, token_flops

    def orthogonalise(dtype):
        def measure(row):
            M = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32)
            row.ms = cuda_ms(lambda: newton_schulz(M, steps, dtype=dtype))
            row.flops = B * n * H * newton_schulz_flops(D, D, steps)
            row.note = f"torch matmuls in {str(dtype).replace('torch.', '')}, all {n} chunks at once"
        return measure

    _attempt(rows, Row(section, "Triton increments G_j = φ(K_j)ᵀ(lr ⊙ V_j)", "fwd"), increments(False))
    _attempt(rows, Row(section, "Triton increments, split lr ⊙ V", "fwd"), increments(True))
    _attempt(rows, Row(section, "Triton read o = φ(Q_j) W_j", "fwd"), read)
    _attempt(rows, Row(section, "Newton–Schulz", "fwd"), orthogonalise(torch.float32))
    _attempt(rows, Row(section, "Newton–Schulz", "fwd"), orthogonalise(torch.bfloat16))


# ----------------------------------------------------------------------------- report

def markdown(rows, header, peak, nominal) -> str:
    lines = [header, "",
             "| section | implementation | pass | median ms | tokens/s | TFLOP/s | % of measured peak | "
             "% of nominal peak | rel. RMS error vs torch | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tflops = r.flops / (r.ms * 1e-3) / 1e12 if r.ms and r.flops else None
        cells = [r.section, r.implementation, r.passes,
                 f"{r.ms:.3f}" if r.ms else "-",
                 f"{r.tokens / (r.ms * 1e-3) / 1e6:.2f}M" if r.ms and r.tokens else "-",
                 f"{tflops:.1f}" if tflops else "-",
                 f"{100 * tflops / peak:.1f}" if tflops and peak else "-",
                 f"{100 * tflops / nominal:.1f}" if tflops and nominal else "-",
                 f"{r.error:.1e}" if r.error is not None else "-",
                 r.note.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="Markdown output path (default benchmarks/results/gpu-<date>.md)")
    parser.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    import triton

    name = torch.cuda.get_device_name()
    nominal = next((v for key, v in NOMINAL_BF16_TFLOPS.items() if key in name), None)
    peak = measured_peak_tflops(2048 if args.quick else 8192)
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    header = (f"## GPU results {date}: {name}\n\n"
              f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}. "
              f"bf16 matmul rate measured here (8192³): {peak:.0f} TFLOP/s; nominal dense bf16: "
              f"{nominal if nominal else 'unknown'} TFLOP/s. Medians of CUDA-event timings after warm-up."
              + (" **Quick (small-shape) run.**" if args.quick else ""))
    print(header, flush=True)
    lact = dict(B=1, T=4096, H=2, D=128, C=512, steps=5) if args.quick else \
        dict(B=1, T=32768, H=4, D=384, C=2048, steps=5)
    causal = dict(B=1, T=1024, H=2, D=64) if args.quick else dict(B=8, T=8192, H=16, D=128)
    rows: list[Row] = []
    section_lact(rows, **lact)
    section_chunk(rows, **causal)
    section_matmuls(rows, **lact)
    table = markdown(rows, header, peak, nominal)
    print(table)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gpu-{date}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(table)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
