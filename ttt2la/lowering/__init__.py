"""Lowering a checked program to an executable plan: chunking and the generic executors."""
from .chunking import ChunkLayout, assemble_outputs, chunk_layout, chunk_streams
from .executors import SCHEDULES, Plan, execute, extract, lower, padding_problem

__all__ = ["ChunkLayout", "assemble_outputs", "chunk_layout", "chunk_streams", "SCHEDULES",
           "Plan", "execute", "extract", "lower", "padding_problem"]
