"""Side-by-side timing that reproduces: warm-up, interleaved rounds, medians and their spread.

Every model runs once per round, in an order rotated each round, so a burst of background load
hits all of them alike; rounds continue until ``rounds`` are done or ``max_seconds`` have passed
(never fewer than ``min_rounds``). A result is the median time per call together with the
spread of the per-round times (interquartile range and min–max range, as % of the median), and
speed-ups are medians of per-round ratios, which cancels load shared by the two calls of a round.
The command line's ``demo``/``bench`` and ``benchmarks/throughput.py`` both time with this.
"""
from __future__ import annotations

import statistics
import time

from dataclasses import dataclass
from typing import Callable, Mapping

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one model, one entry per timed round, and the work of one call."""

    seconds: tuple[float, ...]
    units: float = 1.0              # tokens (or FLOPs ...) one call processes

    @property
    def rounds(self) -> int:
        return len(self.seconds)

    @property
    def median(self) -> float:
        """Median seconds per call."""
        return statistics.median(self.seconds)

    @property
    def rate(self) -> float:
        """Units per second at the median time."""
        return self.units / self.median

    @property
    def iqr_pct(self) -> float:
        """Interquartile range of the per-round times, % of the median (0 below 2 rounds)."""
        return _iqr(self.seconds) / self.median * 100

    @property
    def range_pct(self) -> float:
        """Min–max range of the per-round times, % of the median."""
        return (max(self.seconds) - min(self.seconds)) / self.median * 100

    def spread(self) -> str:
        """``"IQR a%, range b%, n rounds"``: how far the rounds scatter around the median."""
        return f"IQR {self.iqr_pct:.0f}%, range {self.range_pct:.0f}%, n={self.rounds}"

    def speedup_over(self, baseline: "Timing") -> "Ratio":
        """How many times faster than ``baseline`` per unit of work, paired round by round."""
        n = min(self.rounds, baseline.rounds)
        ratios = tuple((b / baseline.units) / (s / self.units)
                       for s, b in zip(self.seconds[:n], baseline.seconds[:n]))
        return Ratio(ratios)


@dataclass(frozen=True)
class Ratio:
    """Per-round speed-ups of one model over another; the median is the reported figure."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def iqr_pct(self) -> float:
        return _iqr(self.values) / self.median * 100

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.iqr_pct:.0f}%)"


def _iqr(values) -> float:
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q3 - q1


def time_side_by_side(models: Mapping[str, Callable], inputs: tuple, units: float = 1.0, *,
                      rounds: int = 15, min_rounds: int = 3, max_seconds: float = 60.0,
                      warmup: int = 2, no_grad: bool = True,
                      clock: Callable[[], float] = time.perf_counter,
                      on_round: Callable[[int], None] | None = None) -> dict[str, Timing]:
    """Time ``model(*inputs)`` for every model, interleaved; ``units`` of work per call.

    ``warmup`` untimed rounds first (lazy initialisation, caches, allocator); then timed rounds,
    each calling every model once with the order rotated by one per round, until ``rounds``
    rounds or ``max_seconds`` of timing (at least ``min_rounds``). CUDA work is synchronised
    before each clock read. ``no_grad=False`` times calls that build graphs (a backward pass run
    by the callable itself). ``on_round(i)`` is called after every round (progress display).
    """
    names = list(models)
    sync = _synchroniser(inputs)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    min_rounds = min(min_rounds, rounds)
    with torch.no_grad() if no_grad else torch.enable_grad():
        for r in range(warmup):
            for name in _rotated(names, r):
                models[name](*inputs)
            sync()
        start = clock()
        r = 0
        while r < rounds and (r < min_rounds or clock() - start < max_seconds):
            for name in _rotated(names, r):
                t0 = clock()
                models[name](*inputs)
                sync()
                seconds[name].append(clock() - t0)
            r += 1
            if on_round is not None:
                on_round(r)
    return {name: Timing(tuple(s), units) for name, s in seconds.items()}


def _rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def _synchroniser(inputs: tuple) -> Callable[[], None]:
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda}
    if not devices:
        return lambda: None

    def sync() -> None:
        for device in devices:
            torch.cuda.synchronize(device)
    return sync


__all__ = ["Timing", "Ratio", "time_side_by_side"]
