"""Step 2 of the paper: remove the weight normalisation after the state update.

``W' = Norm(W + Δ)`` becomes ``W' = W + Δ``: every state-out that ends in a normalisation of a
value computed from the state (``x/‖x‖·n₀``, RMS or layer norm) returns the pre-normalisation
value instead, and everything that read the normalised state reads the new one. Not exact:
``Norm(A + B) ≠ Norm(A) + Norm(B)``, which is also why it is what blocks a full parallel scan.
"""
from __future__ import annotations

from ..analysis.dependence import analyze_dependence
from ..analysis.roles import peel_views
from ..analysis.rules import match_norm
from ..ir import TTTProgram, op_at
from .base import Pass, PassContext, PassResult, register


def state_norms(program: TTTProgram):
    """``(state index, NormMatch)`` for every normalisation that ends a state update."""
    dep = analyze_dependence(program)
    found = []
    for i, out in enumerate(program.state_outputs()):
        node = out
        while (m := match_norm(peel_views(node))) is not None and i in dep.states_of(m.input):
            found.append((i, m))
            node = m.input
    return found


class DropNorm(Pass):
    """Return the pre-normalisation value of every normalised state update (Step 2)."""

    name = "drop_norm"
    step = 2
    exact = False
    removes = "state_norm"

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Replace every normalisation that ends a state update by its input."""
        norms = state_norms(program)
        if not norms:
            ins, outs = program.state_inputs(), program.state_outputs()
            if not any(o is not i for i, o in zip(ins, outs)):
                return self.result("not_applicable", "the loop updates no carried state")
            return self.result("already_satisfied", "no state update ends in a normalisation")
        removed = []
        for i, m in norms:
            where = op_at(m.output)
            m.output.replace_all_uses_with(m.input)
            removed.append(f"the {m.kind} normalisation of {program.states[i].name} ({where})")
        program.recompile()
        reason = "removed " + "; ".join(removed)
        program.notes.append(f"drop_norm: {reason}")
        return self.result("applied", reason)

    def ensures(self, program: TTTProgram) -> None:
        """No state update ends in a normalisation any more."""
        if state_norms(program):
            raise AssertionError("drop_norm left a normalised state update")


drop_norm = register(DropNorm())

__all__ = ["DropNorm", "drop_norm", "state_norms"]
