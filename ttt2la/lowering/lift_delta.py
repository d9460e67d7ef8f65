"""States that are matrix-affine in themselves (the delta rule) scanned over chunks in log depth.

A linear fast weight trained on the MSE loss updates as ``S' = (I − η Kᵀ K) S + η Kᵀ V``: affine
in ``S`` through a matrix, so the checker runs it *semi-parallel*, a sequential pass over the
chunks. Each chunk's update is still one affine map ``S ↦ A_j S + B_j`` (or ``S A_j + B_j`` when
the state is stored transposed) whose ``A_j`` and ``B_j`` do not depend on the state: this plan
gets every chunk's pair at once — ``B_j`` is the update at ``S = 0``, the columns of ``A_j`` its
derivative there along identity blocks (``jvp``, one per ``c`` columns of ``A``: one
update's cost for a square state), all batched over chunks — and composes them
with the runtime's log-depth ``matrix_affine_scan``. Which side ``A_j`` multiplies on is read off
the first chunk: the derivative along a random direction must equal ``A_0`` applied on that
side; when neither side fits (another linear map of the state: transposes, sums), the sequential
pass runs as before and the plan names the state as sequential.

Several states coupled affinely (a memory and its momentum: ``S' = β S − g(W)``,
``W' = γ W + S'``) are one affine map of the states stacked — rows for ``A·[W; S]``, columns
for ``[W | S]·A`` — and are scanned the same way, jointly.
"""
from __future__ import annotations

import torch
from torch.func import vmap

from ..analysis.associativity import Analysis
from ..analysis.dependence import Dep
from ..ir import TTTProgram
from ..runtime import matrix_affine_scan
from ..testing import rel_rms_error
from .executors import Plan, _call_batched
from .forward_ad import jvp
from .scan_choice import forced, scanning
from .written_products import written

SIDES = ("left", "right")


