"""A feature graph recorded for a gradient, as one autograd function with planned buffers.

Autograd through a traced graph keeps every op's functional result and allocates a fresh
tensor for every gradient, which on CPU costs more than the arithmetic (see
``buffer_reuse``). ``planned_autograd`` splits the graph's joint forward and backward with
torch's rematerialising partitioner (cheap pointwise values are recomputed in the backward
rather than kept), then rewrites both so that large results go into buffers that died before
them; the backward counts as its own the activations the forward saved for it alone, which
nothing reads once it has. A second backward through the same graph (``retain_graph=True``)
would read those overwritten activations: it is refused with an ``UnsupportedTTTError`` (so is a
backward with ``create_graph=True``), before autograd would find their version counters moved.

Gradients keep autograd's meaning: an input that no output given a gradient depends on gets
``None``, not zeros (the partitioned backward fills missing output gradients with zeros).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.utils._python_dispatch import _disable_current_modes

from ttt2la.errors import UnsupportedTTTError
from ttt2la.lowering.buffer_reuse import output_storages, reuse_buffers, writes_inputs


def _outputs(gm: torch.fx.GraphModule) -> list:
    out = gm.graph.output_node().args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def output_users(gm: torch.fx.GraphModule) -> list[frozenset[int]]:
    """For each input of ``gm``, the positions of the outputs computed from it."""
    deps: dict = {}
    position = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = frozenset({position})
            position += 1
        elif node.op != "output":
            deps[node] = frozenset().union(*(deps[a] for a in node.all_input_nodes))
    per_output = [deps[o] if isinstance(o, torch.fx.Node) else frozenset() for o in _outputs(gm)]
    return [frozenset(k for k, d in enumerate(per_output) if i in d) for i in range(position)]


class _Call:
    """What one call's backward learns: the outputs that received a gradient, and whether a
    backward already ran (and overwrote the activations)."""

    def __init__(self, plan: dict):
        self.given: frozenset[int] = frozenset()
        self.done = False
        self.plan = plan          # the compiled backward's: whether it overwrites saved values

    @property
    def spent(self) -> bool:
        """Whether a backward ran and overwrote the activations the forward kept."""
        return self.done and self.plan["overwrites_saved"]


class _Outputs(torch.autograd.Function):
    """Identity on the outputs at ``positions``; its backward records which received a gradient."""

    @staticmethod
    def forward(ctx, call, positions, *outputs):
        ctx.call, ctx.positions = call, positions
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.call.spent or torch.is_grad_enabled():
            what = ("a backward that records a graph for higher-order gradients "
                    "(create_graph=True)" if torch.is_grad_enabled() else
                    "a second backward through one call (retain_graph=True)")
            raise UnsupportedTTTError(
                f"{what} of a converted layer: its backward writes into the activation memory "
                "its forward kept, so they can be read once, and it is not differentiable "
                "itself. Call the converted layer again for each backward; where "
                "higher-order gradients are needed, run the original model (convert returns a "
                "copy and leaves it as it was).")
        ctx.call.done = True
        ctx.call.given = frozenset(p for p, g in zip(ctx.positions, grads) if g is not None)
        return (None, None, *grads)


class _Inputs(torch.autograd.Function):
    """Identity on the inputs; its backward drops the gradient of every input that no output
    given a gradient depends on (``users``: per input, the outputs computed from it)."""

    @staticmethod
    def forward(ctx, call, users, *inputs):
        ctx.call, ctx.users = call, users
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads):
        given = ctx.call.given
        return (None, None, *(g if users & given else None
                              for users, g in zip(ctx.users, grads)))


def _compilers(first: int):
    """The partitioned forward and backward graphs, each with its buffers planned."""
    from functorch.compile import make_boxed_func

    saved: dict[str, object] = {}
    plan = {"overwrites_saved": False}

    def forward_compiler(fw: torch.fx.GraphModule, example_inputs):
        with _disable_current_modes():
            names = [n.name if isinstance(n, torch.fx.Node) else None for n in _outputs(fw)]
            reuse_buffers(fw, example_inputs)
            keys = output_storages(fw, example_inputs, first)
            saved.update({name: key for name, key in zip(names[first:], keys)
                          if key is not None and name is not None})
        return make_boxed_func(fw)

    def backward_compiler(bw: torch.fx.GraphModule, example_inputs):
        with _disable_current_modes():
            owned = {n.name: saved[n.name] for n in bw.graph.nodes
                     if n.op == "placeholder" and n.name in saved}
            reuse_buffers(bw, example_inputs, owned_inputs=owned)
            plan["overwrites_saved"] = writes_inputs(bw)
        return make_boxed_func(bw)

    return forward_compiler, backward_compiler, plan


def planned_autograd(gm: torch.fx.GraphModule):
    """``gm`` as a callable recording one autograd function (see the module); it takes and
    returns what ``gm`` does."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition

    forward_compiler, backward_compiler, plan = _compilers(len(_outputs(gm)))
    joint = aot_function(gm, forward_compiler, backward_compiler,
                         partition_fn=min_cut_rematerialization_partition)
    users_of = output_users(gm)            # static: computed once, read by every call
    single = not isinstance(gm.graph.output_node().args[0], (tuple, list))

    def call(*args):
        record = _Call(plan)
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        users = [users_of[i] for i in at]
        args = list(args)
        for i, x in zip(at, _Inputs.apply(record, users, *(args[i] for i in at))):
            args[i] = x
        outs = joint(*args)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        at = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        for i, o in zip(at, _Outputs.apply(record, at, *(outs[i] for i in at))):
            outs[i] = o
        return outs[0] if single else tuple(outs)

    return call


__all__ = ["planned_autograd", "output_users"]
