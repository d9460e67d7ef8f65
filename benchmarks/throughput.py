"""TTT-layer throughput, side by side: LaCT as written against its conversions; per-token layers.

Every case times its rows in one run, interleaved (one call of each per round, order rotated
every round, after warm-up rounds; ``ttt2la.timing``), and reports each row's median tokens/s with
the spread of its rounds, and ratios as medians of per-round ratios.

LaCT cases — ``LaCTPublishedLayer`` from the zoo when it exists (LaCT's released operator: heads
folded into the batch by the caller, the chunk loop in a helper), else ``LaCTFoldedLayer`` — with
4 heads of 128 features, chunk 2048 at L=16384 and chunk 64 at L=4096, with and without Muon:

* ``original (level 0)``     — the layer as written (Θ updated, weight norm), unconverted;
* ``level 1 converted``      — ``ttt2la.convert(layer, level=1)``: Θ frozen, weight norm kept;
* ``level 2 converted``      — ``ttt2la.convert(layer, level=2)``: Θ frozen, no weight norm;
* ``variant 1 as written``   — the layer built with ``update_theta=False``, run by its own loop;
* ``variant 2 as written``   — the layer built with ``update_theta=False, weight_norm=False``;
* ``variant 2 hand-written`` — the variant-2 function written here as a plain fp32 loop over
  chunks with the features hoisted out of it and the heads batched (``hand_written.py``).

Targets per case: level 2 ≥ 1.0× variant 2 as written and ≥ 1.0× hand-written; level 1 ≥ 1.0×
variant 1 as written; at chunk 2048 with Muon level 2 ≥ 1.8× the original; at chunk 2048 the
level-2 layer's useful FLOP/s ≥ 70 % of the measured fp32 GEMM peak. Per-token cases: the
per-token layers of the zoo (loop in a helper; loop inline in ``forward`` when the zoo has it)
against their conversions at L=2048 (target ≥ 10×) and L=8192 (≥ 30×).

Every converted row names the plan that ran (schedule and implementation of the plan the converted
layer built for the timed shape) and its relative RMS error against the unconverted layer that
computes the same function. Without Muon that error must be ≤ 1e-5 (fp32); with Muon the bound is
the project's precision criterion: the converted layer's error against a float64 evaluation of the
same function at most 2× the unconverted layer's own error against it, plus 1e-6.

Useful FLOPs are counted analytically (matmuls only, see ``flops.py``); "% of peak" divides useful
FLOP/s by the GEMM peak: the square matmuls of ``gemm_peak.py`` are timed again in every round of
every case, beside its rows, and a case divides by the best of their medians (a machine whose
speed drifts during a run moves the rows and their yardstick alike).

Every converted row has a twin, ``…: its matmuls alone``, timed in the same rounds: the matrix
products one call of it dispatches, replayed alone (``ceiling.py``). Each target then states its
ceiling: how far the row could go if everything around its products were free, and (speed-ups)
how far any implementation could go with the row's useful FLOPs at the GEMM peak; a target above
the latter is marked "beyond the GEMM peak".

Results go to ``--results DIR`` as they are measured: ``rows.jsonl`` gains each case's rows as soon
as the case is timed, ``throughput.md`` is rewritten after every case, ``--profile`` adds a
``torch.profiler`` summary (top ops by self CPU time) of the converted layer of every missed target.

    python benchmarks/throughput.py                  # the issue's CPU sizes, ~15 min, 2 quiet cores
    python benchmarks/throughput.py --size quick     # small sizes, a few minutes
    python benchmarks/throughput.py --backward       # forward + backward instead of forward only
    python benchmarks/throughput.py --keep-freed-memory   # glibc keeping freed memory (allocator.py)
    python benchmarks/throughput.py --compile-whole  # also each layer under torch.compile, whole
    python benchmarks/throughput.py --compile-plan   # also convert(..., compile=True) rows

``--compile-whole`` adds, to LaCT cases of at most ``COMPILED_CHUNKS`` chunks, the original and
the level-2 conversion each compiled whole (``torch.compile(layer)``), and the target that the
compiled level-2 layer is at least as fast as the compiled original: the question of a user
whose model is compiled anyway. ``--compile-plan`` adds, to every case, the level-2 (per-token:
level-0) conversion made with ``convert(..., compile=True)``, whose plan alone runs compiled, and
the same targets as the eager conversion's, for it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ttt2la  # noqa: E402
import ttt2la.zoo  # noqa: E402
from ttt2la.cli import ran_plans  # noqa: E402
from ttt2la.errors import ConversionError  # noqa: E402
from ttt2la.runtime.newton_schulz import half_gemms, half_gemms_native  # noqa: E402
from ttt2la.testing import TOLERANCE, rel_rms_error  # noqa: E402
from ttt2la.timing import Timing, time_side_by_side  # noqa: E402

from allocator import DEFAULT as DEFAULT_ALLOCATOR, keep_freed_memory  # noqa: E402
from ceiling import Replay, matmul_flops, record_matmuls  # noqa: E402
from flops import lact_flops_per_token, per_token_flops_per_token  # noqa: E402
from gemm_peak import measure_gemm_peak  # noqa: E402
from hand_written import HandWrittenVariant2  # noqa: E402


@dataclass
class Setup:
    """Sizes, timing budget and placement of one run (``SIZES`` holds the presets)."""

    batch: int = 1
    heads: int = 4
    head_dim: int = 128
    lact: tuple[tuple[int, int], ...] = ((2048, 16384), (64, 4096))     # (chunk, length)
    per_token_lengths: tuple[int, ...] = (2048, 8192)
    per_token_targets: tuple[float, ...] = (10.0, 30.0)                  # one per length
    muon_steps: int = 5
    rounds: int = 15
    max_seconds: float = 40.0          # timing budget of one case (at least 3 rounds)
    warmup: int = 1                    # untimed rounds first (also absorbs torch.compile)
    dtype: str = "float32"
    device: str = "cpu"
    backward: bool = False
    levels: tuple[int, ...] = (1, 2)    # conversion levels measured in the LaCT cases
    size: str = "issue"
    peak: float = float("nan")         # measured GEMM FLOP/s, filled in before the cases run
    peak_sizes: tuple[int, ...] = ()   # the square GEMMs it was the best of, re-timed per case
    allocator: str = DEFAULT_ALLOCATOR   # ``--keep-freed-memory`` changes it
    half_gemms: str = "auto"            # bf16 Newton–Schulz products on CPU (``--half-gemms``)
    compile_whole: bool = False         # rows of the layers under torch.compile, whole
    compile_plan: bool = False          # rows of conversions made with compile=True

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def passes(self) -> int:
        """Useful FLOPs per call, in forward counts: a matmul's backward is two more its size."""
        return 3 if self.backward else 1


