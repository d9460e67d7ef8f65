"""What every simplification pass shares: the ``Pass`` interface, its result, the step registry.

A pass rewrites a ``TTTProgram`` in place and reports one of three outcomes: ``applied``,
``already_satisfied`` (nothing to change, so still exact) or ``not_applicable`` (the program has
nothing the pass is about). ``exact`` is declared per pass (does it preserve the function?) and a
result is exact unless the pass changed something it cannot preserve.

The registry is the only place that knows the levels: level k applies the passes registered for
steps 1..k, a step with no pass yet makes its level (and every higher one) unavailable, and each
pass names the associativity blocker it removes, so the checker's remedies come from here too.

Lossy passes fold what they remove into the remaining weights from calibration data
(``PassContext.calibration``) and record the folded constants in ``PassContext.folds``; a context
whose ``folds`` already hold a pass's constants replays them instead (the three traced programs
of a layer, or a conversion replayed from a checkpoint's manifest, get identical constants).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch.fx

from ..errors import ConversionError, LevelNotImplementedError
from ..ir import TTTProgram

PassStatus = Literal["applied", "already_satisfied", "not_applicable"]
MAX_LEVEL = 6


@dataclass(frozen=True)
class PassResult:
    """The outcome of one pass on one program, as the report shows it."""

    name: str
    step: int
    status: PassStatus
    exact: bool
    reason: str
    folded: dict | None = None          # constants a lossy pass folded (JSON-able), if any


@dataclass
class PassContext:
    """What passes share during one conversion: calibration data and the folded constants.

    ``fold=False`` makes lossy passes remove without folding (the "unfolded" drift baseline).
    ``folds`` maps a pass name to the constants it folded (JSON-able); a pass finding its
    entry there replays it instead of measuring calibration data again.
    """

    calibration: Any = None              # ``ttt2la.calibration.LoopCalibration`` or None
    folds: dict[str, dict] = field(default_factory=dict)
    fold: bool = True

    def replay(self, name: str) -> dict | None:
        return self.folds.get(name)


class Pass:
    """One of the paper's simplification steps, rewriting a program's body in place.

    Subclasses set ``name``, ``step`` and ``exact`` and implement ``run``; ``requires`` and
    ``ensures`` check the pre- and postconditions around it (as torch.fx's ``PassBase`` does).
    """

    name: str = ""
    step: int = 0
    exact: bool = True
    implemented: bool = True
    removes: str | None = None        # the associativity blocker it removes (``Blocker.kind``)

    def requires(self, program: TTTProgram) -> None:
        """Raise when ``program`` is not something this pass can run on."""

    def ensures(self, program: TTTProgram) -> None:
        """Raise when the pass left ``program`` without the property it promises."""

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Rewrite ``program`` in place (``context``: calibration data and folded constants)."""
        raise NotImplementedError

    def __call__(self, program: TTTProgram, context: PassContext | None = None) -> PassResult:
        context = context if isinstance(context, PassContext) else PassContext(context)
        self.requires(program)
        result = self.run(program, context)
        try:
            self.ensures(program)
        except AssertionError as e:         # a broken promise is ttt2la's bug, said as one
            raise ConversionError(
                f"{self.name} (step {self.step}) left {program.module_path or 'the model'} "
                f"({program.loop_src}) without the property it promises: {e}. This is a bug in "
                f"ttt2la — please report it with the model; convert at level <= {self.step - 1} "
                "meanwhile.") from e
        return result

    def result(self, status: PassStatus, reason: str, folded: dict | None = None) -> PassResult:
        """A ``PassResult`` whose ``exact`` follows from the status and the declared ``exact``."""
        exact = self.exact if status == "applied" else True
        return PassResult(self.name, self.step, status, exact, reason, folded)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, name={self.name!r}, exact={self.exact})"


