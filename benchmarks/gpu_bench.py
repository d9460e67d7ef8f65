"""GPU benchmark of the Triton kernels against their recurrent forms, the torch runtime and flash-linear-attention.

Six sections (``--sections``, a comma list of a, b, c, d, e, f run in the order given; all by default), every time the median of several
runs timed with CUDA events after warm-up runs (with the interquartile range of the runs as % of the median),
forward and forward + backward:

(a) LaCT variant 2 (Θ frozen, no weight norm; momentum and Muon kept): 4 heads of 384, chunks of 2048,
    T = 32K, bf16, apply-then-update order, Newton–Schulz as LaCT's release runs it (its five per-step
    coefficient triples, iterated in bf16: ``ns_coefficients``/``ns_dtype`` of the runtime op — precision
    follows the source, nothing runs in float64). The Triton block op (features given, and with the SwiGLU
    kernel fused in), the torch runtime's parallel op and the recurrent form (the reference's loop over
    chunks).
(b) Token-causal linear attention with a per-head decay: B = 8, T = 8192, H = 16, D = 128, bf16, Triton
    against the torch runtime and fla's ``chunk_simple_gla`` when it imports.
(c) Achieved TFLOP/s of the dominant matmuls (the block op's increment and read kernels, and Newton–Schulz
    through ``newton_schulz`` — forward in fp32, TF32 and bf16, forward + backward in bf16 and fp32) against
    the GPU's bf16 matmul rate, measured here on an 8192³ product.
(d) The whole LaCT zoo layer at the shape of (a) (``LaCTPublishedLayer`` when the zoo has it, else
    ``LaCTFoldedLayer``; projections included) as written in its variant-2 and baseline configurations, and
    the baseline converted by ``ttt2la.convert(level=2)`` (the plan that ran in the note); forward + backward
    backpropagates the output's sum into every parameter.
(e) Tile tuning: the increment and read kernels, the block op at the shape of (a) and the chunk op at the shape
    of (b), each with its default tiles and then with ``TTT2LA_TUNE_KERNELS`` on (the first call's time, which
    includes the tuning, and the configurations chosen are in the note); for the ops' forward + backward also
    with one configuration per kernel site forced for every launch (the forward's choice where it has one): the
    static defaults tuning suggests, which compose where per-launch choices may not.
(f) Token-causal linear attention with a decay per key channel (GLA's gate, ``logsigmoid(·)/16``) at the
    shape of (b): the torch runtime and the Triton kernels (``runtime/triton/channel_decay.py``) against fla's
    ``chunk_gla`` when it imports.

FLOPs are counted analytically, matmuls only (see ``block_flops``/``chunk_flops``); the backward counts the
matmuls it performs, recomputation included (Newton–Schulz alone in (c): 3× its forward, no recomputation).
Each Triton row also reports its relative RMS error against the torch runtime on the same inputs. Every row is
written to ``--out`` (default ``benchmarks/results/gpu-<date>.md``) as soon as it is measured, so a time-out
loses nothing; rows that would start after ``--budget-seconds`` are recorded as skipped. ``--profile DIR``
then writes ``torch.profiler`` tables (sorted by device time) of the level-2 converted layer and of variant 2
as written at the shape of (d), forward and forward + backward, to ``DIR/profile-{converted,variant2}-
{fwd,fwdbwd}.txt`` (the layer converted for (d) is reused; each file is written as soon as it is done, the
rows' budget does not apply to them, and a profiler failure is printed, not fatal). ``--quick`` shrinks every
shape for a short GPU run; ``--device cpu --size tiny`` (with ``TRITON_INTERPRET=1``) smoke-tests the script
itself without a GPU: one timed run per row, the wall clock, and the zoo layers' ``torch.compile`` turned off.

Read before trusting tile choices: the kernels' compile check (``ttt2la/runtime/triton/ahead_of_time.py``)
compiles without the divisibility hints (``tt.divisibility``) the JIT adds at launch, so the register counts
it reports, which chose the tile sizes and warp counts, are pessimistic (e.g. 254 registers reported where
the hinted compile uses 80). Measured times here are the ground truth.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import datetime
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttt2la.runtime import block_linear_attention, chunk_linear_attention  # noqa: E402
from ttt2la.runtime.naive import naive_block_linear_attention  # noqa: E402
from ttt2la.runtime.newton_schulz import newton_schulz  # noqa: E402
from ttt2la.testing import rel_rms_error  # noqa: E402

#: Where the benchmark runs (``--device cpu`` redirects it for a smoke test of this script).
DEVICE = "cuda"

#: LaCT's released Newton–Schulz: one (a, b, c) per step, iterated in bf16.
LACT_NS_COEFFICIENTS = ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                        (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))
LACT_NS_DTYPE = torch.bfloat16

#: Rows that would start after this time (``time.monotonic()``) are recorded as skipped.
DEADLINE = math.inf

#: When the script started (``time.monotonic()``), for the elapsed times in its progress lines.
START = time.monotonic()


def elapsed() -> str:
    """Seconds since the script started, as ``+12s``."""
    return f"+{time.monotonic() - START:.0f}s"


#: Dense bf16 matmul rate the vendor states for the chips this is meant for (TFLOP/s, no sparsity).
NOMINAL_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclasses.dataclass
class Row:
    """One measurement of the results table."""
    section: str
    implementation: str
    passes: str
    ms: float | None = None
    iqr_pct: float | None = None
    tokens: int = 0
    flops: float = 0.0
    error: float | None = None
    note: str = ""


#: Spread (IQR % of the median) of the last ``cuda_ms`` call, picked up by ``_attempt`` for its row.
LAST_SPREAD: list[float | None] = [None]


def cuda_ms(fn, *, warmup: int = 2, repeats: int = 7) -> float:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, timed with CUDA events
    (the wall clock off CUDA); the runs' interquartile range goes to ``LAST_SPREAD``."""
    cuda = DEVICE.startswith("cuda")
    if not cuda:                # a smoke run of the script itself: its numbers mean nothing, one run will do
        warmup, repeats = 0, 1
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(times)
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else (median, median, median)
    LAST_SPREAD[0] = (q[2] - q[0]) / median * 100
    return median