#: Size presets: the issue's CPU sizes (about 15 minutes on 2 cores), a quick run, and a smoke
#: run small enough for the test suite.
SIZES = {
    "issue": {},
    "quick": dict(heads=2, head_dim=32, lact=((256, 1024), (32, 512)),
                  per_token_lengths=(256, 1024), rounds=7, max_seconds=8.0),
    "smoke": dict(heads=2, head_dim=8, lact=((16, 64),), per_token_lengths=(32,),
                  per_token_targets=(10.0,), rounds=1, max_seconds=0.0, warmup=1, muon_steps=2),
}


@dataclass
class Row:
    """One measured layer of one case."""

    case: str
    model: str
    plan: str
    tokens_per_s: float | None = None
    iqr_pct: float | None = None
    range_pct: float | None = None
    rounds: int = 0
    flops_per_token: float | None = None
    error: float | None = None          # rel. RMS vs the unconverted layer of the same function
    bound: float | None = None          # the error the precision criterion allows
    reference: str = ""
    not_timed: str = ""                 # why not: refused, crashed or failed, in its words
    peak: float | None = None           # the GEMM peak timed in the case's rounds

    @property
    def flops_per_s(self) -> float | None:
        if self.tokens_per_s is None or self.flops_per_token is None:
            return None
        return self.flops_per_token * self.tokens_per_s


@dataclass
class Target:
    """One target of a case: ``row`` at least ``threshold`` × ``baseline`` (or % of peak)."""

    case: str
    what: str
    row: str
    threshold: float
    baseline: str | None = None         # None: FLOP/s as % of the GEMM peak
    measured: float | None = None
    spread: str = ""
    profile: str = ""
    ceiling: str = ""                   # how far the target could go (``ceiling.py``)
    beyond_peak: bool = False           # not even the useful FLOPs at the GEMM peak would meet it

    @property
    def met(self) -> bool | None:
        return None if self.measured is None else self.measured >= self.threshold


#: Suffix of the row that times a converted row's matrix products alone (``ceiling.py``).
ALONE = "its matmuls alone"


@dataclass
class Candidate:
    """A layer to time: a module (or why none could be built), its plan and useful FLOPs/token,
    and the name of the unconverted row computing the same function (None for those)."""

    model: torch.nn.Module | str
    plan: str
    flops_per_token: float | None = None
    reference: str | None = None


# -- the layers ---------------------------------------------------------------------------------
def lact_class() -> type:
    """LaCT's published-operator style when the zoo has it, else the folded layer."""
    return getattr(ttt2la.zoo, "LaCTPublishedLayer", None) or ttt2la.zoo.LaCTFoldedLayer


def per_token_classes() -> dict[str, type]:
    """The per-token layers to measure: loop in a helper, and inline in ``forward`` if present."""
    classes = {"per-token (loop in helper)": ttt2la.zoo.PerTokenTTTLayer}
    inline = getattr(ttt2la.zoo, "PerTokenInlineTTTLayer", None)
    if inline is not None:
        classes["per-token (loop inline)"] = inline
    return classes


def _with_weights_of(model: torch.nn.Module, source: torch.nn.Module) -> torch.nn.Module:
    model.load_state_dict(source.state_dict())
    return model


def _converted(layer, level: int, example: torch.Tensor, flops: float, reference: str,
               progress, compile: bool = False) -> Candidate:
    """``ttt2la.convert`` on a short example; the converted layer then runs at any length
    (``compile``: its plan under ``torch.compile``, compiled at each shape's first call)."""
    start = time.perf_counter()
    try:
        converted = ttt2la.convert(layer, level=level, example_inputs=(example,),
                                   compile=compile)
    except ConversionError as e:
        progress(f"  level {level}: refused ({type(e).__name__})")
        return Candidate(f"{type(e).__name__}: {_first_line(e)}", "refused")
    except Exception as e:  # noqa: BLE001 - not an interface error: a bug, recorded, run goes on
        progress(f"  level {level}: conversion CRASHED ({type(e).__name__}: {_first_line(e)})")
        return Candidate(f"conversion crashed with {type(e).__name__}: {_first_line(e)}",
                         "crashed")
    progress(f"  converted at level {level} in {time.perf_counter() - start:.1f} s")
    return Candidate(converted, "", flops, reference)