def _tangents(state: torch.Tensor, side: str) -> torch.Tensor:
    """Directions along which one derivative of ``S ↦ A S`` (left) or ``S ↦ S A`` (right) reads
    ``ceil(r / c)`` blocks of ``A`` at once: the ``k``-th holds the identity's block ``k`` in its
    first columns (left) or rows (right), ``A X_k`` then holds ``A``'s columns ``k·c …`` (``X_k A``
    its rows). One derivative per block, not one per basis matrix: each costs one update.
    ``[m, *state.shape]``."""
    rows, cols = state.shape[-2:]
    r, c = (rows, cols) if side == "left" else (cols, rows)
    m = -(-r // c)
    eye = torch.eye(r, m * c, dtype=state.dtype, device=state.device)   # zero columns past r
    blocks = eye.view(r, m, c).movedim(1, 0)
    if side == "right":
        blocks = blocks.mT
    return blocks.view(m, *([1] * (state.dim() - 2)), rows, cols).expand(m, *state.shape)


def _assembled(moved: torch.Tensor, r: int, side: str) -> torch.Tensor:
    """``A`` from the derivatives along ``_tangents`` (``moved``: ``[m, ..., rows, cols]``)."""
    if side == "left":  # block k's columns: A's columns k·c ...
        return torch.cat(moved.unbind(0), dim=-1)[..., :r]
    return torch.cat(moved.unbind(0), dim=-2)[..., :r, :]


def _apply(A: torch.Tensor, S: torch.Tensor, side: str) -> torch.Tensor:
    return A @ S if side == "left" else S @ A


def _stack(parts: list[torch.Tensor], side: str) -> torch.Tensor:
    """States stacked so that one map acts on all: rows (left) or columns (right)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2 if side == "left" else -1)


def _unstack(stacked: torch.Tensor, like: list[torch.Tensor], side: str) -> list[torch.Tensor]:
    """The stacked state split back into states shaped like ``like`` (``_stack``'s inverse)."""
    if len(like) == 1:
        return [stacked]
    dim = -2 if side == "left" else -1
    return list(stacked.split([t.shape[dim] for t in like], dim=dim))


def _stackable(states: list[torch.Tensor], side: str) -> bool:
    """Can the states be stacked on ``side`` (same leading axes, same other matrix axis)?"""
    if any(t.dim() < 2 or not t.is_floating_point() for t in states):
        return False
    keep = -1 if side == "left" else -2
    first = states[0]
    return all(t.shape[:-2] == first.shape[:-2] and t.shape[keep] == first.shape[keep]
               and t.dtype == first.dtype for t in states)


class DeltaScanPlan(Plan):
    """The generic semi-parallel plan in which every group of states whose update is
    matrix-affine in its members (one state: the delta rule; several: a memory and its momentum)
    gets its sequence from a log-depth matrix-affine scan."""

    def __init__(self, program: TTTProgram, analysis: Analysis, schedule: str):
        super().__init__(program, analysis, schedule)
        self.scanned = scanned_groups(analysis) if schedule == "semi-parallel" else set()
        self.sides: dict[int, str | None] = {}     # keyed by a group's first state
        self.looped: dict[tuple[int, ...], bool] = {}  # groups the last call ran as a loop

    @property
    def implementation(self) -> str:
        """``"torch.vmap(semi-parallel; matrix-affine scan: W)"`` — what runs, for the report."""
        if self.schedule == "recurrent":
            return super().implementation
        scanned = self._scanned_groups()
        name = lambda t: self.program.states[t].name  # noqa: E731
        sequential = self._sequential_names()
        parts = [self.schedule]
        if scanned:
            groups = ", ".join(" + ".join(name(t) for t in g) for g in scanned)
            parts.append(f"matrix-affine scan: {groups}")
        if sequential:
            parts.append(f"sequential: {', '.join(sequential)}")
        if self.fallbacks:
            parts.append("loop fallback")
        return f"torch.vmap({'; '.join(parts)})"

    @property
    def forward_ad(self) -> bool:
        """A matrix-affine scan reads its matrices off the update by ``jvp``, and chooses their
        side by evaluating them."""
        return bool(self.scanned) or super().forward_ad

    def _scanned_groups(self) -> list[tuple[int, ...]]:
        """The groups of states the last call scanned."""
        return [g for g in sorted(self.scanned) if self.sides.get(g[0], "left") is not None
                and not self.looped.get(g, False)]

    def _scanned_states(self) -> set[int]:
        return {t for g in self._scanned_groups() for t in g}

    def _loops(self, step, states0, n):
        group = tuple(step.states)
        if group not in self.scanned or self.sides.get(group[0], "left") is None:
            return super()._loops(step, states0, n)
        self.looped[group] = not scan_pays([states0[t] for t in group], n,
                                           self.program.chunk_size)
        return self.looped[group]

    def _sequential(self, step, env, states0, n):
        if self._loops(step, states0, n):
            return super()._sequential(step, env, states0, n)
        group = tuple(step.states)
        starts = [states0[t] for t in group]
        maps = self._maps(step, env, starts, n)
        if maps is None:
            return super()._sequential(step, env, states0, n)
        A, B, side = maps
        s0 = _stack(starts, side)
        if side == "right":  # S A + B: scan the transposes
            A, B, s0 = A.mT, B.mT, s0.mT
        after = matrix_affine_scan(A.movedim(0, -3), B.movedim(0, -3), s0).movedim(-3, 0)
        return _unstack(after.mT if side == "right" else after, starts, side)

    def _maps(self, step, env, starts: list[torch.Tensor], n: int):
        """``(A [n, ..., r, r], B [n, ..., rows, cols], side)`` of every chunk, for the group's
        states stacked on ``side``, or ``None``."""
        t = step.states[0]
        sides = [self.sides[t]] if t in self.sides else list(SIDES)
        sides = [side for side in sides if side is not None and _stackable(starts, side)]
        if not sides:
            self.sides[t] = None
            return None
        values = self._step_values(step, env, n)
        ins = self.program.state_inputs()
        ks = [step.inputs.index(ins[u]) for u in step.states]

        def update_of(args, side):
            def update(stacked):
                full = list(args)
                for k, part in zip(ks, _unstack(stacked, starts, side)):
                    full[k] = part
                return _stack(list(step.graph(*full)[:len(ks)]), side)
            return update

        for side in sides:
            s0 = _stack(starts, side)
            zero = torch.zeros_like(s0)
            tangents = _tangents(s0, side)
            r = s0.shape[-2] if side == "left" else s0.shape[-1]

            def pair(*args, side=side, tangents=tangents, zero=zero, r=r):
                update = update_of(args, side)
                at_zero, moved = vmap(lambda x: jvp(update, (zero,), (x,)))(tangents)
                return _assembled(moved, r, side), at_zero[0]

            (A, B), fell_back = _call_batched(pair, values, n)
            if fell_back:
                self.fallbacks.update(self.program.states[u].name for u in step.states)
            first = update_of([v[0] if batched else v for v, batched in values], side)
            if t in self.sides or _fits(first, A[0], s0, side):
                self.sides[t] = side
                return A, B, side
        self.sides[t] = None  # neither A·S nor S·A: the sequential pass, named as such
        return None

    def _step_values(self, step, env, n: int):
        frontier_values = self._frontier_values(step, env, n)
        ins = self.program.state_inputs()
        state_ins = {ins[u] for u in step.states}
        values = []
        for i in step.inputs:
            if i in state_ins:
                values.append((None, False))
            else:
                values.append(frontier_values.get(i) or env[i])
        return values


#: The CPU cost model that decides where the log-depth scan beats a Python loop over the chunks,
#: fitted to a 12-shape grid of delta-rule memories (2 cores, fp32; docs/benchmarks.md, "CPU:
#: delta-rule memories"; it picks the faster path at every point of the grid;
#: ``benchmarks/matrix_affine_memories.py --fit-rule`` refits it): one chunk step of the loop
#: costs this much in dispatch (s) ...
LOOP_STEP_SECONDS = 28e-6
#: ... and runs the update's products, one chunk at a time, at this rate (FLOP/s) ...
LOOP_FLOPS = 2.7e9
#: ... the scan costs this much once (its extraction and log-depth recursion, s) ...
SCAN_FIXED_SECONDS = 2.8e-3
#: ... and runs its products, batched over the chunks, at this rate (FLOP/s).
SCAN_FLOPS = 8e9


def step_flops(states: list[torch.Tensor], tokens: int) -> tuple[int, int]:
    """FLOPs per chunk of ``tokens`` tokens for this group of states: one update (the MSE
    step's two products) and one composition of the scan's maps (``2 r² (r + c)``)."""
    first = states[0]
    rows, cols = sum(t.shape[-2] for t in states), first.shape[-1]
    r = max(rows, cols)                 # A_j is [rows, rows] or [cols, cols], by the side
    batch = first[..., 0, 0].numel()
    return batch * 2 * tokens * rows * cols, batch * 2 * r * r * (rows + cols)


def scan_pays(states: list[torch.Tensor], n: int, tokens: int) -> bool:
    """Is the log-depth scan faster than the loop over ``n`` chunks of ``tokens`` tokens for
    this group of states? Always on CUDA and under a compiler (no Python loop over chunks
    there). On a CPU the scan does every chunk's update once more (to read ``A_j`` and ``B_j``)
    plus its compositions, ``2 r² (r + c)`` per chunk, to save the loop's per-step dispatch:
    it pays for small states over many chunks only (a ``[64, 64]`` memory ran 1.8–13× slower
    scanned than looped, a ``[4, 4]`` one 3.3× faster over 2048 chunks)."""
    if forced() is not None:
        return forced()
    first = states[0]
    if first.device.type == "cuda" or torch.compiler.is_compiling():
        return True
    update, compose = step_flops(states, tokens)
    scanned = n * (2 * update + compose) / SCAN_FLOPS + SCAN_FIXED_SECONDS
    looped = n * (LOOP_STEP_SECONDS + update / LOOP_FLOPS)
    return scanned < looped


#: How far (relative RMS) chunk 0's update may move from ``A_0`` applied on the chosen side; the
#: wrong side or another linear map misses by order one.
FIT_TOLERANCE = 1e-3


def _fits(update, A0: torch.Tensor, s0: torch.Tensor, side: str) -> bool:
    """Does one chunk's update move along a random direction as ``A0`` on ``side`` says?"""
    g = torch.Generator(device=s0.device).manual_seed(0)
    probe = torch.randn(s0.shape, generator=g, dtype=s0.dtype, device=s0.device)
    moved = jvp(update, (torch.zeros_like(s0),), (probe,))[1]
    return rel_rms_error(moved, _apply(A0, probe, side)) <= FIT_TOLERANCE


def scanned_groups(analysis: Analysis) -> set[tuple[int, ...]]:
    """The groups of states the checker runs sequentially only because each member's update is
    at most matrix-affine in the group's states (no weight norm): one state matrix-affine in
    itself, or several coupled affinely."""
    dep = analysis.dependence
    out = set()
    for group, mode in zip(analysis.groups, analysis.group_modes):
        if mode != "sequential":
            continue
        worst = max(dep.update(t, u).cls for t in group for u in group)
        if worst == Dep.MATRIX_AFFINE or (len(group) > 1 and worst < Dep.MATRIX_AFFINE):
            out.add(tuple(group))
    return out


def scanned_states(analysis: Analysis) -> set[int]:
    """Every state in a group ``scanned_groups`` finds."""
    return {t for group in scanned_groups(analysis) for t in group}


def lift_delta(program: TTTProgram, analysis: Analysis, schedule: str,
               sides: dict | None = None) -> DeltaScanPlan | None:
    """The delta-rule plan for ``program`` on ``schedule``, or ``None`` when no group of its
    states is matrix-affine in its members: a per-token loop that is exactly the (gated) delta
    rule runs on the chunked ``delta_rule`` op (``lift_delta_rule``), as does one of several
    delta-rule steps a token over its expanded sequence (``lift_delta_product``), any other
    such group on the matrix-affine scan. Raises ``NonReducibleError`` when the program does
    not allow ``schedule``. ``sides``: what a plan of the same body at another batch size
    already read off it — each group's side, or the delta-rule match of a per-token loop —
    (structural, so carried over: a later call, even one a compiler traces with fake tensors,
    need not probe again)."""
    if schedule != "semi-parallel" or not scanned_states(analysis):
        return None
    from .lift_delta_product import DeltaProductMatch, lift_delta_product  # build on this
    from .lift_delta_rule import DeltaRuleMatch, lift_delta_rule
    carried = next((m for m in (sides or {}).values()
                    if isinstance(m, (DeltaRuleMatch, DeltaProductMatch))), None)
    exact = None
    if not isinstance(carried, DeltaProductMatch):
        exact = lift_delta_rule(program, analysis, schedule, carried)
    if exact is None and not isinstance(carried, DeltaRuleMatch):  # several steps a token
        exact = lift_delta_product(program, analysis, schedule, carried)
    if exact is not None:
        return exact
    program, analysis = written(program, analysis)     # the scan runs the code's own products
    analysis.require_schedule(schedule)
    plan = DeltaScanPlan(program, analysis, schedule)
    plan.sides.update({t: side for t, side in (sides or {}).items()
                       if side is None or isinstance(side, str)})
    return plan


__all__ = ["DeltaScanPlan", "lift_delta", "scan_pays", "scanned_groups", "scanned_states",
           "scanning", "step_flops"]
