"""Step 1 of the paper: freeze the kernel parameters Θ, so only the final layer W is updated.

Every ``theta`` state's state-out becomes its state-in: φ keeps reading Θ, but Θ's update (its
gradient, momentum, Newton–Schulz, norm) becomes dead code and is eliminated, and carried states
that only fed it (Θ's momentum buffers) are removed. Not exact: a model trained with Θ updated
computes something else once Θ is frozen.
"""
from __future__ import annotations

from ..analysis.roles import final_products, kernel_parameters
from ..ir import TTTProgram, node_src
from .base import Pass, PassContext, PassResult, register, remove_dead_states


def updated_theta(program: TTTProgram) -> list[int]:
    """Indices of ``theta`` states whose state-out is not simply their state-in."""
    ins, outs = program.state_inputs(), program.state_outputs()
    return [i for i in program.states_with_role("theta") if outs[i] is not ins[i]]


class FreezeTheta(Pass):
    """Stop updating the kernel weights Θ (the paper's Step 1)."""

    name = "freeze_theta"
    step = 1
    exact = False
    removes = "theta_update"

    def run(self, program: TTTProgram, context: PassContext) -> PassResult:
        """Make every updated Θ state's state-out its state-in and drop the states that die."""
        thetas = updated_theta(program)
        if not thetas:
            frozen = program.states_with_role("theta")
            if frozen:
                names = ", ".join(program.states[i].name for i in frozen)
                return self.result("already_satisfied",
                                   f"the kernel weights Θ ({names}) are not updated by the loop")
            params = kernel_parameters(program)
            if params:
                return self.result("already_satisfied",
                                   f"the kernel φ reads {len(params)} parameter tensor(s) that "
                                   f"the loop does not update")
            if final_products(program):
                return self.result("already_satisfied",
                                   "the kernel φ has no weights Θ to freeze (only the final layer "
                                   "W is a fast weight)")
            return self.result("not_applicable", "no final layer W was found")
        ins, outs = program.state_inputs(), program.state_outputs()
        described = []
        for i in thetas:
            src = node_src(outs[i])
            described.append(f"{program.states[i].name}" + (f" (updated at {src})" if src else ""))
        for i in thetas:            # whatever reads the stepped Θ (an output read after the
            outs[i].replace_all_uses_with(ins[i])   # update) reads the unchanged Θ
        new_outs = [ins[i] if i in thetas else o for i, o in enumerate(outs)]
        program.set_outputs(new_outs, program.chunk_outputs())
        removed = remove_dead_states(program)
        reason = f"froze the kernel weights Θ: {', '.join(described)} no longer updated"
        if removed:
            reason += f"; removed the carried state(s) {', '.join(removed)} that only fed them"
        program.notes.append(f"freeze_theta: {reason}")
        return self.result("applied", reason)

    def ensures(self, program: TTTProgram) -> None:
        """No ``theta`` state is updated any more."""
        left = updated_theta(program)
        if left:
            raise AssertionError(f"freeze_theta left Θ states updated: {left}")


freeze_theta = register(FreezeTheta())

__all__ = ["FreezeTheta", "freeze_theta", "updated_theta"]
