"""Lengths the probe traces vouch for, in a layer whose code computes Python values of the length.

The converted layer generalises over lengths from traces at a few lengths. Where the code
branches on the length, clamps it or derives its chunk size from it before the loop
(``frontend.length_values`` names the lines), another length may take another branch, which no
trace showed. Such a layer holds the lengths it was traced or checked at (``LengthVouching``);
at any other length an exact conversion runs the plan and the code as written once, on the
call's own inputs, and keeps the plan for that length only where the two agree (else the code as
written runs there); a lossy one, whose function the code does not compute, runs the plan where
every decision the code makes with the sizes takes the value it takes at every traced shape
(``LengthVouching.decided_alike``) and refuses the length elsewhere. Decisions that tell apart
only what the plan tells apart by itself (a whole chunk, a partial last chunk) are dropped from
the vouching once checked (``chunking_decisions``).

The probes trace the code around the loop at lengths of their own, never at the example's. Where
the conversion's check finds the plan off the code as written at the example's length,
``example_branch`` traces the layer there and names the first op (or constant) that differs
from the probe traces — the code takes another Python branch at that length — and
``unvouch_example`` leaves that length to the code as written (``LengthVouching`` with the
example's length not vouched for), instead of reporting a bug. A lossy conversion, whose
function the code as written does not compute, is refused there (``refuse_lossy_branch``).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedShapeError, UnsupportedTTTError
from .frontend.size_uses import probe_sizes, size_uses_at
from .frontend.length_values import describe, length_values
from .ir import SRC, torch_name
from .original_class import original_class
from .testing import same_value


@dataclass
class LengthVouching:
    """The uses of the call's sizes (``what``, in words) and, per shape, whether the plan
    computes the code's function there (``True`` for the traced shapes). ``by``: the sizes the
    code computes values of (the length, the batch size or both), which key the shapes: a length,
    a batch size in units, or both as ``(B, L)``."""

    what: str
    lengths: dict = field(default_factory=dict)
    by: tuple[str, ...] = ("the length",)
    found: tuple = ()       # the uses (``LengthValue``) ``what`` names, where they are known
    traced: tuple = ()      # the shapes ``(B, L)`` (batch units, tokens) the plan was traced at
    unit: int = 1           # the batch unit

    def key(self, B: int, L: int):
        """The shape ``(B, L)`` (batch units, tokens) as ``lengths`` holds it."""
        length, batch = "the length" in self.by, "the batch size" in self.by
        return (B, L) if length and batch else B if batch else L

    def holds(self, B: int, L: int) -> bool:
        """Was the plan traced, or checked to agree with the code as written, at ``(B, L)``?"""
        return bool(self.lengths.get(self.key(B, L)))

    def decided_alike(self, B: int, L: int) -> bool:
        """Does the code decide at ``(B, L)`` as at every shape it was traced at? Each use must
        be decisions the run recorded (``LengthValue.outcomes``: no number passed to torch, no
        line read off the source only), each taking one value at every traced shape and that
        value at ``(B, L)``: the code then takes the traced path there, which the plan
        computes. Remembered per shape."""
        key = self.key(B, L)
        if key in self.lengths:
            return bool(self.lengths[key])
        alike = bool(self.found) and all(
            v.outcomes and all(not judged and _one_value(at, self.traced, (B, L), self.unit)
                               for judged, at in v.outcomes)
            for v in self.found)
        if alike:
            self.lengths[key] = True
        return alike

    def shape(self, B: int, L: int) -> str:
        """``(B, L)`` in words, as far as the vouching tells shapes apart."""
        length, batch = "the length" in self.by, "the batch size" in self.by
        return f"batch size {B} units, length {L}" if length and batch else \
            f"batch size {B} units" if batch else f"length {L}"

    def note(self, exact: bool) -> str:
        """The report's note: what the code computes, and what the converted layer does at
        shapes it was not traced at."""
        shapes = "lengths" if self.by == ("the length",) else \
            "batch sizes" if self.by == ("the batch size",) else "shapes"
        return (f"its code computes Python values of {' and '.join(self.by)} ({self.what}): "
                f"converted for the {shapes} it was traced at; " +
                ("each other one is checked once against the code as written, which runs "
                 "where they differ" if exact else f"other {shapes} run it where the code "
                 "decides as at those, and are refused elsewhere"))

    def refusal(self, where: str, B: int, L: int) -> UnsupportedShapeError:
        """The refusal of a lossy conversion at the untraced shape ``(B, L)``."""
        held = ", ".join(str(n) for n, ok in sorted(self.lengths.items()) if ok)
        sizes = " and ".join(self.by)
        return UnsupportedShapeError(
            f"{where} was called at {self.shape(B, L)}, but its code computes Python values of "
            f"{sizes} ({self.what}), which may differ there from the shapes it was traced at "
            f"({held}): the lossy conversion holds at those shapes, and at others only where "
            "its code's decisions are found to be the same (here they differ, or cannot be "
            "read). Call it at those "
            "shapes, convert it at level 0 (exact conversions check each new shape against "
            "the code as written), or compute those values from sizes that do not change.")

    def check(self, B: int, L: int, plan, written) -> bool:
        """Whether the plan computes the code's function at ``(B, L)``: the two run once on
        the call's inputs, without gradients, and must agree to the dtype's tolerance."""
        key = self.key(B, L)
        known = self.lengths.get(key)
        if known is not None:
            return known
        with torch.no_grad():
            try:
                mine = plan()
            except Exception:
                mine = None
            try:
                theirs = written()
            except Exception:               # the code's own error: it runs as written
                mine = theirs = None
        self.lengths[key] = agree = mine is not None and _same(mine, theirs)
        return agree


def _one_value(at, traced, shape, unit: int) -> bool:
    """``at(L, B)`` takes one value at the ``traced`` shapes and ``shape`` (batch units)."""
    try:
        values = [at(L, B * unit) for B, L in (*traced, shape)]
        return all(v == values[0] and type(v) is type(values[0]) for v in values)
    except Exception:
        return False


def _same(a, b) -> bool:
    """Outputs of one structure whose tensors agree to their dtype's tolerance."""
    xs, spec_a = pytree.tree_flatten(a)
    ys, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(same_value(x, y) for x, y in zip(xs, ys))


