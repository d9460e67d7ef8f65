"""TTT-layer throughput, side by side: LaCT as written against its conversions, and a per-token layer.

For every (chunk size, Muon on/off) case, four LaCT layers with the same weights run on the same
input ``[B, L, H·D]``, one call of each per round, medians of several rounds:

* ``original (level 0)``    — the LaCT layer as published (Θ updated, weight norm), unconverted:
  its Python loop over chunks is the recurrent form;
* ``level 1 converted``     — ``ttt2la.convert(layer, level=1)``: Θ frozen, weight norm kept
  (semi-parallel schedule);
* ``level 2 converted``     — ``ttt2la.convert(layer, level=2)``: Θ frozen, no weight norm
  (parallel schedule);
* ``variant 2 as written``  — the layer built with ``update_theta=False, weight_norm=False``, run by
  its own loop: the recurrent form of the level-2 function (the paper's "tok/s recurrent").

Then the per-token layer (``ttt2la.zoo.PerTokenTTTLayer``) against its conversion. Each converted
row also reports its relative RMS error against the unconverted layer that computes the same
function (variant 1 / variant 2 as written, or the per-token layer itself).

Useful FLOPs are counted analytically (matmuls only; elementwise work is not counted):

LaCT, per batch element and head, with head dim ``d``, fast-weight hidden dim ``i``, ``N`` chunks
of ``C`` tokens and ``U = L - len(last chunk)`` tokens that update (the last chunk only applies)::

    kernel φ(x) = silu(x W0) ⊙ (x W2) on the queries (L) and keys (U):  4·d·i·(L + U)
    increments φ(K_j)ᵀ (η ⊙ V_j) for the updating chunks:               2·d·i·U
    outputs φ(Q_j) W1_j:                                                2·d·i·L
    Muon on each of the N-1 increments, s Newton–Schulz steps,
      m = min(d, i), n = max(d, i):                                     (N-1)·s·(4·m²·n + 2·m³)
    with Θ updated (level 0 only): W1ᵀ V_j and the two Θ increments:    6·d·i·U,
      and Muon on the two Θ increments:                                 2·(N-1)·s·(4·m²·n + 2·m³)

Per-token layer, per batch element, head and token: the update ``η kᵀ v`` and the read ``q W``:
``4·d²``. Projections, per batch element and token, with ``D_m = H·d``: LaCT ``2·D_m·(4·D_m + 4·H)``
(qkv, output, learning rates, momentum), per-token layer ``2·D_m·(4·D_m + H)``. A layer's useful
FLOPs are the core plus its projections, since the timed call runs both; "% of peak" divides
useful FLOP/s by this machine's measured GEMM peak in the same dtype (``gemm_peak.py``).

Run ``python benchmarks/throughput.py`` (full sizes: B=4, head dim 128, L=16384, chunks 2048 and
64, per-token L=4096 — meant for a GPU), or ``--quick`` for a small CPU run; ``--markdown PATH``
writes the table as Markdown.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import ttt2la
from ttt2la.cli import measure_throughput
from ttt2la.errors import ConversionError
from ttt2la.testing import TOLERANCE, rel_rms_error
from ttt2la.zoo import LaCTFoldedLayer, PerTokenTTTLayer

from gemm_peak import measure_gemm_peak


@dataclass
class Setup:
    """Sizes and placement of one benchmark run."""

    batch: int = 4
    heads: int = 4
    head_dim: int = 128
    length: int = 16384
    chunks: tuple[int, ...] = (2048, 64)
    per_token_length: int = 4096
    muon_steps: int = 5
    repeats: int = 5
    dtype: str = "bfloat16"
    device: str = "cuda"
    peak: float = math.nan       # measured GEMM FLOP/s, filled in before the cases run

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Row:
    """One measured layer of one case."""

    case: str
    model: str
    schedule: str
    tokens_per_s: float | None = None
    useful_flops: float | None = None
    peak: float | None = None
    error: float | None = None          # rel. RMS vs the unconverted layer of the same function
    tolerance: float | None = None
    refused: str = ""
    speedups: dict[str, float] = field(default_factory=dict)

    @property
    def flops_per_s(self) -> float | None:
        if self.tokens_per_s is None or self.useful_flops is None:
            return None
        return self.useful_flops * self.tokens_per_s


# -- analytic FLOP counts (see the module docstring) ------------------------------------------------
def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of ``steps`` quintic Newton–Schulz steps on one ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


def lact_core_flops(length: int, chunk: int, head_dim: int, inter_dim: int, *, muon_steps: int,
                    update_theta: bool) -> int:
    """Useful matmul FLOPs of LaCT's TTT core for one sequence and one head."""
    d, i = head_dim, inter_dim
    n_chunks = math.ceil(length / chunk)
    updating = (n_chunks - 1) * chunk               # tokens of every chunk but the last
    flops = 4 * d * i * (length + updating) + 2 * d * i * updating + 2 * d * i * length
    muon = (n_chunks - 1) * newton_schulz_flops(d, i, muon_steps)
    flops += muon
    if update_theta:
        flops += 6 * d * i * updating + 2 * muon
    return flops