# -- measuring one case ---------------------------------------------------------------------------
def _callables(models: dict[str, torch.nn.Module], backward: bool) -> dict:
    """What is timed: the forward call, or forward and backward of the output's sum."""
    if not backward:
        return models

    def train_step(model):
        def run(x):
            # the input asks for its gradient, as a layer's input inside a network does: every
            # product's backward is then two products of its size (``Setup.passes``)
            x = x.detach().requires_grad_()
            model.zero_grad(set_to_none=True)
            model(x).float().sum().backward()
        return run
    return {name: train_step(m) for name, m in models.items()}


def measure_case(case: str, candidates: dict[str, Candidate], x: torch.Tensor, setup: Setup,
                 progress, float64_refs: dict | None = None,
                 alone: tuple[str, ...] = ()) -> tuple[list[Row], dict]:
    """Time every candidate side by side; check converted ones against their references.

    ``float64_refs`` maps a reference row to ``(its float64 twin, x in float64)``: then the error
    bound is the precision criterion (2× the reference's own error against float64, plus 1e-6).
    Every row named in ``alone`` gets a twin row timing its call's matrix products alone.
    Returns the rows and the timings by row name.
    """
    outputs = first_calls(candidates, x, setup, progress)
    models = {n: c.model for n, c in candidates.items() if not isinstance(c.model, str)}
    calls = _callables(models, setup.backward)
    replays = _replays({n: calls[n] for n in alone if n in calls}, x, setup)
    peak_gemms = {f"{PEAK} {n}": _square_gemm(n, setup, x.device) for n in setup.peak_sizes}
    tokens = x.shape[0] * x.shape[1]
    progress(f"  timing {len(calls) + len(replays)} rows side by side (≤{setup.rounds} rounds, "
             f"≤{setup.max_seconds:g} s)")
    timings = time_side_by_side(calls | replays | peak_gemms, (x,), tokens,
                                rounds=setup.rounds, max_seconds=setup.max_seconds,
                                warmup=setup.warmup, no_grad=not setup.backward,
                                on_round=lambda r: progress(f"    round {r}", transient=True))
    peak = max((2 * n**3 / timings.pop(f"{PEAK} {n}").median for n in setup.peak_sizes),
               default=None)
    with torch.no_grad():
        exact64 = {name: twin(x64) for name, (twin, x64) in (float64_refs or {}).items()
                   if name in outputs}
    rows = []
    for name, c in candidates.items():
        if isinstance(c.model, str):
            rows.append(Row(case, name, c.plan, not_timed=c.model))
            continue
        t = timings[name]
        plan = c.plan or ran_plans(c.model, x.shape[0])
        row = Row(case, name, plan, t.rate, t.iqr_pct, t.range_pct, t.rounds, c.flops_per_token,
                  peak=peak)
        if c.reference in outputs:
            row.reference = c.reference
            row.error = rel_rms_error(outputs[name], outputs[c.reference])
            row.bound = TOLERANCE[x.dtype]
            if c.reference in exact64:
                exact = exact64[c.reference]
                own = rel_rms_error(outputs[c.reference], exact)
                row.bound = 2 * own + 1e-6
                row.error = rel_rms_error(outputs[name], exact)
                row.reference = f"float64 {c.reference}, whose fp32 run is off by {own:.1e}"
        rows.append(row)
        if f"{name}: {ALONE}" in replays:
            replay, t = replays[f"{name}: {ALONE}"], timings[f"{name}: {ALONE}"]
            plan = (f"the {len(replay.products)} matrix products of one call, replayed alone "
                    f"({matmul_flops(replay.products) / 1e9:,.3g} GFLOP)")
            rows.append(Row(case, f"{name}: {ALONE}", plan, t.rate, t.iqr_pct, t.range_pct,
                            t.rounds, c.flops_per_token, peak=peak))
    return rows, timings


#: Prefix of the rows under which the GEMM peak's matmuls are timed in a case's rounds.
PEAK = "GEMM peak"


def _square_gemm(n: int, setup: Setup, device) -> Callable:
    """An ``n x n`` matmul of the GEMM peak's, to time in a case's rounds."""
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device).to(setup.torch_dtype) for _ in "ab")

    def gemm(*ignored):
        with torch.no_grad():
            torch.mm(a, b)
    return gemm


def _replays(calls: dict, x: torch.Tensor, setup: Setup) -> dict[str, Replay]:
    """For each call, its matrix products (``ceiling.py``) as a ``Replay`` to time beside it."""
    with torch.no_grad() if not setup.backward else torch.enable_grad():
        return {f"{name}: {ALONE}": Replay(record_matmuls(call, x))
                for name, call in calls.items()}


