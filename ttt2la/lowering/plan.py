"""The choice of the plan a converted loop runs: a runtime op when the program lifts, else the
generic schedule — one function, ``plan_for``, so every caller runs what the report names.

Every plan exposes ``schedule`` (parallel, semi-parallel, recurrent) and ``implementation`` (what
really runs: ``block_linear_attention[torch]``, ``torch.vmap(parallel)``, ``torch(recurrent
loop)``). A plan is chosen once, on the program as traced, and carried over to every other batch
size by ``plan_at``; if the carried-over plan could not be built, the generic schedule runs
instead only with ``strict=False``, and the fallback is recorded for that shape.
"""
from __future__ import annotations

from typing import Union

import torch

from ..analysis.associativity import Analysis, analyze
from ..errors import PlanFallbackError, UnsupportedTTTError
from ..ir import TTTProgram
from .executors import Plan, lower
from .lift import LiftedPlan, lift
from .lift_delta import DeltaScanPlan, lift_delta
from .lift_single_step import SingleStepPlan, lift_single_step

AnyPlan = Union[Plan, LiftedPlan, DeltaScanPlan, SingleStepPlan]
BACKENDS = ("auto", "torch", "triton", "naive")


def resolve_backend(backend: str, device: torch.device | str | None) -> str:
    """``"auto"`` resolved where the device decides it: CPU tensors always run torch (the
    dispatcher picks Triton only for CUDA tensors); on CUDA the dispatcher decides per call."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and (device is None or torch.device(device).type != "cuda"):
        return "torch"
    return backend


def _liftable(lifted, used: set[int], zero_init: set[int] | None) -> bool:
    """The runtime ops start momentum at zero and return only the final linear state."""
    if lifted.m is not None and ((zero_init is not None and lifted.m not in zero_init)
                                 or lifted.m in used):
        return False
    return True


def _loop_for(lifted, program: TTTProgram, analysis: Analysis, schedule: str, backend: str):
    """The generic plan a decayed lifted state runs where a loop over the chunks pays
    (``scan_choice.decayed_op_pays``) or, per token, where a decay <= 0 has no log; None for
    other lifts and for an explicit Triton backend, which never runs the generic schedule."""
    if not lifted.decayed or backend == "triton":
        return None
    return lower(program, analysis, backend="torch", schedule=schedule)


def _where(program: TTTProgram) -> str:
    return f"the loop of {program.module_path or 'the model'} ({program.loop_src})"


def plan_for(program: TTTProgram, analysis: Analysis | None = None, *, backend: str = "auto",
             strict: bool = True, schedule: str | None = None, used: set[int] = frozenset(),
             zero_init: set[int] | None = None, device=None) -> AnyPlan:
    """The plan ``program`` runs: lifted onto a runtime op when its parallel schedule has the
    linear-attention shape, else the generic executor on ``schedule`` (default: the analysis').

    ``used``: states the code after the loop reads; ``zero_init``: states that start at zero
    (``None``: unknown, taken as all). ``backend`` is honoured on both paths: the runtime ops
    take it, the generic schedules run with torch (``"naive"``: the recurrent reference), and
    ``"triton"`` where no Triton kernel runs the program raises ``UnsupportedTTTError`` here.
    ``strict=True`` with a non-reducible program raises ``NonReducibleError``.
    """
    backend = resolve_backend(backend, device)
    if analysis is None:
        analysis = analyze(program)
    if schedule is None:
        if not analysis.reducible and strict:
            analysis.require_reducible(None)
        schedule = analysis.schedule if analysis.reducible else "recurrent"
    if schedule == "parallel" and backend in ("torch", "triton"):
        single = lift_single_step(program, backend)
        if single is not None:
            return single
    # a single step reads every token with the stepped weights (one chunk of all the tokens):
    # the token-causal and block ops, which read each chunk before later ones, never run it
    if schedule in ("parallel", "semi-parallel") and not program.single_step:
        lifted = lift(program)
        # semi-parallel programs lift only when the op's weight norm is what is sequential
        if lifted is not None and _liftable(lifted, set(used), zero_init) and \
                (schedule == "parallel") == (lifted.weight_norm is None):
            return LiftedPlan(lifted, backend=backend,
                              loop=_loop_for(lifted, program, analysis, schedule, backend))
    if backend == "triton":
        raise UnsupportedTTTError(
            f"backend='triton' was asked for, but {_where(program)} does not have the shape of "
            f"a runtime op (block or token-causal linear attention) on its {schedule} schedule, "
            "and the generic schedules run with torch; use backend='auto' or 'torch'")
    if backend == "naive":
        schedule = "recurrent"
    delta = lift_delta(program, analysis, schedule)
    if delta is not None:
        return delta
    return lower(program, analysis, backend="torch", schedule=schedule)


def plan_at(plan: AnyPlan, program: TTTProgram, *, strict: bool = True
            ) -> tuple[AnyPlan, str | None]:
    """``plan`` carried over to ``program`` (the same body re-sized to another batch size), and
    a note when the generic schedule had to run instead (``strict=False`` only)."""
    if isinstance(plan, (LiftedPlan, SingleStepPlan)):
        try:
            if isinstance(plan, LiftedPlan):
                loop = None if plan.loop is None else _loop_for(
                    plan.lifted, program, analyze(program), plan.loop.schedule, plan.backend)
                return plan.resized(program, loop), None
            return plan.resized(program), None
        except (UnsupportedTTTError, RuntimeError) as e:
            if strict:
                raise PlanFallbackError(
                    f"{_where(program)} was converted to run on {plan.implementation}, but "
                    f"that plan cannot be built at this batch size ({e}); strict=True refuses "
                    "to run another plan silently. Convert with strict=False to fall back to "
                    "the generic schedule (recorded in the report), or report this as a bug."
                ) from e
            generic = lower(program, analyze(program), backend="torch", schedule="parallel")
            return generic, f"{generic.implementation} instead of {plan.implementation}: {e}"
    if isinstance(plan, DeltaScanPlan):
        return lift_delta(program, analyze(program), plan.schedule, plan.sides), None
    return lower(program, analyze(program), backend="torch", schedule=plan.schedule), None


__all__ = ["plan_for", "plan_at", "resolve_backend", "AnyPlan"]
