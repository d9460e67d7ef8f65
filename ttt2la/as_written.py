"""The code as written, raced against the plan: an exact conversion computes the user's own
function, so where its plan could lose to the user's loop the layer times both on its first
calls at each shape and keeps the faster.

A plan that still loops over the chunks runs the user's per-chunk ops as a traced graph, and on
a CPU it can lose a few percent to the same loop written by hand: its graph dispatches more per
chunk, and its chunk-major copies of whole sequences are fresh memory the allocator faults in on
every call. A generic plan that scans instead materialises every chunk's states, which can cost
far more than the loop (a normalised linear attention per token: 0.17-0.23x): every generic
plan races. The block op can lose too, where chunks are as long as the features are wide and
no Newton–Schulz runs: the source's loop runs the same products, and the op's per-chunk states
are memory the loop never writes.
Only calls that record no autograd graph race: with gradients the converted loop's backward
beats the user's slicing (1.4–6.4× in ``docs/benchmarks.md``), so a forward timed alone would
choose wrongly. Plans on the token-causal and delta-rule ops (which replace a loop over every
token) race only at lengths up to their op's chunk of 64 tokens (``may_lose``): the op pads a
shorter sequence to its chunk, so its cost is flat there (about 1.1 ms a call at 32 features on
a CPU) while the loop's grows with every token: at 8–16 tokens the plan ran at 0.26–0.90× its
source, at 32 at 0.65–1.38×, at one whole chunk at 0.99–2.6×, and at 80–128 tokens it never lost
(1.0–4.7×, ``docs/design.md``). Longer calls do not race: the plan's win is certain there, and a
race would cost several slow calls of the token loop at every new shape. CUDA tensors, calls
under a compiler, stateful calls and a path forced with ``scan_choice.scanning`` never race.
Each side is judged by its fastest timed call: on a loaded machine a call preempted by another
process gains a time slice longer than the calls raced, and the median of three would be such a
call wherever two were. Each call runs one side only (the plan after the user's code only where
that raised, which ends the race), so the race adds no work beyond timing. A call at a shape
whose race kept the code as written runs it straight after the call's decision
(``ConvertedState.decide``, its shape part remembered per input shape) (``ConvertedState.kept_call``):
no plan is looked up for it, and the layer's hook, attribute and weight guards are not asked,
since the code as written reads its hooks, attributes and weights itself. A call of positional
tensors at input shapes such a call had before is known by its shapes, before it is spelled as
the example or flattened (``ConvertedState.kept_as_given``): its checks, run cold after the
user's forward, are what such a call costs beyond the original.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from .lowering.scan_choice import forced

#: Timed calls of each side before the race is decided, after one untimed call of each.
ROUNDS = 3
#: Calls at one shape before the faster side runs alone (what a benchmark's warm-up covers).
CALLS_TO_DECIDE = 2 + 2 * ROUNDS
#: The code as written is kept only when its fastest call is this much below the plan's (a tie
#: keeps the plan the report names).
MARGIN = 0.03

PLAN, WRITTEN = "plan", "as written"

_enabled = True
_clock: Callable[[], float] = time.perf_counter


@contextmanager
def race_as_written(enabled: bool):
    """Within the block, converted layers race their plan against the code as written
    (``True``, the default) or always run the plan (``False``: tests of a plan, benchmarks that
    time it alone)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def races(module: torch.nn.Module, flat: list) -> bool:
    """Would a call of ``module`` on ``flat`` inputs race (the global switch, no forced path, a
    CPU call in eager mode that records no autograd graph)?"""
    if not _enabled or forced() is not None or torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in flat:          # a plain loop: every call of a kept shape asks this
        if isinstance(t, torch.Tensor) and (not t.is_cpu or grad and t.requires_grad):
            return False
    return not grad or not any(p.requires_grad for p in module.parameters())


def may_lose(plan, length: int) -> bool:
    """Can ``plan``'s last call, at ``length`` tokens, lose to the code as written? Where the
    plan says so (``raced``), and on the token-causal and delta-rule ops at lengths up to the
    op's chunk (``races_up_to``: 0 for other plans), which it pads a shorter sequence to."""
    return plan.raced or length <= getattr(plan, "races_up_to", 0)