@contextlib.contextmanager
def tf32_matmuls(allowed: bool):
    """fp32 matmuls with TF32 tensor cores ``allowed`` or not, the previous setting restored after."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


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


class Rows(list):
    """The measured rows; every ``append`` rewrites the results file, so a time-out loses nothing."""

    def __init__(self, path: str, header: str, peak: float, nominal: float | None):
        super().__init__()
        self.path, self.header, self.peak, self.nominal = path, header, peak, nominal
        self.flush(done=False)

    def append(self, row: Row) -> None:
        super().append(row)
        self.flush(done=False)

    def flush(self, *, done: bool) -> str:
        table = markdown(self, self.header + ("" if done else "\n\n**Partial: the run has not finished.**"),
                         self.peak, self.nominal)
        with open(self.path, "w") as f:
            f.write(table)
        return table


def _attempt(rows, row: Row, measure):
    """Fill ``row`` by ``measure(row)``; a failure becomes a note instead of ending the run."""
    if time.monotonic() > DEADLINE:
        row.note = "skipped: the run's time budget (--budget-seconds) was spent"
    else:
        LAST_SPREAD[0] = None
        try:
            measure(row)
            row.iqr_pct = LAST_SPREAD[0] if row.ms is not None else None
        except Exception as exc:  # one broken row must not cost the others (device time is scarce)
            row.note = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            traceback.print_exc()
    rows.append(row)
    print(f"  [{elapsed()}] {row.section} | {row.implementation} | {row.passes} | "
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

    section = (f"(a) LaCT variant 2: B={B} T={T} H={H} D={D} C={C} bf16, momentum + Muon({steps} steps of "
               f"LaCT's schedule, in bf16)")
    q, k, v, lr, momentum, w0, w2 = lact_inputs(B, T, H, D, C)
    phi_q, phi_k = swiglu_features(q, w0, w2), swiglu_features(k, w0, w2)
    options = dict(chunk_size=C, order="exclusive", lr=lr, momentum=momentum, **lact_newton_schulz(steps))
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

    def recurrent_training(row):
        row.ms = cuda_ms(grads(lambda a, b, c: naive_block_linear_attention(a, b, c, **options), (phi_q, phi_k, v)),
                         warmup=1, repeats=3)
        row.tokens, row.flops = B * T, block_flops(**flops, backward=True)

    _attempt(rows, Row(section, "torch runtime, parallel (φ given)", "fwd"), torch_forward)
    _attempt(rows, Row(section, "Triton block op (φ given)", "fwd"), triton_forward)
    _attempt(rows, Row(section, "Triton, SwiGLU φ fused", "fwd"), fused_forward)
    _attempt(rows, Row(section, "torch φ, then Triton block op", "fwd"), materialised_forward)
    _attempt(rows, Row(section, "recurrent form (loop over chunks, φ given)", "fwd"), recurrent_forward)
    _attempt(rows, Row(section, "torch runtime, parallel (φ given)", "fwd+bwd"), torch_training)
    _attempt(rows, Row(section, "Triton block op (φ given)", "fwd+bwd"), triton_training)
    _attempt(rows, Row(section, "Triton, SwiGLU φ fused", "fwd+bwd"), fused_training)
    _attempt(rows, Row(section, "recurrent form (loop over chunks, φ given)", "fwd+bwd"), recurrent_training)


def lact_newton_schulz(steps: int) -> dict:
    """Runtime-op options for ``steps`` Newton–Schulz steps as LaCT's release runs them (none for 0)."""
    if steps == 0:
        return dict(muon_steps=0)
    return dict(muon_steps=steps, ns_coefficients=LACT_NS_COEFFICIENTS[:steps], ns_dtype=LACT_NS_DTYPE)