def first_calls(candidates: dict[str, Candidate], x: torch.Tensor, setup: Setup,
                progress) -> dict[str, torch.Tensor]:
    """Each candidate's output on ``x`` (no_grad), and its training step once with
    ``--backward``; a candidate that raises is marked failed (its row says why), not timed."""
    outputs = {}
    for name, c in candidates.items():
        if isinstance(c.model, str):
            continue
        try:
            with torch.no_grad():
                outputs[name] = c.model(x)
            if setup.backward:
                _callables({name: c.model}, True)[name](x)
        except Exception as e:  # noqa: BLE001 - recorded in the row; the other rows still run
            progress(f"  {name} FAILED at {tuple(x.shape)}: {type(e).__name__}: {_first_line(e)}")
            c.model, c.plan = f"failed with {type(e).__name__}: {_first_line(e)}", "failed"
            outputs.pop(name, None)
    return outputs


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def lact_models(setup: Setup, chunk: int, muon: bool):
    """Original, variant 1 and variant 2 as written (same weights), the hand-written variant 2,
    and float64 twins of the variants (the precision criterion's references, with Muon)."""
    cls = lact_class()
    kw = dict(muon=muon, muon_steps=setup.muon_steps)
    torch.manual_seed(0)
    original = cls(setup.d_model, setup.heads, chunk, **kw)
    v1 = _with_weights_of(cls(setup.d_model, setup.heads, chunk, update_theta=False, **kw),
                          original)
    v2 = _with_weights_of(cls(setup.d_model, setup.heads, chunk, update_theta=False,
                              weight_norm=False, **kw), original)
    dev, dt = torch.device(setup.device), setup.torch_dtype
    for m in (original, v1, v2):
        m.to(dev, dt).eval()
    hand = HandWrittenVariant2(v2).to(dev).eval()
    twins = {}
    if muon:
        for name, theta_kw in (("variant 1 as written", dict(update_theta=False)),
                               ("variant 2 as written", dict(update_theta=False,
                                                             weight_norm=False))):
            twins[name] = _float64_twin(cls, setup, chunk, kw | theta_kw, original)
    return original, v1, v2, hand, twins


def _float64_twin(cls, setup: Setup, chunk: int, kw: dict, source) -> torch.nn.Module:
    """The same layer in float64, its Newton–Schulz too where the layer takes ``ns_dtype``."""
    try:
        twin = cls(setup.d_model, setup.heads, chunk, ns_dtype=torch.float64, **kw)
    except TypeError:
        twin = cls(setup.d_model, setup.heads, chunk, **kw)
    twin.load_state_dict(source.state_dict())
    return twin.to(setup.device, torch.float64).eval()


#: Dynamo unrolls the published operator's chunk loop; compiling a loop of many more chunks than
#: this took over ten minutes per configuration on 2 cores (the chunk-64 case has 64), so such
#: cases run the "as written" rows eagerly and their plan says so.
COMPILED_CHUNKS = 16