def lact_projection_flops(length: int, d_model: int, heads: int) -> int:
    """qkv, output, learning-rate and momentum projections of a LaCT layer, one sequence."""
    return 2 * length * d_model * (4 * d_model + 4 * heads)


def per_token_flops(length: int, d_model: int, heads: int) -> int:
    """Useful FLOPs of the per-token layer, one sequence: core ``4·d²`` per head-token plus projections."""
    d = d_model // heads
    return length * heads * 4 * d * d + 2 * length * d_model * (4 * d_model + heads)


# -- one case -----------------------------------------------------------------------------------
@dataclass
class Candidate:
    """A layer to time: the module (or why it could not be built), its schedule, useful FLOPs per
    token and the name of the unconverted layer computing the same function (None for those)."""

    model: torch.nn.Module | str
    schedule: str
    flops_per_token: float | None = None
    reference: str | None = None


def _with_weights_of(model: torch.nn.Module, source: torch.nn.Module) -> torch.nn.Module:
    model.load_state_dict(source.state_dict())
    return model


def _converted(layer, level: int, example: torch.Tensor, flops: float, reference: str) -> Candidate:
    """``ttt2la.convert`` on a short example: the converted layer must then work at any length."""
    try:
        converted = ttt2la.convert(layer, level=level, example_inputs=(example,))
    except ConversionError as e:
        return Candidate(f"{type(e).__name__}: {e}", "refused")
    schedules = ", ".join(sorted({layer.schedule for layer in converted.ttt2la_report.layers}))
    return Candidate(converted, schedules, flops, reference)


def measure_case(case: str, candidates: dict[str, Candidate], x: torch.Tensor, setup: Setup,
                 progress: Progress, references: dict[str, torch.nn.Module] | None = None,
                 baselines: tuple[str, ...] = ()) -> list[Row]:
    """Time every candidate side by side, check converted ones against their references, and
    express each rate as a speed-up over the ``baselines`` rows. ``references`` are extra
    unconverted layers whose outputs are compared against but whose speed is not measured."""
    timed = {name: c.model for name, c in candidates.items() if not isinstance(c.model, str)}
    rates = measure_throughput(timed, (x,), x.shape[0] * x.shape[1], repeats=setup.repeats,
                               progress=progress)
    with torch.no_grad():
        outputs = {name: model(x) for name, model in {**timed, **(references or {})}.items()}
    rows = []
    for name, c in candidates.items():
        if isinstance(c.model, str):
            rows.append(Row(case, name, c.schedule, refused=c.model))
            continue
        row = Row(case, name, c.schedule, rates[name], c.flops_per_token, setup.peak)
        if c.reference is not None:
            row.error = rel_rms_error(outputs[name], outputs[c.reference])
            row.tolerance = TOLERANCE[x.dtype]
        row.speedups = {b: rates[name] / rates[b] for b in baselines if b in rates and b != name}
        rows.append(row)
    return rows