class LaCTLayers:
    """The zoo's LaCT layer at one shape: its input, the baseline and variant-2 configurations (same weights), and
    the baseline converted at level 2 — converted once, on first use, and shared by (d) and ``--profile``."""

    def __init__(self, *, B, T, H, D, C, steps):
        import ttt2la.zoo

        self.cls = getattr(ttt2la.zoo, "LaCTPublishedLayer", None) or ttt2la.zoo.LaCTFoldedLayer
        self.B, self.T, self.C = B, T, C
        self.x = torch.randn(B, T, H * D, device=DEVICE, dtype=torch.bfloat16)
        torch.manual_seed(0)
        self.baseline = self.cls(H * D, H, C, muon_steps=steps).to(DEVICE, torch.bfloat16).eval()
        self.variant2 = self.cls(H * D, H, C, muon_steps=steps, update_theta=False, weight_norm=False)
        self.variant2.load_state_dict(self.baseline.state_dict())
        self.variant2.to(DEVICE, torch.bfloat16).eval()
        self._converted: torch.nn.Module | None = None
        self._failure: Exception | None = None
        self.convert_seconds: float | None = None

    def converted(self) -> torch.nn.Module:
        """The baseline converted at level 2 (a failed conversion is raised again, not retried)."""
        if self._failure is not None:
            raise self._failure
        if self._converted is None:
            import ttt2la

            start = time.monotonic()
            try:
                self._converted = ttt2la.convert(self.baseline, level=2,
                                                 example_inputs=(self.x[:1, : min(self.T, 3 * self.C)],))
            except Exception as exc:
                self._failure = exc
                raise
            self.convert_seconds = time.monotonic() - start
        return self._converted

    def plan_note(self) -> str:
        from ttt2la.cli import ran_plans

        return f"plan that ran: {ran_plans(self._converted, self.B)}; converted in {self.convert_seconds:.0f} s"


def layer_training(layer, x):
    """A closure running ``layer(x)`` and backpropagating the sum of its output into every parameter."""
    parameters = list(layer.parameters())

    def run():
        for p in parameters:
            p.grad = None
        layer(x).float().sum().backward()
    return run


def gradients(layer) -> dict[str, torch.Tensor]:
    """The parameter gradients ``layer`` holds, by name, in float32."""
    return {name: p.grad.float() for name, p in layer.named_parameters() if p.grad is not None}


def reached(grads, layer) -> str:
    """How many of ``layer``'s parameters the backward of the output's sum reached."""
    return f"backward of the output's sum: {len(grads)} of {len(list(layer.parameters()))} parameters get a gradient"


def gradient_error(grads, reference) -> tuple[float | None, str]:
    """The worst per-parameter relative RMS error of ``grads`` against ``reference`` (by name), and which."""
    shared = sorted(set(grads) & set(reference))
    if not shared:
        return None, "no parameter gradient shared with variant 2 as written to compare"
    errors = {name: rel_rms_error(grads[name], reference[name]) for name in shared}
    worst = max(errors, key=errors.get)
    return errors[worst], f"worst of {len(shared)} parameter gradients ({worst}) vs variant 2 as written"