class PendingPass(Pass):
    """A step of the paper whose pass is not written yet: running it raises."""

    implemented = False

    def __init__(self, step: int, name: str, exact: bool = False):
        self.step, self.name, self.exact = step, name, exact

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Always raises ``LevelNotImplementedError``."""
        raise LevelNotImplementedError(
            f"Step {self.step} ({self.name}) is not implemented yet, so levels >= {self.step} "
            f"cannot be applied; use level <= {self.step - 1}.")


_REGISTRY: dict[int, Pass] = {
    3: PendingPass(3, "collapse_mlp"),
    4: PendingPass(4, "absorb_lr"),
    5: PendingPass(5, "remove_momentum"),
    6: PendingPass(6, "remove_muon"),
}


def register(pass_: Pass) -> Pass:
    """Make ``pass_`` the pass of its step (replacing a pending placeholder)."""
    if not 1 <= pass_.step <= MAX_LEVEL:
        raise ValueError(f"a pass step must be in 1..{MAX_LEVEL}, got {pass_.step}")
    _REGISTRY[pass_.step] = pass_
    return pass_


def get_pass(step: int) -> Pass:
    """The pass registered for ``step`` (1..6)."""
    if step not in _REGISTRY:
        raise KeyError(f"no pass registered for step {step}")
    return _REGISTRY[step]


def implemented_level() -> int:
    """The highest level whose steps all have a pass."""
    level = 0
    while level < MAX_LEVEL and get_pass(level + 1).implemented:
        level += 1
    return level


def check_level(level) -> None:
    """``ValueError`` outside 0..6, ``LevelNotImplementedError`` for a level with a missing step."""
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"level must be an integer from 0 to {MAX_LEVEL} (the paper's steps "
                         f"applied), got {level!r}")
    missing = [get_pass(step) for step in range(1, level + 1) if not get_pass(step).implemented]
    if missing:
        names = ", ".join(p.name for p in missing)
        steps = ", ".join(str(p.step) for p in missing)
        raise LevelNotImplementedError(
            f"Level {level} needs step{'s' if len(missing) > 1 else ''} {steps} ({names}), "
            f"which this version of ttt2la does not implement yet; use level <= "
            f"{implemented_level()}.")


def passes_for_level(level: int) -> list[Pass]:
    """Steps 1..level in paper order (``check_level`` says why a level cannot be had)."""
    check_level(level)
    return [get_pass(step) for step in range(1, level + 1)]


def remedy_for(blocker: str) -> str | None:
    """"Apply <pass> (level >= k)" for the pass that removes ``blocker``, or ``None``."""
    for step in sorted(_REGISTRY):
        p = _REGISTRY[step]
        if p.removes == blocker:
            return f"apply {p.name} (level >= {p.step})"
    return None


@dataclass
class Snapshot:
    """A program as it stood after one step, for measuring that step's drift."""

    step: int
    program: TTTProgram
    results: list[PassResult]


def run_passes(program: TTTProgram, level: int, context: PassContext | None = None,
               snapshots: bool = False) -> tuple[TTTProgram, list[PassResult], list[Snapshot]]:
    """Apply steps 1..level to a clone of ``program``: the result, one result per step, and (with
    ``snapshots``) a clone after every step but the last (the result itself).

    Roles are inferred first when none were assigned (every state ``other``).
    """
    passes = passes_for_level(level)
    context = context if isinstance(context, PassContext) else PassContext(context)
    program = program.clone()
    if program.states and all(s.role == "other" for s in program.states):
        from ..analysis.roles import assign_roles
        assign_roles(program)
    results, taken = [], []
    for p in passes[:-1] if passes else ():
        results.append(p(program, context))
        if snapshots:
            taken.append(Snapshot(p.step, program.clone(), list(results)))
    if passes:
        results.append(passes[-1](program, context))
    return program, results, taken


def run_level(program: TTTProgram, level: int, context: PassContext | Any = None
              ) -> tuple[TTTProgram, list[PassResult]]:
    """Apply steps 1..level to a clone of ``program``; returns the clone and one result per step."""
    program, results, _ = run_passes(program, level, context)
    return program, results


def _state_reach(program: TTTProgram) -> dict[torch.fx.Node, frozenset[int]]:
    """For every node, the state-ins it is computed from."""
    index = {n: i for i, n in enumerate(program.state_inputs())}
    reach: dict[torch.fx.Node, frozenset[int]] = {}
    for node in program.body.graph.nodes:
        own = frozenset([index[node]]) if node in index else frozenset()
        reach[node] = own.union(*(reach[n] for n in node.all_input_nodes))
    return reach


def remove_dead_states(program: TTTProgram) -> list[str]:
    """Drop carried states that influence no chunk output and no live state; returns their names.

    The calling convention stays intact: the state's placeholder, its state-out slot and its
    ``StateSpec`` go together, and the now-dead update computation is eliminated.
    """
    outs, chunk_outs = program.state_outputs(), program.chunk_outputs()
    reach = _state_reach(program)

    def reads(value) -> frozenset[int]:
        return reach.get(value, frozenset()) if isinstance(value, torch.fx.Node) else frozenset()

    live = set().union(*(reads(o) for o in chunk_outs)) if chunk_outs else set()
    changed = True
    while changed:
        changed = False
        for i in list(live):
            for j in reads(outs[i]) - live:
                live.add(j)
                changed = True
    dead = [i for i in range(len(program.states)) if i not in live]
    if not dead:
        return []
    ins = program.state_inputs()
    names = [program.states[i].name for i in dead]
    program.set_outputs([o for i, o in enumerate(outs) if i in live], chunk_outs)
    for i in dead:
        if ins[i].users:
            raise RuntimeError(f"state {program.states[i].name} is still read after removal")
        program.body.graph.erase_node(ins[i])
    program.states = [s for i, s in enumerate(program.states) if i in live]
    program.recompile()
    return names


__all__ = ["Pass", "PassResult", "PassStatus", "PassContext", "PendingPass", "Snapshot",
           "register", "get_pass", "implemented_level", "check_level", "passes_for_level",
           "remedy_for", "run_passes", "run_level", "remove_dead_states", "MAX_LEVEL"]
