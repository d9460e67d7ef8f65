"""``ttt2la.sweep``: the paper's Table 2 for the user's own model — every level, side by side.

Converts the model at every level (the layers are traced once; each level only reruns the
passes and the lowering), and tabulates per level: exact or not, the drift of the converted TTT
layers on the calibration data (with and without folds) and, for a language model, the change in
cross-entropy, the schedule and runtime op, what was folded, and the tokens/s of the converted
TTT layers, all timed interleaved in one run. Renders as rich, Markdown or JSON, and plots drift
and throughput against level (PNG, matplotlib).
"""
from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .as_found import as_found
from .as_written import CALLS_TO_DECIDE
from .errors import ConversionError, LevelNotImplementedError
from .passes import MAX_LEVEL, check_level
from .timing import time_side_by_side
from .training_mode import evaluating
from .validation import InvalidInputError, check_backend, check_call, check_finite_weights

SWEEP_VERSION = 1


@dataclass
class SweepRow:
    """One level of the sweep (``level`` None: the original model)."""

    level: int | None
    exact: bool
    drift: float | None                    # worst layer's relative RMS output error
    unfolded_drift: float | None           # the same without the lossy passes' folds
    loss_change: float | None              # nats, for a language model
    schedule: str
    runtime: str
    folded: list[str] = field(default_factory=list)
    tokens_per_s: float | None = None
    spread: str = ""
    error: str = ""                         # why the level could not be converted

    @property
    def label(self) -> str:
        return "original" if self.level is None else f"level {self.level}"


@dataclass
class SweepReport:
    """The sweep's table: one row for the original model, one per level."""

    rows: list[SweepRow]
    inputs: str                             # what drift and loss were measured on
    tokens: int                             # tokens per timed call
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"version": SWEEP_VERSION, "kind": "sweep", "inputs": self.inputs,
                "tokens": self.tokens, "notes": list(self.notes),
                "rows": [asdict(r) for r in self.rows]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _cells(self, r: SweepRow) -> list[str]:
        if r.error:
            return [r.label, "-", "-", "-", "-", "-", r.error, "-", "-"]
        return [r.label, "yes" if r.exact else "no", _num(r.drift), _num(r.unfolded_drift),
                _signed(r.loss_change), r.schedule, r.runtime,
                "; ".join(r.folded) or "-",
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f} ({r.spread})"]

    HEADER = ("level", "exact", "drift", "drift unfolded", "loss change (nats)", "schedule",
              "runtime", "folded", "TTT tokens/s")

    def to_markdown(self) -> str:
        lines = ["# ttt2la sweep", "",
                 f"Drift and loss measured on the {self.inputs} inputs; throughput of the TTT "
                 f"layers alone, {self.tokens} tokens per call, interleaved medians.", "",
                 "| " + " | ".join(self.HEADER) + " |", "|" + "---|" * len(self.HEADER)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in self._cells(r)) + " |"
                  for r in self.rows]
        lines += [""] + [f"> {n}" for n in self.notes] if self.notes else []
        return "\n".join(lines) + "\n"

    def __rich__(self):
        from rich import box
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(*self.HEADER, box=box.SIMPLE_HEAD,
                      title=f"ttt2la sweep (drift on the {self.inputs} inputs)")
        for r in self.rows:
            table.add_row(*self._cells(r))
        return Group(table, *[Text(f"note: {n}", style="italic") for n in self.notes])

    def plot(self, path: str) -> None:
        """Drift and TTT-layer throughput against level, as a PNG."""
        matplotlib = plotting_library()
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows if r.level is not None and not r.error]
        levels = [r.level for r in rows]
        fig, left = plt.subplots(figsize=(6.4, 4.0))
        left.plot(levels, [max(r.drift or 0.0, 1e-9) for r in rows], "o-", color="tab:red",
                  label="drift (rel. RMS)")
        left.set_yscale("log")
        left.set_xlabel("level (paper steps applied)")
        left.set_ylabel("output drift (relative RMS)", color="tab:red")
        right = left.twinx()
        right.plot(levels, [r.tokens_per_s or 0.0 for r in rows], "s--", color="tab:blue")
        original = next((r for r in self.rows if r.level is None), None)
        if original is not None and original.tokens_per_s:
            right.axhline(original.tokens_per_s, color="tab:gray", linestyle=":",
                          label="original")
        right.set_ylabel("TTT-layer tokens/s", color="tab:blue")
        left.set_xticks(levels)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3g}"


def _row(level: int, converted: torch.nn.Module) -> SweepRow:
    report = converted.ttt2la_report
    drift = unfolded = None
    folded = []
    for layer in report.layers:
        lossy = [p for p in layer.passes if p.status == "applied" and not p.exact]
        if lossy and lossy[-1].drift:
            drift = max(drift or 0.0, lossy[-1].drift.get("rel_rms_error", 0.0))
            u = lossy[-1].drift.get("unfolded_rel_rms_error")
            unfolded = None if u is None else max(unfolded or 0.0, u)
        folded += [_folded(p.name, p.folded) for p in layer.passes if p.folded]
    exact = report.exact
    return SweepRow(level, exact, 0.0 if exact else drift, unfolded,
                    (report.loss or {}).get("change"),
                    ", ".join(sorted({layer.schedule for layer in report.layers})),
                    ", ".join(sorted({layer.runtime for layer in report.layers})),
                    sorted(set(folded)))