def section_lact_layers(rows, section, layers: LaCTLayers):
    """The whole LaCT zoo layer as written (projections, norms, its own chunk loop) in its variant-2 and
    baseline configurations, and the baseline converted at level 2 (the plan that ran in the note): forward,
    then forward + backward of the output's sum into every parameter (the converted layer before the slow
    baseline, so that a short run keeps the rows that matter most)."""
    x, B, T, name = layers.x, layers.B, layers.T, layers.cls.__name__
    outputs, grads = {}, {}
    whole = "whole layer: projections, norms and Θ updates where enabled; FLOPs not counted"

    def as_written(layer, key):
        def measure(row):
            with torch.no_grad():
                outputs[key] = layer(x).float()
                row.ms = cuda_ms(lambda: layer(x), warmup=1, repeats=3)
            row.tokens, row.note = B * T, whole
        return measure

    def converted(row):
        layer = layers.converted()
        with torch.no_grad():
            out = layer(x).float()
            row.ms = cuda_ms(lambda: layer(x), warmup=1, repeats=3)
        row.tokens = B * T
        row.error = rel_rms_error(out, outputs["v2"]) if "v2" in outputs else None
        row.note = f"{layers.plan_note()}; error vs variant 2 as written"

    def as_written_training(layer, key):
        def measure(row):
            run = layer_training(layer, x)
            run()
            grads[key] = gradients(layer)
            row.ms = cuda_ms(run, warmup=1, repeats=3)
            row.tokens = B * T
            row.note = f"{whole}; {reached(grads[key], layer)}"
        return measure

    def converted_training(row):
        layer = layers.converted()
        run = layer_training(layer, x)
        run()
        mine = gradients(layer)
        row.ms = cuda_ms(run, warmup=1, repeats=3)
        row.tokens = B * T
        if "v2" in grads:
            row.error, compared = gradient_error(mine, grads["v2"])
        else:
            compared = "variant 2 as written has no gradients to compare"
        row.note = f"{layers.plan_note()}; {reached(mine, layer)}; error: {compared}"

    _attempt(rows, Row(section, f"{name}, variant 2 as written (whole layer)", "fwd"), as_written(layers.variant2, "v2"))
    _attempt(rows, Row(section, f"{name}, baseline as written (whole layer)", "fwd"),
             as_written(layers.baseline, "baseline"))
    _attempt(rows, Row(section, f"{name} baseline converted at level 2 (whole layer)", "fwd"), converted)
    _attempt(rows, Row(section, f"{name}, variant 2 as written (whole layer)", "fwd+bwd"),
             as_written_training(layers.variant2, "v2"))
    _attempt(rows, Row(section, f"{name} baseline converted at level 2 (whole layer)", "fwd+bwd"),
             converted_training)
    _attempt(rows, Row(section, f"{name}, baseline as written (whole layer)", "fwd+bwd"),
             as_written_training(layers.baseline, "baseline"))


