"""The lowering's own check: a plan against the recurrent executor on the same program and inputs.

Whatever the level, lowering is exact: the plan must compute what the rewritten program computes
run chunk after chunk (``ir``'s definition of the loop). Without Newton–Schulz, or in float64,
that is a tolerance on the relative RMS error. With Newton–Schulz in fp32/bf16 the iteration
amplifies rounding in any implementation, so both the plan and the recurrent executor are
compared with the program evaluated in float64 (``precision.promoted``), and the plan may be at
most twice as far from it as the recurrent executor is, plus 1e-6.
"""
from __future__ import annotations

import dataclasses
import math

from typing import Sequence

import torch

from ..analysis.dependence import op_name
from ..analysis.rules import match_newton_schulz
from ..ir import TTTProgram
from ..testing import rel_rms_error, tolerance
from .executors import Plan
from .precision import as_dtype, promoted

#: Criterion with Newton–Schulz in low precision: err(plan) <= FACTOR * err(reference) + SLACK.
FACTOR, SLACK = 2.0, 1e-6


def has_newton_schulz(program: TTTProgram) -> bool:
    """Whether the body runs a Newton–Schulz iteration anywhere."""
    return any(n.op == "call_function" and op_name(n) == "add" and match_newton_schulz(n)
               is not None for n in program.body.graph.nodes)


def _names_low_precision(program: TTTProgram) -> bool:
    """Whether the body names a floating dtype narrower than float64 (a cast, a created tensor)."""
    low = (torch.float16, torch.bfloat16, torch.float32)

    def found(value) -> bool:
        if isinstance(value, torch.dtype):
            return value in low
        if isinstance(value, (list, tuple)):
            return any(found(v) for v in value)
        if isinstance(value, dict):
            return any(found(v) for v in value.values())
        return False

    return any(found(n.args) or found(n.kwargs) for n in program.body.graph.nodes)


def needs_float64_reference(program: TTTProgram, dtype: torch.dtype) -> bool:
    """Newton–Schulz computed below float64 (inputs in fp32/bf16, or a cast in the body):
    rounding is amplified, and only the precision criterion judges honestly."""
    return has_newton_schulz(program) and (dtype != torch.float64
                                           or _names_low_precision(program))


def judge(got: torch.Tensor, ref: torch.Tensor, exact64: torch.Tensor | None) -> dict:
    """One comparison: with ``exact64`` (a float64 evaluation) the precision criterion, else the
    dtype's tolerance on ``rel_rms_error(got, ref)``. A plan whose output has another shape than
    the loop's is wrong whatever its values: not ok."""
    if got.shape != ref.shape:
        return {"rel_rms_error": math.inf, "ok": False,
                "shape": f"{tuple(got.shape)} where the loop gives {tuple(ref.shape)}"}
    err = rel_rms_error(got, ref)
    if exact64 is None:
        tol = tolerance(ref.dtype)
        return {"rel_rms_error": err, "tolerance": tol, "ok": bool(err <= tol)}
    mine, theirs = rel_rms_error(got, exact64), rel_rms_error(ref, exact64)
    bound = FACTOR * theirs + SLACK
    return {"rel_rms_error": err, "error_vs_float64": mine, "reference_error_vs_float64": theirs,
            "bound": bound, "ok": bool(mine <= bound)}


def recurrent_reference(program: TTTProgram) -> Plan:
    """The recurrent executor of ``program``: the body in a Python loop over chunks."""
    return Plan(program, None, "recurrent")


def check_plan(plan, program: TTTProgram, states0: Sequence[torch.Tensor],
               invariants: Sequence[torch.Tensor], compare_states: set[str] = frozenset()
               ) -> dict:
    """Run ``plan`` and the recurrent executor of ``program`` on the same inputs and judge the
    chunk output and the final states named in ``compare_states``.

    Returns ``{"ok", "criterion", "output": judge(...), "<state>": judge(...)}``.
    """
    with torch.no_grad():
        out, finals = plan(list(states0), list(invariants))
        ref_out, ref_finals = recurrent_reference(program)(list(states0), list(invariants))
        dtype = ref_out[0].dtype
        exact_out = exact_finals = None
        use64 = needs_float64_reference(program, dtype)
        if use64:
            program64 = dataclasses.replace(program.clone(), body=promoted(program.body))
            exact_out, exact_finals = recurrent_reference(program64)(
                as_dtype(states0), as_dtype(invariants))
    result = {"criterion": "2x the recurrent executor's error vs float64 + 1e-6" if use64
              else f"relative RMS <= {tolerance(dtype):g}",
              "output": judge(out[0], ref_out[0], exact_out[0] if use64 else None)}
    for j, spec in enumerate(program.states):
        if spec.name in compare_states and finals[j] is not None:
            result[spec.name] = judge(finals[j], ref_finals[j],
                                      exact_finals[j] if use64 else None)
    result["ok"] = all(v["ok"] for v in result.values() if isinstance(v, dict))
    return result


__all__ = ["check_plan", "judge", "has_newton_schulz", "needs_float64_reference", "recurrent_reference", "FACTOR", "SLACK"]