class Eager(torch.nn.Module):
    """A layer with its ``torch.compile``d code run eagerly."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return self.layer(*args, **kwargs)


def lact_case(setup: Setup, chunk: int, length: int, muon: bool, progress):
    """The six LaCT rows of one (chunk size, length, Muon) case and its targets."""
    case = f"LaCT chunk {chunk}, L={length}, {'Muon' if muon else 'no Muon'}"
    progress(f"{case}: building and converting")
    original, v1, v2, hand, twins = lact_models(setup, chunk, muon)
    chunks = -(-length // chunk)
    written, timed = "as written", {"original": original, "v1": v1, "v2": v2}
    if chunks > COMPILED_CHUNKS:
        written = f"as written, run eagerly ({chunks} chunks, not compiled)"
        timed = {name: Eager(m) for name, m in timed.items()}
        twins = {name: Eager(m) for name, m in twins.items()}
    x = torch.randn(setup.batch, length, setup.d_model,
                    generator=torch.Generator().manual_seed(1)).to(setup.device,
                                                                   setup.torch_dtype)
    example = x[:1, : min(length, 3 * chunk)]        # two updating chunks and a last one
    steps = setup.muon_steps if muon else 0
    flops = {theta: setup.passes * lact_flops_per_token(length, chunk, setup.heads,
                                                        setup.head_dim, muon_steps=steps,
                                                        update_theta=theta)
             for theta in (True, False)}
    candidates = {"original (level 0)": Candidate(timed["original"], written, flops[True])}
    for level in setup.levels:
        candidates[f"level {level} converted"] = _converted(
            original, level, example, flops[False], f"variant {level} as written", progress)
    candidates |= {
        "variant 1 as written": Candidate(timed["v1"], written, flops[False]),
        "variant 2 as written": Candidate(timed["v2"], written, flops[False]),
        "variant 2 hand-written": Candidate(hand, "hand-written loop", flops[False],
                                            "variant 2 as written"),
    }
    if setup.compile_whole:
        candidates |= compiled_whole(candidates, chunks)
    if setup.compile_plan:
        candidates[COMPILED_PLAN] = _converted(original, 2, example, flops[False],
                                               "variant 2 as written", progress, compile=True)
    refs = {name: (twin, x.to(torch.float64)) for name, twin in twins.items()}
    rows, timings = measure_case(case, candidates, x, setup, progress, refs,
                                 alone=tuple(f"level {lv} converted" for lv in setup.levels))
    large = chunk == max(c for c, _ in setup.lact)      # the large-chunk case
    targets = _level_2_targets(case, "level 2 converted", "level 2", large, muon)
    targets.append(Target(case, "level 1 ≥ 1.0× variant 1 as written", "level 1 converted",
                          1.0, "variant 1 as written"))
    targets += _level_2_targets(case, COMPILED_PLAN, "level 2 with compile=True", large, muon)
    if all(not isinstance(candidates.get(n, Candidate("", "")).model, str)
           for n in (COMPILED_ORIGINAL, COMPILED_LEVEL_2)):
        targets.append(Target(case, "level 2 compiled ≥ 1.0× the original compiled, both whole",
                              COMPILED_LEVEL_2, 1.0, COMPILED_ORIGINAL))
    targets = [t for t in targets if t.row in candidates]
    models = {n: c.model for n, c in candidates.items() if not isinstance(c.model, str)}
    return rows, evaluate(targets, rows, timings, setup), models, x


def _level_2_targets(case: str, row: str, label: str, large: bool, muon: bool) -> list[Target]:
    """The issue's targets for a level-2 row (``label`` names it): against variant 2 as written
    and hand-written, and in the large-chunk case against the original (with Muon) and the GEMM
    peak."""
    targets = [Target(case, f"{label} ≥ 1.0× variant 2 as written", row, 1.0,
                      "variant 2 as written"),
               Target(case, f"{label} ≥ 1.0× variant 2 hand-written", row, 1.0,
                      "variant 2 hand-written")]
    if large and muon:
        targets.append(Target(case, f"{label} ≥ 1.8× the original", row, 1.8,
                              "original (level 0)"))
    if large:
        targets.append(Target(case, f"{label} useful FLOP/s ≥ 70% of the GEMM peak", row, 70.0))
    return targets


#: The row ``--compile-plan`` adds to a LaCT case: the level-2 conversion made with compile=True.
COMPILED_PLAN = "level 2 converted, compile=True"

#: The rows ``--compile-whole`` adds: the original and the level-2 conversion compiled whole.
COMPILED_ORIGINAL = "original, compiled whole"
COMPILED_LEVEL_2 = "level 2 converted, compiled whole"


def compiled_whole(candidates: dict[str, Candidate], chunks: int) -> dict[str, Candidate]:
    """The original and the level-2 conversion under ``torch.compile`` of the whole layer (the
    first call, untimed, compiles them); not built for cases of more than ``COMPILED_CHUNKS``
    chunks, whose unrolled loop takes many minutes to compile."""
    original, level2 = candidates["original (level 0)"], candidates.get("level 2 converted")
    if chunks > COMPILED_CHUNKS:
        why = f"not built: {chunks} chunks, over {COMPILED_CHUNKS}, take minutes to compile"
        return {COMPILED_ORIGINAL: Candidate(why, "skipped"),
                COMPILED_LEVEL_2: Candidate(why, "skipped")}
    out = {COMPILED_ORIGINAL: Candidate(torch.compile(original.model),
                                        "torch.compile(layer as written)",
                                        original.flops_per_token)}
    if level2 is not None and not isinstance(level2.model, str):
        out[COMPILED_LEVEL_2] = Candidate(torch.compile(level2.model),
                                          "torch.compile(level-2 converted layer)",
                                          level2.flops_per_token, level2.reference)
    return out


def per_token_case(setup: Setup, length: int, target: float, progress):
    """Each per-token layer as written (a loop over tokens) against its conversion."""
    case = f"per-token, L={length}"
    progress(f"{case}: building and converting")
    dev, dt = torch.device(setup.device), setup.torch_dtype
    x = torch.randn(setup.batch, length, setup.d_model,
                    generator=torch.Generator().manual_seed(1)).to(dev, dt)
    flops = setup.passes * per_token_flops_per_token(setup.d_model, setup.heads)
    candidates, targets = {}, []
    for name, cls in per_token_classes().items():
        torch.manual_seed(0)
        layer = cls(setup.d_model, setup.heads).to(dev, dt).eval()
        candidates[f"{name} as written"] = Candidate(layer, "as written", flops)
        candidates[f"{name} converted"] = _converted(layer, 0, x[:1, :16], flops,
                                                     f"{name} as written", progress)
        targets.append(Target(case, f"{name}: converted ≥ {target:g}× as written",
                              f"{name} converted", target, f"{name} as written"))
        if setup.compile_plan:
            row = f"{name} converted, compile=True"
            candidates[row] = _converted(layer, 0, x[:1, :16], flops, f"{name} as written",
                                         progress, compile=True)
            targets.append(Target(case, f"{name}: converted with compile=True ≥ {target:g}× as "
                                  "written", row, target, f"{name} as written"))
    rows, timings = measure_case(case, candidates, x, setup, progress,
                                 alone=tuple(n for n in candidates if n.endswith("converted")))
    models = {n: c.model for n, c in candidates.items() if not isinstance(c.model, str)}
    return rows, evaluate(targets, rows, timings, setup), models, x


def evaluate(targets: list[Target], rows: list[Row], timings: dict[str, Timing],
             setup: Setup) -> list[Target]:
    """Fill in each target's measured value (median of per-round ratios, or % of peak)."""
    by_name = {r.model: r for r in rows}
    for t in targets:
        if t.row not in timings:
            t.spread = "not measured: " + (by_name[t.row].not_timed if t.row in by_name else "")
            continue
        if t.baseline is None:
            row = by_name[t.row]
            t.measured = row.flops_per_s / _peak(row, setup) * 100 if row.flops_per_s else None
            t.spread = f"IQR {row.iqr_pct:.0f}% of the rate"
        elif t.baseline in timings:
            ratio = timings[t.row].speedup_over(timings[t.baseline])
            t.measured, t.spread = ratio.median, f"IQR {ratio.iqr_pct:.0f}%"
        _ceiling(t, by_name, timings, setup)
    return targets