def _folded(name: str, folded: dict) -> str:
    """A pass's folds in a cell: each constant by what it scales, where every fold is one number
    (``absorb_lr: lr=0.853``), else the pass alone (``collapse_mlp`` folds a matrix)."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in folded.values()):
        return f"{name}: {', '.join(f'{k}={v:.4g}' for k, v in sorted(folded.items()))}"
    return name


def _ttt_layers(model: torch.nn.Module, paths: list[str], inputs: dict) -> Callable:
    """A callable running every TTT layer of ``model`` on its own recorded inputs."""
    modules = [model.get_submodule(p) if p else model for p in paths]

    def run(*_sync):            # the example tensor is passed only so CUDA work is synchronised
        for p, m in zip(paths, modules):
            args, kwargs = inputs[p]
            m(*args, **kwargs)
    return run


def _levels(levels) -> list[int]:
    """The levels to sweep: 0–6 by default, else each an integer from 0 to 6, at least one."""
    if levels is None:
        return list(range(MAX_LEVEL + 1))
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Iterable):
        raise InvalidInputError(f"levels must be a list of integers from 0 to {MAX_LEVEL}, got "
                                f"{levels!r}")
    levels = list(levels)
    for level in levels:
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
            raise InvalidInputError(f"levels must be integers from 0 to {MAX_LEVEL}, got "
                                    f"{level!r}")
    if not levels:
        raise InvalidInputError("levels is empty: give at least one level to convert at")
    return levels


def sweep(model: torch.nn.Module, calibration=None, *, example_inputs=None,
          levels: Sequence[int] | None = None, backend: str = "auto", example_kwargs=None,
          time_budget: float = 30.0, progress: Callable[[str], None] | None = None
          ) -> SweepReport:
    """Convert ``model`` at every level (0–6 by default) and tabulate what each step costs in
    drift and buys in throughput (see the module docstring). ``model`` is not modified."""
    from .conversion import convert

    if example_inputs is None and calibration is not None:
        example_inputs = calibration                # model inputs as well: trace on them
    levels = _levels(levels)
    check_call(model, None, example_inputs, example_kwargs, run=False)
    check_finite_weights(model)
    check_backend(backend)
    if not (isinstance(time_budget, (int, float)) and not isinstance(time_budget, bool)
            and time_budget > 0):                   # NaN is not > 0; infinity: no budget
        raise InvalidInputError(f"time_budget must be a positive number of seconds, got "
                                f"{time_budget!r}")
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress must be a function taking a message, got "
                                f"{type(progress).__name__}")
    say = progress or (lambda _msg: None)
    rows, converted = [], {}
    for level in levels:
        say(f"converting at level {level}")
        try:
            check_level(level)
            converted[level] = convert(model, level=level, example_inputs=example_inputs,
                                       calibration=calibration, backend=backend, strict=False,
                                       example_kwargs=example_kwargs)
            rows.append(_row(level, converted[level]))
        except LevelNotImplementedError as e:
            rows.append(SweepRow(level, False, None, None, None, "-", "-",
                                 error=f"not implemented ({str(e).split(';')[0]})"))
        except ConversionError as e:
            rows.append(SweepRow(level, False, None, None, None, "-", "-",
                                 error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
    if not converted:
        raise ConversionError("no level could be converted: " +
                              "; ".join(f"{r.label}: {r.error}" for r in rows))
    first = next(iter(converted.values())).ttt2la_report
    source = "calibration" if calibration is not None else "example"
    paths = [layer.module_path for layer in first.layers]
    timed = _time_levels(model, converted, paths, example_inputs, example_kwargs, time_budget,
                         say)
    lm = any(r.loss_change is not None for r in rows)
    original = SweepRow(None, True, 0.0, None, 0.0 if lm else None, "as written",
                        "the user's code")
    for row in [original, *rows]:
        key = "original" if row.level is None else row.level
        if key in timed:
            row.tokens_per_s, row.spread = timed[key]
    tokens = timed.get("tokens", 0)
    return SweepReport([original, *rows], source, tokens)


def _time_levels(model, converted: dict, paths: list[str], example_inputs, example_kwargs,
                 budget: float, say) -> dict:
    """Tokens/s of the TTT layers of the original and of every level, timed interleaved on the
    layers' own inputs at the example inputs."""
    from .conversion import _as_tuple, _layer_inputs, recognize

    # the layers' inputs as recognition recorded them on the example (the traces are cached)
    with as_found(model):
        layers, inputs, _notes = recognize(model, example_inputs, example_kwargs=example_kwargs)
    recorded = {rl.path: _layer_inputs(rl) for rl in layers}
    x = _as_tuple(inputs)[0]
    tokens = int(x.shape[0] * x.shape[1]) if x.dim() >= 2 else int(x.numel())
    original = copy.deepcopy(model)
    runs = {"original": _ttt_layers(original, paths, recorded)}
    runs.update({level: _ttt_layers(m, paths, recorded) for level, m in converted.items()})
    say(f"timing {len(runs)} rows side by side")
    # warm-up long enough for any race against the code as written to be decided (as_written)
    with evaluating(original, *converted.values()):     # inference, as the levels were checked
        timings = time_side_by_side(runs, (x,), units=tokens, max_seconds=budget, rounds=9,
                                    warmup=CALLS_TO_DECIDE)
    out = {key: (t.rate, t.spread()) for key, t in timings.items()}
    out["tokens"] = tokens
    return out



def plotting_library():
    """matplotlib, or an ``InvalidInputError`` saying how to install it (asked before a sweep
    whose plot would otherwise fail after all its work)."""
    try:
        import matplotlib
    except ImportError as e:
        raise InvalidInputError(
            f"a plot needs matplotlib, which cannot be imported here ({e}); install it with "
            "`pip install matplotlib`, or leave out the plot.") from None
    return matplotlib


__all__ = ["sweep", "SweepReport", "SweepRow", "plotting_library"]
