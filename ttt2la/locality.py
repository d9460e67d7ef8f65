"""Token locality of the code around a converted loop: what stateful decoding relies on.

A converted layer continues a sequence by running only the new tokens through the code around
the loop (``ttt2la.stream``), so that code must treat tokens one by one: the sequences the loop
slices chunks from hold, at token ``t``, a function of the layer's inputs at ``t`` only; the
initial states and the other loop inputs do not depend on the tokens or the length at all; and
the layer's output at ``t`` is a function of the loop's output and the inputs at ``t`` only.
A mean over the sequence, a causal convolution or a cumulative sum outside the loop breaks it.

``streaming_problem`` checks this on the converted layer itself, at a small length, by
perturbing single tokens of the inputs (and of the loop's output) and looking where the
changes land.
"""
from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree

from .errors import PartialChunkError
from .frontend.recognize import _inputs_at, params_and_buffers
from .ir import LOOP_MODULE
from .lowering.lean_calls import lean_calls
from .frontend.single_step import FixedLengthLayout
from .testing import tolerance


class _Stand(torch.nn.Module):
    """Stands in for the loop: records its arguments and returns ``reply(args)``."""

    def __init__(self, reply):
        super().__init__()
        self.reply = reply
        self.seen: tuple = ()

    def forward(self, *args):
        self.seen = args
        return self.reply(args)


def _leaks(base: torch.Tensor, changed: torch.Tensor, axis: int, t: int) -> bool:
    """Whether ``changed`` differs from ``base`` at a position other than ``t`` on ``axis``."""
    if not base.is_floating_point():
        diff = (changed != base).movedim(axis, 0)
        return bool(diff[:t].any() or diff[t + 1:].any())
    d = (changed.double() - base.double()).abs().movedim(axis, 0)
    others = torch.cat([d[:t], d[t + 1:]])
    if others.numel() == 0:
        return False
    scale = max(float(base.double().abs().max()), float(d.max()), 1e-30)
    return float(others.max()) > tolerance(base.dtype) * scale


def _differs(a, b) -> bool:
    if not isinstance(a, torch.Tensor):
        return a != b
    if a.shape != b.shape:
        return True
    if not a.is_floating_point():
        return not torch.equal(a, b)
    scale = max(float(a.double().abs().max()), 1e-30)
    return float((a.double() - b.double()).abs().max()) > tolerance(a.dtype) * scale


def _perturbed(flat: list, token_axis: dict[int, int], t: int, gen) -> list:
    out = []
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and i in token_axis:
            x = x.clone()
            row = x.select(token_axis[i], t)
            noise = torch.randn(row.shape, generator=gen, dtype=torch.float32)
            row += (noise * (float(x.double().std()) or 1.0)).to(x.dtype)
        out.append(x)
    return out


def _reads_final_states(state) -> bool:
    call = next(n for n in state.outer.gm.graph.nodes
                if n.op == "call_module" and n.target == LOOP_MODULE)
    return any(u.target is operator.getitem and u.args[1] >= 1 and u.users for u in call.users)


def streaming_problem(state, module: torch.nn.Module, flat: list) -> str | None:
    """What in the code around ``module``'s loop mixes tokens (a sentence), or ``None``.

    ``state`` is the layer's ``ConvertedState``, ``flat`` a call's flattened inputs (their
    batch is kept; they are resized to a probe length of a few chunks).
    """
    if _reads_final_states(state):
        return "the code after the loop reads the final fast weights"
    if isinstance(state.layout, FixedLengthLayout):
        return ("its fast weights are stepped once on all its tokens, which every token then "
                "reads (a single-step TTT layer): there is no sequence to continue")
    program, layout = state.program, state.layout
    C = 1 if any(s.per_token for s in program.streams) else program.chunk_size
    x = flat[layout.ref]
    batch = x.shape[layout.batch_axis[layout.ref]]
    with torch.no_grad():
        try:
            return _probe(state, module, flat, batch, 2 * C + 3, 1)
        except PartialChunkError:       # the plan pads no partial chunk of this loop
            return _probe(state, module, flat, batch, *_whole_chunks(flat, C))


def _whole_chunks(flat: list, C: int) -> tuple[int, int]:
    """Two probe lengths of whole chunks, ``(m·C, C)`` for the length and the step to the
    longer one, both unlike every size of the inputs (so the outputs' token axes are found)."""
    sizes = {int(n) for t in flat if isinstance(t, torch.Tensor) for n in t.shape}
    m = 2
    while m * C in sizes or (m + 1) * C in sizes:
        m += 1
    return m * C, C


def _probe(state, module, flat, batch: int, length: int, step: int) -> str | None:
    layout, program = state.layout, state.program
    pb = params_and_buffers(module)
    names = state.interface[0] + state.interface[1]
    n_states = len(state.interface[0])
    axes = {names.index(program.invariants[s.source].name): s.axis for s in program.streams}
    out_axis = program.outputs[0].axis

    def run(B_L, inputs, reply=None):
        # a graph of its own: the layer's cached one may be running on another thread
        gm = lean_calls(state.outer.instantiate(*B_L))
        loop = state.loop_for(B_L[0])
        stand = _Stand(reply or (lambda args: loop(*args)))
        setattr(gm, LOOP_MODULE, stand)
        y = gm.forward(pb, *inputs)
        return stand.seen, pytree.tree_leaves(y)

    unit = layout.batch_unit
    base_in = _inputs_at(flat, layout, batch, length)
    seen0, y0 = run((batch // unit, length), base_in)
    replied = state.loop_for(batch // unit)(*seen0)
    longer_in = _inputs_at(flat, layout, batch, length + step)
    seen1, _ = run((batch // unit, length + step), longer_in)
    for i, (a, b) in enumerate(zip(seen0, seen1)):
        if i not in axes and _differs(a, b):
            kind = "initial state" if i < n_states else "loop input"
            return f"the {kind} {names[i]} depends on the sequence length"
    gen = torch.Generator().manual_seed(0)
    token_outputs = [(k, next((ax for ax in range(1, y.dim()) if y.shape[ax] == length), None))
                     for k, y in enumerate(y0) if isinstance(y, torch.Tensor)]
    for t in (0, length // 2, length - 1):
        seen, ys = run((batch // unit, length), _perturbed(base_in, layout.token_axis, t, gen),
                          reply=lambda args: replied)
        for i, (a, b) in enumerate(zip(seen0, seen)):
            if i in axes:
                if _leaks(a, b, axes[i] % a.dim(), t):
                    return (f"the sequence {names[i]} the loop reads mixes tokens: a change at "
                            f"token {t} of the input changes other tokens of it")
            elif _differs(a, b):
                kind = "initial state" if i < n_states else "loop input"
                return f"the {kind} {names[i]} depends on the tokens of the sequence"
        for k, ax in token_outputs:
            if ax is not None and _leaks(y0[k], ys[k], ax, t):
                return (f"the layer's output mixes tokens: a change at token {t} of the input "
                        "changes other tokens of the output outside the loop")

        def moved(_args, t=t):
            o = replied[0].clone()
            row = o.select(out_axis % o.dim(), t)
            row += torch.randn(row.shape, generator=gen).to(o.dtype)
            return (o, *replied[1:])

        _, ys = run((batch // unit, length), base_in, reply=moved)
        for k, ax in token_outputs:
            if ax is not None and _leaks(y0[k], ys[k], ax, t):
                return (f"the code after the loop mixes tokens: a change at token {t} of the "
                        "loop's output changes other tokens of the layer's output")
    return None


__all__ = ["streaming_problem"]