def _ceiling(t: Target, by_name: dict[str, Row], timings: dict[str, Timing],
             setup: Setup) -> None:
    """How far ``t`` could go: with the row's matrix products alone, and (a speed-up) with its
    useful FLOPs at the GEMM peak (``ceiling.py``)."""
    alone, row = f"{t.row}: {ALONE}", by_name[t.row]
    parts = []
    if t.baseline is None:
        if alone in by_name and by_name[alone].flops_per_s:
            parts.append(f"≤ {by_name[alone].flops_per_s / _peak(row, setup) * 100:.0f}% with "
                         f"{ALONE}")
    elif t.baseline in timings:
        if alone in timings:
            parts.append(f"≤ {timings[alone].speedup_over(timings[t.baseline]).median:.2f}× "
                         f"with {ALONE}")
        if row.flops_per_token:
            at_peak = row.flops_per_token * timings[t.row].units / _peak(row, setup)
            bound = timings[t.baseline].median / at_peak
            t.beyond_peak = bound < t.threshold
            parts.append(f"≤ {bound:.2f}× with its useful FLOPs at the GEMM peak")
    t.ceiling = "; ".join(parts)


# -- profiles of missed targets -------------------------------------------------------------------
def profile_misses(targets: list[Target], models: dict, x: torch.Tensor, setup: Setup,
                   results: Path, progress) -> None:
    """For every missed target, a torch.profiler summary of its converted layer (top ops by
    self CPU time) written to the results directory; each layer is profiled once."""
    from torch.profiler import ProfilerActivity, profile

    done: dict[str, str] = {}
    for t in targets:
        if t.met is not False or t.row not in models:
            continue
        if t.row not in done:
            model = _callables({t.row: models[t.row]}, setup.backward)[t.row]
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if x.is_cuda else [])
            with torch.no_grad() if not setup.backward else torch.enable_grad():
                model(x)
                with profile(activities=activities) as prof:
                    model(x)
            name = f"profile-{_slug(t.case)}-{_slug(t.row)}.txt"
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            plan = ran_plans(models[t.row], x.shape[0])
            (results / name).write_text(f"{t.case}: {t.row} ({plan}), "
                                        f"one call, x {tuple(x.shape)}\n\n{table}\n")
            done[t.row] = name
            progress(f"  profile written: {name}")
        t.profile = done[t.row]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


# -- output -------------------------------------------------------------------------------------
def _fmt_rate(r: float | None) -> str:
    return "" if r is None else f"{r / 1e6:,.2f}M" if r >= 1e5 else f"{r:,.0f}"


def _fmt_error(row: Row) -> str:
    if row.error is None:
        return ""
    verdict = "ok" if row.error <= row.bound else "ABOVE BOUND"
    return f"{row.error:.1e} {verdict} (bound {row.bound:.1e}; vs {row.reference})"


def _peak(row: Row, setup: Setup) -> float:
    """The GEMM peak a row is measured against: its case's, else the run's."""
    return row.peak or setup.peak


def _cells(row: Row, setup: Setup) -> list[str]:
    if row.not_timed:
        return [row.case, row.model, row.plan, "", "", "", "", row.not_timed]
    gflops = row.flops_per_s / 1e9 if row.flops_per_s else None
    return [row.case, row.model, row.plan, _fmt_rate(row.tokens_per_s),
            f"{row.iqr_pct:.0f}% / {row.range_pct:.0f}% (n={row.rounds})",
            "" if gflops is None else f"{gflops:,.3g}",
            "" if gflops is None else f"{gflops * 1e9 / _peak(row, setup) * 100:.2g}%",
            _fmt_error(row)]


HEADERS = ["case", "row", "plan that ran", "tokens/s (median)", "spread: IQR / range",
           "useful GFLOP/s", "% of GEMM peak", "rel. RMS error vs same function unconverted"]


def _case_peaks(rows: list[Row]) -> str:
    peaks = {}
    for r in rows:
        if r.peak:
            peaks.setdefault(r.case, r.peak)
    return ", ".join(f"{p / 1e9:,.1f}" for p in peaks.values()) + " GFLOP/s" if peaks \
        else "no case yet"


def _half_gemms_forced(choice: str):
    """The ``--half-gemms`` choice as a context: nothing for ``auto``, else the runtime's switch."""
    return contextlib.nullcontext() if choice == "auto" else half_gemms(choice == "native")


def _half_gemms_said(choice: str) -> str:
    with _half_gemms_forced(choice):
        native = half_gemms_native(torch.bfloat16, torch.device("cpu"))
    return ("native" if native else "fp32 GEMMs of half operands") + \
        (" (this CPU's default)" if choice == "auto" else f" (forced: --half-gemms {choice})")


