"""Lengths the probe traces vouch for, in a layer whose code computes Python values of the length.

The converted layer generalises over lengths from traces at a few lengths. Where the code
branches on the length, clamps it or derives its chunk size from it before the loop
(``frontend.length_values`` names the lines), another length may take another branch, which no
trace showed. Such a layer holds the lengths it was traced or checked at (``LengthVouching``);
at any other length an exact conversion runs the plan and the code as written once, on the
call's own inputs, and keeps the plan for that length only where the two agree (else the code as
written runs there); a lossy one, whose function the code does not compute, refuses the length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedShapeError
from .frontend.length_values import describe, length_values
from .testing import TOLERANCE, rel_rms_error


@dataclass
class LengthVouching:
    """The uses of the length (``what``, in words) and, per length, whether the plan computes
    the code's function there (``True`` for the traced lengths)."""

    what: str
    lengths: dict[int, bool] = field(default_factory=dict)

    def refusal(self, where: str, L: int) -> UnsupportedShapeError:
        """The refusal of a lossy conversion at the untraced length ``L``."""
        held = ", ".join(str(n) for n, ok in sorted(self.lengths.items()) if ok)
        return UnsupportedShapeError(
            f"{where} was called at length {L}, but its code computes Python values of the "
            f"length ({self.what}), which may differ there from the lengths it was traced at "
            f"({held}): the lossy conversion holds at those lengths only. Call it at those "
            "lengths, convert it at level 0 (exact conversions check each new length against "
            "the code as written), or compute those values from sizes that do not change.")

    def check(self, L: int, plan, written) -> bool:
        """Whether the plan computes the code's function at length ``L``: the two run once on
        the call's inputs, without gradients, and must agree to the dtype's tolerance."""
        known = self.lengths.get(L)
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
        self.lengths[L] = agree = mine is not None and _same(mine, theirs)
        return agree


def _same(a, b) -> bool:
    """Outputs of one structure whose tensors agree to their dtype's tolerance."""
    xs, spec_a = pytree.tree_flatten(a)
    ys, spec_b = pytree.tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point() and x.numel():
            if rel_rms_error(x, y) > TOLERANCE.get(x.dtype, 1e-5):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def vouching(rl) -> LengthVouching | None:
    """The vouching of the recognized layer ``rl``: ``None`` when its code computes no Python
    value of the length the traces cannot vouch for."""
    layout = rl.layout
    flat, _ = pytree.tree_flatten((tuple(rl.candidate.args), dict(rl.candidate.kwargs)))
    x = flat[layout.ref]
    if layout.ref not in layout.token_axis:     # an image's positions: its size is fixed
        return None
    axis, rank = layout.token_axis[layout.ref], x.dim()
    loop = rl.candidate.loop
    found = length_values(loop.file, loop.line, (axis, axis - rank, rank))
    if not found:
        return None
    traced = {rl.L0, rl.L1, x.shape[axis]}
    return LengthVouching(describe(found), {L: True for L in traced})


__all__ = ["LengthVouching", "vouching"]
