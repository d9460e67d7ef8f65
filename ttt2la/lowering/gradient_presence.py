"""Which loop inputs autograd reaches: the same in a plan as in the loop as written.

A loop as written records every op it runs, so an input that only multiplies a zero (a momentum
factor on a momentum that starts at zero) or only feeds an update nothing reads still receives a
gradient — of zeros. A plan that skips that arithmetic leaves the input out of the graph, and a
parameter computed from it gets ``.grad`` None where the layer gives zeros: optimizers treat
the two differently (AdamW decays and moves a parameter with a zero gradient and skips one with
none), so training would drift. ``loop_reach`` says which inputs each output of the loop as
written reaches after ``n`` iterations (from the body's graph); ``plan_reach`` which the plan's
outputs reach (from their autograd graph); ``tied`` hangs the missing ones on an output by a
sum over none of their elements, which adds an exact zero and gives them zero gradients.
"""
from __future__ import annotations

import torch

from ..ir import TTTProgram

aten = torch.ops.aten

#: Ops whose output carries no gradient to their tensor arguments (shape or dtype only).
_NOT_DIFFERENTIABLE = {aten.detach.default, aten.zeros_like.default, aten.ones_like.default,
                       aten.empty_like.default, aten.full_like.default, aten.rand_like.default,
                       aten.randn_like.default, aten.new_zeros.default, aten.new_ones.default,
                       aten.new_empty.default, aten.new_full.default}

#: Ops that, with one operand not computed, give the other (``x if M is None else x + M``).
_ADDITIONS = {aten.add.Tensor, aten.sub.Tensor}


def body_dependencies(program: TTTProgram, skipped: frozenset = frozenset()
                      ) -> tuple[list[frozenset], list[frozenset]]:
    """For each state the body returns and each chunk output, the loop inputs it depends on
    through differentiable ops: ``("s", j)`` for state ``j``, ``("i", k)`` for invariant ``k``
    (a stream counts as the invariant it slices). ``skipped``: the states whose use the first
    iteration skips (``x if M is None else x + a * M``): an op reading one does not run (an
    addition of it gives its other operand), for the first iteration's dependencies."""
    state_index = {n: j for j, n in enumerate(program.state_inputs())}
    stream_source = {n: program.streams[j].source for j, n in enumerate(program.stream_inputs())}
    invariant_index = {n: k for k, n in enumerate(program.invariant_inputs())}
    deps: dict = {}
    for node in program.body.graph.nodes:
        if node.op == "placeholder":
            j = state_index.get(node)
            deps[node] = (None if j in skipped else frozenset([("s", j)])) if j is not None \
                else frozenset([("i", stream_source[node])]) if node in stream_source \
                else frozenset([("i", invariant_index[node])]) if node in invariant_index \
                else frozenset()
        elif node.op != "output":
            deps[node] = _node_dependencies(node, deps)
    return ([deps.get(n) or frozenset() for n in program.state_outputs()],
            [deps.get(n) or frozenset() for n in program.chunk_outputs()])


def _node_dependencies(node, deps: dict) -> frozenset | None:
    """What ``node`` depends on (``deps``: its inputs'), None where it does not run."""
    args = [deps.get(a, frozenset()) for a in node.all_input_nodes]
    if any(d is None for d in args):
        present = [d for d in args if d is not None]
        if node.target in _ADDITIONS and len(args) == 2 and len(present) == 1:
            return present[0]
        return None
    val = node.meta.get("val")
    if node.target in _NOT_DIFFERENTIABLE or (
            isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex())):
        return frozenset()
    return frozenset().union(*args)


def loop_reach(first, later, program: TTTProgram, n_chunks: int
               ) -> tuple[frozenset, list[frozenset]]:
    """The inputs the loop as written connects to its first chunk output (the one the loop
    returns) over ``n_chunks`` chunks, and to each final state (``apply_only``: the last chunk
    is read, not used to update); ``first`` and ``later`` are ``body_dependencies`` for the
    first iteration and the others."""
    updates = n_chunks - 1 if program.last_chunk == "apply_only" else n_chunks
    current = [frozenset([("s", j)]) for j in range(len(program.states))]
    outputs: set = set()

    def through(keys: frozenset) -> frozenset:
        found: set = set()
        for kind, i in keys:
            found |= current[i] if kind == "s" else {(kind, i)}
        return frozenset(found)

    for step in range(n_chunks):
        state_deps, out_deps = first if step == 0 else later
        for d in out_deps[:1]:
            outputs |= through(d)
        if step < updates:
            current = [through(d) for d in state_deps]
    return frozenset(outputs), current


def plan_reach(output: torch.Tensor, inputs: dict) -> set:
    """The keys of ``inputs`` (key -> tensor) whose values ``output``'s autograd graph reaches:
    a walk back from its ``grad_fn`` that stops at the inputs' own nodes."""
    if output is None or not output.requires_grad:
        return set()
    if output.grad_fn is None:                  # an input handed back as it came
        return {key for key, t in inputs.items() if t is output}
    by_edge, leaves, stops = {}, {}, set()
    for key, t in inputs.items():
        if t.grad_fn is not None:
            by_edge.setdefault((t.grad_fn, t.output_nr), []).append(key)
            stops.add(t.grad_fn)
        elif t.requires_grad:
            leaves.setdefault(id(t), []).append(key)
    found, seen, todo = set(), {output.grad_fn}, [output.grad_fn]
    if (output.grad_fn, output.output_nr) in by_edge:
        found.update(by_edge[(output.grad_fn, output.output_nr)])
    while todo:
        fn = todo.pop()
        if fn in stops:
            continue
        for nxt, nr in fn.next_functions:
            if nxt is None:
                continue
            found.update(by_edge.get((nxt, nr), ()))
            variable = getattr(nxt, "variable", None)
            if variable is not None:
                found.update(leaves.get(id(variable), ()))
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


def tied(output: torch.Tensor, missing: list[torch.Tensor]) -> torch.Tensor:
    """``output`` plus a sum over none of the elements of each of ``missing``: the same values
    (an exact zero, whatever the tensors hold), and a zero gradient for each of them."""
    zero = None
    for t in missing:
        empty = (t.reshape(1) if t.dim() == 0 else t).narrow(0, 0, 0).sum()
        zero = empty if zero is None else zero + empty
    return output if zero is None else output + zero.to(output.dtype)


__all__ = ["body_dependencies", "loop_reach", "plan_reach", "tied"]