def header_lines(setup: Setup, rows: list[Row] = ()) -> list[str]:
    """What was measured where: sizes, device, dtype, timing, peak, versions."""
    device = torch.cuda.get_device_name(setup.device) if setup.device.startswith("cuda") \
        else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
             f"{torch.get_num_threads()} torch threads"
    lact = ", ".join(f"chunk {c} at L={n}" for c, n in setup.lact)
    return [f"sizes `{setup.size}`: B={setup.batch}, {setup.heads} heads × {setup.head_dim}, "
            f"LaCT layer `{lact_class().__name__}` at {lact}; per-token layers "
            f"{', '.join(f'`{c.__name__}`' for c in per_token_classes().values())} at L="
            f"{', '.join(map(str, setup.per_token_lengths))}; {setup.dtype}; "
            + ("forward + backward (useful FLOPs: 3× the forward count)" if setup.backward
               else "forward only, under no_grad"),
            f"timing: rows of a case interleaved, order rotated each round, {setup.warmup} "
            f"warm-up rounds, then up to {setup.rounds} rounds or {setup.max_seconds:g} s "
            f"(at least {min(3, setup.rounds)}); spread = IQR and min–max range of per-round "
            f"times, % of the median; ratios are medians of per-round ratios",
            f"device: {device}; {setup.dtype} GEMM peak {setup.peak / 1e9:,.1f} GFLOP/s at the "
            f"start of the run (best of {', '.join(f'{n}²' for n in setup.peak_sizes)} matmuls;"
            f" each case re-times them in its rounds: "
            f"{_case_peaks(rows)}); allocator: {setup.allocator}; half GEMMs on CPU: "
            f"{_half_gemms_said(setup.half_gemms)}",
            f"torch {torch.__version__}, ttt2la {ttt2la.__version__}, "
            f"{datetime.datetime.now().isoformat(timespec='minutes')}"]


def to_markdown(rows: list[Row], targets: list[Target], setup: Setup, done: bool) -> str:
    """Rows and target verdicts as Markdown, preceded by what was measured where."""
    lines = ["# TTT-layer throughput", ""] + [f"- {line}" for line in header_lines(setup, rows)]
    if not done:
        lines += ["- **partial: the run has not finished (or was stopped)**"]
    lines += ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r, setup)) + " |"
              for r in rows]
    lines += ["", "| case | target | measured | spread | verdict | ceiling | profile |",
              "|---|---|---|---|---|---|---|"]
    for t in targets:
        unit = "%" if t.baseline is None else "×"
        measured = "" if t.measured is None else f"{_fmt_measured(t)}{unit}"
        lines.append(f"| {t.case} | {t.what} | {measured} | {t.spread} | {_verdict(t)} | "
                     f"{t.ceiling} | {t.profile} |")
    return "\n".join(lines) + "\n"


def _fmt_measured(t: Target) -> str:
    """Two decimals, or three where two would round a miss up to the threshold (0.998×)."""
    text = f"{t.measured:.2f}"
    return f"{t.measured:.3f}" if t.measured < t.threshold <= float(text) else text


def _verdict(t: Target) -> str:
    if t.met is False and t.beyond_peak:
        return "**missed**: beyond the GEMM peak"
    return {True: "met", False: "**missed**", None: "not measured"}[t.met]


