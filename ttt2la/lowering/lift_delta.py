"""States that are matrix-affine in themselves (the delta rule) scanned over chunks in log depth.

A linear fast weight trained on the MSE loss updates as ``S' = (I − η Kᵀ K) S + η Kᵀ V``: affine
in ``S`` through a matrix, so the checker runs it *semi-parallel*, a sequential pass over the
chunks. Each chunk's update is still one affine map ``S ↦ A_j S + B_j`` (or ``S A_j + B_j`` when
the state is stored transposed) whose ``A_j`` and ``B_j`` do not depend on the state: this plan
gets every chunk's pair at once — ``B_j`` is the update at ``S = 0``, the columns of ``A_j`` its
derivative there along the basis matrices (``jvp``), all batched over chunks — and composes them
with the runtime's log-depth ``matrix_affine_scan``. Which side ``A_j`` multiplies on is read off
the first chunk: the derivative along a random direction must equal ``A_0`` applied on that
side; when neither side fits (another linear map of the state: transposes, sums), the sequential
pass runs as before and the plan names the state as sequential.
"""
from __future__ import annotations

import torch
from torch.func import jvp, vmap

from ..analysis.associativity import Analysis
from ..analysis.dependence import Dep
from ..ir import TTTProgram
from ..runtime import matrix_affine_scan
from ..testing import rel_rms_error
from .executors import Plan, _call_batched

SIDES = ("left", "right")


def _basis(state: torch.Tensor, side: str) -> torch.Tensor:
    """The ``r`` matrices ``E_{i0}`` (left: ``A S`` reads ``S``'s rows) or ``E_{0i}`` (right),
    broadcast over the state's leading axes: ``[r, *state.shape]``."""
    rows, cols = state.shape[-2:]
    r = rows if side == "left" else cols
    eye = torch.eye(r, dtype=state.dtype, device=state.device)
    basis = torch.zeros(r, rows, cols, dtype=state.dtype, device=state.device)
    if side == "left":
        basis[:, :, 0] = eye
    else:
        basis[:, 0, :] = eye
    return basis.view(r, *([1] * (state.dim() - 2)), rows, cols).expand(r, *state.shape)


def _apply(A: torch.Tensor, S: torch.Tensor, side: str) -> torch.Tensor:
    return A @ S if side == "left" else S @ A