def lact_case(setup: Setup, chunk: int, muon: bool, progress: Progress) -> list[Row]:
    """The four LaCT layers of one (chunk size, Muon) case, all with the original's weights."""
    torch.manual_seed(0)
    kw = dict(muon=muon, muon_steps=setup.muon_steps)
    dev, dt = torch.device(setup.device), setup.torch_dtype
    original = LaCTFoldedLayer(setup.d_model, setup.heads, chunk, **kw)
    variant1 = _with_weights_of(LaCTFoldedLayer(setup.d_model, setup.heads, chunk,
                                                update_theta=False, **kw), original)
    variant2 = _with_weights_of(LaCTFoldedLayer(setup.d_model, setup.heads, chunk,
                                                update_theta=False, weight_norm=False, **kw),
                                original)
    for m in (original, variant1, variant2):
        m.to(dev, dt).eval()
    x = torch.randn(setup.batch, setup.length, setup.d_model,
                    generator=torch.Generator().manual_seed(1)).to(dev, dt)
    example = x[:1, : min(setup.length, 4 * chunk)]

    steps = setup.muon_steps if muon else 0
    flops = {theta: (setup.heads * lact_core_flops(setup.length, chunk, setup.head_dim,
                                                    setup.head_dim, muon_steps=steps,
                                                    update_theta=theta)
                     + lact_projection_flops(setup.length, setup.d_model, setup.heads))
                    / setup.length
             for theta in (True, False)}
    candidates = {
        "original (level 0)": Candidate(original, "as written (recurrent)", flops[True]),
        "level 1 converted": _converted(original, 1, example, flops[False], "variant 1 as written"),
        "level 2 converted": _converted(original, 2, example, flops[False], "variant 2 as written"),
        "variant 2 as written": Candidate(variant2, "as written (recurrent)", flops[False]),
    }
    return measure_case(f"LaCT, chunk {chunk}, {'Muon' if muon else 'no Muon'}", candidates, x,
                        setup, progress, references={"variant 1 as written": variant1},
                        baselines=("original (level 0)", "variant 2 as written"))


def per_token_case(setup: Setup, progress: Progress) -> list[Row]:
    """The per-token layer as written (a loop over tokens) against its conversion."""
    torch.manual_seed(0)
    dev, dt = torch.device(setup.device), setup.torch_dtype
    layer = PerTokenTTTLayer(setup.d_model, setup.heads).to(dev, dt).eval()
    x = torch.randn(setup.batch, setup.per_token_length, setup.d_model,
                    generator=torch.Generator().manual_seed(1)).to(dev, dt)
    flops = per_token_flops(setup.per_token_length, setup.d_model, setup.heads) \
        / setup.per_token_length
    candidates = {
        "per-token as written": Candidate(layer, "as written (recurrent)", flops),
        "converted (level 0)": _converted(layer, 0, x[:1, :16], flops, "per-token as written"),
    }
    return measure_case(f"per-token, L={setup.per_token_length}", candidates, x, setup, progress,
                        baselines=("per-token as written",))


def gemm_peak(setup: Setup) -> float:
    """This machine's GEMM peak (FLOP/s) in the setup's device and dtype."""
    sizes = (1024, 2048, 4096, 8192) if setup.device.startswith("cuda") else (256, 512, 1024)
    return measure_gemm_peak(sizes, dtype=setup.torch_dtype, device=setup.device).peak


# -- output -------------------------------------------------------------------------------------
def _fmt_rate(r: float | None) -> str:
    return "" if r is None else f"{r / 1e6:,.2f}M" if r >= 1e5 else f"{r:,.0f}"


def _fmt_speedups(row: Row) -> str:
    short = {"original (level 0)": "orig", "variant 2 as written": "v2 rec",
             "per-token as written": "as written"}
    return ", ".join(f"{v:.2f}x vs {short[k]}" for k, v in row.speedups.items())


def _fmt_error(row: Row) -> str:
    if row.error is None:
        return ""
    verdict = "ok" if row.error <= row.tolerance else "ABOVE TOLERANCE"
    return f"{row.error:.1e} ({verdict})"


def _cells(row: Row) -> list[str]:
    if row.refused:
        return [row.case, row.model, row.schedule, "", "", "", "", row.refused]
    pct = row.flops_per_s / row.peak * 100 if row.flops_per_s and row.peak else None
    return [row.case, row.model, row.schedule, _fmt_rate(row.tokens_per_s), _fmt_speedups(row),
            "" if row.flops_per_s is None else f"{row.flops_per_s / 1e9:,.3g}",
            "" if pct is None else f"{pct:.2g}%", _fmt_error(row)]


