"""Gradients a loop stops, which a converted plan would let through.

A loop may stop gradients on its fast weights while its outputs stay the same: ``W.detach()``
between chunks (truncated backpropagation through the inner loop), an update under
``torch.no_grad()``, ``.data``, or ``torch.autograd.grad`` without ``create_graph=True``. The
runtime ops and the generic scans compose the state chunk after chunk with autograd through every
step, so their gradients would differ from the layer's while the outputs match. A stop is found
two ways: a ``detach`` the trace recorded on a value that depends on a state (named by its line;
looked for in the loop as the passes left it, so one only a dropped weight norm read stops nothing),
and, for the stops a trace made without gradients cannot record, the rewritten loop run as
written differentiated against the layer itself on the example inputs. A converted layer with a
stop runs the code as written for calls that record gradients when it is exact, and refuses them
when it is lossy (``converted.ConvertedState``).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .ir import SRC, TTTProgram, descendants
from .testing import TOLERANCE, rel_rms_error, tolerance
from .undifferentiable import own_backward_failure

aten = torch.ops.aten

#: What a stop the trace cannot see may be, for messages.
UNSEEN_STOPS = ("a torch.no_grad() block, .data, or torch.autograd.grad without "
                "create_graph=True")


def detached_state(program: TTTProgram) -> str:
    """Where the loop body detaches a value that depends on a state (``"W.detach() at
    file:line"``), or ``""``: a detach of the streams alone runs in the plans' features as
    written, one on the state's path is lost when the plan composes the states."""
    graph = program.body.graph
    state_dep = descendants(graph, program.state_inputs())
    for n in graph.nodes:
        if n.target in (aten.detach.default, aten.alias.default) and n.args[0] in state_dep:
            src = n.meta.get(SRC)
            return "a detach of the fast weights" + (
                f" at {src.short_file}:{src.line} (`{src.code.strip()}`)" if src else "")
    return ""


def records_gradients(module: torch.nn.Module, flat: list) -> bool:
    """Whether a call builds an autograd graph: gradients enabled and a parameter or an input
    that requires them."""
    if not torch.is_grad_enabled():
        return False
    return any(p.requires_grad for p in module.parameters()) or any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in flat)


def gradient_difference(original: torch.nn.Module, converted: torch.nn.Module, args: tuple,
                        kwargs: dict) -> tuple[str, float, torch.dtype]:
    """The worst relative RMS difference between the two modules' gradients of a random
    projection of each of their floating outputs, over their parameters and floating inputs,
    whose it is, and the least precise output dtype of the original; ``OwnBackwardFails`` when
    the original cannot be differentiated (``undifferentiable``)."""
    try:
        want, dtype = _gradients(original, args, kwargs)
    except Exception as e:          # an in-place update of a tensor autograd saved, say
        raise own_backward_failure(e) from e
    got, _ = _gradients(converted, args, kwargs)
    name, worst = "", 0.0
    for n, w in want.items():
        g = got.get(n)
        err = rel_rms_error(g, w) if g is not None and g.shape == w.shape else float("inf")
        if err > worst:
            name, worst = n, err
    return name, worst, dtype


def _gradients(module: torch.nn.Module, args: tuple, kwargs: dict, filled: bool = True
               ) -> tuple[dict, torch.dtype]:
    """``{name: gradient}`` of ``(output · r).sum()`` for a fixed random ``r``, for each floating
    output on its own (a stop may act on a returned state alone), and the dtype of the least
    precise of them; with ``filled``, zeros where autograd reaches nothing (else None)."""
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    inputs = {i: t.detach().clone().requires_grad_() for i, t in enumerate(leaves)
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    call_args, call_kwargs = pytree.tree_unflatten(
        [inputs.get(i, t) for i, t in enumerate(leaves)], tree)
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    wrt = {**{f"input {i}": t for i, t in inputs.items()}, **params}
    with torch.enable_grad():
        outs = _floating_outputs(module(*call_args, **call_kwargs))
        generator = torch.Generator().manual_seed(0)
        projections = [(o * torch.randn(o.shape, generator=generator, dtype=torch.float64)
                        .to(o)).sum() for o in outs]
        recording = [j for j, p in enumerate(projections) if p.requires_grad] or [0]
        grads = {}
        for j, projection in enumerate(projections):     # the first, where none records: raises
            got = torch.autograd.grad(projection, list(wrt.values()), allow_unused=True,
                                      retain_graph=j != recording[-1]) \
                if j in recording else [None] * len(wrt)
            of = f" (output {j + 1})" if len(outs) > 1 else ""
            grads.update({n + of: torch.zeros_like(x) if g is None and filled else g
                          for (n, x), g in zip(wrt.items(), got)})
    return grads, max((o.dtype for o in outs), key=lambda d: TOLERANCE.get(d, 0.0))


def _floating_outputs(output) -> list:
    """The floating tensors among ``output``'s leaves, in order (the first leaf tensor where
    there are none: autograd then says what it cannot do)."""
    tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.is_floating_point()] or tensors[:1]


def presence_difference(original: torch.nn.Module, converted: torch.nn.Module, args: tuple,
                        kwargs: dict) -> str:
    """Where the original's autograd reaches a parameter or input (a gradient, zeros included)
    that the converted module's leaves None, or ``""``: optimizers treat the two differently
    (AdamW decays a parameter with a zero gradient and skips one with none). The other way
    round (zeros where the original gives None, as at one chunk, whose update nothing reads) is
    not counted: it would send every call recording gradients to the code as written."""
    try:
        want, _ = _gradients(original, args, kwargs, filled=False)
    except Exception as e:
        raise own_backward_failure(e) from e
    got, _ = _gradients(converted, args, kwargs, filled=False)
    differ = [n for n, w in want.items() if w is not None and got.get(n) is None]
    return ", ".join(f"{n} ({'none' if want[n] is None else 'a gradient'} as written, "
                     f"{'none' if got.get(n) is None else 'a gradient'} converted)"
                     for n in differ)


def unseen_stop(original: torch.nn.Module, converted: torch.nn.Module, args: tuple,
                kwargs: dict) -> str:
    """A stop the trace could not record, or ``""``: ``converted`` runs the rewritten loop as
    written (the user's ops in the user's order), so beyond the dtype's tolerance its gradients
    differ from the layer's only where the layer stopped them."""
    name, err, dtype = gradient_difference(original, converted, args, kwargs)
    if err <= tolerance(dtype):
        return ""
    return (f"the gradient of {name} through the traced loop differs from the layer's own by a "
            f"relative RMS error of {err:.1e}: the loop stops gradients where its trace cannot "
            f"see it ({UNSEEN_STOPS})")


__all__ = ["UNSEEN_STOPS", "detached_state", "gradient_difference", "presence_difference",
           "records_gradients", "unseen_stop"]