class DeltaScanPlan(Plan):
    """The generic semi-parallel plan in which every single state whose update is
    matrix-affine in itself gets its sequence from a log-depth matrix-affine scan."""

    def __init__(self, program: TTTProgram, analysis: Analysis, schedule: str):
        super().__init__(program, analysis, schedule)
        self.scanned = scanned_states(analysis) if schedule == "semi-parallel" else set()
        self.sides: dict[int, str | None] = {}

    @property
    def implementation(self) -> str:
        """``"torch.vmap(semi-parallel; matrix-affine scan: W)"`` — what runs, for the report."""
        if self.schedule == "recurrent":
            return super().implementation
        scanned = {t for t in self.scanned if self.sides.get(t, "left") is not None}
        name = lambda t: self.program.states[t].name  # noqa: E731
        sequential = [name(t) for s in self._steps if s.mode == "sequential" for t in s.states
                      if t not in scanned]
        parts = [self.schedule]
        if scanned:
            parts.append(f"matrix-affine scan: {', '.join(name(t) for t in sorted(scanned))}")
        if sequential:
            parts.append(f"sequential: {', '.join(sequential)}")
        if self.fallbacks:
            parts.append("loop fallback")
        return f"torch.vmap({'; '.join(parts)})"

    def _sequential(self, step, env, states0, n):
        t = step.states[0] if len(step.states) == 1 else None
        if t not in self.scanned or self.sides.get(t, "left") is None:
            return super()._sequential(step, env, states0, n)
        maps = self._maps(step, env, states0[t], n)
        if maps is None:
            return super()._sequential(step, env, states0, n)
        A, B, side = maps
        if side == "right":  # S A + B: scan the transposes
            A, B, s0 = A.mT, B.mT, states0[t].mT
        else:
            s0 = states0[t]
        after = matrix_affine_scan(A.movedim(0, -3), B.movedim(0, -3), s0).movedim(-3, 0)
        return [after.mT if side == "right" else after]

    def _maps(self, step, env, s0: torch.Tensor, n: int):
        """``(A [n, ..., r, r], B [n, ..., rows, cols], side)`` of every chunk, or ``None``."""
        t = step.states[0]
        if s0.dim() < 2 or not s0.is_floating_point():
            self.sides[t] = None
            return None
        values = self._step_values(step, env, n)
        k = step.inputs.index(self.program.state_inputs()[t])
        zero = torch.zeros_like(s0)

        def update_of(args):
            def update(state):
                full = list(args)
                full[k] = state
                return step.graph(*full)[0]
            return update

        for side in [self.sides[t]] if t in self.sides else list(SIDES):
            basis = _basis(s0, side)

            def pair(*args, side=side, basis=basis):
                update = update_of(args)
                cols = vmap(lambda x: jvp(update, (zero,), (x,))[1])(basis)
                if side == "left":  # (A E_i0)[:, 0] is A's column i
                    A = cols[..., 0].movedim(0, -1)
                else:  # (E_0i A)[0, :] is A's row i
                    A = cols[..., 0, :].movedim(0, -2)
                return A, update(zero)

            (A, B), fell_back = _call_batched(pair, values, n)
            if fell_back:
                self.fallbacks.add(self.program.states[t].name)
            first = update_of([v[0] if batched else v for v, batched in values])
            if t in self.sides or _fits(first, A[0], s0, side):
                self.sides[t] = side
                return A, B, side
        self.sides[t] = None  # neither A·S nor S·A: the sequential pass, named as such
        return None

    def _step_values(self, step, env, n: int):
        frontier_values = self._frontier_values(step, env, n)
        state_in = self.program.state_inputs()[step.states[0]]
        values = []
        for i in step.inputs:
            if i is state_in:
                values.append((None, False))
            else:
                values.append(frontier_values.get(i) or env[i])
        return values


#: How far (relative RMS) chunk 0's update may move from ``A_0`` applied on the chosen side; the
#: wrong side or another linear map misses by order one.
FIT_TOLERANCE = 1e-3


def _fits(update, A0: torch.Tensor, s0: torch.Tensor, side: str) -> bool:
    """Does one chunk's update move along a random direction as ``A0`` on ``side`` says?"""
    g = torch.Generator(device=s0.device).manual_seed(0)
    probe = torch.randn(s0.shape, generator=g, dtype=s0.dtype, device=s0.device)
    moved = jvp(update, (torch.zeros_like(s0),), (probe,))[1]
    return rel_rms_error(moved, _apply(A0, probe, side)) <= FIT_TOLERANCE


def scanned_states(analysis: Analysis) -> set[int]:
    """The states the checker runs sequentially only because they are matrix-affine in
    themselves (one state per group, no weight norm)."""
    return {group[0] for group, mode in zip(analysis.groups, analysis.group_modes)
            if mode == "sequential" and len(group) == 1
            and analysis.states[group[0]].self_dependence == Dep.MATRIX_AFFINE}


def lift_delta(program: TTTProgram, analysis: Analysis, schedule: str,
               sides: dict[int, str | None] | None = None) -> DeltaScanPlan | None:
    """The delta-rule plan for ``program`` on ``schedule``, or ``None`` when no state of it is
    matrix-affine in itself. Raises ``NonReducibleError`` when the program does not allow
    ``schedule``. ``sides``: the sides already read off a plan of the same body at another
    batch size (structural, so carried over: a later call, even one a compiler traces with
    fake tensors, need not probe again)."""
    if schedule != "semi-parallel" or not scanned_states(analysis):
        return None
    analysis.require_schedule(schedule)
    plan = DeltaScanPlan(program, analysis, schedule)
    plan.sides.update(sides or {})
    return plan


__all__ = ["DeltaScanPlan", "lift_delta", "scanned_states"]