def profile_layers(layers: LaCTLayers, directory: str, *, iterations: int = 3) -> None:
    """``torch.profiler`` tables (CPU and CUDA activities, sorted by device time) of the converted layer and of
    variant 2 as written, forward and forward + backward, ``iterations`` runs after warm-up each. Each file is
    written when done (an outer time-out loses only the one under way); a failure is printed and ends nothing."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(directory, exist_ok=True)
    cuda = DEVICE.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    keys = ("self_device_time_total", "device_time_total") if cuda else ("self_cpu_time_total", "cpu_time_total")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not cuda:
        iterations = 1

    def forward(layer):
        def run():
            with torch.no_grad():
                layer(layers.x)
        return run

    for label, get in (("converted", layers.converted), ("variant2", lambda: layers.variant2)):
        for passes, make in (("fwd", forward), ("fwdbwd", lambda layer: layer_training(layer, layers.x))):
            path = os.path.join(directory, f"profile-{label}-{passes}.txt")
            try:
                run = make(get())
                for _ in range(2 if cuda else 1):
                    run()
                sync()
                with profile(activities=activities) as prof:
                    for _ in range(iterations):
                        run()
                    sync()
                averages = prof.key_averages()
                text = [f"{label} layer ({layers.cls.__name__}, B={layers.B} T={layers.T}), {passes}, "
                        f"{iterations} iterations after warm-up; {DEVICE}\n"]
                for key in keys:
                    text += [f"\n== sorted by {key} (top 30)\n",
                             averages.table(sort_by=key, row_limit=30, max_name_column_width=100)]
                with open(path, "w") as f:
                    f.write("".join(text))
                print(f"  profile written: {path} ({elapsed()})", flush=True)
            except Exception as exc:  # the table is what counts: a profiler failure is reported, not fatal
                print(f"  profile {path} failed: {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc()


# ----------------------------------------------------------------------------- (b) token-causal

def section_chunk(rows, *, B, T, H, D, per_channel: bool = False):
    """Section (b), or with ``per_channel`` (f): the token-causal op against fla's kernel for its decay."""
    from ttt2la.runtime import triton as kernels

    section = (f"(f) token-causal, a decay per key channel: B={B} T={T} H={H} D={D} bf16" if per_channel
               else f"(b) token-causal, per-head decay: B={B} T={T} H={H} D={D} bf16")
    fla_name = "fla chunk_gla" if per_channel else "fla chunk_simple_gla"
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q, k, v = (torch.randn(B, T, H, D, generator=g, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    if per_channel:
        log_decay = F.logsigmoid(torch.randn(B, T, H, D, generator=g, device=DEVICE) + 4) / 16
    else:
        log_decay = F.logsigmoid(torch.randn(B, T, H, generator=g, device=DEVICE) + 3)
    scale = D ** -0.5
    reference = {}
    flops = dict(B=B, T=T, H=H, K=D, V=D)

    def runner(which):
        if which == "torch":
            return lambda a, b, c, d: chunk_linear_attention(a, b, c, log_decay=d, scale=scale, backend="torch")
        if which == "triton":
            return lambda a, b, c, d: kernels.chunk_linear_attention(a, b, c, log_decay=d, scale=scale)
        if per_channel:
            from fla.ops.gla import chunk_gla
            return lambda a, b, c, d: chunk_gla(a, b, c, g=d, scale=scale)
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
        importlib.import_module("fla.ops.gla" if per_channel else "fla.ops.simple_gla")
        have_fla = True
    except Exception as exc:  # fla absent (no wheels shipped) or broken on this stack
        have_fla = False
        rows.append(Row(section, fla_name, "-", note=f"skipped, fla not importable: {exc}"))
    for passes, make in (("fwd", forward), ("fwd+bwd", training)):
        _attempt(rows, Row(section, "torch runtime", passes), make("torch"))
        _attempt(rows, Row(section, "Triton chunk op", passes), make("triton"))
        if have_fla:
            _attempt(rows, Row(section, fla_name, passes), make("fla"))


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

    def orthogonalise(dtype, tf32=False):
        def measure(row):
            M = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32)
            coefficients = LACT_NS_COEFFICIENTS[:steps]
            with tf32_matmuls(tf32):
                row.ms = cuda_ms(lambda: newton_schulz(M, steps, coefficients, dtype=dtype))
            row.flops = B * n * H * newton_schulz_flops(D, D, steps)
            row.note = (f"LaCT's schedule, torch matmuls in {str(dtype).replace('torch.', '')}"
                        f"{' (TF32 allowed)' if tf32 else ''}, all {n} chunks at once")
        return measure

    def orthogonalise_training(dtype):
        def measure(row):
            M = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32, requires_grad=True)
            cotangent = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32)
            coefficients = LACT_NS_COEFFICIENTS[:steps]

            def run():
                M.grad = None
                newton_schulz(M, steps, coefficients, dtype=dtype).backward(cotangent)

            with tf32_matmuls(False):
                row.ms = cuda_ms(run)
            row.flops = 3 * B * n * H * newton_schulz_flops(D, D, steps)
            row.note = (f"LaCT's schedule iterated in {str(dtype).replace('torch.', '')}, float32 input and "
                        f"gradient as the block op gives them, all {n} chunks at once; FLOPs: 3× the forward's "
                        f"matmuls (the backward's two products per forward matmul; recomputation not counted)")
        return measure

    _attempt(rows, Row(section, "Triton increments G_j = φ(K_j)ᵀ(lr ⊙ V_j)", "fwd"), increments(False))
    _attempt(rows, Row(section, "Triton increments, split lr ⊙ V", "fwd"), increments(True))
    _attempt(rows, Row(section, "Triton read o = φ(Q_j) W_j", "fwd"), read)
    _attempt(rows, Row(section, "Newton–Schulz", "fwd"), orthogonalise(torch.float32))
    _attempt(rows, Row(section, "Newton–Schulz", "fwd"), orthogonalise(torch.float32, tf32=True))
    _attempt(rows, Row(section, "Newton–Schulz", "fwd"), orthogonalise(torch.bfloat16))
    _attempt(rows, Row(section, "Newton–Schulz", "fwd+bwd"), orthogonalise_training(torch.bfloat16))
    _attempt(rows, Row(section, "Newton–Schulz", "fwd+bwd"), orthogonalise_training(torch.float32))