@dataclass
class Race:
    """The race at one shape: the calls so far and, once decided, the side that runs."""

    plan: list[float] = field(default_factory=list)
    written: list[float] = field(default_factory=list)
    calls: int = 0
    winner: str | None = None

    def next_side(self) -> str:
        """Plan first (it builds its graphs), the code as written second, then alternating."""
        return self.winner or (PLAN if self.calls % 2 == 0 else WRITTEN)

    def record(self, side: str, seconds: float) -> None:
        if self.calls >= 2:                  # the first call of each side is a warm-up
            (self.plan if side == PLAN else self.written).append(seconds)
        self.calls += 1
        if self.calls == CALLS_TO_DECIDE:
            # the fastest call of each side, not the median: a call preempted by another
            # process (a time slice, ~4 ms on a loaded machine, longer than the calls raced) or
            # interrupted only gains time, and with three calls a side two preempted ones would
            # make its median; what a side costs on every call (its dispatch, the memory it
            # faults in) is in its fastest call too
            plan, written = min(self.plan), min(self.written)
            self.winner = WRITTEN if written < plan * (1 - MARGIN) else PLAN

    def describe(self) -> str:
        return (f"{min(self.written) * 1e3:.3g} ms against {min(self.plan) * 1e3:.3g} ms for "
                f"the plan, the fastest of {ROUNDS} calls each without gradients")


@dataclass
class AsWritten:
    """A converted layer's races, one per shape it is called at (batch, length, dtype)."""

    races: dict[tuple, Race] = field(default_factory=dict)
    #: The shapes whose race kept the code as written: a call at one of them runs the code
    #: with the layer's guards only, before the plan's graph for the call is even fetched.
    kept: set = field(default_factory=set)
    #: The input shapes of calls of positional tensors, spelled as the example was, that ran
    #: the code as written at a kept shape: a call at one of them is known by its shapes alone
    #: (``ConvertedState.kept_as_given``).
    given: set = field(default_factory=set)
    #: The user's class by the converted layer's class, whose ``forward`` kept calls run
    #: (never asked under a compiler, where no race runs).
    forwards: dict = field(default_factory=dict)

    def call(self, key: tuple, plan: Callable[[], object], written: Callable[[], object],
             plan_may_lose: Callable[[], bool], runs: dict, shape: Callable[[], str]):
        """Run this call on the side the race at ``key`` gives it, timing it while the race
        runs; ``plan_may_lose()`` says, after the plan's first call, whether what it ran can lose
        to the code as written (else the plan wins at once). A race running, or decided for the
        code as written, is recorded in ``runs`` under ``shape()``."""
        race = self.races.get(key)
        if race is None:
            race = self.races[key] = Race()
        elif race.winner is not None:       # decided: every later call at this shape
            return plan() if race.winner == PLAN else written()
        side = race.next_side()
        start = _clock()
        try:
            out = plan() if side == PLAN else written()
        except Exception:
            if side == PLAN:
                raise
            race.winner = PLAN        # the plan ran at this shape: it is the layer's answer
            runs.pop(shape(), None)
            return plan()
        race.record(side, _clock() - start)
        if race.calls == 1 and not plan_may_lose():
            race.winner = PLAN
        if race.winner == WRITTEN:
            self.kept.add(key)
            runs[shape()] = f"as written: the user's own loop ran faster ({race.describe()})"
        elif race.winner == PLAN:
            runs.pop(shape(), None)
        elif side == WRITTEN:               # the report says what ran while the race runs
            runs[shape()] = (f"racing: the plan and the user's own loop take turns, the faster "
                             f"kept after {CALLS_TO_DECIDE} calls")
        return out

    @staticmethod
    def shape(batch: int, length: int) -> str:
        """The key under which a converted layer's ``runs`` record what a decided race keeps."""
        return f"batch {batch}, length {length}, without gradients"

    def kept_at(self, batch: int) -> bool:
        """Does any shape of this batch size run the code as written?"""
        return any(r.winner == WRITTEN for key, r in self.races.items() if key[0] == batch)


__all__ = ["AsWritten", "Race", "race_as_written", "races", "may_lose", "ROUNDS",
           "CALLS_TO_DECIDE", "MARGIN"]