def vouching(rl) -> LengthVouching | None:
    """The vouching of the recognized layer ``rl``: ``None`` when its code computes no Python
    value of the length or the batch size the traces cannot vouch for."""
    layout = rl.layout
    flat, _ = pytree.tree_flatten((tuple(rl.candidate.args), dict(rl.candidate.kwargs)))
    x = flat[layout.ref]
    if layout.ref not in layout.token_axis:     # an image's positions: its size is fixed
        return None
    axis, rank = layout.token_axis[layout.ref], x.dim()
    loop = rl.candidate.loop
    found = length_values(loop.file, loop.line, (axis, axis - rank, rank), after=True,
                          owner=original_class(type(rl.candidate.module)))
    read = {(v.file, v.line) for v in found}
    run = _run_uses(rl)
    outcomes = {(v.file, v.line, v.of): v.outcomes for v in run}
    found = [dataclasses.replace(v, outcomes=outcomes.get((v.file, v.line, v.of), ()))
             for v in found]
    found += [v for v in run if (v.file, v.line) not in read or v.of != "the length"]
    if not found:
        return None
    by = tuple(of for of in ("the batch size", "the length") if any(v.of == of for v in found))
    unit = layout.batch_unit
    example = (x.shape[layout.batch_axis[layout.ref]] // unit, x.shape[axis])
    traced = {(rl.B0, rl.L0), (rl.B0, rl.L1), (rl.B1, rl.L0), example}
    held = LengthVouching(describe(found), by=by, found=tuple(found), traced=tuple(traced),
                          unit=unit)
    for B, L in traced:
        held.lengths[held.key(B, L)] = True
    return held


def _run_uses(rl) -> list:
    """``size_uses`` of the recognized layer: its code as written run once at a length and a
    batch size no other size of it is a multiple of (the example's batch, where the layer
    takes that one only)."""
    from .frontend.recognize import _inputs_at, layer_function, traced_weights

    cand, layout = rl.candidate, rl.layout
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    fn = layer_function(cand.module, in_spec, original_class(type(cand.module)).forward)
    pb = traced_weights(cand.module)
    tokens = set(layout.token_axis.items()) | set(layout.batch_axis.items())
    sizes = {n for v in pb.values() for n in v.shape}
    sizes |= {n for i, x in enumerate(flat) if isinstance(x, torch.Tensor)
              for ax, n in enumerate(x.shape) if (i, ax) not in tokens}
    chunk = max(rl.program.chunk_size or 1, 1)
    fixed = flat[layout.ref].shape[layout.batch_axis[layout.ref]] if layout.fixed_batch \
        else None
    runs = [(functools.partial(fn, pb, *_inputs_at(flat, layout, B, L)), L, B)
            for L, B in _run_sizes(sizes, chunk, layout.batch_unit, fixed)]
    found = size_uses_at(runs, chunk, layout.batch_unit, (cand.loop.file, cand.loop.line))
    return [v for v in _merged(found) if v.of == "the length" or not layout.fixed_batch]


def _run_sizes(sizes: set[int], chunk: int, unit: int,
               fixed: int | None) -> list[tuple[int, int]]:
    """The two shapes the code is run at (``probe_sizes``'s, then the same batch size with a
    further length; ``fixed``: the one batch size the layer takes): a decision one run skips
    by short-circuiting on a constant its length happens to equal (``x.size(1) in (16, 24,
    32)`` at 16 compares once) is reached at the other. The second length's number of chunks
    is no multiple or divisor of a batch size the runs judge, which a count of the chunks
    would be taken for."""
    L, B = probe_sizes(sizes, chunk, unit)
    B = fixed or B
    taken = sizes | {L}
    for _ in range(64):
        L2 = probe_sizes(taken, chunk, unit)[0]
        n = L2 // chunk
        if fixed or n % B and B % n:        # a fixed batch's decisions are not judged
            return [(L, B), (L2, B)]
        taken = taken | {L2}
    return [(L, B)]


def _merged(found: list) -> list:
    """The uses the runs found, one per line and size, with the outcomes each recorded there
    (a plan's own case kept where the runs agree on it)."""
    out: dict = {}
    for v in found:
        key = (v.file, v.line, v.of)
        seen = out.get(key)
        if seen is None:
            out[key] = v
            continue
        chunking = seen.chunking if seen.chunking == v.chunking else ""
        out[key] = dataclasses.replace(seen, chunking=chunking,
                                       outcomes=seen.outcomes + v.outcomes)
    return sorted(out.values(), key=lambda v: (v.file, v.line, v.of))


def example_length(rl) -> int | None:
    """The number of tokens of the recognized layer's example (``None``: an image's)."""
    layout = rl.layout
    if layout.ref not in layout.token_axis:
        return None
    flat, _ = pytree.tree_flatten((tuple(rl.candidate.args), dict(rl.candidate.kwargs)))
    return layout.length_of(flat[layout.ref])


def example_branch(rl) -> str:
    """Where the code around the loop (or the step) computes another function at the example's
    length than at the probe lengths its converted graphs were fitted from: the code as written
    is traced at the two probe lengths and at the example's, and the ops outside the loop are
    compared — the first op that differs, or the first constant that is the same at both probe
    lengths and another at the example's (``"the op at file:line (`code`) is `torch.add` at
    length 16 and `torch.mul` at lengths 28 and 29"``); ``""`` where they agree, or the probe
    traces differ among themselves, or the layer cannot be traced there."""
    L = example_length(rl)
    if L is None or L in (rl.L0, rl.L1):
        return ""
    try:
        at = _outer_tracer(rl)
        batch = rl.layout.batch_unit * rl.B0
        n0, n1, ne = (at(batch, n) for n in (rl.L0, rl.L1, L))
    except Exception:           # the layer does not trace there: the check's failure stands
        return ""
    if [n.target for n in n0] != [n.target for n in n1]:
        return ""
    probes = f"lengths {rl.L0} and {rl.L1}"
    for a, e in zip(n0, ne):
        if a.target != e.target:
            return (f"{_where(e, a)} is {torch_name(e)} at length {L} and {torch_name(a)} "
                    f"at {probes}")
    if len(n0) != len(ne):
        extra = (ne if len(ne) > len(n0) else n0)[min(len(n0), len(ne)):]
        return (f"{_where(*extra)} runs at {'length ' + str(L) if len(ne) > len(n0) else probes}"
                f" only ({len(ne)} ops at length {L}, {len(n0)} at {probes})")
    for a, b, e in zip(n0, n1, ne):
        for x, y, z in zip(_scalars(a), _scalars(b), _scalars(e)):
            if x == y != z:
                return f"{_where(e, a)} takes {z!r} at length {L} and {x!r} at {probes}"
    return ""


def refuse_lossy_branch(rl, lossy: list[str], why: str) -> None:
    """Raise for a lossy conversion whose code takes another Python branch at the example's
    length than at the probe lengths (``why``: where, from ``example_branch`` or the source):
    its converted graphs, fitted from the probe traces, would compute the other branch's
    function there, and the code as written does not compute the simplified one (``lossy``: the
    passes that change the function)."""
    L, loop = example_length(rl), rl.candidate.loop
    raise UnsupportedTTTError(
        f"{rl.path or 'the model'} (the loop at {loop.src}): its code takes another Python branch "
        f"at the example's length {L} than at the probe lengths {rl.L0} and {rl.L1} it was "
        f"traced at ({why}). The lossy passes ({', '.join(lossy)}) change the function the code "
        f"as written computes, and the converted graphs, fitted from the probe traces, would "
        f"take the probes' branch at length {L}. Convert it with example inputs of a length "
        f"that takes the probes' branch, convert it at an exact level (the code as written then "
        f"runs at length {L}), or compute the branch from sizes that do not change.")


def _outer_tracer(rl):
    """``at(B, L)``: the ops of the layer's code as written outside its loop (all of them, for a
    single step), traced at batch ``B`` and length ``L``."""
    from .frontend.capture import trace
    from .frontend.loops import loops_of
    from .frontend.recognize import _inputs_at, layer_function, traced_weights

    cand = rl.candidate
    flat, in_spec = pytree.tree_flatten((tuple(cand.args), dict(cand.kwargs)))
    fn = layer_function(cand.module, in_spec, original_class(type(cand.module)).forward)
    pb = traced_weights(cand.module)

    def at(B: int, L: int) -> list:
        gm = trace(fn, pb, *_inputs_at(flat, rl.layout, B, L))
        return [n for n in gm.graph.nodes
                if n.op == "call_function" and cand.loop not in loops_of(n)]
    return at


def _where(*nodes) -> str:
    """``the op at file:line (`code`)`` of the first of ``nodes`` with a source line."""
    src = next((n.meta.get(SRC) for n in nodes if n.meta.get(SRC) is not None), None)
    return f"the op at {src.at()}" if src is not None else "an op"


def _scalars(node) -> list:
    """The Python numbers among a node's arguments that are no sizes (floats, bools), in order."""
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return [v for v in leaves if isinstance(v, (float, bool))]


def unvouch_example(state, rl, why: str) -> str:
    """Leave the example's length, where the plan is off the code as written (``why``), to the
    code as written: the converted layer's vouching then holds the probe lengths, and checks
    every other length once against the code as written. Returns the report's note."""
    L = example_length(rl)
    what = f"another function at length {L}: {why}"
    held = state.length_vouching
    if held is None:
        held = state.length_vouching = LengthVouching(what, {rl.L0: True, rl.L1: True})
    elif why not in held.what:
        held.what = f"{held.what}; {what}"
    layout = rl.layout
    flat, _ = pytree.tree_flatten((tuple(rl.candidate.args), dict(rl.candidate.kwargs)))
    B = flat[layout.ref].shape[layout.batch_axis[layout.ref]] // layout.batch_unit
    held.lengths[held.key(B, L)] = False
    return (f"the layer's code computes another function at the example's length {L} "
            f"than at the probe lengths {rl.L0} and {rl.L1} ({why}): the code as written runs at "
            f"length {L}, the plan at lengths where it was checked to agree with it")


__all__ = ["LengthVouching", "vouching", "example_branch", "example_length", "unvouch_example",
           "refuse_lossy_branch"]
