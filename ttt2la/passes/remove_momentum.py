"""Step 5 of the paper: remove the momentum of the updates.

A momentum state ``M`` updated as ``M' = α·M + G`` (or ``α·M - G``, then ``-G`` is the
increment) feeds another state's update (``W' = W +
T(M')``); every reader of ``M'`` other than ``M``'s own state-out reads ``c·G`` instead, and the
momentum state dies (``remove_dead_states``).

The fold ``c`` is the mean accumulation factor of the momentum on calibration data. Without a
transform T, chunk ``i``'s increment ``G_i`` reaches the state with total weight
``A_i = Σ_{j=i..N} Π_{s=i+1..j} α_s`` by the end of a sequence of ``N`` updating chunks
(``A_N = 1``, ``A_i = 1 + α_{i+1}·A_{i+1}``; Theorem 5.3). ``c`` is the mean of ``A_i`` over
the updating chunks ``i`` of every calibration sequence and every row (batch × heads); a
constant momentum ``α`` is used as the number it is. Unfolded (``fold=False``) ``c = 1``: the
increment alone. Exact when α is identically zero (``α = 0·x``): then ``M' = G`` already, and
the pass only rewrites it so (``already_satisfied``).
"""
from __future__ import annotations

import torch
import torch.fx

from ..analysis.dependence import Dep, analyze_dependence
from ..analysis.rules import MomentumMatch, constant_value, match_momentum
from ..analysis.sequence_scan import scans_within
from ..ir import TTTProgram, op_at
from .base import Pass, PassContext, PassResult, register, remove_dead_states
from .folding import folded_constant, resolve_folds, scaled, update_chunk_values


def momentum_updates(program: TTTProgram) -> list[tuple[int, MomentumMatch]]:
    """``(state index, match)`` for every momentum state whose update is ``α·M + G`` and whose
    new value feeds another state's update."""
    ins, outs = program.state_inputs(), program.state_outputs()
    found = []
    for i in program.states_with_role("momentum"):
        m = match_momentum(outs[i], ins[i])
        if m is not None and _readers(program, i, m):
            found.append((i, m))
    return found


def _readers(program: TTTProgram, i: int, m: MomentumMatch) -> list[torch.fx.Node]:
    """Nodes reading ``M'`` other than the body's output (``M``'s own state-out)."""
    return [u for u in m.output.users if u.op != "output"]


def _carried_into_updates(program: TTTProgram) -> dict[int, list[int]]:
    """States the roles call neither fast weights nor momentum whose previous value enters
    another state's update (Titans' surprise, scanned token by token inside each chunk): a
    momentum in effect, not in the form ``α·M + G`` this pass removes. ``{state: [states whose
    update reads it]}``."""
    dep = analyze_dependence(program)
    n = len(program.states)
    found = {}
    for i in program.states_with_role("other"):
        readers = [t for t in range(n) if t != i and dep.update(t, i).kind > Dep.INDEPENDENT]
        if readers:
            found[i] = readers
    return found


def _carried_reason(program: TTTProgram, carried: dict[int, list[int]]) -> str:
    outs = program.state_outputs()
    name = lambda i: program.states[i].name      # noqa: E731
    each = "; ".join(
        f"{name(i)} ({op_at(outs[i])}) enters the update of {', '.join(map(name, readers))}"
        for i, readers in carried.items())
    return (f"state(s) carried from one update to the next feed another state's update: "
            f"{each}. A momentum in effect, but not updated as α·M + G, the form this pass "
            "folds into a factor of the increment: left unchanged, so this level keeps it")


def accumulation_factor(alphas: list[torch.Tensor]) -> torch.Tensor:
    """``A_i = Σ_{j=i..N} Π_{s=i+1..j} α_s`` for one sequence of per-chunk coefficients
    (``A_N = 1``, ``A_i = 1 + α_{i+1}·A_{i+1}``), stacked over the chunks."""
    factors = [torch.ones_like(alphas[-1])]
    for alpha in reversed(alphas[1:]):
        factors.append(1 + alpha * factors[-1])
    return torch.stack(factors[::-1])


