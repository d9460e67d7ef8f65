"""Step 1 of the paper: freeze the kernel parameters Θ, so only the final layer W is updated.

Every ``theta`` state's state-out becomes its state-in: φ keeps reading Θ, but Θ's update (its
gradient, momentum, Newton–Schulz, norm) becomes dead code and is eliminated, and carried states
that only fed it (Θ's momentum buffers) are removed. Not exact: a model trained with Θ updated
computes something else once Θ is frozen.
"""
from __future__ import annotations

import torch.fx

from ..analysis.dependence import node_shape, op_name
from ..analysis.op_vocabulary import ADDITIVE
from ..analysis.roles import final_products, kernel_parameters
from ..errors import UnsupportedTTTError
from ..ir import TTTProgram, ancestors, describe_op, descendants, node_src
from .base import Pass, PassContext, PassResult, register, remove_dead_states


def updated_theta(program: TTTProgram) -> list[int]:
    """Indices of ``theta`` states whose state-out is not simply their state-in."""
    ins, outs = program.state_inputs(), program.state_outputs()
    return [i for i in program.states_with_role("theta") if outs[i] is not ins[i]]


def stepped_inside(program: TTTProgram, thetas: list[int]) -> torch.fx.Node | None:
    """A value of Θ stepped within the iteration that the outputs read other than through the
    carried Θ: a sum on the way from Θ's state-in to its state-out, made from the streams, of
    Θ's shape (a step of Θ a later chunk of the iteration reads, a scan of Θ's steps over them),
    read by a chunk output, and no other state's new value. Freezing the carried Θ leaves such
    a value updated."""
    graph = program.body.graph
    ins, outs = program.state_inputs(), program.state_outputs()
    streamed = descendants(graph, program.stream_inputs())
    kept = {o for j, o in enumerate(outs) if j not in thetas}     # another state's new value
    # what the outputs read other than through Θ's new value (which freezing replaces)
    chunk_outputs = [o for o in program.chunk_outputs() if isinstance(o, torch.fx.Node)]
    read = _ancestors_avoiding(chunk_outputs, {outs[i] for i in thetas})
    order = {n: k for k, n in enumerate(graph.nodes)}
    found = []
    C = 1 if any(s.per_token for s in program.streams) else program.chunk_size
    for i in thetas:
        shape = tuple(node_shape(ins[i]) or ())[-2:]
        if C in shape:          # a chunk's values look like Θ by their shape: no telling
            continue
        on_path = ancestors(outs[i]) & descendants(graph, [ins[i]])
        found += [n for n in on_path - kept if n in streamed and n in read
                  and op_name(n) in ADDITIVE and tuple(node_shape(n) or ())[-2:] == shape]
    return max(found, key=order.get, default=None)      # the latest: where it is read


def _ancestors_avoiding(roots: list, avoid: set) -> set:
    """``roots`` and what they are computed from, not walking through the nodes ``avoid``."""
    seen, stack = set(), [r for r in roots if r not in avoid]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(a for a in n.all_input_nodes if a not in avoid)
    return seen


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
            finals = program.states_with_role("final")
            if finals:      # a final layer the roles find by its uses, read otherwise than φ·W
                names = ", ".join(program.states[i].name for i in finals)
                return self.result("already_satisfied",
                                   f"the loop updates no kernel weights Θ: its fast weights "
                                   f"({names}) are the final layer")
            return self.result("not_applicable", "no final layer W was found")
        ins, outs = program.state_inputs(), program.state_outputs()
        inside = stepped_inside(program, thetas)
        if inside is not None:
            raise UnsupportedTTTError(
                f"{program.module_path or 'the model'} ({program.loop_src}) reads its kernel "
                f"weights Θ as stepped within an iteration ({describe_op(inside)}): each "
                "iteration runs several steps, so freezing Θ between iterations would leave it "
                "updated inside them. Loop over one chunk per iteration to have Θ frozen, or "
                "convert at level 0.")
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