HEADERS = ["case", "layer", "schedule", "tokens/s", "speed-up", "useful GFLOP/s", "% of peak",
           "rel. RMS vs same function as written"]


def header_lines(setup: Setup) -> list[str]:
    """What was measured where: sizes, device, dtype, peak, versions."""
    device = torch.cuda.get_device_name(setup.device) if setup.device.startswith("cuda") \
        else f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return [f"B={setup.batch}, H={setup.heads}, head dim {setup.head_dim}, L={setup.length} "
            f"(per-token L={setup.per_token_length}), {setup.dtype}, median of {setup.repeats} "
            f"runs side by side",
            f"device: {device}; {setup.dtype} GEMM peak {setup.peak / 1e12:.3g} TFLOP/s",
            f"torch {torch.__version__}, ttt2la {ttt2la.__version__}, "
            f"{datetime.date.today().isoformat()}"]


def to_markdown(rows: list[Row], setup: Setup) -> str:
    """The results as a Markdown table preceded by what was measured where."""
    lines = ["# TTT-layer throughput", ""] + [f"- {line}" for line in header_lines(setup)] + [""]
    lines += ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(row)) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"


def to_table(rows: list[Row], setup: Setup) -> Table:
    """The results as a rich table."""
    table = Table(*HEADERS, title="TTT-layer throughput", caption="\n".join(header_lines(setup)))
    for row in rows:
        table.add_row(*_cells(row))
    return table


# -- command line ---------------------------------------------------------------------------------
def parse_setup(argv=None) -> tuple[Setup, argparse.Namespace]:
    """Read the run's sizes from the command line (``--quick`` shrinks every default)."""
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small sizes for a CPU run: B=1, H=2, head dim 32, L=1024, chunks 256 "
                        "and 32, per-token L=256, 3 repeats")
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--length", type=int)
    p.add_argument("--chunks", type=int, nargs="+")
    p.add_argument("--per-token-length", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--muon", choices=("both", "on", "off"), default="both")
    p.add_argument("--skip-per-token", action="store_true")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--markdown", metavar="PATH", help="also write the results as Markdown")
    p.add_argument("--json", metavar="PATH", help="also write the raw rows as JSON")
    args = p.parse_args(argv)
    setup = Setup(device=args.device, dtype=args.dtype or ("bfloat16" if args.device.startswith(
        "cuda") else "float32"))
    if args.quick:
        setup.batch, setup.heads, setup.head_dim, setup.length = 1, 2, 32, 1024
        setup.chunks, setup.per_token_length, setup.repeats = (256, 32), 256, 3
    for name in ("batch", "heads", "head_dim", "length", "per_token_length", "repeats"):
        if getattr(args, name) is not None:
            setattr(setup, name, getattr(args, name))
    if args.chunks:
        setup.chunks = tuple(args.chunks)
    return setup, args


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)


def main(argv=None) -> int:
    setup, args = parse_setup(argv)
    console, err = Console(width=None if sys.stdout.isatty() else 200), Console(stderr=True)
    muons = {"both": (True, False), "on": (True,), "off": (False,)}[args.muon]
    rows: list[Row] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, transient=True) as progress:
        cases = progress.add_task("cases", total=len(setup.chunks) * len(muons)
                                  + (not args.skip_per_token))
        progress.update(cases, description="measuring the GEMM peak")
        setup.peak = gemm_peak(setup)
        for chunk in setup.chunks:
            for muon in muons:
                progress.update(cases, description=f"LaCT chunk {chunk}, muon={muon}")
                rows += lact_case(setup, chunk, muon, progress)
                progress.advance(cases)
        if not args.skip_per_token:
            progress.update(cases, description="per-token layer")
            rows += per_token_case(setup, progress)
            progress.advance(cases)
    console.print(to_table(rows, setup))
    if args.markdown:
        _write(args.markdown, to_markdown(rows, setup))
    if args.json:
        _write(args.json, json.dumps({"setup": asdict(setup), "rows": [asdict(r) for r in rows]},
                                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