# ----------------------------------------------------------------------------- (e) tuned tiles

def section_tuning(rows, *, lact, causal):
    """Each token-level Triton path with its default tiles, then with tile tuning on (``tile_tuning``): the
    first tuned call times every candidate configuration (its wall time is the tuning's cost, in the note, with
    the configurations chosen); the row is the median after it, its error taken against the default's output."""
    from ttt2la.runtime import triton as kernels
    from ttt2la.runtime.triton import tile_tuning
    from ttt2la.runtime.triton.block import chunk_increments, chunk_read

    section = "(e) tile tuning (TTT2LA_TUNE_KERNELS=1) against the default tiles (error: against their output)"
    B, T, H, D, C, steps = (lact[n] for n in ("B", "T", "H", "D", "C", "steps"))
    q, k, v, lr, momentum, _, _ = lact_inputs(B, T, H, D, C)
    n = math.ceil(T / C)
    states = torch.randn(B, n, H, D, D, device=DEVICE, dtype=torch.float32)
    block_options = dict(chunk_size=C, order="exclusive", lr=lr, momentum=momentum, **lact_newton_schulz(steps))
    cb, ct, ch, cd = (causal[n] for n in ("B", "T", "H", "D"))
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cq, ck, cv = (torch.randn(cb, ct, ch, cd, generator=g, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    log_decay = F.logsigmoid(torch.randn(cb, ct, ch, generator=g, device=DEVICE) + 3)
    token_flops = B * H * 2 * T * D * D
    block = dict(B=B, T=T, H=H, Dk=D, Dv=D, C=C, muon_steps=steps)
    chunk = dict(B=cb, T=ct, H=ch, K=cd, V=cd)

    def first(out):
        return (out[0] if isinstance(out, tuple) else out).float()

    cases = [
        ("increments G_j = φ(K_j)ᵀ(lr ⊙ V_j)", "fwd", lambda: chunk_increments(k, v, n, C, scale=lr),
         B * T, token_flops),
        ("read o = φ(Q_j) W_j", "fwd", lambda: chunk_read(q, states, C), B * T, token_flops),
        ("block op (φ given), LaCT shape", "fwd", lambda: kernels.block_linear_attention(q, k, v, **block_options),
         B * T, block_flops(**block)),
        ("block op (φ given), LaCT shape", "fwd+bwd",
         forward_backward(lambda a, b, c: kernels.block_linear_attention(a, b, c, **block_options),
                          [t.detach().requires_grad_() for t in (q, k, v)]), B * T, block_flops(**block, backward=True)),
        ("chunk op, shape of (b)", "fwd",
         lambda: kernels.chunk_linear_attention(cq, ck, cv, log_decay=log_decay, scale=cd ** -0.5),
         cb * ct, chunk_flops(**chunk)),
        ("chunk op, shape of (b)", "fwd+bwd",
         forward_backward(lambda a, b, c, d: kernels.chunk_linear_attention(a, b, c, log_decay=d, scale=cd ** -0.5),
                          [t.detach().requires_grad_() for t in (cq, ck, cv, log_decay)]),
         cb * ct, chunk_flops(**chunk, backward=True)),
    ]
    forward_choice: dict[str, dict] = {}     # per case name: the forward's tuned choice per site
    try:
        for name, passes, fn, tokens, flops in cases:
            default = {}
            tuned_here: dict = {}

            def measure_default(row, fn=fn, tokens=tokens, flops=flops):
                tile_tuning.tune_kernels(False)
                out = fn()
                default["o"] = first(out) if out is not None else None
                row.ms = cuda_ms(fn)
                row.tokens, row.flops = tokens, flops

            def measure_tuned(row, fn=fn, tokens=tokens, flops=flops):
                tile_tuning.tune_kernels(True)
                before = set(tile_tuning.CHOSEN)
                started = time.monotonic()
                out = fn()
                if DEVICE.startswith("cuda"):
                    torch.cuda.synchronize()
                tuning_s = time.monotonic() - started
                if out is not None and default.get("o") is not None:
                    row.error = rel_rms_error(first(out), default["o"])
                row.ms = cuda_ms(fn)
                row.tokens, row.flops = tokens, flops
                chosen = [t for key, t in tile_tuning.CHOSEN.items() if key not in before]
                tuned_here.update((t.site, t.chosen) for t in reversed(chosen))   # a site's first choice
                if passes == "fwd":
                    forward_choice[name] = dict(tuned_here)
                if not tile_tuning.enabled():
                    row.note = "tuning is off here (Triton's interpreter): the default tiles ran"
                elif chosen:
                    row.note = (f"first call {tuning_s:.1f} s (tuning); chose "
                                + "; ".join(f"{t.site}: {t.chosen}" for t in chosen))
                else:
                    row.note = "nothing new to tune (chosen at an earlier row)"

            def measure_one_per_site(row, fn=fn, tokens=tokens, flops=flops, name=name):
                # tuning off, one configuration per site for every launch: the forward's choice where the
                # forward launched the site, else the first this row's tuning chose -- static defaults
                # that would compose, where per-launch tuning (the row above) did not always
                forced = {**tuned_here, **forward_choice.get(name, {})}
                tile_tuning.tune_kernels(False)
                with tile_tuning.forcing(**forced):
                    out = fn()
                    if out is not None and default.get("o") is not None:
                        row.error = rel_rms_error(first(out), default["o"])
                    row.ms = cuda_ms(fn)
                row.tokens, row.flops = tokens, flops
                row.note = ("forced: " + "; ".join(f"{site}: {c}" for site, c in forced.items())
                            if forced else "nothing was tuned here: the default tiles ran")

            _attempt(rows, Row(section, f"{name}, default tiles", passes), measure_default)
            _attempt(rows, Row(section, f"{name}, tuned tiles", passes), measure_tuned)
            if passes == "fwd+bwd":
                _attempt(rows, Row(section, f"{name}, tuned tiles, one per site", passes),
                         measure_one_per_site)
    finally:
        tile_tuning.tune_kernels(None)


# ----------------------------------------------------------------------------- report

def markdown(rows, header, peak, nominal) -> str:
    lines = [header, "",
             "| section | implementation | pass | median ms | IQR | tokens/s | TFLOP/s | % of measured peak | "
             "% of nominal peak | rel. RMS error vs torch | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tflops = r.flops / (r.ms * 1e-3) / 1e12 if r.ms and r.flops else None
        cells = [r.section, r.implementation, r.passes,
                 f"{r.ms:.3f}" if r.ms else "-",
                 f"{r.iqr_pct:.0f}%" if r.iqr_pct is not None else "-",
                 f"{r.tokens / (r.ms * 1e-3) / 1e6:.2f}M" if r.ms and r.tokens else "-",
                 f"{tflops:.1f}" if tflops else "-",
                 f"{100 * tflops / peak:.1f}" if tflops and peak else "-",
                 f"{100 * tflops / nominal:.1f}" if tflops and nominal else "-",
                 f"{r.error:.1e}" if r.error is not None else "-",
                 r.note.replace("|", "/")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: Shapes per ``--size``: the benchmark's own, a quick GPU run, and a tiny one for the interpreter on CPU.
SHAPES = {
    "full": (dict(B=1, T=32768, H=4, D=384, C=2048, steps=5), dict(B=8, T=8192, H=16, D=128), 8192),
    "quick": (dict(B=1, T=4096, H=2, D=128, C=512, steps=5), dict(B=1, T=1024, H=2, D=64), 2048),
    "tiny": (dict(B=1, T=64, H=1, D=16, C=16, steps=2), dict(B=1, T=64, H=1, D=16), 128),
}


def main(argv=None):
    global DEVICE, DEADLINE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="Markdown output path (default benchmarks/results/gpu-<date>.md)")
    parser.add_argument("--size", choices=sorted(SHAPES), default="full")
    parser.add_argument("--quick", dest="size", action="store_const", const="quick", help="--size quick")
    parser.add_argument("--device", default="cuda",
                        help="cuda; cpu only smoke-tests the script (TRITON_INTERPRET=1, --size tiny)")
    parser.add_argument("--budget-seconds", type=float, default=math.inf,
                        help="rows that would start later than this are recorded as skipped")
    parser.add_argument("--sections", default="a,b,c,d,e,f", type=sections,
                        help="comma list of the sections to run, of a,b,c,d,e,f, in that order (default all)")
    parser.add_argument("--profile", metavar="DIR",
                        help="after the table, write torch.profiler tables of the level-2 converted layer and of "
                             "variant 2 as written (shape of (d)), forward and forward + backward, to DIR")
    args = parser.parse_args(argv)
    DEVICE, DEADLINE = args.device, time.monotonic() + args.budget_seconds
    if DEVICE.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    if not DEVICE.startswith("cuda"):
        # A smoke run of the script: the zoo layers' torch.compile would spend minutes in Inductor's C++ build
        # on a small CPU, so it runs them eagerly; the GPU run compiles them as written.
        importlib.import_module("torch._dynamo").config.disable = True   # no local `import torch`: main reads the global
    import triton

    name = torch.cuda.get_device_name() if DEVICE.startswith("cuda") else f"{platform.machine()} (smoke run)"
    nominal = next((v for key, v in NOMINAL_BF16_TFLOPS.items() if key in name), None)
    lact, causal, peak_n = SHAPES[args.size]
    peak = measured_peak_tflops(peak_n)
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    header = (f"## GPU results {date}: {name}\n\n"
              f"torch {torch.__version__}, triton {triton.__version__}, Python {platform.python_version()}. "
              f"bf16 matmul rate measured here ({peak_n}³): {peak:.0f} TFLOP/s; nominal dense bf16: "
              f"{nominal if nominal else 'unknown'} TFLOP/s. Medians of CUDA-event timings after warm-up, with "
              f"the interquartile range of the runs (% of the median)."
              + ("" if args.size == "full" else f" **{args.size} (small-shape) run.**"))
    print(header, flush=True)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"gpu-{date}.md")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    rows = Rows(out, header, peak, nominal)
    layers = None
    for section in args.sections:
        if section == "a":
            section_lact(rows, **lact)
        elif section == "b":
            section_chunk(rows, **causal)
        elif section == "c":
            section_matmuls(rows, **lact)
        elif section == "d":
            layers = lact_layers(rows, lact)
        elif section == "e":
            section_tuning(rows, lact=lact, causal=causal)
        else:
            section_chunk(rows, **causal, per_channel=True)
    print(rows.flush(done=True))
    print(f"written to {out} ({elapsed()})", flush=True)
    if args.profile:
        print(f"profiles of the whole layer at the shape of (d), to {args.profile}", flush=True)
        try:
            profile_layers(layers or LaCTLayers(**lact), args.profile)
        except Exception as exc:  # building the layers failed: say so, the table is written already
            print(f"  profiles failed: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
    print(f"done ({elapsed()})", flush=True)
    return 0


def sections(text: str) -> list[str]:
    """``--sections``: a comma list of a, b, c, d, e, f, run in the order given (a short slot measures what
    it most needs first; the rows' budget then skips the last ones)."""
    names = list(dict.fromkeys(name.strip().lower() for name in text.split(",") if name.strip()))
    unknown = set(names) - set("abcdef")
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are a comma list of a,b,c,d,e,f; got {text!r}")
    return names


def lact_layers(rows, lact) -> LaCTLayers | None:
    """Section (d): builds the layers (a failure to build them becomes a row) and measures them."""
    section = "(d) whole LaCT layer, shape of (a)"
    try:
        layers = LaCTLayers(**lact)
    except Exception as exc:
        traceback.print_exc()
        rows.append(Row(section, "LaCT zoo layer", "-", note=f"failed to build: {type(exc).__name__}: {exc}"))
        return None
    section_lact_layers(rows, section, layers)
    return layers


if __name__ == "__main__":
    sys.exit(main())
