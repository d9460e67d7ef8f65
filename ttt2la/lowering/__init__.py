"""Lowering a checked program to an executable plan: chunking, the generic executors, the lifting
onto the runtime ops and the one function that chooses between them (``plan_for``)."""
from .chunking import ChunkLayout, assemble_outputs, chunk_layout, chunk_streams
from .executors import SCHEDULES, Plan, execute, extract, lower, padding_problem
from .lift import LiftedPlan, LiftedProgram, NewtonSchulz
from .plan import plan_at, plan_for, resolve_backend

__all__ = ["ChunkLayout", "assemble_outputs", "chunk_layout", "chunk_streams", "SCHEDULES",
           "Plan", "execute", "extract", "lower", "padding_problem", "LiftedPlan",
           "LiftedProgram", "NewtonSchulz", "plan_at", "plan_for",
           "resolve_backend"]
