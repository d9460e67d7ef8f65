"""Tile tuning: a kernel's tile sides, warps and pipeline stages chosen by timing candidates on the device.

The default tiles were chosen from register counts of a compile without the divisibility hints the JIT adds
at launch (``ahead_of_time``), which are pessimistic, and no timing settled them. Each launch site therefore
names its candidates, the default first. With tuning on (``TTT2LA_TUNE_KERNELS=1`` in the environment, or
``tune_kernels(True)``) the first launch at each shape class times every candidate that compiles and keeps
the fastest for that class; with tuning off, and always in Triton's interpreter, the default runs. Every
candidate computes the same sums in another tiling, so a choice changes rounding order only, never the math.
"""
from __future__ import annotations

import functools
import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import triton
import triton.testing

from ._common import INTERPRET

#: The environment switch; ``tune_kernels`` overrides it for the process.
ENV = "TTT2LA_TUNE_KERNELS"

_switch: bool | None = None
_forced: dict[str, "Config"] = {}


@dataclass(frozen=True)
class Config:
    """One launch configuration: constexpr tile sides by name, warps and software-pipeline stages."""

    tiles: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    def __getitem__(self, side: str) -> int:
        return dict(self.tiles)[side]

    @property
    def options(self) -> dict:
        """Launch options for ``kernel[grid](..., **options)`` (none in the interpreter, which ignores them)."""
        return {} if INTERPRET else {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def __str__(self) -> str:
        sides = " ".join(f"{k}={v}" for k, v in self.tiles)
        return f"{sides}, {self.num_warps} warps, {self.num_stages} stages"


def config(num_warps: int, num_stages: int, **tiles: int) -> Config:
    return Config(tuple(tiles.items()), num_warps, num_stages)


def candidates(default: Config, sides: dict[str, Sequence[int]], warps: Sequence[int] = (4, 8),
               stages: Sequence[int] = (2, 3)) -> list[Config]:
    """``default`` first, then every combination of the given tile sides, warps and stages (no repeats)."""
    names = [name for name, _ in default.tiles]
    out = [default]
    for values in itertools.product(*(sides[n] for n in names), warps, stages):
        c = Config(tuple(zip(names, values[:-2])), values[-2], values[-1])
        if c not in out:
            out.append(c)
    return out


def sides_up_to(dim: int, options: Sequence[int]) -> tuple[int, ...]:
    """The tile sides of ``options`` a dimension of ``dim`` can use: a wider tile than ``dim``'s next power of
    two would only be masked (the smallest option is always kept)."""
    limit = max(min(options), triton.next_power_of_2(max(int(dim), 1)))
    return tuple(s for s in options if s <= limit)


def enabled() -> bool:
    """Whether launches time their candidates: never in the interpreter; else ``tune_kernels`` or ``ENV``."""
    if INTERPRET:
        return False
    if _switch is not None:
        return _switch
    return os.environ.get(ENV, "0").lower() in ("1", "true", "yes", "on")


def tune_kernels(on: bool | None) -> None:
    """Switch tuning on or off for this process (``None``: follow ``TTT2LA_TUNE_KERNELS`` again)."""
    global _switch
    _switch = on


@contextmanager
def forcing(**configs: Config):
    """Launch each named site with the given configuration, tuning on or off (for tests and benchmarks)."""
    previous = dict(_forced)
    _forced.update(configs)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(previous)


@dataclass
class Tuned:
    """What tuning chose at one site and shape class, with every candidate's time (ms; ``None``: it did not
    compile)."""

    site: str
    key: tuple
    chosen: Config
    times: dict = field(default_factory=dict)


#: Every choice made in this process, by (site, key).
CHOSEN: dict[tuple, Tuned] = {}


def _skippable() -> tuple[type, ...]:
    """Errors that mean a candidate cannot run on this device (too many resources, a compile it refuses)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors
    return tuple(e for e in (getattr(errors, "OutOfResources", None), getattr(errors, "PTXASError", None),
                             CompilationError) if e is not None)


def _time(launch: functools.partial) -> float:
    """Median milliseconds of ``launch()`` (``run`` bound to one configuration) on the device (Triton's
    benchmarker: warm-up, then CUDA-event timing)."""
    return float(triton.testing.do_bench(launch, warmup=5, rep=25, return_mode="median"))


def choose(site: str, key: tuple, options: Sequence[Config], run: Callable[[Config], object]) -> Config:
    """The configuration to launch ``site`` with at shape class ``key``: forced, or timed once per class
    among ``options`` (default first) when tuning is on, else the default. ``run(config)`` launches the
    site's kernel with that configuration and must only write its own outputs."""
    if site in _forced:
        return _forced[site]
    if not enabled() or len(options) == 1:
        return options[0]
    tuned = CHOSEN.get((site, key))
    if tuned is None:
        skippable = _skippable()
        times = {}
        for c in options:
            try:
                times[c] = _time(functools.partial(run, c))
            except skippable:
                times[c] = None
        ran = {c: t for c, t in times.items() if t is not None}
        chosen = min(ran, key=ran.get) if ran else options[0]   # none ran: the default raises its own error
        tuned = CHOSEN[(site, key)] = Tuned(site, key, chosen, times)
    return tuned.chosen


def launch(site: str, key: tuple, options: Sequence[Config], run: Callable[[Config], object]):
    """``run`` with the configuration ``choose`` picks; its result."""
    return run(choose(site, key, options, run))


def shape_key(x, *flags) -> tuple:
    """The shape class a launch on ``x`` ``[B, T, H, D]`` is tuned for: its dtype, batch × heads, the power of
    two of its length (lengths tuned together), and the site's ``flags``."""
    B, T, H, _ = x.shape
    return (x.dtype, B * H, triton.next_power_of_2(max(int(T), 1)), *flags)