# -- command line ---------------------------------------------------------------------------------
def parse_setup(argv=None) -> tuple[Setup, argparse.Namespace]:
    """Read the run's sizes from the command line: a preset, then individual overrides."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="issue",
                   help="issue: the issue's CPU sizes (about 15 min on 2 cores); quick: small "
                        "sizes (a few minutes); smoke: tiny, for tests")
    p.add_argument("--quick", dest="size", action="store_const", const="quick",
                   help="the same as --size quick")
    p.add_argument("--markdown", metavar="PATH",
                   help="also copy the final Markdown tables to PATH")
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--lact", type=_chunk_length, nargs="*", metavar="CHUNKxLENGTH",
                   help="LaCT cases, e.g. 2048x16384 64x4096 (none: the per-token layers only)")
    p.add_argument("--per-token-lengths", type=int, nargs="*")
    p.add_argument("--rounds", type=int, help="at most this many timed rounds per case")
    p.add_argument("--max-seconds", type=float, help="timing budget per case (≥ 3 rounds)")
    p.add_argument("--muon", choices=("both", "on", "off"), default="both")
    p.add_argument("--levels", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                   help="conversion levels of the LaCT cases (1 2)")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--profile", action="store_true",
                   help="write a torch.profiler summary of each converted layer that misses a "
                        "target into the results directory")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: one per core)")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="make glibc keep freed memory instead of mapping every large tensor "
                        "afresh (allocator.py); applies to every row")
    p.add_argument("--half-gemms", choices=("auto", "native", "fp32"), default="auto",
                   help="bf16 Newton-Schulz products on CPU: as this CPU's units decide (auto), "
                        "native bf16 GEMMs, or fp32 GEMMs of the bf16 operands; every row")
    p.add_argument("--compile-whole", action="store_true",
                   help="also time the original and the level-2 conversion each under "
                        "torch.compile of the whole layer (LaCT cases of at most "
                        f"{COMPILED_CHUNKS} chunks; compiling takes a minute or so per layer)")
    p.add_argument("--compile-plan", action="store_true",
                   help="also time each case's level-2 (per-token: level-0) conversion made with "
                        "convert(..., compile=True): its plan under torch.compile")
    p.add_argument("--results", metavar="DIR",
                   help="results directory (default benchmarks/results/throughput-<size>-<time>)")
    args = p.parse_args(argv)
    setup = Setup(device=args.device, dtype=args.dtype, backward=args.backward, size=args.size,
                  levels=tuple(args.levels), compile_whole=args.compile_whole,
                  compile_plan=args.compile_plan)
    for key, value in SIZES[args.size].items():
        setattr(setup, key, value)
    for name in ("batch", "heads", "head_dim", "rounds", "max_seconds"):
        if getattr(args, name) is not None:
            setattr(setup, name, getattr(args, name))
    if args.lact is not None:
        setup.lact = tuple(args.lact)
    if args.per_token_lengths is not None:
        lengths = tuple(args.per_token_lengths)
        targets = setup.per_token_targets
        setup.per_token_targets = tuple(targets[min(i, len(targets) - 1)]
                                        for i in range(len(lengths)))
        setup.per_token_lengths = lengths
    return setup, args


def _chunk_length(text: str) -> tuple[int, int]:
    chunk, _, length = text.partition("x")
    try:
        return int(chunk), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CHUNKxLENGTH such as 64x4096, got {text}")


class Results:
    """The results directory, written as the run goes: JSON lines per row, Markdown per case."""

    def __init__(self, path: Path, setup: Setup):
        self.path, self.setup = path, setup
        path.mkdir(parents=True, exist_ok=True)
        self.rows: list[Row] = []
        self.targets: list[Target] = []
        (path / "rows.jsonl").write_text(json.dumps({"setup": dataclasses.asdict(setup)}) + "\n")

    def add(self, rows: list[Row], targets: list[Target]) -> None:
        self.rows += rows
        self.targets += targets
        with open(self.path / "rows.jsonl", "a") as f:
            for item in [*rows, *targets]:
                record = dataclasses.asdict(item) | {"kind": type(item).__name__}
                f.write(json.dumps(record) + "\n")
        self.write_markdown(done=False)

    def write_markdown(self, done: bool) -> None:
        (self.path / "throughput.md").write_text(
            to_markdown(self.rows, self.targets, self.setup, done))


def run(setup: Setup, results: Path, muons: tuple[bool, ...], profile: bool,
        say=print) -> Results:
    """Measure every case of ``setup``, writing each case's rows to ``results`` when it ends."""
    t0 = time.perf_counter()

    def progress(text: str, transient: bool = False) -> None:
        if not transient:
            say(f"[{time.perf_counter() - t0:6.0f}s] {text}")

    out = Results(results, setup)
    progress(f"results directory: {results}")
    peak_sizes = {"issue": (256, 512, 1024, 2048), "smoke": (64, 128)}.get(setup.size,
                                                                           (256, 512, 1024))
    gemm = measure_gemm_peak(peak_sizes, dtype=setup.torch_dtype, device=setup.device,
                             max_seconds=min(10.0, max(setup.max_seconds, 1.0)))
    setup.peak, setup.peak_sizes = gemm.peak, tuple(peak_sizes)
    progress(f"{setup.dtype} GEMM peak: {setup.peak / 1e9:,.1f} GFLOP/s")
    cases = [("lact", chunk, length, muon) for chunk, length in setup.lact for muon in muons]
    cases += [("per-token", None, length, target)
              for length, target in zip(setup.per_token_lengths, setup.per_token_targets)]
    for kind, chunk, length, extra in cases:
        if kind == "lact":
            rows, targets, models, x = lact_case(setup, chunk, length, extra, progress)
        else:
            rows, targets, models, x = per_token_case(setup, length, extra, progress)
        if profile:
            profile_misses(targets, models, x, setup, results, progress)
        out.add(rows, targets)
        for t in targets:
            verdict = _verdict(t).replace("**missed**", "MISSED")
            progress(f"  {t.what}: {'' if t.measured is None else _fmt_measured(t)} "
                     f"({t.spread}) {verdict}" + (f"; ceiling {t.ceiling}" if t.ceiling else ""))
    out.write_markdown(done=True)
    progress(f"done: {results / 'throughput.md'}")
    return out


#: Every case builds the published operator with other switches (update_theta, weight_norm,
#: use_muon, chunk size); each is one more compiled specialisation. Dynamo's default limit (8)
#: is reached within the run and the rest would silently time *eager* code as "as written",
#: which a user with one configuration never runs; the limit is raised so they stay compiled.
RECOMPILE_LIMIT = 256


def main(argv=None) -> int:
    setup, args = parse_setup(argv)
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.accumulated_recompile_limit = max(
        RECOMPILE_LIMIT, torch._dynamo.config.accumulated_recompile_limit)
    if args.keep_freed_memory:
        setup.allocator = keep_freed_memory()
    setup.half_gemms = args.half_gemms
    if args.threads:
        torch.set_num_threads(args.threads)
    elif setup.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    results = Path(args.results or Path(__file__).parent / "results" /
                   f"throughput-{setup.size}-{stamp}")
    muons = {"both": (True, False), "on": (True,), "off": (False,)}[args.muon]
    with _half_gemms_forced(args.half_gemms):
        out = run(setup, results, muons, args.profile, say=lambda s: print(s, flush=True))
    table = to_markdown(out.rows, out.targets, setup, done=True)
    print(table)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