def _calibration_factor(program: TTTProgram, context: PassContext, matches) -> dict:
    """The mean accumulation factor of every momentum state, as JSON."""
    nodes = [m.coefficient for _, m in matches if isinstance(m.coefficient, torch.fx.Node)]
    # a constant coefficient holds no value per chunk: the first momentum's new value, computed
    # in every updating chunk, counts them
    per_sample = update_chunk_values(context.calibration, program, [*nodes, matches[0][1].output])
    folded = {}
    k = 0
    for i, m in matches:
        factors = []
        for sample in per_sample:
            if isinstance(m.coefficient, torch.fx.Node):
                alphas = [a.double() for a in sample[k]]
            else:
                alphas = [torch.tensor(float(m.coefficient), dtype=torch.float64)] * len(sample[-1])
            if alphas:
                factors.append(accumulation_factor(alphas).flatten())
        if isinstance(m.coefficient, torch.fx.Node):
            k += 1
        folded[program.states[i].name] = torch.cat(factors).mean().item()
    return folded


class RemoveMomentum(Pass):
    """Replace every momentum ``α·M + G`` feeding an update by ``c·G`` (Step 5)."""

    name = "remove_momentum"
    step = 5
    exact = False

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Fold the momentum into a scalar factor of the increment and drop the momentum state."""
        matches = momentum_updates(program)
        if not matches:
            left = program.states_with_role("momentum")
            if left:
                names = ", ".join(program.states[i].name for i in left)
                return self.result("not_applicable",
                                   f"momentum state(s) {names} are not updated as α·M + G "
                                   "feeding another update; left unchanged")
            carried = _carried_into_updates(program)
            if carried:
                return self.result("not_applicable", _carried_reason(program, carried))
            scans = scans_within(program) if program.single_step else []
            if scans:
                return self.result(
                    "not_applicable",
                    f"the step runs along the sequence in order ({_listed(scans)}): "
                    "sequence-parallel code, whose "
                    "momentum over chunks, if any, is that scan and not a state ttt2la can "
                    "remove; left unchanged, so this level keeps it")
            return self.result("already_satisfied", "no momentum feeds a state update")
        zero = [(i, m) for i, m in matches if constant_value(m.coefficient) == 0.0]
        data = [(i, m) for i, m in matches if constant_value(m.coefficient) != 0.0]
        done = []
        for i, m in zero:
            done.append(f"{program.states[i].name} has the coefficient 0 "
                        f"({op_at(m.output)}): it is its increment")
            self._replace(program, i, m, 1.0)
        folded, mode = resolve_folds(context, self.name,
                                     lambda: _calibration_factor(program, context, data)) \
            if data else (None, "exact")
        removed = []
        for i, m in data:
            name = program.states[i].name
            factor = float(folded_constant(folded, name, self.name, 1.0))
            removed.append(f"{name} ({op_at(m.output)}): its increment times "
                           f"{factor:.6g}")
            self._replace(program, i, m, factor)
        program.recompile()
        dead = remove_dead_states(program)
        if not data:
            reason = "; ".join(done) + (f"; removed the state(s) {', '.join(dead)}"
                                        if dead else "")
            program.notes.append(f"remove_momentum: {reason}")
            return self.result("already_satisfied", reason)
        reason = "removed the momentum " + "; ".join(removed) + _how_folded(mode)
        if dead:
            reason += f"; removed the state(s) {', '.join(dead)}"
        if done:
            reason += "; " + "; ".join(done)
        program.notes.append(f"remove_momentum: {reason}")
        return self.result("applied", reason, folded if mode in ("measure", "replay") else None)

    @staticmethod
    def _replace(program: TTTProgram, i: int, m: MomentumMatch, factor: float) -> None:
        new = scaled(program, m.increment, m.sign * factor, m.increment)
        for user in _readers(program, i, m):
            user.replace_input_with(m.output, new)

    def ensures(self, program: TTTProgram) -> None:
        """No momentum state feeds another state's update any more."""
        if momentum_updates(program):
            raise AssertionError("remove_momentum left a momentum feeding an update")


def _listed(nodes: list[torch.fx.Node], most: int = 3) -> str:
    """The distinct ops ``nodes`` name (``op_at``), the first ``most`` of them."""
    names = list(dict.fromkeys(map(op_at, nodes)))
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def _how_folded(mode: str) -> str:
    return {"unfolded": " (unfolded: the increment alone)",
            "no_calibration": " (no calibration data: the increment alone, nothing folded)",
            "replay": " (replayed: the mean accumulation factor of the momentum)",
            "measure": " (folded: the mean accumulation factor of the momentum over the "
                       "calibration chunks)"}[mode]


remove_momentum = register(RemoveMomentum())

__all__ = ["RemoveMomentum", "remove_momentum", "momentum_updates", "accumulation_factor"]
